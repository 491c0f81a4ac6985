"""What several commands share: the command line's own errors, its argument types, the store of
--store, and the checks before a sweep (the executor, a dirty checkout, the group size shown)."""

from __future__ import annotations

import argparse
import json


class CliError(Exception):
    """Bad input found by the command line itself (exit code 2)."""


class CliFailure(Exception):
    """A failure the command line found and explains in one line (exit code 1)."""


def _whole_number(least: int):
    """An argparse type: a whole number >= ``least``, refused in one line before anything runs."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {n}")
        return n
    return parse


_at_least_one = _whole_number(1)  # --workers
_nonneg_int = _whole_number(0)


def _group_arg(v: str) -> int | str:
    """--group: a positive int or 'auto'."""
    if v == "auto":
        return v
    try:
        k = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {v!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {k}")
    return k


def _add_sweep_args(s) -> None:
    """The store and executor options of a command that runs studies (``study``, ``atlas``)."""
    s.add_argument("--store", default="runs")
    s.add_argument("--executor", default="local", choices=["local", "ray"])
    s.add_argument("--workers", type=_at_least_one, default=1)
    s.add_argument("--group", type=_group_arg, default="auto", help="runs per group, or 'auto' (as reproduce)")
    s.add_argument("--address", default=None)


def parse_gates(text: str | None) -> tuple:
    """'pos=0,content=0' -> (0.0, 0.0); a missing gate keeps the model's own value (None)."""
    if not text:
        return None, None
    allowed = ("pos", "content")
    vals: dict[str, float | None] = {}
    for item in text.split(","):
        if "=" not in item:
            raise CliError(f"malformed gate override {item!r} in --gates {text!r}; expected e.g. pos=0,content=0")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in allowed:
            raise CliError(f"unknown gate {k!r} in --gates {text!r}; allowed: {', '.join(allowed)}")
        if k in vals:
            raise CliError(f"gate {k!r} is given twice in --gates {text!r}")
        if v in ("model", "learned"):
            vals[k] = None
            continue
        try:
            f = float(v)
        except ValueError:
            raise CliError(f"gate value {v!r} for {k} in --gates {text!r} is not a number in [0, 1] (or 'model')") from None
        if not 0.0 <= f <= 1.0:
            raise CliError(f"gate value {f} for {k} in --gates {text!r} must lie in [0, 1]")
        vals[k] = f
    return vals.get("pos"), vals.get("content")


def parse_options(items: list[str] | None) -> dict:
    """['p=0.2', 'n_pairs=12'] -> {'p': 0.2, 'n_pairs': 12} (numbers parsed as JSON, else strings)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise CliError(f"malformed option {item!r}; expected KEY=VALUE, e.g. p=0.2")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = v
    return out


def _print_rows(rows) -> int:
    width = max((len(n) for n, _ in rows), default=0) + 2
    for name, desc in rows:
        print(f"{name:<{width}} {desc}")
    return 0


def _store(args, read_only: bool = False):
    """The store of --store. The commands that only read it open it ``read_only``: they never create a
    store (a typo in --store is an error, not a new empty store) and never write one, so a store shared
    read-only or on a read-only mount is read like any other. The others need it writable (created if
    missing: train, reproduce, calibrate)."""
    from ..store import RunStore
    return RunStore(args.store, read_only=read_only)


def _check_executor(args) -> None:
    """--executor ray without Ray installed: said before anything runs."""
    if getattr(args, "executor", "local") == "ray":
        import importlib.util
        if importlib.util.find_spec("ray") is None:
            raise CliError("--executor ray needs Ray, which is not installed: pip install 'softprior[ray]' "
                           "(or leave --executor at local)")


def _refuse_dirty_training(cfgs, store, exploratory: bool) -> None:
    """Before a sweep (an experiment's or the paper's): runs trained now from a checkout with uncommitted
    changes would be ``+dirty`` and refused by every table (``reports.experiment.check_clean``), so say so before
    training them rather than after."""
    if exploratory:
        return
    from ..provenance import code_version, provenance
    version = code_version(provenance())
    todo = sum(not store.is_done(c.run_id) for c in cfgs)
    if todo and version.endswith("+dirty"):
        raise CliError(f"this checkout has uncommitted changes ({version}): the {todo} runs left to train would "
                       "be trained from a dirty tree, which no table accepts unless it is marked exploratory; "
                       "commit first, or pass --exploratory")


def _group_shown(args, cfgs, store) -> str:
    """The group size a sweep of ``cfgs`` will use (``auto`` resolved as ``execute`` resolves it)."""
    from ..executors.sweep import sweep_plan
    _, ks = sweep_plan(cfgs, store, args.group, args.workers)
    if args.group != "auto":
        return str(args.group)
    return "auto (" + ", ".join(f"K = {k}" + (f" {m}" if len(ks) > 1 else "") for m, k in ks.items()) + ")" if ks else "auto"
