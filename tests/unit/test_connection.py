"""Where the CLI finds a running stack: the environment, the file `make run` wrote in this
directory, or this user's copy of it from anywhere else."""

from __future__ import annotations

import stat

import pytest

from gpusched.gateway import connection
from gpusched.gateway.connection import Connection

STACK = Connection("nats://127.0.0.1:4999", "operator", "secret", "postgresql://127.0.0.1:5999/gpusched")


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ("GPUSCHED_NATS_URL", "GPUSCHED_NATS_USER", "GPUSCHED_NATS_PASSWORD", "GPUSCHED_PG_DSN",
                 "GPUSCHED_CONNECTION_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    connection.save(STACK, project / ".data" / "run" / "connection.json")
    return project, elsewhere


def test_the_cli_finds_a_running_stack_from_another_directory(home):
    assert Connection.resolve() == STACK


def test_the_file_in_this_directory_comes_before_the_users_copy(home, monkeypatch):
    project, _ = home
    monkeypatch.chdir(project)
    connection.save(Connection("nats://127.0.0.1:1", None, None, "postgresql://here"),
                    project / ".data" / "run" / "connection.json")
    connection.user_connection_file().write_text('{"nats_url": "nats://other:1"}')
    assert Connection.resolve().pg_dsn == "postgresql://here"


def test_the_environment_comes_first(home, monkeypatch):
    monkeypatch.setenv("GPUSCHED_PG_DSN", "postgresql://from-env")
    monkeypatch.setenv("GPUSCHED_CONNECTION_FILE", "/nonexistent")
    resolved = Connection.resolve()
    assert (resolved.pg_dsn, resolved.nats_user) == ("postgresql://from-env", None)


def test_the_saved_credentials_are_readable_by_their_owner_only(home):
    project, _ = home
    for path in (project / ".data" / "run" / "connection.json", connection.user_connection_file()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
