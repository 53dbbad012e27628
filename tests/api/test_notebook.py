"""The quickstart notebook (examples/notebooks/quickstart.ipynb), executed by nbclient in a
real Jupyter kernel (``python3``: this virtualenv's interpreter, which jupyter_client puts in the
kernel spec's ``python``) against the running platform."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "quickstart.ipynb"


def notebook_code() -> str:
    """The notebook's code cells, in order, as one script (tests/api/test_sdk_install.py runs it
    with an interpreter that has only the SDK)."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    return "\n\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")


def notebook_env(api_stack) -> dict[str, str]:
    """The environment the notebook runs in: the stack's API and alice's token, no other GPUSCHED_,
    and an idempotency key of its own (each call a new one: a run with the same env repeats)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(GPUSCHED_API_URL=api_stack.url, GPUSCHED_API_TOKEN=api_stack.tokens["alice"],
               QUICKSTART_KEY=f"notebook-{uuid.uuid4().hex[:12]}")
    return env


def check_output(out: str) -> str:
    """The notebook's first answer line (``admitted <job id> new|repeat``), once its output is right."""
    assert "alice team-a q-team-a" in out
    assert "final state: succeeded" in out and "JobSubmitted" in out and "JobSucceeded" in out and "last event:" in out
    assert "ran for 0:" in out  # finished_at - started_at: datetimes
    return next(line for line in out.splitlines() if line.startswith("admitted "))


def run(tmp_path: Path, env: dict[str, str]) -> str:
    """The notebook's printed output, executed in a kernel with ``env`` as its environment."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print('kernel:', sys.executable)"))
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    return "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for o in cell.get("outputs", []))


def test_the_quickstart_notebook_runs_and_runs_again_as_a_repeat(api_stack, tmp_path):
    env = notebook_env(api_stack)
    out = run(tmp_path, env)
    assert f"kernel: {sys.executable}" in out
    first = check_output(out)
    assert first.endswith(" new")
    again = run(tmp_path, env)  # the same idempotency key: the same job, answered as a repeat
    assert next(line for line in again.splitlines() if line.startswith("admitted ")) == first.replace(" new", " repeat")
