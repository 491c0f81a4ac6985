"""The notebook tour (docs/tour.ipynb) runs end to end on a tiny budget, so it cannot rot (issue 17)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tour_notebook_runs(tmp_path, monkeypatch):
    import nbclient
    import nbformat
    monkeypatch.setenv("TOUR_STEPS", "24")
    monkeypatch.setenv("TOUR_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(ROOT / "docs" / "tour.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "zero_acc" in out and "max |TL - softprior| logits" in out


def test_tour_twins_agree():
    """tour.py (jupytext) and tour.ipynb hold the same code cells."""
    import jupytext
    py = jupytext.read(ROOT / "docs" / "tour.py")
    nb = jupytext.read(ROOT / "docs" / "tour.ipynb")
    src = lambda n: [c.source for c in n.cells if c.cell_type == "code"]  # noqa: E731
    assert src(py) == src(nb)
