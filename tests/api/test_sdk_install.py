"""The SDK installs alone: ``pip install ./sdk`` into a fresh virtualenv brings pydantic and httpx
(from the package index), none of the server's libraries, and the quickstart notebook's code runs
with that interpreter against the running platform.

The notebook's cells run as one script there (no Jupyter kernel in the fresh virtualenv, so that
its package list is the SDK's own); tests/api/test_notebook.py runs them in a real kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.api.test_notebook import check_output, notebook_code, notebook_env

REPO = Path(__file__).resolve().parents[2]
SERVER_ONLY = {"fastapi", "asyncpg", "kubernetes", "nats-py", "uvicorn", "starlette", "faststream", "gpusched"}


def test_the_sdk_installs_alone_and_runs_the_notebook(api_stack, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                str(REPO / "sdk")], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True, timeout=120)
    packages = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert "gpusched-sdk" in packages and {"pydantic", "httpx"} <= packages
    assert not packages & SERVER_ONLY, sorted(packages)
    assert len(packages - {"pip", "setuptools"}) <= 15, sorted(packages)  # the SDK, pydantic, httpx and theirs
    where = subprocess.run([str(python), "-c", "import gpusched_sdk.contract as c; print(c.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path, timeout=60).stdout
    assert where.startswith(str(venv)), where  # the installed copy, not the checkout

    script = tmp_path / "quickstart.py"
    script.write_text(notebook_code())
    ran = subprocess.run([str(python), str(script)], env=notebook_env(api_stack), cwd=tmp_path, capture_output=True,
                         text=True, timeout=400)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert check_output(ran.stdout).endswith(" new")
