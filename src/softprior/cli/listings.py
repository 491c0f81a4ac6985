"""``softprior store verify``, ``paths`` and ``tasks``."""

from __future__ import annotations

from .common import _print_rows


def cmd_store_verify(args) -> int:
    from ..store.integrity import verify_store
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
    from ..paths import list_paths
    return _print_rows(list_paths())


def cmd_tasks(args) -> int:
    """Each task, its options and the Bayes ceiling of its registered default (closed form, no torch);
    ``--ceilings``: every default's ceiling or references measured, as its generator states them
    (``Task.ceiling_text`` at each of its ``ceiling_options``: Monte Carlo where there is no closed form,
    Markov at each p; linear ICL's least squares, Bayes ridge and one GD step; a task without a
    ``bayes_accuracy`` says so)."""
    from ..plugins import load_plugin
    from ..preregistration import default_options
    from ..tasks.registry import TASK_CONFIGS, describe_tasks
    for f in args.plugin or []:
        load_plugin(f)
    defaults = {t: default_options(t)[0] for t in TASK_CONFIGS}
    _print_rows(describe_tasks(defaults))
    if not args.ceilings:
        return 0
    from ..tasks.generators import make_task
    from ..tasks.registry import task_config, task_spec
    print("\nmeasured on the registered defaults (Monte Carlo: seed 0, standard error beside):")
    for name, opts in defaults.items():
        for extra in task_spec(name).task_class().ceiling_options:
            task = make_task(task_config(name, **opts, **extra))
            print(f"  {name}" + "".join(f" {k}={v}" for k, v in extra.items()) + f": {task.ceiling_text()}")
    return 0


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
