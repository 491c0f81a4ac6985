"""The ``softprior`` command line. Every command calls the same library functions as the Python API.

Errors (``main``): bad input gets one line, ``softprior: error: ...``, naming the bad value and the
allowed ones or the command that fixes it, and exit code 2; a failure our code finds and explains (a
damaged run, a run whose training failed) gets one line too, and exit code 1. Only our own error
classes are read so (``_BAD_INPUT``, ``_FAILURES``): anything else is a bug or an unforeseen failure,
and shows its traceback (exit code 1) rather than pass for a user's mistake.

Start-up: building the parser imports nothing heavy, and each command imports what it needs, so
``--help`` and ``paths`` answer without importing torch (seconds on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


class CliError(Exception):
    """Bad input found by the command line itself (exit code 2)."""


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


def _one_line(msg: str) -> str:
    """``msg`` with every non-printable character (newlines included) escaped as ``repr`` does, so an
    error is always one line, whatever the user typed."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(msg))


class _HelpFormatter(argparse.HelpFormatter):
    """Fills ``{model_presets}`` in a help text when help is shown: the presets live beside the model,
    which imports torch, and building the parser must not."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if "{model_presets}" in text:
            from .model.config import MODEL_PRESETS
            text = text.replace("{model_presets}", ", ".join(MODEL_PRESETS))
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line, ``softprior: error: ...``, exit code 2
    (argparse's default prints the usage block first)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"softprior: error: {_one_line(message)} (see '{self.prog} --help')\n")


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


def _creatable(path: str, flag: str) -> Path:
    """``path`` where it can be created: its nearest existing ancestor is a directory we may write
    (a one-line error naming ``flag`` if not, before any work is done)."""
    p = Path(path)
    try:
        q = p.absolute()
        while not q.exists():
            q = q.parent
    except (OSError, ValueError) as e:  # e.g. a NUL byte in the name
        raise CliError(f"{flag} {path!r} is not a usable path ({e})") from None
    if q == p.absolute() and q.is_file():  # a file to rewrite (a --doc, a --readme)
        if not os.access(q, os.W_OK):
            raise CliError(f"{flag} {path!r} cannot be written: the file is read-only")
        return p
    if not q.is_dir():
        raise CliError(f"{flag} {path!r} cannot be created: {str(q)!r} is a file, not a directory")
    if not os.access(q, os.W_OK):
        raise CliError(f"{flag} {path!r} cannot be written: directory {str(q)!r} is read-only")
    return p


def _out_dir(path: str, flag: str = "--out") -> Path:
    """A directory to write into (created if missing)."""
    p = _creatable(path, flag)
    if p.exists() and not p.is_dir():
        raise CliError(f"{flag} {path!r} is a file; give a directory (it receives the tables and figures)")
    return p


def _doc_file(path: str | None, flag: str = "--doc") -> None:
    """A markdown file to splice tables into (created if missing; its directory must exist)."""
    if path is None:
        return
    p = _creatable(path, flag)
    if p.is_dir():
        raise CliError(f"{flag} {path!r} is a directory; give a markdown file (tables go between "
                       "<!-- table:NAME --> markers in it)")
    if not p.absolute().parent.is_dir():
        raise CliError(f"{flag} {path!r}: directory {str(p.parent)!r} does not exist (mkdir -p {str(p.parent)!r})")


def _check_outputs(args, default_out: str) -> None:
    """--out, --doc and --readme checked before a report (or the training before it) starts."""
    _out_dir(args.out or default_out)
    _doc_file(getattr(args, "doc", None))
    _doc_file(getattr(args, "readme", None), "--readme")


def _record_report(store, name: str, started: float, seconds: float, runs: int) -> None:
    """A report's wall time in the store's time ledger (``report timings``), where the store can be
    written (``reproduce``; ``report`` only reads it)."""
    if store.read_only:
        return
    from .provenance import code_version, provenance
    from .store import StoreError
    try:
        store.record_timing("report", name, seconds, 0.0, runs, started, code_version=code_version(provenance()))
    except StoreError as e:
        print(f"softprior: the time ledger could not record report {name!r}: {e}", file=sys.stderr)


def _files_written(out: Path, before: dict) -> list[str]:
    """The files under ``out`` created or rewritten since ``before`` (``_stamps``), by path under ``out``."""
    return sorted(k for k, v in _stamps(out).items() if before.get(k) != v)


def _stamps(out: Path) -> dict[str, int]:
    return {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} \
        if out.is_dir() else {}


def _write_report(args, exp, cells, store) -> None:
    from .report import splice_into_doc, write_report
    out = Path(args.out or f"results/{exp.name}")
    started, t0, before = time.time(), time.perf_counter(), _stamps(out)
    md = write_report(store, exp, cells, out, exploratory=args.exploratory)
    _record_report(store, exp.name, started, time.perf_counter() - t0, len(cells))
    if args.doc:
        splice_into_doc(args.doc, exp.name, md)
    print(md)
    print(f"wrote {out}/: {', '.join(_files_written(out, before))}" + (f"; updated {args.doc}" if args.doc else ""),
          file=sys.stderr)


def _store(args, read_only: bool = False):
    """The store of --store. The commands that only read it open it ``read_only``: they never create a
    store (a typo in --store is an error, not a new empty store) and never write one, so a store shared
    read-only or on a read-only mount is read like any other. The others need it writable (created if
    missing: train, reproduce, calibrate)."""
    from .store import RunStore
    return RunStore(args.store, read_only=read_only)


def _print_result(summary: dict, as_json: bool, extra_lines=()):
    m = summary.get("metric", "acc")
    if not as_json:
        for line in extra_lines:
            print(line)
        print(f"normal {m}: {summary[f'normal_{m}']:.4f}   zero-gate {m}: {summary[f'zero_{m}']:.4f}   "
              f"(chance {summary.get('chance', float('nan')):.3f})")
    else:
        print(json.dumps(summary, sort_keys=True))


# ------------------------------------------------------------------------------------------ commands
def cmd_train(args) -> int:
    import torch

    from .config import make_run_config
    from .experiments import PAPER_STEPS
    from .paths import fits_budget, scale_to_budget, settles_at
    from .executors.sweep import run
    from .training.runtime import choose_threads
    from .model.transformer import build_model

    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be a positive integer, got {args.threads}")
    cfg = make_run_config(args.task, args.path, args.seed, model=args.model, steps=args.steps,
                          baseline=args.baseline, task_options=parse_options(args.task_opt),
                          **({"checkpoint_every": args.checkpoint_every} if args.checkpoint_every else {}))
    note = None
    if not fits_budget(cfg.path, cfg.steps):
        # fade600 on 200 steps would never fade: its schedule is scaled to the budget as --quick scales
        # it, under a name that says so (stored in the run's summary) and a label that says why
        named = cfg.path
        path = scale_to_budget(named, cfg.steps, PAPER_STEPS)
        why = f"{named.name} settles at step {settles_at(named)}, after the run's {cfg.steps} steps"
        cfg = cfg.model_copy(update={"path": path, "label": f"{path.description} ({why})"})
        note = (f"{why}: scaled x{cfg.steps / PAPER_STEPS:.4g} as --quick does, stored as {path.name!r} "
                f"({path.description.split(': ', 1)[1]})")
    threads, chosen = (args.threads, "--threads") if args.threads else choose_threads()
    torch.set_num_threads(threads)
    store = _store(args)
    n_params = build_model(cfg).n_params()
    was_done = store.is_done(cfg.run_id)
    header = sys.stderr if args.json else sys.stdout
    if note:
        print(note, file=header)
    print(f"run {cfg.run_id}: task={cfg.task.name} path={cfg.path.name} seed={cfg.seed} "
          f"model={args.model} params={n_params:,} steps={cfg.total_steps} threads={threads} ({chosen})"
          + ("  [already in store: not retrained]" if was_done else ""), file=header)
    t0 = time.perf_counter()
    summary = dict(run(cfg, store, progress=not args.no_progress, require_calibration=not args.exploratory))
    if was_done:
        summary["cached"] = True
    if cfg.label:
        summary["label"] = cfg.label
    summary.setdefault("seconds", round(time.perf_counter() - t0, 3))
    _print_result(summary, args.json)
    return 0


def _check_length(length: int, cfg, model) -> None:
    """--length against what the run's model can hold: a learned position table's rows, and memory:
    one layer's attention over the validation set holds about three [n_val, heads, T, T] tensors
    (measured: 2.1 at T = 512 and 1024), refused beyond this machine's memory rather than left to the
    allocator's error."""
    rows = [m.max_len for m in model.modules() if isinstance(getattr(m, "max_len", None), int)]
    if rows and length > min(rows):
        raise CliError(f"--length {length} is longer than run {cfg.run_id}'s {cfg.model.positional} position table "
                       f"({min(rows)} rows); the longest it can evaluate is {min(rows)}")
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: the allocator decides
        return
    per = 3 * cfg.n_val * cfg.model.n_heads * next(model.parameters()).element_size()  # bytes per T^2
    if per * length ** 2 > have:
        raise CliError(f"--length {length} needs about {per * length ** 2 / 2 ** 30:,.0f} GiB for the attention of "
                       f"{cfg.n_val} validation sequences; this machine has {have / 2 ** 30:,.0f} GiB: the longest "
                       f"length that fits is about {int((have / per) ** 0.5):,}")


