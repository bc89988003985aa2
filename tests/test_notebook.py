"""examples/quickstart.ipynb runs top to bottom on a real Jupyter kernel.

The kernel is the venv's ``python3`` (ipykernel); the notebook's top-level ``await`` runs the
controller inside the kernel's own event loop, which is what this test is about.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


@pytest.mark.timeout(90)
async def test_quickstart_notebook_runs_a_recipe_in_the_kernel_loop() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    client = NotebookClient(
        nb, kernel_name="python3", timeout=75, allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    await client.async_execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    for cell in code:
        assert all(o.output_type != "error" for o in cell.outputs), cell.outputs

    def text(cell: nbformat.NotebookNode) -> str:
        parts = []
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == "stdout":
                parts.append(o.text)
            elif o.output_type == "execute_result":
                parts.append(o.data.get("text/plain", ""))
        return "".join(parts)

    run_cell = next(c for c in code if "async with Controller" in c.source)
    out = text(run_cell)
    assert "dashboard: http://127.0.0.1:" in out
    assert "5 steps," in out
    status_cell = next(c for c in code if "staleness_histogram" in c.source)
    status = ast.literal_eval(text(status_cell))
    assert status["version"] == 5
    assert status["worker_deaths"] == 0
    assert status["samples_trained"] == 5 * 8 * 8  # steps x groups per step x group size
    plot_cell = code[-1]
    svg = next(o.data["image/svg+xml"] for o in plot_cell.outputs
               if o.output_type == "execute_result")
    points = svg.split('points="')[1].split('"')[0].split()
    assert len(points) == 5  # one point per step
