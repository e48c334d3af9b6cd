"""Every notebook in examples/ runs top to bottom without an error, and draws its plots."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "examples").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, smollm2_path, gemma3_path, monkeypatch):
    # matplotlib's inline backend: non-interactive, each figure comes back as a PNG output.
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    plots = sum("plt.show()" in cell.source for cell in notebook.cells)
    assert sum("image/png" in o.get("data", {}) for o in outputs) == plots