def cmd_eval(args) -> int:
    import torch

    from .tasks.generators import make_task
    from .training.loop import evaluate

    gp, gc = parse_gates(args.gates)
    store = _store(args, read_only=True)
    cfg, model = store.load_model(args.run_id)
    task = make_task(cfg.task)
    length = cfg.model.n_ctx if args.length is None else args.length
    if length < task.min_length():
        raise CliError(f"--length {length} is too short for {cfg.task.name}; minimum {task.min_length()}")
    _check_length(length, cfg, model)
    val = cfg.validation_batch(task, length=length)
    with torch.no_grad():
        res = evaluate(model, task, val.inputs, val.targets, gp, gc)
        g_pos, g_content = model.gates(gp, gc)
    out = {"run_id": cfg.run_id, "metric": task.metric, task.metric: res[task.metric], "loss": res["loss"],
           "length": length, "g_pos": float(g_pos.mean()), "g_content": float(g_content.mean()),
           "chance": task.chance_at(length)}
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"run {cfg.run_id} ({cfg.task.name}, {cfg.path.name}, seed {cfg.seed}) at length {length}, "
              f"g_pos={out['g_pos']:.3f} g_content={out['g_content']:.3f}: "
              f"{task.metric} {res[task.metric]:.4f}, loss {res['loss']:.4f} (chance {out['chance']:.3f})")
    return 0


def _experiment(args):
    from .experiments import Options, get_experiment, load_plugin
    for f in args.plugin or []:
        load_plugin(f)
    exp = get_experiment(args.name)
    tasks = tuple(t.strip() for t in args.tasks.split(",")) if getattr(args, "tasks", None) is not None else None
    opts = Options(seeds=args.seeds, quick=args.quick, tasks=tasks, record=getattr(args, "record", None))
    if opts.seeds is not None and opts.seeds < 1:
        raise CliError(f"--seeds must be >= 1, got {opts.seeds}")
    return exp, exp.cells(opts)


def _from_bundle(args):
    """``report paper --from-bundle DIR``: the bundle as the source, and what it was written with (the
    options, the experiments, the calibration spaces, exploratory or not, where the documents went,
    relative to --out, by default the results directory the bundle sits in)."""
    from .bundle import BundleSource
    from .experiments import Options
    source = BundleSource(args.from_bundle)
    m = source.manifest
    o = m["options"]
    opts = Options(seeds=o["seeds"], quick=o["quick"], tasks=tuple(o["tasks"]) if o["tasks"] is not None else None,
                   extend=tuple(tuple(x) for x in o.get("extend", ())), extend_seeds=o.get("extend_seeds"),
                   record=o.get("record"))
    given = {"--seeds": (args.seeds, opts.seeds), "--tasks": (args.tasks and tuple(
        t.strip() for t in args.tasks.split(",")), opts.tasks), "--quick": (args.quick or None, opts.quick or None),
        "--record": (getattr(args, "record", None), opts.record)}
    for flag, (mine, theirs) in given.items():
        if mine is not None and mine != theirs:
            raise CliError(f"{flag}: the bundle {str(source.root)!r} was written with {flag} {theirs!r}; "
                           "a bundle regenerates the documents it was written for (omit the flag)")
    out = Path(args.out) if args.out else source.results_dir
    docs = m.get("docs", {})

    def where(flag_value, key):
        return flag_value if flag_value is not None else (str(out / docs[key]) if docs.get(key) else None)
    notes = source.results_dir / "NOTES.md"
    if notes.is_file() and not (out / "NOTES.md").exists():  # the fixed prose of RESULTS.md
        out.mkdir(parents=True, exist_ok=True)
        (out / "NOTES.md").write_text(notes.read_text())
    return (source, opts, m["experiments"], out, where(args.doc, "results") or str(out / "RESULTS.md"),
            where(args.readme, "readme"),
            where(args.calibration_doc, "calibration"), [s["name"] for s in m.get("spaces", [])],
            args.exploratory or bool(m.get("exploratory")))


def _only(args, names: list[str]) -> list[str]:
    """The paper's experiments ``names``, those of ``reproduce paper --only`` alone where it is given."""
    if not getattr(args, "only", None):  # reproduce only
        return names
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in only if n not in names]
    if bad:
        raise CliError(f"--only: {', '.join(map(repr, bad))} not among the experiments of 'paper' here "
                       f"({', '.join(names)})")
    return [n for n in names if n in only]


