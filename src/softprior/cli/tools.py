"""``softprior experiments``, ``baselines``, ``bench`` and ``export``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .common import CliError, _print_rows, _store, parse_gates
from .outputs import _creatable


def cmd_experiments(args) -> int:
    from ..experiments import list_experiments
    from ..plugins import load_plugin
    for f in args.plugin or []:
        load_plugin(f)
    return _print_rows(list_experiments())


def cmd_baselines(args) -> int:
    from ..model.baselines import list_baselines
    return _print_rows(list_baselines())


def cmd_bench(args) -> int:
    from ..bench import run_bench, run_engines
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print  # --json: stdout holds the JSON alone
    if args.engines_only:
        res = run_engines(quick=args.quick, log=log)
    else:
        res = run_bench(quick=args.quick, group_size=args.group, log=log)
    if args.sweep and not args.engines_only:
        from ..bench import sweep_bench
        res.update(sweep_bench(args.sweep, res["reference_ms_per_step"], steps=args.sweep_steps, log=log))
    if args.json:
        print(json.dumps(res, sort_keys=True))
    return 0


EXPORT_SUFFIX = ".hooked.safetensors"  # names the format: a HookedTransformer's weights, in safetensors


def _export_path(out: str | None, run_id: str) -> Path:
    """Where ``export`` writes: --out as given if it names a .safetensors file, RUN_ID.hooked.safetensors
    inside it if it is a directory (or ends in /), in the current directory without --out. Another
    extension is refused: the file is safetensors whatever it is called (a .pt would lie)."""
    if out is None:
        return Path(run_id + EXPORT_SUFFIX)
    p = _creatable(out, "--out")
    if p.is_dir() or out.endswith(("/", os.sep)):
        return p / (run_id + EXPORT_SUFFIX)
    if not p.name.endswith(".safetensors"):
        stem = p.name.split(".", 1)[0] or run_id
        raise CliError(f"--out {out!r}: the export is a safetensors file, so its name ends in .safetensors "
                       f"(e.g. {str(p.with_name(stem + EXPORT_SUFFIX))!r}), or give a directory")
    return p


def cmd_export(args) -> int:
    from ..interop import export_transformer_lens
    if args.format != "transformer-lens":
        raise CliError(f"unknown export format {args.format!r}; allowed: transformer-lens")
    if args.n_ctx is not None and args.n_ctx < 1:
        raise CliError(f"--n-ctx must be a positive integer, got {args.n_ctx}")
    gates = parse_gates(args.gates) if args.gates else None
    _export_path(args.out, "RUN_ID")  # refused before the run is read
    store = _store(args, read_only=True)
    cfg, model = store.load_model(args.run_id)
    path = export_transformer_lens(model, _export_path(args.out, cfg.run_id), gates=gates, n_ctx=args.n_ctx)
    load = f"from softprior.interop import load_transformer_lens\nmodel = load_transformer_lens({str(path)!r})"
    print(f"wrote {path} (TransformerLens config + state dict and prior of run {cfg.run_id}, inputs up to "
          f"{args.n_ctx or cfg.model.n_ctx} tokens); load it into a HookedTransformer with:\n{load}")
    return 0


def _add_tool_parsers(sub) -> None:
    """``softprior experiments``, ``baselines``, ``bench`` and ``export``."""
    x = sub.add_parser("experiments", help="list experiments")
    x.add_argument("--plugin", action="append")
    x.set_defaults(fn=cmd_experiments)
    sub.add_parser("baselines", help="list the thirteen static baselines").set_defaults(fn=cmd_baselines)
    b = sub.add_parser("bench", help="benchmark the training engine against a plain reference")
    b.add_argument("--json", action="store_true")
    b.add_argument("--quick", action="store_true", help="fewer repetitions")
    b.add_argument("--group", type=int, default=8, help="K, the number of runs trained together")
    b.add_argument("--sweep", type=int, default=0, metavar="N",
                   help="also time a sweep of N base runs through the sweep driver (all cores), vs N reference runs")
    b.add_argument("--sweep-steps", type=int, default=3600, help="steps per run in --sweep")
    b.add_argument("--engines-only", action="store_true",
                   help="only the fused engine against the attention operator alone, the engine without either "
                        "and the reference (base and large, K = 1 and 8, 1 and 2 threads)")
    b.set_defaults(fn=cmd_bench)
    ex = sub.add_parser("export", help="export a stored run to another library's format")
    ex.add_argument("run_id")
    ex.add_argument("--format", default="transformer-lens")
    ex.add_argument("--out", default=None, help="a .safetensors file, or a directory for RUN_ID.hooked.safetensors "
                    "(default: RUN_ID.hooked.safetensors here)")
    ex.add_argument("--gates", default=None, help="gates baked into the export, e.g. pos=0,content=0")
    ex.add_argument("--n-ctx", type=int, default=None, help="longest input the exported model accepts "
                    "(default: the training context; e.g. 120 for the length test)")
    ex.add_argument("--store", default="runs")
    ex.set_defaults(fn=cmd_export)
