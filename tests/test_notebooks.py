"""The notebooks in notebooks/ run top to bottom on the CPU (their GPU cells skip themselves) and
draw their figures; they are stored without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
# the figures each notebook saves into its working directory
FIGURES = {
    "quickstart.ipynb": ("quickstart_blocks.png", "quickstart_recall.png", "quickstart_copy.png"),
    "train_forecast.ipynb": ("train_metrics.png",),
    "sparse_finetune.ipynb": ("sparse_grad_check.png", "finetune_metrics.png"),
    "offload_gpu.ipynb": ("offload_throughput.png", "offload_miss_rate.png"),
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CELL_TIMEOUT_S = 300


def test_every_notebook_is_listed_and_stored_without_outputs():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(FIGURES)
    for name in FIGURES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name} cell {i} has stored outputs"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_and_draws_its_figures(name, tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # NumPy's OpenBLAS threads contend with XLA's on a small CPU (InfiniGen's SVDs ran ~25x slower)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(cwd=str(tmp_path))
    shown = sum(1 for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
                if "image/png" in out.get("data", {}))
    assert shown >= len(FIGURES[name]), f"{name} displayed {shown} figures"
    for fig in FIGURES[name]:
        path = tmp_path / fig
        assert path.is_file(), f"{name} did not save {fig}"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, f"{fig}: {len(data)} bytes"
