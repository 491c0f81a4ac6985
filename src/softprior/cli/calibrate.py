"""``softprior calibrate``: the search, pre-registration and the robustness map."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .common import CliError, _at_least_one, _check_executor, _group_arg, _nonneg_int, _store
from .outputs import _check_outputs


def _register(args, space, store, cands) -> list:
    """``calibrate --register``: measure the best candidates on every seed (an identification search: until
    its set holds the hard constraints; else the nearest passing ones), then pre-register the choice."""
    from ..reports.calibration_doc import register
    from ..calibration.search import complete_nearest
    run_kw = dict(executor=args.executor, workers=args.workers, group_size=args.group,
                  progress=not args.no_progress, address=args.address)
    if space.identify:
        from ..calibration.identify import complete
        cands = complete(space, store, cands, steps=args.steps, log=lambda m: print(m, file=sys.stderr),
                         sweep_bar=not args.no_progress, **run_kw)
    else:
        cands = complete_nearest(space, store, cands, k=args.complete, steps=args.steps, **run_kw)
    rec = register(space, store, cands, steps=args.steps, ship=args.ship, doc=args.doc)
    print(f"registered {rec['hash']} at {rec['registered_at']}: {rec['task_options']} {rec['model_options']}"
          f" ({'passes' if rec['passes'] else 'NO candidate passes: nearest'})", file=sys.stderr)
    return cands


def cmd_calibrate(args) -> int:
    from ..calibration.space import load_space
    from ..reports.calibration import choose, write_outputs
    from ..calibration.search import load_candidates, run_search

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
        from ..bundle import BundleError, BundleSource
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
    from ..calibration.robustness import fade_points, run_robustness
    if args.robustness:
        rep = run_robustness(space, store, cands, executor=args.executor, workers=args.workers,
                             group_size=args.group, progress=not args.no_progress, steps=args.steps,
                             all_fade=args.fade_points, **({} if args.wide is None else {"wide": args.wide}))
        print(rep.line(), file=sys.stderr)
    if bundle is not None:  # the same outputs and blocks, written through the bundle (bundle.add_part)
        from ..bundle import add_part
        from ..reports.calibration_doc import write_calibration
        from ..store.record_clock import first_rows
        if not cands:
            raise CliError(f"search space {space.name!r} was never searched in store {args.store!r}: nothing to record")
        add_part(args.bundle, store, f"calibration-{space.name}",
                 lambda src: write_calibration(args.doc, src, space, out, steps=args.steps), space=space.name,
                 first_rows=first_rows(store.index.rows()), doc=args.doc)
        files = {f.name: f for f in sorted(out.iterdir()) if f.is_file()}
        print(f"recorded search {space.name} into the bundle {args.bundle}: `softprior report paper --from-bundle "
              f"{args.bundle}` writes RESULTS.md with it", file=sys.stderr)
    else:
        from ..reports.calibration_doc import write_sections
        fade = fade_points(space, store, cands, steps=args.steps) or None
        files = write_outputs(space, cands, out, fade)
        if args.doc:
            from ..reports.calibration_doc import update_doc
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


def _add_calibrate_parser(sub) -> None:
    """``softprior calibrate``: the search, pre-registration and the robustness map."""
    from ..tasks.registry import TASK_SPECS  # no torch
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