def _paper_sweep(args, store, cfgs) -> int:
    """One training sweep of the paper; how many runs failed."""
    from .executors.sweep import execute
    t0 = time.perf_counter()
    report = execute(cfgs, store, executor=args.executor, workers=args.workers, group_size=args.group,
                     address=args.address, progress=not args.no_progress, require_calibration=not args.exploratory)
    print(report.line() + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return len(report.failed)


def _check_paper_args(args) -> None:
    if args.seeds is not None and args.seeds < 1:
        raise CliError(f"--seeds must be >= 1, got {args.seeds}")
    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    _doc_file(getattr(args, "calibration_doc", None), "--calibration-doc")


def _splice_verdicts(readme, out) -> None:
    """The README's answer: the verdicts in plain words, then the same claims on every record whose tables ran."""
    from .paper import cross_regime_summary, load_tables, verdict_summary
    from .report import splice_into_doc
    cross = cross_regime_summary(out)
    splice_into_doc(readme, "verdicts", verdict_summary(load_tables(out)) + ("\n\n" + cross if cross else ""))


def _paper(args, train: bool) -> int:
    """``reproduce paper`` / ``report paper``: every experiment, one sweep, every table, RESULTS.md (and
    CALIBRATION.md's blocks with --calibration-doc), and the results bundle ``OUT/bundle`` of everything
    they read (``softprior.bundle``); or, with --from-bundle, the same documents from a bundle."""
    from pathlib import Path

    from .experiments import Options, load_plugin
    from .paper import (CALIBRATION_SPACES, ON_RECORD, OURS, PAPER, paper_cells, write_calibration_docs,
                        write_reports, write_results_doc)
    from .report import check_clean
    for f in args.plugin or []:
        load_plugin(f)
    _check_paper_args(args)
    if getattr(args, "from_bundle", None):
        store, opts, names, out, doc, readme, cal_doc, spaces, exploratory = _from_bundle(args)
        exps = paper_cells(opts, names)
        args.out = str(out)
        _check_outputs(args, "results")
        bundle = None
    else:
        tasks = tuple(t.strip() for t in args.tasks.split(",")) if args.tasks else None
        opts = Options(seeds=args.seeds, quick=args.quick, tasks=tasks, record=args.record)
        names = _only(args, ON_RECORD if opts.record else PAPER + OURS)
        exploratory = args.exploratory
        exps = paper_cells(opts, names)
        _check_outputs(args, "results")
        store = _store(args, read_only=not train)
        out = Path(args.out or "results")
        doc, readme, cal_doc = args.doc or str(out / "RESULTS.md"), args.readme, args.calibration_doc
        spaces = CALIBRATION_SPACES
        bundle = out / "bundle"
    failed = 0
    if train:
        cfgs = list({c.cfg.run_id: c.cfg for _, cells in exps for c in cells}.values())
        _refuse_dirty_training(cfgs, store, exploratory)
        print(f"paper: {len(exps)} experiments, {len(cfgs)} distinct runs, store {args.store}, executor "
              f"{args.executor} x{args.workers}, group size {_group_shown(args, cfgs, store)}", file=sys.stderr)
        failed = _paper_sweep(args, store, cfgs)
    if not getattr(args, "from_bundle", None) and opts.seeds is None and not opts.quick:
        opts, exps, more = _more_seeds(store, opts, names, exps)
        if more and train:
            _refuse_dirty_training(more, store, exploratory)
            print(f"paper: {len(opts.extend)} cell(s) undecided at the paper's seed counts, run on up to "
                  f"{opts.extend_seeds} seeds: {len(more)} more runs", file=sys.stderr)
            failed += _paper_sweep(args, store, more)
    check_clean(store, exps, exploratory)  # before any file is written: every table's runs at once
    writer = None
    if bundle is not None:
        from .bundle import BundleWriter
        writer = BundleWriter(bundle)
    write_reports(store, exps, out, opts=opts, workers=args.workers, plugins=args.plugin or (),
                  on_report=lambda *a: _record_report(store, *a), bundle=writer.dir if writer else None,
                  exploratory=exploratory)
    # the searches first: RESULTS.md shows an identification or effect search's section (paper.search_sections)
    written = write_calibration_docs(store, cal_doc, out, spaces, bundle=writer.dir if writer else None) \
        if cal_doc else []
    if getattr(args, "from_bundle", None):  # the bundles of the paper on other records it holds, then their section
        from .paper import ON_RECORD_DIR
        for sub in sorted((store.results_dir / ON_RECORD_DIR).glob("*/bundle/manifest.json")):
            here = sub.parent.parent
            if main(["report", "paper", "--from-bundle", str(here), "--out", str(out / ON_RECORD_DIR / here.name),
                     "--workers", str(args.workers)]) != 0:
                raise CliFailure(f"the bundle {str(here)!r} inside {str(store.root)!r} did not regenerate")
    started, t0 = time.time(), time.perf_counter()
    write_results_doc(out, doc, names=[e.name for e, _ in exps], spaces=written, record=opts.record)
    _record_report(store, "RESULTS.md", started, time.perf_counter() - t0, 0)
    if readme:  # the verdicts at a glance, generated from the same tables
        _splice_verdicts(readme, out)
    if writer is not None:
        _finish_bundle(writer, store, opts, exps, written, exploratory, out, doc, readme, cal_doc)
    print(Path(doc).read_text().split("\n## ", 2)[1] if "\n## " in Path(doc).read_text() else "")
    print(f"wrote {len(exps)} experiments under {out}/ and {doc}" + (f", the bundle {bundle}/" if writer else "")
          + (f"; updated {cal_doc} ({', '.join(written)})" if written else "")
          + (f"; updated {readme} (its verdict list)" if readme else ""), file=sys.stderr)
    return 1 if failed else 0


def _finish_bundle(writer, store, opts, exps, written, exploratory, out, doc, readme, cal_doc) -> None:
    """The results bundle's last part: the time ledger (this report's rows included), each record's first
    prediction row (its age, for a report outside git), and the manifest that ``report paper --from-bundle``
    rewrites the documents from."""
    from .bundle import write_ledger
    from .store.record_clock import first_rows
    rows = store.ledger()
    kind_of = _ledger_kind(store)
    write_ledger(writer.dir, rows, {r["id"]: kind_of(r) for r in rows if r["kind"] == "job"})

    def rel(p):
        return Path(os.path.relpath(Path(p).resolve(), out.resolve())).as_posix() if p else None
    first = first_rows(store.index.rows())
    held = sorted(f.stem for f in (writer.dir / "records").glob("*.json"))
    writer.finish({"records": {h: {"first_row": first.get(h)} for h in held},
                   "options": {"seeds": opts.seeds, "quick": opts.quick,
                               "tasks": list(opts.tasks) if opts.tasks is not None else None,
                               "record": opts.record,
                               "extend": [list(x) for x in opts.extend], "extend_seeds": opts.extend_seeds},
                   "experiments": [e.name for e, _ in exps], "spaces": [{"name": s} for s in written],
                   "exploratory": bool(exploratory),
                   "docs": {"results": rel(doc), "readme": rel(readme), "calibration": rel(cal_doc) if written
                            else None}})


def _more_seeds(store, opts, names, exps):
    """At the paper's seed counts: the cells whose condition is undecided there (``paper.more_seeds``,
    decided on those seeds' runs alone, and only once every one of them is stored, so that a partly
    trained store cannot decide otherwise than the finished one) get seeds up to ``paper.MAX_SEEDS``.
    Returns the options with the extension, their (experiment, cells), and the added runs not yet in
    ``store``; says so when runs of the paper's seeds are missing."""
    import dataclasses

    from .paper import MAX_SEEDS, claim_tables, more_seeds, paper_cells
    missing = sum(not store.is_done(c.cfg.run_id) for _, cells in exps for c in cells)
    if missing:
        print(f"paper: {missing} run(s) of the paper's seeds are not stored, so no cell is given more seeds yet "
              "(decided once they all are)", file=sys.stderr)
        return opts, exps, []
    extend = more_seeds(claim_tables(store, exps))
    if not extend:
        return opts, exps, []
    opts = dataclasses.replace(opts, extend=extend, extend_seeds=MAX_SEEDS)
    wider = paper_cells(opts, names)
    have = {c.cfg.run_id for _, cells in exps for c in cells}
    more = list({c.cfg.run_id: c.cfg for _, cells in wider for c in cells
                 if c.cfg.run_id not in have and not store.is_done(c.cfg.run_id)}.values())
    return opts, wider, more


def _refuse_dirty_training(cfgs, store, exploratory: bool) -> None:
    """Before a sweep (an experiment's or the paper's): runs trained now from a checkout with uncommitted
    changes would be ``+dirty`` and refused by every table (``report.check_clean``), so say so before
    training them rather than after."""
    if exploratory:
        return
    from .provenance import code_version, provenance
    version = code_version(provenance())
    todo = sum(not store.is_done(c.run_id) for c in cfgs)
    if todo and version.endswith("+dirty"):
        raise CliError(f"this checkout has uncommitted changes ({version}): the {todo} runs left to train would "
                       "be trained from a dirty tree, which no table accepts unless it is marked exploratory; "
                       "commit first, or pass --exploratory")



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


def _group_shown(args, cfgs, store) -> str:
    """The group size a sweep of ``cfgs`` will use (``auto`` resolved as ``execute`` resolves it)."""
    from .executors.sweep import sweep_plan
    _, ks = sweep_plan(cfgs, store, args.group, args.workers)
    if args.group != "auto":
        return str(args.group)
    return "auto (" + ", ".join(f"K = {k}" + (f" {m}" if len(ks) > 1 else "") for m, k in ks.items()) + ")" if ks else "auto"


def cmd_reproduce(args) -> int:
    from .executors.sweep import execute
    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    _check_executor(args)
    if args.device:  # for one experiment and for the paper alike
        import os
        import torch
        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, AssertionError) as e:
            raise CliError(f"--device {args.device!r} is not usable here: {e}") from None
        os.environ["SOFTPRIOR_DEVICE"] = args.device  # read by train.Runs in every worker
    if args.name == "paper":
        return _paper(args, train=True)
    exp, cells = _experiment(args)
    _check_outputs(args, f"results/{exp.name}")
    store = _store(args)
    _refuse_dirty_training([c.cfg for c in cells], store, args.exploratory)
    print(f"{exp.name}: {exp.description}\n{len(cells)} runs, store {args.store}, executor {args.executor}"
          f"{f' x{args.workers}' if args.workers > 1 else ''}, group size {_group_shown(args, [c.cfg for c in cells], store)}",
          file=sys.stderr)
    report = execute([c.cfg for c in cells], store, executor=args.executor, workers=args.workers,
                     group_size=args.group, address=args.address, progress=not args.no_progress,
                     require_calibration=not args.exploratory)
    print(report.line(), file=sys.stderr)
    _write_report(args, exp, cells, store)
    return 1 if report.failed else 0


