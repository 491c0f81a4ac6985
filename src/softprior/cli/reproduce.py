"""``softprior reproduce`` and ``softprior report`` of an experiment: its missing runs trained, its table
and figures written (``report paper`` and ``reproduce paper``: ``paper``; ``report timings``: ``timings``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .common import (CliError, _at_least_one, _check_executor, _group_arg, _group_shown, _refuse_dirty_training,
                     _store)
from .outputs import _check_outputs, _files_written, _record_report, _stamps
from .paper import _paper
from .timings import cmd_report_timings


def _experiment(args):
    from ..experiments import Options, get_experiment
    from ..plugins import load_plugin
    for f in args.plugin or []:
        load_plugin(f)
    exp = get_experiment(args.name)
    tasks = tuple(t.strip() for t in args.tasks.split(",")) if getattr(args, "tasks", None) is not None else None
    opts = Options(seeds=args.seeds, quick=args.quick, tasks=tasks, record=getattr(args, "record", None))
    if opts.seeds is not None and opts.seeds < 1:
        raise CliError(f"--seeds must be >= 1, got {opts.seeds}")
    return exp, exp.cells(opts)


def _write_report(args, exp, cells, store) -> None:
    from ..reports.experiment import splice_into_doc, write_report
    out = Path(args.out or f"results/{exp.name}")
    started, t0, before = time.time(), time.perf_counter(), _stamps(out)
    md = write_report(store, exp, cells, out, exploratory=args.exploratory)
    _record_report(store, exp.name, started, time.perf_counter() - t0, len(cells))
    if args.doc:
        splice_into_doc(args.doc, exp.name, md)
    print(md)
    print(f"wrote {out}/: {', '.join(_files_written(out, before))}" + (f"; updated {args.doc}" if args.doc else ""),
          file=sys.stderr)


def cmd_reproduce(args) -> int:
    from ..executors.sweep import execute
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
        os.environ["SOFTPRIOR_DEVICE"] = args.device  # read by loop.Runs in every worker
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


def cmd_report(args) -> int:
    if args.name == "paper":
        return _paper(args, train=False)
    if args.name == "timings":
        return cmd_report_timings(args)
    exp, cells = _experiment(args)
    _check_outputs(args, f"results/{exp.name}")
    if args.from_bundle:
        from ..bundle import BundleSource
        _write_report(args, exp, cells, BundleSource(args.from_bundle))
        return 0
    _write_report(args, exp, cells, _store(args, read_only=True))
    return 0


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
