"""The dev supervisor (`make run`) outlives its dependencies (issue 21): nats-server and Postgres
killed with SIGKILL under it are shown as down and started again on the same port and data, the
summary reconnects, and the supervisor runs to the end of its duration."""

from __future__ import annotations

import asyncio

import asyncpg

from conftest import eventually
from gpusched.dev import run as devrun
from gpusched.dev import stack as devstack
from runtime import eventlog
from runtime.settings import Settings


async def test_the_supervisor_rides_out_nats_and_postgres_dying(tmp_path):
    nats_server = devstack.NatsServer(tmp_path / "nats").start()
    pg = devstack.Postgres(tmp_path / "pg", fsync=False).start()
    admin = Settings(nats_url=nats_server.url(), nats_user="admin", nats_password=nats_server.creds.users["admin"])
    nc = await eventlog.connect(admin, "test-supervisor")
    js = nc.jetstream()
    await eventlog.provision(js)
    deps = devrun.Dependencies([nats_server, pg], lambda: asyncpg.connect(pg.dsn, timeout=3))
    procs = devstack.ServiceProcesses(tmp_path / "logs", {})
    stop = asyncio.Event()
    supervisor = asyncio.create_task(devrun._supervise(procs, js, deps, 8, stop, duration=45))
    try:
        await eventually(lambda: deps.conn is not None, timeout_s=10)
        nats_pid, pg_pid = nats_server.proc.pid, pg.proc.pid

        nats_server.kill()
        await eventually(lambda: "NATS restarted" in deps.notes and nats_server.alive(), timeout_s=20)
        assert nats_server.proc.pid != nats_pid
        await eventually(lambda: deps.notes[-1] == "NATS back", timeout_s=20)
        assert await eventlog.last_sequence(js) == 0  # the client reconnected to the restarted server

        pg.kill()
        await eventually(lambda: "Postgres restarted" in deps.notes and pg.alive(), timeout_s=30)
        assert pg.proc.pid != pg_pid
        await eventually(lambda: "Postgres back" in deps.notes[deps.notes.index("Postgres restarted"):],
                         timeout_s=20)
        assert not supervisor.done()
        stop.set()
        await asyncio.wait_for(supervisor, 15)
    finally:
        stop.set()
        supervisor.cancel()
        await deps.close()
        await nc.close()
        pg.stop()
        nats_server.stop()
    assert deps.notes[:2] == ["NATS down", "NATS restarted"], deps.notes
