"""Accounting against a real nats-server and a real Postgres: read models from the log, the
stream position in the same transaction, nothing counted twice."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from conftest import eventually, service_settings
from runtime import eventlog
from schemas import (
    JobAdmitted, JobScheduled, JobSpec, JobStarted, JobSubmitted, JobSucceeded, NodeAssignment, QuotaReserved,
    new_event,
)
from services.accounting import __main__ as accounting
from services.accounting import operations, projection, sink

T0 = datetime(2026, 11, 3, 9, 0, tzinfo=UTC)


def lifecycle(job_id: str, gpus: int, runtime_s: float, team: str = "team-a") -> list:
    spec = JobSpec(kind="training", queue="q", team=team, image="img", gpus=gpus)
    s = new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=T0, key="1", spec=spec,
                  submitter="u", intake_sequence=1)
    start = T0 + timedelta(seconds=5)
    return [
        s,
        new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=T0, key="d", queue="q",
                  priority=500, preemptible=True),
        new_event(QuotaReserved, aggregate_id=job_id, producer="quota", occurred_at=T0, key="1", attempt=1,
                  queue="q", flavor="a100", gpus=gpus),
        new_event(JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=T0, key="1", attempt=1,
                  flavor="a100", placement=(NodeAssignment(node="n1", gpus=gpus),)),
        new_event(JobStarted, aggregate_id=job_id, producer="executor", occurred_at=start, key="1", attempt=1,
                  nodes=("n1",)),
        new_event(JobSucceeded, aggregate_id=job_id, producer="executor", occurred_at=start + timedelta(seconds=runtime_s),
                  key="1", attempt=1, started_at=start),
    ]


async def totals(dsn: str):
    conn = await asyncpg.connect(dsn)
    try:
        # One snapshot: read apart, a batch committed in between gave a position past the rows read.
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            rows = await conn.fetch("SELECT job_id, gpu_seconds FROM usage_ledger ORDER BY job_id")
            pos = await sink.position(conn)
            states = dict(await conn.fetch("SELECT job_id, state FROM jobs"))
        return {r["job_id"]: r["gpu_seconds"] for r in rows}, pos, states
    finally:
        await conn.close()


async def test_service_projects_the_log_and_resumes_after_restart(nats_server, admin_js, pg_dsn):
    log = eventlog.EventLog(admin_js)
    for e in lifecycle("a1", gpus=2, runtime_s=100):
        await log.append(e)
    await admin_js.publish("gpusched.job.zz.submitted", b"garbage")  # poison: dead-lettered, skipped
    settings = service_settings(nats_server, "accounting", pg_dsn=pg_dsn)
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(settings, stop))
    try:
        usage, pos, states = await eventually(lambda: _at(pg_dsn, 7))
        assert usage == {"a1": 200.0}
        assert states == {"a1": "succeeded"}
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    # events while it is down are applied after the restart, once
    for e in lifecycle("a2", gpus=4, runtime_s=10):
        await log.append(e)
    stop2 = asyncio.Event()
    task2 = asyncio.create_task(accounting.run(settings, stop2))
    try:
        usage, pos, _ = await eventually(lambda: _at(pg_dsn, 13))
        assert usage == {"a1": 200.0, "a2": 40.0}
    finally:
        stop2.set()
        await asyncio.wait_for(task2, 10)
    dead = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    assert [m.subject for m in dead] == ["gpusched.deadletter.accounting"]


async def _at(dsn, seq):
    try:
        result = await totals(dsn)
    except asyncpg.UndefinedTableError:  # migrations not applied yet
        return None
    return result if result[1] >= seq else None


async def test_sink_is_idempotent_and_all_or_nothing(pg_dsn):
    conn = await asyncpg.connect(pg_dsn)
    try:
        await sink.migrate(conn)
        assert await sink.migrate(conn) == []  # second start applies nothing
        batch = [(i + 1, projection.convert(e, i + 1)) for i, e in enumerate(lifecycle("b1", 8, 3600))]
        assert await sink.apply_batch(conn, batch) == 6
        assert await sink.apply_batch(conn, batch) == 0  # redelivered batch: no effect
        assert await sink.apply_batch(conn, batch[3:]) == 0
        # a batch that fails half way commits nothing, position included
        later = [(i + 7, projection.convert(e, i + 7)) for i, e in enumerate(lifecycle("b2", 1, 60))]
        broken = later[:3] + [(10, [operations.RejectJob("b2", None, None, None, None)])]
        with pytest.raises(asyncpg.PostgresError):
            await sink.apply_batch(conn, broken)
        assert await sink.position(conn) == 6
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE job_id = 'b2'") == 0
        assert await sink.apply_batch(conn, later) == 6
        rows = await conn.fetch("SELECT job_id, gpu_seconds FROM usage_ledger ORDER BY job_id")
        assert [(r["job_id"], r["gpu_seconds"]) for r in rows] == [("b1", 8 * 3600.0), ("b2", 60.0)]
    finally:
        await conn.close()


async def test_a_failing_write_is_retried_in_order_and_nothing_is_skipped(nats_server, admin_js, pg_dsn):
    """Postgres refuses a batch for a while (a trigger stands in for an outage): accounting
    must neither skip that batch nor apply later events before it."""
    settings = service_settings(nats_server, "accounting", pg_dsn=pg_dsn)
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(settings, stop))
    conn = await asyncpg.connect(pg_dsn)
    try:
        await eventually(lambda: _migrated(conn))
        await conn.execute("""
            CREATE TABLE outage (active boolean NOT NULL);
            INSERT INTO outage VALUES (true);
            CREATE FUNCTION refuse() RETURNS trigger AS $$
            BEGIN
                IF (SELECT active FROM outage) THEN RAISE EXCEPTION 'simulated outage'; END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER refuse BEFORE INSERT ON usage_ledger FOR EACH ROW EXECUTE FUNCTION refuse();
        """)
        log = eventlog.EventLog(admin_js)
        for e in lifecycle("o1", gpus=1, runtime_s=10):
            await log.append(e)
        await asyncio.sleep(1.5)
        for e in lifecycle("o2", gpus=2, runtime_s=10):
            await log.append(e)
        await asyncio.sleep(1.5)
        assert await sink.position(conn) < 6  # stuck before o1's success, not past it
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE job_id = 'o2'") == 0
        await conn.execute("UPDATE outage SET active = false")
        usage, pos, states = await eventually(lambda: _at(pg_dsn, 12), timeout_s=30)
        assert usage == {"o1": 10.0, "o2": 20.0}
        assert states == {"o1": "succeeded", "o2": "succeeded"}
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await conn.close()


async def _migrated(conn) -> bool:
    return bool(await conn.fetchval("SELECT to_regclass('usage_ledger') IS NOT NULL"))


async def test_clusters_their_nodes_and_a_lost_cluster(pg_dsn):
    """Many clusters: each node's cluster, each cluster's last heartbeat; a ClusterLost marks the
    cluster and its nodes lost, and a later report brings the cluster back."""
    from tests.unit.builders import at, cluster_lost, cluster_reported, node

    events = [node("gpu-0.east", cluster="east"), node("gpu-1.east", cluster="east"), node("gpu-0.west", cluster="west"),
              cluster_reported("east", when=at(10), nodes=2), cluster_reported("west", when=at(10), nodes=1),
              cluster_lost("east", ("gpu-0.east", "gpu-1.east"), last_report=at(10), when=at(100))]
    conn = await asyncpg.connect(pg_dsn)
    try:
        await sink.migrate(conn)
        await sink.apply_batch(conn, [(i + 1, projection.convert(e, i + 1)) for i, e in enumerate(events)])
        nodes = {r["name"]: (r["cluster"], r["lost"]) for r in await conn.fetch("SELECT name, cluster, lost FROM nodes")}
        assert nodes == {"gpu-0.east": ("east", True), "gpu-1.east": ("east", True), "gpu-0.west": ("west", False)}
        rows = {r["name"]: r for r in await conn.fetch("SELECT * FROM clusters")}
        assert rows["east"]["lost_at"] == at(100) and rows["west"]["lost_at"] is None
        back = cluster_reported("east", when=at(200), nodes=2)
        await sink.apply_batch(conn, [(len(events) + 1, projection.convert(back, len(events) + 1))])
        east = await conn.fetchrow("SELECT last_report, lost_at, lost_reason FROM clusters WHERE name = 'east'")
        assert (east["last_report"], east["lost_at"], east["lost_reason"]) == (at(200), None, None)
    finally:
        await conn.close()
