"""``softprior atlas``: ``softprior study`` for every registered prior family on associative recall and
Markov induction, resumable, and docs/ATLAS.md written from the cells' verdicts (``--report-only``:
from the committed files alone)."""

from __future__ import annotations

import time

from .common import _add_sweep_args, _at_least_one, _check_executor, _store


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def cmd_atlas(args) -> int:
    from ..plugins import load_plugin
    for f in args.plugin or []:
        load_plugin(f)
    from ..reports.atlas import atlas_dir, note_atlas, write_atlas
    from ..study import atlas_names, atlas_plans, run_atlas, study_claims
    if args.report_only:
        print(f"atlas: wrote {write_atlas(args.doc)}")
        return 0
    priors, tasks = atlas_names(_names(args.priors), _names(args.tasks))
    _check_executor(args)
    plans = atlas_plans(priors, tasks, quick=args.quick, steps=args.steps, seeds=args.seeds, budget=args.budget,
                        map_limit=args.map_limit, out=args.out, executor=args.executor, workers=args.workers,
                        group_size=args.group, address=args.address)
    cmd = ("softprior atlas" + "".join(f" --plugin {p}" for p in args.plugin or [])
           + (" --quick" if args.quick else "") + f" --steps {plans[0].steps} --seeds {plans[0].seeds}"
           + f" --budget {plans[0].budget} --map {plans[0].map_limit}")
    note_atlas(args.doc, priors, tasks, [c.name for c in study_claims("acc", 0.0, 1.0)],
               {"steps": plans[0].steps, "seeds": plans[0].seeds, "budget": plans[0].budget,
                "map_limit": plans[0].map_limit, "quick": args.quick, "command": cmd})
    started = time.time()
    store = _store(args)
    write_atlas(args.doc)  # the cells not yet run shown as such from the start
    run_atlas(plans, store, atlas_dir(args.doc) / "cells", on_cell=lambda: write_atlas(args.doc))
    print(f"atlas: wrote {write_atlas(args.doc)} ({time.time() - started:.0f} s)")
    return 0


def _add_atlas_parser(sub) -> None:
    """``softprior atlas``: the study of every prior family on each task, and docs/ATLAS.md."""
    s = sub.add_parser("atlas", help="the removability atlas: `softprior study` for every prior family on associative "
                       "recall and Markov induction, resumable, and docs/ATLAS.md (docs/STUDY.md, \"The atlas\")")
    s.add_argument("--priors", default=None, help="comma-separated prior families (default: every registered one: "
                   "soft, alibi, t5, kerple_log, kerple_power, fire, and any a --plugin registers)")
    s.add_argument("--tasks", default=None, help="comma-separated tasks (default assoc_recall,markov)")
    s.add_argument("--plugin", action="append", help="a Python file that registers a prior or a task; repeatable")
    s.add_argument("--quick", action="store_true", help="a tiny atlas: each cell a --quick study (60 steps, 2 "
                   "seeds, 2 candidates)")
    s.add_argument("--steps", type=int, default=None, help="steps per run (default 3600; the paths are scaled)")
    s.add_argument("--seeds", type=_at_least_one, default=None, help="seeds per row (default 5; 2 with --quick)")
    s.add_argument("--budget", type=int, default=None, help="candidates each cell's difficulty search measures "
                   "(default 12, 2 with --quick)")
    s.add_argument("--map", type=int, default=None, dest="map_limit", help="other candidates each cell's robustness "
                   "map trains every path on, nearest first (default 3)")
    s.add_argument("--out", default="atlas", help="where each cell's study goes, OUT/atlas-TASK-PRIOR/ (default ./atlas)")
    s.add_argument("--doc", default="docs/ATLAS.md", help="the document (default docs/ATLAS.md); its data and figure "
                   "go to atlas/ beside it (cells/TASK-PRIOR.json, atlas.json, atlas.png)")
    s.add_argument("--report-only", action="store_true", help="rewrite --doc from the files beside it alone "
                   "(no store, no training)")
    _add_sweep_args(s)
    s.set_defaults(fn=cmd_atlas)