def _check_executor(args) -> None:
    """--executor ray without Ray installed: said before anything runs."""
    if getattr(args, "executor", "local") == "ray":
        import importlib.util
        if importlib.util.find_spec("ray") is None:
            raise CliError("--executor ray needs Ray, which is not installed: pip install 'softprior[ray]' "
                           "(or leave --executor at local)")


def _register(args, space, store, cands) -> list:
    """``calibrate --register``: measure the best candidates on every seed (an identification search: until
    its set holds the hard constraints; else the nearest passing ones), then pre-register the choice."""
    from .calibration.doc import register
    from .calibration.search import complete_nearest
    run_kw = dict(executor=args.executor, workers=args.workers, group_size=args.group,
                  progress=not args.no_progress, address=args.address)
    if space.identify:
        from .calibration.identify import complete
        cands = complete(space, store, cands, steps=args.steps, log=lambda m: print(m, file=sys.stderr),
                         sweep_bar=not args.no_progress, **run_kw)
    else:
        cands = complete_nearest(space, store, cands, k=args.complete, steps=args.steps, **run_kw)
    rec = register(space, store, cands, steps=args.steps, ship=args.ship, doc=args.doc)
    print(f"registered {rec['hash']} at {rec['registered_at']}: {rec['task_options']} {rec['model_options']}"
          f" ({'passes' if rec['passes'] else 'NO candidate passes: nearest'})", file=sys.stderr)
    return cands


