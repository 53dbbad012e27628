"""The dev stack binds before it tells (issue 42): no port is written anywhere or handed to a
client before the process meant to serve it holds it, a port another process holds ends the run
with the reason instead of a restart loop (and no credential reaches that process), the dev
Postgres wants its password, and the connection file is private from its first byte."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

from gpusched.dev import run as devrun
from gpusched.dev import stack as devstack
from gpusched.gateway import connection
from gpusched.gateway.connection import Connection
from runtime.observability import EXIT_CANNOT_LISTEN, CannotListen


class Squatter:
    """Another process's listener: holds a port, accepts, and records what it receives."""

    def __init__(self, port: int = 0) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.received = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        with conn:
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def squatter():
    held = Squatter()
    yield held
    held.close()


def dev_up(tmp_path: Path, **env: str) -> subprocess.Popen:
    """`gpusched dev up` as `make run` starts it, its data and this user's connection file under tmp_path."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    clean.update(XDG_STATE_HOME=str(tmp_path / "state"), **env)
    return subprocess.Popen([sys.executable, "-m", "gpusched.cli.main", "dev", "up", "--data-dir",
                             str(tmp_path / ".data"), "--no-demo", "--duration", "120"],
                            cwd=tmp_path, env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def connection_files(tmp_path: Path) -> list[Path]:
    return [tmp_path / ".data" / "run" / "connection.json", tmp_path / "state" / "gpusched" / "connection.json"]


def use_connection_files(tmp_path: Path, seen: list[dict]) -> None:
    """What the CLI would do with each connection file there is: call the API it names with its token."""
    for path in connection_files(tmp_path):
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or replaced while read
            continue
        seen.append(saved)
        if saved.get("api_url"):
            try:
                httpx.get(f"{saved['api_url']}/v1/whoami", headers={"Authorization": f"Bearer {saved['api_token']}"},
                          timeout=1)
            except httpx.HTTPError:
                pass


def test_dev_up_with_its_api_port_taken_stops_at_once_and_no_token_reaches_the_holder(tmp_path, squatter):
    proc = dev_up(tmp_path, GPUSCHED_API_PORT=str(squatter.port))
    seen: list[dict] = []
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        use_connection_files(tmp_path, seen)
        time.sleep(0.1)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    use_connection_files(tmp_path, seen)

    assert proc.returncode == EXIT_CANNOT_LISTEN, out
    assert (f"cannot listen on 127.0.0.1:{squatter.port}: address in use (another process holds it); "
            "set GPUSCHED_API_PORT to a free port") in " ".join(out.split()), out
    assert not [s for s in seen if str(squatter.port) in str(s.get("api_url"))]
    assert b"Bearer" not in squatter.received and squatter.connections == 0


def test_dev_up_writes_only_ports_it_holds_private_and_forgets_them_when_it_stops(tmp_path):
    """8080 taken (by this test, or by whoever holds it already): the API serves on another port
    the stack bound, the connection files name it, are readable by this user only, and are gone
    once the run ends; the Postgres DSN in them carries the password."""
    try:
        on_8080 = Squatter(8080)
    except OSError:  # someone holds it already: taken all the same
        on_8080 = None
    proc = dev_up(tmp_path)
    try:
        files = connection_files(tmp_path)
        deadline = time.monotonic() + 90
        while not all(f.exists() for f in files):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no connection file after 90 s"
            time.sleep(0.2)
        saved = json.loads(files[0].read_text())
        assert json.loads(files[1].read_text()) == saved
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        api_url = saved["api_url"]
        assert api_url != "http://127.0.0.1:8080"
        assert httpx.get(f"{api_url}/healthz", timeout=30).json() == {"status": "ok"}
        assert httpx.get(f"{api_url}/v1/whoami", headers={"Authorization": f"Bearer {saved['api_token']}"},
                         timeout=30).status_code == 200

        async def postgres() -> None:
            conn = await asyncpg.connect(saved["pg_dsn"], timeout=10)
            await conn.close()
            without_password = saved["pg_dsn"].replace(f":{urlsplit(saved['pg_dsn']).password}@", "@")
            with pytest.raises(asyncpg.InvalidPasswordError):
                await asyncpg.connect(without_password, timeout=10)
        asyncio.run(postgres())
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=90)[0]
        if on_8080 is not None:
            on_8080.close()
    assert proc.returncode == 0, out
    assert not [f for f in files if f.exists()]
    if on_8080 is not None:
        assert b"Bearer" not in on_8080.received


def test_a_service_that_cannot_listen_is_not_restarted(tmp_path, squatter):
    """Its own port (not the stack's sockets: a deployment's, or a test's) held by another process:
    it exits with EXIT_CANNOT_LISTEN and says why; the supervisor stops instead of restarting it."""
    env = {"quota": {"GPUSCHED_METRICS_PORT": str(squatter.port)},
           "api": {"GPUSCHED_API_PORT": str(squatter.port), "GPUSCHED_PG_DSN": "postgresql://nobody@127.0.0.1:1/x"}}
    for name in env:
        procs = devstack.ServiceProcesses(tmp_path / "logs", {name: env[name]})
        first = procs.start(name)
        assert first.wait(60) == EXIT_CANNOT_LISTEN, procs.log(name).read_text()
        with pytest.raises(CannotListen, match=f"cannot listen on 127.0.0.1:{squatter.port}: address in use"):
            procs.restart_dead()
        assert procs.procs[name] is first  # not started again
    assert squatter.received == b""


def test_nats_and_postgres_on_a_taken_port_fail_fast_and_send_nothing(tmp_path, squatter):
    for piece in (devstack.NatsServer(tmp_path / "nats", port=squatter.port),
                  devstack.Postgres(tmp_path / "pg", port=squatter.port, fsync=False)):
        started = time.monotonic()
        with pytest.raises(CannotListen, match=f"cannot listen on 127.0.0.1:{squatter.port}: address in use"):
            piece.start()
        assert time.monotonic() - started < 20
        assert not piece.alive()
    assert squatter.connections == 0


async def test_a_nats_server_whose_port_was_taken_while_it_was_down_ends_the_run(tmp_path):
    nats_server = devstack.NatsServer(tmp_path / "nats").start()
    deps = devrun.Dependencies([nats_server], lambda: asyncpg.connect("postgresql://127.0.0.1:1/x"))
    try:
        nats_server.kill()
        taken = Squatter(nats_server.port)
        try:
            with pytest.raises(CannotListen, match=f"cannot listen on 127.0.0.1:{nats_server.port}"):
                await deps.revive()
            assert taken.connections == 0
        finally:
            taken.close()
    finally:
        nats_server.stop()


async def test_the_dev_postgres_wants_its_password(tmp_path):
    pg = devstack.Postgres(tmp_path / "pg", fsync=False).start()
    try:
        assert stat.S_IMODE(pg.password_file.stat().st_mode) == 0o600
        await refuses_all_but_the_password(pg)
        password = pg.password
        pg.stop()
        pg.start()  # the same password the next run
        assert pg.password == password
        await (await asyncpg.connect(pg.dsn)).close()
        pg.stop()

        # A data directory from before passwords: trusted everyone, no password file.
        (pg.data_dir / "pgdata" / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        pg.password_file.unlink()
        pg.start()
        assert pg.password != password
        await refuses_all_but_the_password(pg)
    finally:
        pg.stop()


async def refuses_all_but_the_password(pg: devstack.Postgres) -> None:
    tcp = {"host": "127.0.0.1", "port": pg.port, "user": "postgres", "database": "postgres"}
    for attempt in ({**tcp, "password": ""}, {**tcp, "password": "wrong"},
                    {**tcp, "host": str(pg.data_dir), "password": ""}):  # the Unix socket too
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(**attempt, timeout=10)
    conn = await asyncpg.connect(pg.dsn, timeout=10)
    assert await conn.fetchval("SELECT 1") == 1
    await conn.close()


def test_the_connection_file_never_shows_its_credentials_to_others(tmp_path, monkeypatch):
    """Over a world-readable file an older version left (and a reader holding it open), the new
    credentials go into a new file, mode 0600 from its creation."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = tmp_path / "run" / "connection.json"
    path.parent.mkdir()
    path.write_text('{"nats_url": "nats://old:1"}')
    path.chmod(0o644)
    with open(path) as reader:
        connection.save(Connection("nats://127.0.0.1:4222", "operator", "new-secret", None), path)
        assert "new-secret" not in reader.read()
    for saved in (path, connection.user_connection_file()):
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert json.loads(saved.read_text())["nats_password"] == "new-secret"
    assert sorted(p.name for p in path.parent.iterdir()) == ["connection.json"]  # no temporary file left
