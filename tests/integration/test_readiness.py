"""Readiness on real health for the services that read Postgres (runtime/health.py), as real
processes against a real nats-server and a Postgres of their own that the test stops and starts:
accounting is ready only once its projection has reached the log's end as it was at its start,
and neither accounting nor the API is ready while Postgres is away."""

from __future__ import annotations

import os
import subprocess
import sys

import asyncpg

from conftest import eventually
from gpusched.dev import stack as devstack
from runtime import eventlog
from services.accounting import sink
from tests.integration.test_failover import readiness, start
from tests.integration.test_telemetry import REPO
from tests.unit.builders import spec, submitted

BACKLOG = 1_500


def _waiting(port: int, what: str):
    def check():
        answer = readiness(port)
        return answer is not None and not answer["ok"] and what in answer["waiting_for"]
    return check


def _ready(port: int):
    def check():
        answer = readiness(port)
        return answer is not None and answer["ok"]
    return check


async def _position(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await sink.position(conn)
    finally:
        await conn.close()


async def test_accounting_and_the_api_are_ready_only_when_caught_up_and_postgres_answers(nats_server, admin_js,
                                                                                          tmp_path):
    pg = devstack.Postgres(tmp_path / "pg", fsync=False).start()
    log = eventlog.EventLog(admin_js)
    for i in range(BACKLOG):
        await log.append(submitted(f"j{i}", spec(gpus=1)))
    backlog_end = await eventlog.last_sequence(admin_js)
    acc_port = devstack.free_ports(1)[0]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start(nats_server, "accounting", tmp_path / "accounting.log", acc_port,
                           GPUSCHED_PG_DSN=pg.dsn))
        api, api_port = _start_api(nats_server, pg, tmp_path)
        procs.append(api)

        # ready means caught up: the first ready answer comes after the backlog is in Postgres
        await eventually(_ready(acc_port), timeout_s=60, interval_s=0.02)
        assert await _position(pg.dsn) >= backlog_end
        await eventually(_ready(api_port), timeout_s=60)

        pg.stop()
        await log.append(submitted("after-stop", spec(gpus=1)))  # accounting finds Postgres away on its write
        await eventually(_waiting(acc_port, "postgres"), timeout_s=30)
        await eventually(_waiting(api_port, "postgres"), timeout_s=30)
        assert all(p.poll() is None for p in procs), "a process died instead of waiting for Postgres"

        pg.start()
        await eventually(_ready(acc_port), timeout_s=60)
        await eventually(_ready(api_port), timeout_s=60)
        assert await _position(pg.dsn) >= backlog_end + 1
    finally:
        _stop(procs, pg)


async def test_the_api_started_while_postgres_is_away_waits_for_it_and_is_not_ready_until_it_answers(
        nats_server, tmp_path):
    pg = devstack.Postgres(tmp_path / "pg", fsync=False).start()  # its port and password, then away
    pg.stop()
    proc, api_port = _start_api(nats_server, pg, tmp_path)
    try:
        await eventually(_waiting(api_port, "postgres"), timeout_s=60)
        assert proc.poll() is None, "the API exited instead of waiting for Postgres"
        pg.start()
        await eventually(_ready(api_port), timeout_s=60)
        assert proc.poll() is None
    finally:
        _stop([proc], pg)


def _start_api(nats_server, pg: devstack.Postgres, tmp_path) -> tuple[subprocess.Popen, int]:
    """The API as a process, and the port of its readiness (its metrics port)."""
    metrics_port, api_port = devstack.free_ports(2)
    env = {**os.environ, **nats_server.env("api"), "GPUSCHED_PG_DSN": pg.dsn, "GPUSCHED_API_PORT": str(api_port),
           "GPUSCHED_METRICS_PORT": str(metrics_port), "GPUSCHED_LOG_FORMAT": "text"}
    return subprocess.Popen([sys.executable, "-m", "gpusched.api"], cwd=REPO, env=env,
                            stdout=open(tmp_path / "api.log", "ab"), stderr=subprocess.STDOUT), metrics_port


def _stop(procs: list[subprocess.Popen], pg: devstack.Postgres) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    if pg.alive():
        pg.stop()
