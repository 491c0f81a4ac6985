"""``softprior tour``: the notebook tour, headless (``softprior.tour``)."""

from __future__ import annotations

import sys


def cmd_tour(args) -> int:
    """``softprior tour``: ``tour.run_tour`` (the notebook executed headless, its outputs kept in OUT)."""
    from ..tour import run_tour
    env = {"SOFTPRIOR_TOUR_STEPS": str(args.steps)} if args.steps is not None else {}
    dest = run_tour(args.notebook, args.out, env=env)
    print(f"wrote {dest} (the executed tour, with its outputs) and the tour's table and figures in {dest.parent}/",
          file=sys.stderr)
    return 0


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
