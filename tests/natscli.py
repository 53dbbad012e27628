"""The plain `nats` CLI (natscli, built from the Go module proxy by scripts/natscli.sh) for tests
that act as a team would, with nothing but a credential and this binary.

    from tests.natscli import nats_cli, run_nats  # noqa: F401  (nats_cli is a fixture)

    def test_x(nats_cli, nats_server):
        out = run_nats(nats_cli, nats_server.url(), "admin", nats_server.creds.users["admin"],
                       "stream", "ls", "--names", inbox_prefix=eventlog.inbox_prefix("admin"))

GPUSCHED_NO_NATSCLI=1 skips the tests that need it (no Go toolchain); otherwise a failed build
fails them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "scripts" / "natscli.sh"
VERSION = "v0.5.0"
"""The natscli version scripts/natscli.sh builds (unless GPUSCHED_NATSCLI_VERSION says otherwise)."""
BUILD_TIMEOUT_S = 1200


def build() -> str:
    """The path of the `nats` binary, built into ~/.cache/gpusched/natscli-<version>/bin on first
    use (a lock makes concurrent callers wait for one build). Raises RuntimeError if the build fails."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not os.access(lines[-1], os.X_OK):
        raise RuntimeError(f"scripts/natscli.sh failed (exit {proc.returncode}); set GPUSCHED_NO_NATSCLI=1 to skip "
                           f"the tests that need the nats CLI:\n{proc.stderr[-4000:]}")
    return lines[-1]


@pytest.fixture(scope="session")
def nats_cli() -> str:
    """The `nats` binary's path; skips only when GPUSCHED_NO_NATSCLI=1."""
    if os.environ.get("GPUSCHED_NO_NATSCLI") == "1":
        pytest.skip("GPUSCHED_NO_NATSCLI=1: the nats CLI (scripts/natscli.sh, needs Go) is not built")
    return build()


def run_nats(binary: str, server_url: str, user: str, password: str, *args: str, inbox_prefix: str | None = None,
             input: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``nats <args>`` against ``server_url`` as ``user`` and return the finished process
    (stdout and stderr captured as text; a non-zero exit is returned, not raised).

    Only the flags given here reach the server: no saved context (``--no-context``) and no ``NATS_*``
    variable of the caller's environment. ``inbox_prefix`` (``--inbox-prefix``) is needed by every
    command that waits for a reply (``req``, ``pub -J``, JetStream management) when the credential
    may subscribe only under its own inbox (``runtime.eventlog.inbox_prefix(user)``). ``input`` is
    the standard input (empty when None). Raises ValueError on an empty user, password, server URL
    or argument list, and subprocess.TimeoutExpired after ``timeout`` seconds."""
    for name, value in (("server_url", server_url), ("user", user), ("password", password)):
        if not value:
            raise ValueError(f"run_nats: {name} is empty; a non-empty string is required")
    if not args:
        raise ValueError("run_nats: no command given (e.g. 'stream', 'ls')")
    if timeout <= 0:
        raise ValueError(f"run_nats: timeout {timeout!r} must be > 0 seconds")
    # flag=value: a generated password may begin with "-", which the CLI would take for a flag
    command = [binary, "--no-context", f"--server={server_url}", f"--user={user}", f"--password={password}"]
    if inbox_prefix is not None:
        command += ["--inbox-prefix", inbox_prefix]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    return subprocess.run([*command, *args], input=input or "", capture_output=True, text=True, env=env,
                          timeout=timeout)