def cmd_calibrate(args) -> int:
    from .calibration import load_space
    from .calibration.report import choose, write_outputs
    from .calibration.search import load_candidates, run_search

    if args.identify and args.space:
        raise CliError("--identify chooses the task's identification space; give --space or --identify, not both")
    space = load_space(args.space or (f"{args.task}_identify" if args.identify else args.task))
    if space.task != args.task:
        raise CliError(f"search space {space.name!r} is for task {space.task!r}, not {args.task!r}")
    if args.budget is not None and args.budget < 1:
        raise CliError(f"--budget must be >= 1, got {args.budget}")
    _check_executor(args)
    bundle = None
    if args.bundle:
        from .bundle import BundleError, BundleSource
        if not args.doc:
            raise CliError("--bundle records the search's blocks of a document: give --doc (docs/CALIBRATION.md)")
        try:
            bundle = BundleSource(args.bundle).results_dir
        except BundleError as e:
            raise CliError(str(e)) from None
        args.out = args.out or str(bundle / "calibration" / space.name)
    _check_outputs(args, f"results/calibration/{space.name}")
    store = _store(args)
    out = Path(args.out or f"results/calibration/{space.name}")
    t0 = time.perf_counter()
    if args.budget:
        cands = run_search(space, store, budget=args.budget, executor=args.executor, workers=args.workers,
                           group_size=args.group, batch=args.batch, progress=not args.no_progress,
                           address=args.address, steps=args.steps,
                           log=lambda m: print(m, file=sys.stderr))
    else:
        cands = load_candidates(space, store)
    if args.register:
        cands = _register(args, space, store, cands)
    from .calibration.robustness import fade_points, run_robustness
    if args.robustness:
        rep = run_robustness(space, store, cands, executor=args.executor, workers=args.workers,
                             group_size=args.group, progress=not args.no_progress, steps=args.steps,
                             all_fade=args.fade_points, **({} if args.wide is None else {"wide": args.wide}))
        print(rep.line(), file=sys.stderr)
    if bundle is not None:  # the same outputs and blocks, written through the bundle (bundle.add_part)
        from .bundle import add_part
        from .calibration.doc import write_calibration
        from .store.record_clock import first_rows
        if not cands:
            raise CliError(f"search space {space.name!r} was never searched in store {args.store!r}: nothing to record")
        add_part(args.bundle, store, f"calibration-{space.name}",
                 lambda src: write_calibration(args.doc, src, space, out, steps=args.steps), space=space.name,
                 first_rows=first_rows(store.index.rows()), doc=args.doc)
        files = {f.name: f for f in sorted(out.iterdir()) if f.is_file()}
        print(f"recorded search {space.name} into the bundle {args.bundle}: `softprior report paper --from-bundle "
              f"{args.bundle}` writes RESULTS.md with it", file=sys.stderr)
    else:
        from .calibration.doc import write_sections
        fade = fade_points(space, store, cands, steps=args.steps) or None
        files = write_outputs(space, cands, out, fade)
        if args.doc:
            from .calibration.doc import update_doc
            blocks = update_doc(args.doc, space, store, cands, steps=args.steps, figure=files.get("figure"))
            write_sections(space, store, cands, out, blocks, steps=args.steps)
    print((out / "candidates.md").read_text())
    best = choose(cands)
    n = {s: sum(c.status == s for c in cands) for s in ("passes", "fails", "pruned", "infeasible")}
    print(f"{len(cands)} candidates: " + ", ".join(f"{v} {k}" for k, v in n.items())
          + (f"; nearest passing: {best.cid} ({best.label}), distance {best.distance:.3f}" if best
             else "; no candidate passes every criterion") + f"; {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(f"wrote {', '.join(str(f) for f in files.values())}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    if args.name == "paper":
        return _paper(args, train=False)
    if args.name == "timings":
        return cmd_report_timings(args)
    exp, cells = _experiment(args)
    _check_outputs(args, f"results/{exp.name}")
    if args.from_bundle:
        from .bundle import BundleSource
        _write_report(args, exp, cells, BundleSource(args.from_bundle))
        return 0
    _write_report(args, exp, cells, _store(args, read_only=True))
    return 0


def _ledger_kind(store):
    """A job row's kind for ``report timings``: task/size (``bench.job_kind``), and the positional scheme
    where there is one, read from the store's config of its first run."""
    from .bench import job_kind
    from .store import StoreError

    def kind_of(row) -> str:
        try:
            pos = store.load_config(row["detail"]["run_ids"][0]).model.positional
        except (StoreError, KeyError, IndexError, OSError, ValueError):
            return job_kind(row)
        return job_kind(row) + ("" if pos in (None, "none") else f" {pos}")
    return kind_of


def _until(text: str | None) -> float | None:
    """--until: an ISO 8601 date or time (UTC where it names no zone) or unix seconds, as unix seconds."""
    if text is None:
        return None
    import datetime
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--until must be an ISO 8601 time (e.g. 2026-12-06T03:00, UTC unless it names a zone) "
                       f"or unix seconds, got {text!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)).timestamp()


def cmd_report_timings(args) -> int:
    """``report timings``: the store's time ledger (``bench.ledger_summary``), or the one a results bundle
    carries (--from-bundle): the paper's wall time, its FLOP, the floor at the GEMM rate and the ratio,
    and the costliest jobs; by default only the rows of the code version this checkout is
    (``provenance.code_version``), another with --code-version, all with --all-versions; rows started
    before --until only; and where the time goes, per kind of job (task/size and positional scheme)."""
    if args.gemm_rate is not None and not args.gemm_rate > 0:
        raise CliError(f"--gemm-rate must be a positive number of GFLOP/s, got {args.gemm_rate}")
    if args.top < 0:
        raise CliError(f"--top must be >= 0, got {args.top}")
    if args.all_versions and args.code_version:
        raise CliError("--all-versions and --code-version contradict each other: give one")
    until = _until(args.until)
    from .bench import format_timings, job_kind, ledger_summary
    from .provenance import code_version, provenance
    if args.from_bundle:
        from .bundle import read_ledger
        rows, kinds = read_ledger(args.from_bundle)

        def kind_of(row) -> str:
            return kinds.get(row["id"]) or job_kind(row)
        where = {"bundle": str(args.from_bundle)}
    else:
        store = _store(args, read_only=True)
        rows, kind_of, where = store.ledger(), _ledger_kind(store), {"store": str(args.store)}
    if args.code_version and not any(r.get("code_version") == args.code_version for r in rows):
        known = sorted({r.get("code_version") or "?" for r in rows})
        raise CliError(f"--code-version {args.code_version!r}: the time ledger has no row of it; it has "
                       f"{', '.join(known) or 'no rows'}")
    before = [r for r in rows if until is None or r["started_at"] < until]
    version = None if args.all_versions else args.code_version or code_version(provenance())
    t = ledger_summary(before, version, rate=args.gemm_rate, top=args.top, kind_of=kind_of)
    t.update(where, until=until, rows_after_until=len(rows) - len(before))
    print(json.dumps(t, sort_keys=True) if args.json else format_timings(t))
    return 0


def cmd_experiments(args) -> int:
    from .experiments import list_experiments, load_plugin
    for f in args.plugin or []:
        load_plugin(f)
    return _print_rows(list_experiments())


def cmd_baselines(args) -> int:
    from .model.baselines import list_baselines
    return _print_rows(list_baselines())


def cmd_bench(args) -> int:
    from .bench import run_bench, run_engines
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print  # --json: stdout holds the JSON alone
    if args.engines_only:
        res = run_engines(quick=args.quick, log=log)
    else:
        res = run_bench(quick=args.quick, group_size=args.group, log=log)
    if args.sweep and not args.engines_only:
        from .bench import sweep_bench
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
    from .interop import export_transformer_lens
    if args.format != "transformer-lens":
        raise CliError(f"unknown export format {args.format!r}; allowed: transformer-lens")
    if args.n_ctx is not None and args.n_ctx < 1:
        raise CliError(f"--n-ctx must be a positive integer, got {args.n_ctx}")
    gates = parse_gates(args.gates) if args.gates else None
    _export_path(args.out, "RUN_ID")  # refused before the run is read
    store = _store(args, read_only=True)
    cfg, model = store.load_model(args.run_id)
    path = export_transformer_lens(model, _export_path(args.out, cfg.run_id), gates=gates, n_ctx=args.n_ctx)
    print(f"wrote {path} (TransformerLens config + state dict and prior of run {cfg.run_id}, "
          f"inputs up to {args.n_ctx or cfg.model.n_ctx} tokens); load it into a HookedTransformer with:\n"
          f"from softprior.interop import load_transformer_lens\n"
          f"model = load_transformer_lens({str(path)!r})")
    return 0


def cmd_store_verify(args) -> int:
    from .store.integrity import verify_store
    report = verify_store(args.store, repair=args.repair)
    for line in report.lines():
        print(line)
    if report.healthy:
        return 0
    if not args.repair:
        return 1
    after = verify_store(args.store)  # what the repair left
    print("after repair: " + after.lines()[0])
    return 0 if after.healthy else 1


def cmd_paths(args) -> int:
    from .paths import list_paths
    return _print_rows(list_paths())


def cmd_tasks(args) -> int:
    """Each task, its options and the Bayes ceiling of its registered default (closed form, no torch);
    ``--ceilings``: every default's ceiling or references measured (Monte Carlo where there is no
    closed form: Markov at each p, linear ICL's least squares, Bayes ridge and one GD step)."""
    from .plugins import load_plugin
    from .preregistration import default_options
    from .tasks.registry import TASK_CONFIGS, describe_tasks
    for f in args.plugin or []:
        load_plugin(f)
    defaults = {t: default_options(t)[0] for t in TASK_CONFIGS}
    _print_rows(describe_tasks(defaults))
    if not args.ceilings:
        return 0
    import torch

    from .tasks.generators import make_task
    from .tasks.registry import task_config
    print("\nmeasured on the registered defaults (Monte Carlo: seed 0, standard error beside):")
    for name, opts in defaults.items():
        if name == "linear_icl":
            task = make_task(task_config(name, **opts))
            ref = task.reference_mse(task.sample(4096, 32, torch.Generator().manual_seed(0)))
            print(f"  {name}: query MSE / E[y^2]: " + ", ".join(f"{k} {v:.4f}" for k, v in ref.items())
                  + " (the zero predictor: 1.0)")
            continue
        for p in ((0.2, 0.5, 0.8) if name == "markov" else (None,)):
            task = make_task(task_config(name, **opts, **({"p": p} if p is not None else {})))
            acc, se = task.bayes_accuracy()
            print(f"  {name}{f' p={p}' if p is not None else ''}: Bayes ceiling {acc:.3f}" + (f" ± {se:.3f}" if se else ""))
    return 0


def cmd_tour(args) -> int:
    """``softprior tour``: ``tour.run_tour`` (the notebook executed headless, its outputs kept in OUT)."""
    from .tour import run_tour
    env = {"SOFTPRIOR_TOUR_STEPS": str(args.steps)} if args.steps is not None else {}
    dest = run_tour(args.notebook, args.out, env=env)
    print(f"wrote {dest} (the executed tour, with its outputs) and the tour's table and figures in {dest.parent}/",
          file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------ parser
def cmd_study(args) -> int:
    from .plugins import load_plugin
    for f in args.plugin or []:
        load_plugin(f)
    from .study import StudyPlan, load_criteria, run_study
    _check_executor(args)
    plan = StudyPlan(task=args.task, prior=args.prior, name=args.name or "", quick=args.quick, steps=args.steps,
                     seeds=args.seeds, budget=args.budget, out=args.out, executor=args.executor,
                     criteria=load_criteria(args.criteria) if args.criteria else None, workers=args.workers,
                     group_size=args.group, address=args.address)
    started = time.time()
    report = run_study(plan, _store(args))
    print(f"study {plan.name}: {report} ({time.time() - started:.0f} s)")
    return 0


def _add_study_parser(sub) -> None:
    """``softprior study``: the whole method on a task and a prior, built in or from --plugin files."""
    s = sub.add_parser("study", help="the whole method on your own prior and/or task: difficulty search, "
                       "pre-registration, the paths, the robustness map, study/NAME/REPORT.md (docs/STUDY.md)")
    s.add_argument("--task", required=True, help="a registered task (`softprior tasks`, or one a --plugin registers)")
    s.add_argument("--prior", default="soft", help="a registered prior family (softprior.model.priors: soft, alibi, t5, "
                   "kerple_log, kerple_power, fire, or one a --plugin registers)")
    s.add_argument("--plugin", action="append", help="a Python file that registers a task, a prior, paths or "
                   "experiments; repeatable")
    s.add_argument("--name", default=None, help="the study's name (default TASK-PRIOR, -quick with --quick)")
    s.add_argument("--quick", action="store_true", help="a tiny study: 60 steps, 2 seeds, 2 candidates")
    s.add_argument("--steps", type=int, default=None, help="steps per run (default 3600; the paths are scaled)")
    s.add_argument("--seeds", type=int, default=None, help="seeds per row (default 3)")
    s.add_argument("--budget", type=int, default=None, help="candidates the difficulty search measures (default 12)")
    s.add_argument("--criteria", default=None, help="a .json/.toml file of difficulty criteria (default: the "
                   "task's own if a plugin declares them, else: the prior-on path learns, the no-prior path does not)")
    s.add_argument("--out", default="study", help="where study/NAME/ goes (default ./study)")
    s.add_argument("--store", default="runs")
    s.add_argument("--executor", default="local", choices=["local", "ray"])
    s.add_argument("--workers", type=_at_least_one, default=1)
    s.add_argument("--group", type=_group_arg, default="auto", help="runs per group, or 'auto' (as reproduce)")
    s.add_argument("--address", default=None)
    s.set_defaults(fn=cmd_study)


def _add_train_parser(sub) -> None:
    """``softprior train``: one run."""
    t = sub.add_parser("train", help="train one run (skipped if already in the store)")
    t.add_argument("--task", default="assoc_recall")
    t.add_argument("--path", default="fade600")
    t.add_argument("--baseline", default=None, help="a static baseline (see `softprior baselines`); sets the path")
    t.add_argument("--task-opt", action="append", metavar="KEY=VALUE",
                   help="task option, e.g. p=0.2 (markov) or n_pairs=12 (assoc_recall); repeatable")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--model", default="base", help="one of {model_presets}")
    t.add_argument("--steps", type=int, default=None, help="step budget (default 3600); a path whose schedule "
                   "settles later (fade600->0 ends at step 1050) is scaled to it as --quick does, and named so")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: the free cores, "
                   "runtime.choose_threads)")
    t.add_argument("--checkpoint-every", type=int, default=0, help="steps between resumable checkpoints")
    t.add_argument("--store", default="runs")
    t.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--exploratory", action="store_true",
                   help="train a prediction row even if no calibration record covers its configuration")
    t.set_defaults(fn=cmd_train)


