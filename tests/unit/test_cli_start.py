"""`gpusched --help` imports only what showing the commands needs (issue 41, deliverable 6): the
heavy modules are imported by the command that uses them. A test of what is imported, not a
timed one (docs/performance.md, "CLI start", has the figures)."""

import subprocess
import sys

import pytest

HEAVY = ("asyncpg", "nats", "fastapi", "kubernetes", "services", "httpx", "aiohttp", "runtime", "schemas", "yaml")
"""Top-level packages `--help` must not import: the transports, the servers, the services and the
runtime, the contract's models and the file reader's parser. (pydantic neither, at start and for
`gpusched --help`; a command's own `--help` imports it through typer, which builds each option's
converter with a pydantic TypeAdapter.)"""
HEAVY_OURS = ("gpusched.gateway", "gpusched.config", "gpusched.sim", "gpusched.api", "gpusched.dev",
              "gpusched.userinput")
"""The applications' own modules that the commands import when they run."""

# Runs the CLI as `gpusched ARGS` in a fresh interpreter, then lists what it imported.
SHOW = """
import sys
from gpusched.cli.main import main
sys.argv = ["gpusched", *{args!r}]
try:
    main()
except SystemExit:
    pass
print("\\nIMPORTED:" + ",".join(sorted(sys.modules)))
"""


def imported(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", SHOW.format(args=list(args))], capture_output=True, text=True,
                         check=True).stdout
    return set(out.rsplit("IMPORTED:", 1)[1].strip().split(","))


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(m for m in modules
                  if m.split(".")[0] in HEAVY or any(m == h or m.startswith(h + ".") for h in HEAVY_OURS))


def test_the_cli_starts_without_the_heavy_modules():
    code = "import sys, gpusched.cli.main; print(','.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    modules = set(out.split(","))
    assert heavy_in(modules) == [], "imported at start"
    assert "pydantic" not in modules


@pytest.mark.parametrize("args", [("--help",), ("jobs", "--help"), ("log", "--help"), ("token", "issue", "--help"),
                                  ("chargeback", "--help"), ("replay", "--help"), ("whatif", "--help")])
def test_help_imports_no_heavy_module(args):
    modules = imported(*args)
    assert "gpusched.cli.accounting" in modules  # the sub-CLIs were registered
    assert heavy_in(modules) == [], f"`gpusched {' '.join(args)}` imported them"
    if args == ("--help",):
        assert "pydantic" not in modules


def test_what_the_cli_writes_out_agrees_with_its_source():
    """Values the CLI spells out for its help, so as not to import their owners at start."""
    from gpusched.cli import accounting, log, tokens
    from schemas.auth import Role
    from schemas.registry import EVENT_TYPES_BY_NAME
    from services.accounting.replay import PROJECTIONS

    assert log.AGGREGATES == tuple(sorted({cls.aggregate for cls in EVENT_TYPES_BY_NAME.values()}))
    assert accounting.PROJECTIONS == tuple(PROJECTIONS)
    assert [(r.name, r.value) for r in tokens.Role] == [(r.name, r.value) for r in Role]
