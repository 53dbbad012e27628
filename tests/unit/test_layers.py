"""The layout holds: imports run only down the layers (import-linter's contracts in pyproject.toml),
no service imports another, and no module reaches for another module's private names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "runtime", "services", "gpusched", "bench")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_layer_contracts_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("module", "line"), [
    ("runtime/clock.py", "import services.quota.domain"),           # the runtime reaching up to a service
    ("services/quota/capacity.py", "import services.scheduler.inventory"),  # one service importing another
    ("schemas/priority.py", "import runtime.clock"),                  # the contract importing the runtime
    ("services/executor/cluster.py", "import gpusched.dev.stack"),     # a service importing an application
    ("gpusched/gateway/commands.py", "import gpusched.cli.main"),      # the gateway reaching up to a door
    ("gpusched/api/routes.py", "import gpusched.cli.main"),           # the API reaching up to the CLI
    ("gpusched/sim/trace.py", "import gpusched.gateway.commands"),     # siblings under the doors stay apart
])
def test_an_import_that_runs_back_up_breaks_a_contract(tmp_path, module, line):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr


NAMEDTUPLE_API = {"_replace", "_asdict", "_make", "_fields", "_field_defaults"}
"""A named tuple's public methods (underscored so that they cannot clash with its field names)."""


def _private_uses(path: Path) -> list[str]:
    """`from x import _name` of another module, and `obj._name` on anything but self, cls or super()."""
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            found += [f"{path}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and node.attr not in NAMEDTUPLE_API):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"{path}:{node.lineno} reads {ast.unparse(node)}")
    return found


# The one allowed exception, by file and expression: runtime/eventlog.py's RawDeliveryClient
# overrides nats-py's Client._process_msg (a rebuild's reads skip nats-py's per-message handling),
# checks that method's signature at import and keys its handlers by a subscription's sid.
ALLOWED_PRIVATE_USES = {("runtime/eventlog.py", "NATS._process_msg"), ("runtime/eventlog.py", "sub._id"),
                        ("runtime/eventlog.py", "js._nc")}


def test_no_module_uses_another_modules_private_names():
    found = [use for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for use in _private_uses(path.relative_to(ROOT))
             if (str(path.relative_to(ROOT)), use.rsplit(" reads ", 1)[-1]) not in ALLOWED_PRIVATE_USES]
    assert not found, "\n".join(found)
