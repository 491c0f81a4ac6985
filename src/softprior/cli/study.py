"""``softprior study``: the whole method on a task and a prior, built in or from --plugin files."""

from __future__ import annotations

import time

from .common import _add_sweep_args, _check_executor, _store


def cmd_study(args) -> int:
    from ..plugins import load_plugin
    for f in args.plugin or []:
        load_plugin(f)
    from ..study import StudyPlan, load_criteria, run_study
    _check_executor(args)
    plan = StudyPlan(task=args.task, prior=args.prior, name=args.name or "", quick=args.quick, steps=args.steps,
                     seeds=args.seeds, budget=args.budget, map_limit=args.map_limit, out=args.out,
                     executor=args.executor,
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
    s.add_argument("--map", type=int, default=None, dest="map_limit", help="other candidates the robustness map trains "
                   "every path on, nearest first (default 10)")
    s.add_argument("--criteria", default=None, help="a .json/.toml file of difficulty criteria (default: the "
                   "task's own if a plugin declares them, else: the prior-on path learns, the no-prior path does not)")
    s.add_argument("--out", default="study", help="where study/NAME/ goes (default ./study)")
    _add_sweep_args(s)
    s.set_defaults(fn=cmd_study)
