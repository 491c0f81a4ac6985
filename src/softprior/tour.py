"""The notebook tour, run headless (``softprior tour``).

``docs/tour.py`` (the jupytext twin of ``docs/tour.ipynb``) is read, executed cell by cell with
nbclient in the current directory (the repository root), and written with its outputs to
``OUT/tour.ipynb``: the tracked twins are only read, never rewritten (``jupytext --execute`` would
write the outputs into the tracked notebook). The tour trains into the repository's store ``./runs``,
so after ``softprior reproduce removability`` it reuses those runs and trains only the one run it adds
(a fade600 run that keeps snapshots); its table and figures go to ``OUT`` beside the notebook.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["run_tour", "TourError"]


class TourError(RuntimeError):
    """The tour could not run (its extra is not installed) or a cell failed (its outputs so far are kept)."""


def run_tour(notebook: str | Path = "docs/tour.py", out: str | Path = "results/tour", *,
             timeout: int = 3600, env: dict[str, str] | None = None) -> Path:
    """Execute ``notebook`` (a jupytext .py or an .ipynb) headless and write it, outputs included, to
    ``out/tour.ipynb``; return that path. The kernel runs in the current directory with this process's
    environment plus ``env`` and ``SOFTPRIOR_TOUR_OUT=out`` (where the tour writes its table and figures).
    A failing cell raises ``TourError`` naming it, after the outputs so far are written."""
    try:
        import jupytext
        import nbclient
        import nbformat
    except ImportError as e:
        raise TourError(f"the tour needs jupytext, nbclient and ipykernel: pip install -e \".[tour]\" ({e})") from None
    src = Path(notebook)
    if not src.is_file():
        raise TourError(f"no notebook at {str(src)!r} (run `softprior tour` in the repository root, or pass --notebook)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    nb = jupytext.read(src)
    dest = out / "tour.ipynb"
    saved = {k: os.environ.get(k) for k in [*(env or {}), "SOFTPRIOR_TOUR_OUT"]}
    os.environ.update({**(env or {}), "SOFTPRIOR_TOUR_OUT": str(out.resolve())})  # the kernel inherits it
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(Path.cwd())}}).execute()
    except nbclient.exceptions.CellExecutionError as e:
        raise TourError(f"a cell of the tour failed ({e.ename}: {e.evalue}); its outputs so far: {dest}") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        nbformat.write(nb, dest)
    return dest
