"""The quickstart notebook (examples/notebooks/quickstart.ipynb), executed by nbclient in a
real Jupyter kernel against the running platform."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "quickstart.ipynb"


def run(tmp_path: Path) -> str:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for o in cell.get("outputs", []))


def test_the_quickstart_notebook_runs_and_runs_again_as_a_repeat(api_stack, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSCHED_API_URL", api_stack.url)
    monkeypatch.setenv("GPUSCHED_API_TOKEN", api_stack.tokens["alice"])
    monkeypatch.setenv("QUICKSTART_KEY", f"notebook-{os.getpid()}")
    out = run(tmp_path)
    assert "alice team-a q-team-a" in out
    assert "final state: succeeded" in out and "JobSubmitted" in out and "JobSucceeded" in out and "last event:" in out
    first = next(line for line in out.splitlines() if line.startswith("admitted "))
    assert first.endswith(" new")
    again = run(tmp_path)  # the same idempotency key: the same job, answered as a repeat
    assert next(line for line in again.splitlines() if line.startswith("admitted ")) == first.replace(" new", " repeat")