def _add_eval_parser(sub) -> None:
    """``softprior eval``: a stored run under gate overrides."""
    e = sub.add_parser("eval", help="evaluate a stored run under a gate override")
    e.add_argument("run_id")
    e.add_argument("--gates", default=None, help="e.g. pos=0,content=0 (missing gates keep the model's)")
    e.add_argument("--length", type=int, default=None, help="sequence length (default: the training context)")
    e.add_argument("--store", default="runs")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=cmd_eval)


def _add_experiment_parsers(sub) -> None:
    """``softprior reproduce`` and ``softprior report``: an experiment, or the paper; the arguments they share
    here, each one's own in ``_add_reproduce_args`` / ``_add_report_args``."""
    for name, fn, hlp in (("reproduce", cmd_reproduce, "run an experiment's missing runs, then tabulate and plot it"),
                          ("report", cmd_report, "rebuild an experiment's table and figures from the store")):
        r = sub.add_parser(name, help=hlp)
        r.add_argument("name", help="an experiment (see `softprior experiments`), or 'paper' for all of them"
                       + (", or 'timings': the store's time ledger (wall time, FLOP, the floor)" if name == "report"
                          else ""))
        r.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default: the paper's)")
        r.add_argument("--tasks", default=None, help="comma-separated task filter (static_baselines)")
        r.add_argument("--record", default=None, metavar="NAME",
                       help="a shipped pre-registered record (src/softprior/calibration/registered/NAME.json, e.g. "
                            "identified-assoc_recall) in place of its task's default: the cells of that task, "
                            "built on its configuration (for 'paper': its experiments but the continuation trace)"),
        r.add_argument("--store", default="runs")
        r.add_argument("--quick", action="store_true", help="few steps and seeds: a smoke run")
        r.add_argument("--out", default=None, help="output directory (default results/NAME)")
        r.add_argument("--plugin", action="append", help="a Python file that registers experiments or paths")
        r.add_argument("--doc", default=None, help="also splice the table into this markdown file "
                       "(between <!-- table:NAME --> markers)")
        r.add_argument("--readme", default=None, help="paper only: also splice the verdict summary into this file")
        r.add_argument("--calibration-doc", default=None, help="paper only: also write the generated blocks of this "
                       "file (docs/CALIBRATION.md) for each task's searched space, and OUT/calibration/SPACE")
        r.add_argument("--workers", type=_at_least_one, default=1, help="parallel worker processes (local) or jobs (ray); "
                       "for 'paper' also the processes that write the reports")
        if name == "report":
            _add_report_args(r)
        if name == "reproduce":
            _add_reproduce_args(r)
        r.set_defaults(fn=fn)


def _add_report_args(r) -> None:
    """``softprior report``'s own arguments: a results bundle, and ``report timings``."""
    r.add_argument("--from-bundle", default=None, metavar="DIR", help="read a results bundle (DIR/bundle, "
                   "e.g. docs/results) instead of a store: 'paper' rewrites the documents it was written "
                   "for (RESULTS.md, CALIBRATION.md, the README table; paths relative to --out, by default "
                   "DIR), no store and no weights needed; 'timings' reads the time ledger it carries")
    r.add_argument("--exploratory", action="store_true", help="let runs trained from a dirty tree "
                   "(uncommitted changes) enter the tables, marked exploratory (default: refused)")
    r.add_argument("--json", action="store_true", help="timings: print one JSON object")
    r.add_argument("--gemm-rate", type=float, default=None, metavar="GFLOPS", help="timings: the GEMM rate "
                   "of the floor (default: the fastest the ledger's sweeps measured, else measured now)")
    r.add_argument("--all-versions", action="store_true", help="timings: count the rows of every code "
                   "version (default: only this checkout's, provenance.code_version)")
    r.add_argument("--code-version", default=None, metavar="VERSION", help="timings: count the rows of "
                   "this code version (as the ledger names it, e.g. 0.1.0@1a7f242198ad) instead of this "
                   "checkout's")
    r.add_argument("--top", type=int, default=10, help="timings: the costliest jobs listed")
    r.add_argument("--until", default=None, metavar="WHEN", help="timings: count only the rows started "
                   "before WHEN (ISO 8601, UTC unless it names a zone, or unix seconds), e.g. a sweep's "
                   "time before later sweeps of the same code")


def _add_reproduce_args(r) -> None:
    """``softprior reproduce``'s own arguments: where and how runs train."""
    r.add_argument("--executor", default="local", choices=["local", "ray"])
    r.add_argument("--group", type=_group_arg, default="auto", help="runs trained together in one "
                   "process, their parameters stacked on a run dimension (engine.train_group); 'auto' "
                   "(default): chosen per model size from its measured group scaling (executors.grouping.group_sizes)")
    r.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    r.add_argument("--device", default=None, help="where runs train (single runs and groups), e.g. cuda "
                   "(default: $SOFTPRIOR_DEVICE or cpu)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--only", default=None, metavar="EXP,EXP", help="paper only: these of its experiments (e.g. "
                   "the large rows of a record: --record NAME --only paths)")
    r.add_argument("--exploratory", action="store_true",
                   help="train prediction rows even if no calibration record covers their configuration, "
                   "and let runs trained from a dirty tree enter the tables, marked exploratory")


def _add_calibrate_parser(sub) -> None:
    """``softprior calibrate``: the search, pre-registration and the robustness map."""
    from .tasks.registry import TASK_SPECS  # no torch
    c = sub.add_parser("calibrate", help="search task design and initialisation against the difficulty rows "
                       "(Optuna), pre-register the choice, map the claims' robustness")
    c.add_argument("task", choices=list(TASK_SPECS), help="a registered task")
    c.add_argument("--identify", action="store_true", help="search the task's identification space "
                   "(TASK_identify: scored on every static row of the paper, src/softprior/tiers.py)")
    c.add_argument("--space", default=None, help="a .toml/.json search space or a shipped one "
                   "(default: the task's shipped space)")
    c.add_argument("--budget", type=int, default=None, help="candidates to measure in all (a resumed search "
                   "counts those measured before); default: only report")
    c.add_argument("--register", action="store_true", help="pre-register the choice (the passing candidate "
                   "nearest to the difficulty rows) in the store and --doc, before any prediction row")
    c.add_argument("--ship", action="store_true", help="with --register: also make it the package default "
                   "(writes src/softprior/calibration/registered/TASK.json)")
    c.add_argument("--robustness", action="store_true", help="train the prediction rows of every passing "
                   "candidate (needs a registered record) and count the claims")
    c.add_argument("--complete", type=int, default=5, metavar="K",
                   help="with --register, when no candidate passes: measure the K nearest on every seed first")
    c.add_argument("--wide", type=_nonneg_int, default=None, metavar="N",
                   help="with --robustness on an identified set: the N best configurations also train the fade's "
                   "other starts and shapes (default 3; 0 first, then 3, trains the whole map before them)")
    c.add_argument("--fade-points", action=argparse.BooleanOptionalAction, default=True,
                   help="with --robustness: also fade600 at seed 0 on every candidate, for the figure")
    c.add_argument("--store", default="runs")
    c.add_argument("--out", default=None, help="output directory (default results/calibration/SPACE)")
    c.add_argument("--doc", default=None, help="splice the generated blocks into this markdown file")
    c.add_argument("--bundle", default=None, metavar="DIR",
                   help="with --doc: also record the search into the results bundle at DIR (its blocks, and its "
                   "section of RESULTS.md, then regenerate from the bundle: `report paper --from-bundle DIR`); "
                   "--out defaults to DIR's results directory/calibration/SPACE")
    c.add_argument("--executor", default="local", choices=["local", "ray"])
    c.add_argument("--workers", type=_at_least_one, default=1)
    c.add_argument("--group", type=_group_arg, default="auto", help="runs per group, or 'auto' (as reproduce)")
    c.add_argument("--batch", type=int, default=4, help="candidates asked of Optuna at once")
    c.add_argument("--address", default=None)
    c.add_argument("--steps", type=int, default=None, help="step budget per run (smoke tests only; default 3600)")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(fn=cmd_calibrate)


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


def _add_store_and_listing_parsers(sub) -> None:
    """``softprior store verify``, ``paths`` and ``tasks``."""
    st = sub.add_parser("store", help="check the run store").add_subparsers(dest="store_command", required=True)
    sv = st.add_parser("verify", help="check every finished run's files against the SHA-256 checksums recorded when "
                       "they were written, and the index (exit 1 if anything is damaged)")
    sv.add_argument("--repair", action="store_true", help="re-queue only the damaged runs (records deleted, files moved "
                    "to STORE/damaged/); rebuild a damaged index from the run directories (needs a writable store; "
                    "without --repair a read-only store is checked as any other)")
    sv.add_argument("--store", default="runs")
    sv.set_defaults(fn=cmd_store_verify)
    sub.add_parser("paths", help="list training paths").set_defaults(fn=cmd_paths)
    tk = sub.add_parser("tasks", help="list tasks, their options and ceilings")
    tk.add_argument("--ceilings", action="store_true", help="also measure every default's Bayes ceiling "
                    "(Monte Carlo where there is no closed form; imports torch)")
    tk.add_argument("--plugin", action="append", help="a Python file that registers tasks")
    tk.set_defaults(fn=cmd_tasks)


def _add_tour_parser(sub) -> None:
    """``softprior tour``: the notebook tour, headless (``softprior.tour``)."""
    tr = sub.add_parser("tour", help="run the notebook tour (docs/tour.py) headless; keep the executed "
                        "notebook in OUT/tour.ipynb (the tracked docs/tour.py and docs/tour.ipynb are only read)")
    tr.add_argument("--notebook", default="docs/tour.py", help="the tour to run (default docs/tour.py, "
                    "from the repository root)")
    tr.add_argument("--out", default="results/tour", help="where the executed notebook and the tour's table and "
                    "figures go (default results/tour)")
    tr.add_argument("--steps", type=int, default=None, help="step budget per run (default: the paper's 3,600; "
                    "fewer: a smoke run whose schedules are scaled)")
    tr.set_defaults(fn=cmd_tour)


def build_parser() -> argparse.ArgumentParser:
    """The command line: each command (or family of commands) adds its own parser."""
    p = _Parser(prog="softprior", description="Annealable soft-prior Transformers: train, "
                                "evaluate and reproduce circuit-removability experiments.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_eval_parser(sub)
    _add_experiment_parsers(sub)
    _add_calibrate_parser(sub)
    _add_tool_parsers(sub)
    _add_store_and_listing_parsers(sub)
    _add_tour_parser(sub)
    _add_study_parser(sub)
    return p


class CliFailure(Exception):
    """A failure the command line found and explains in one line (exit code 1)."""


# Our own error classes, by module and name: looked up in sys.modules, so telling them apart imports
# nothing (an error whose module was never imported cannot have been raised). A failure is tried first
# (StoreDamagedError is a StoreError).
_FAILURES = (("softprior.cli", "CliFailure"), ("softprior.store.errors", "StoreDamagedError"),
             ("softprior.executors.sweep", "RunFailedError"), ("softprior.tour", "TourError"))
_BAD_INPUT = (("softprior.cli", "CliError"), ("pydantic", "ValidationError"),
              ("softprior.store.errors", "StoreError"),  # a run or store not there, a store not writable
              ("softprior.paths", "UnknownPathError"), ("softprior.tasks.registry", "UnknownTaskError"),
              ("softprior.model.transformer", "UnknownModelError"), ("softprior.model.baselines", "UnknownBaselineError"),
              ("softprior.positional.base", "UnknownSchemeError"),
              ("softprior.experiments", "UnknownExperimentError"), ("softprior.experiments", "UnknownTaskFilterError"),
              ("softprior.plugins", "PluginError"), ("softprior.calibration.space", "SpaceError"),
              ("softprior.study", "StudyError"), ("softprior.model.priors", "UnknownPriorError"),
              ("softprior.preregistration", "CalibrationMissing"),  # and RecordRefused, a subclass
              ("softprior.preregistration", "UnknownRecordError"),
              ("softprior.report", "DirtyRunsRefused"), ("softprior.executors.environment", "SettingError"),
              ("softprior.interop", "ExportError"), ("softprior.interop", "MissingExtraError"))


def _is(e: BaseException, classes) -> bool:
    return any(isinstance(e, c) for mod, name in classes
               if isinstance(c := getattr(sys.modules.get(mod), name, None), type))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "steps", None) is not None and args.steps < 1:
        print(f"softprior: error: --steps must be a positive integer, got {args.steps}", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KeyboardInterrupt as e:  # a training loop says where its runs resume (train.DeferredInterrupt)
        print("softprior: interrupted" + (f": {_one_line(str(e))}" if str(e) else ""), file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - sorted below: ours in one line, anything else with its traceback
        code = 1 if _is(e, _FAILURES) else 2 if _is(e, _BAD_INPUT) else None
        if code is None:
            import traceback
            traceback.print_exc()
            print(f"softprior: unexpected {type(e).__name__} (not an input error; the traceback above shows where)",
                  file=sys.stderr)
            return 1
        if _is(e, [("pydantic", "ValidationError")]):
            from .config import validation_message
            msg = f"invalid configuration: {validation_message(e)}"
        else:
            msg = str(e)
        print(f"softprior: error: {_one_line(msg)}", file=sys.stderr)
        return code


if __name__ == "__main__":  # python -m softprior.cli: run the package's module, not this __main__ copy of it,
    from softprior.cli import main as _main  # whose CliError main() would not know as one of ours
    sys.exit(_main())
