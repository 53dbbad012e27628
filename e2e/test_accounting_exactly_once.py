"""Exactly once, with the accounting service as a real process: killed with SIGKILL while a batch
transaction is open, again and again, then restarted, it counts every attempt once; events
appended a second time (at new sequences) change nothing."""

from __future__ import annotations

import time

import asyncpg
import pytest

from conftest import eventually
from gpusched import devstack
from runtime import eventlog
from schemas.registry import dumps, event_subject
from services.accounting import sink
from tests.integration.test_accounting_ledger import job

pytestmark = pytest.mark.e2e


async def _open_transactions(conn) -> int:
    return await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND xact_start IS NOT NULL AND state <> 'idle'")


async def test_accounting_killed_mid_batch_counts_everything_once(nats_server, admin_js, pg_dsn, tmp_path):
    log = eventlog.EventLog(admin_js)
    events = []
    for i in range(300):
        events += job(f"x{i:03d}", ("team-a", "team-b")[i % 2], gpus=1 + i % 4, borrowed=i % 2, start=10 + i,
                      end=1000 + 7 * i, preempt_at=(500 + i) if i % 5 == 0 else None, checkpoint_at=100 + i)
    for e in events:
        await log.append(e)
    # the same events appended again after the duplicate window (new message ids, new sequences)
    redelivered = [e for e in events if e.type in ("JobSucceeded", "JobPreempted", "JobStarted")][:50]
    for e in redelivered:
        await admin_js.publish(event_subject(e), dumps(e), headers={"Nats-Msg-Id": "again-" + e.event_id})
    last = await eventlog.last_sequence(admin_js)
    usage_at = {0: 0}  # sequence -> ledger rows once everything up to it is applied
    rows = 0
    for seq, e in enumerate(events, start=1):
        rows += e.type in ("JobSucceeded", "JobPreempted")
        usage_at[seq] = rows
    expected_gpu_seconds = sum(
        next(r.gpus for r in events if r.type == "QuotaReserved" and r.aggregate_id == e.aggregate_id
             and r.attempt == e.attempt) * (e.occurred_at - e.started_at).total_seconds()
        for e in events if e.type in ("JobSucceeded", "JobPreempted"))

    conn = await asyncpg.connect(pg_dsn)
    await sink.migrate(conn)
    # every ledger row takes a while, so that batches are long transactions to be killed in
    await conn.execute("""
        CREATE FUNCTION slow() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(0.003); RETURN NEW; END $$
        LANGUAGE plpgsql;
        CREATE TRIGGER slow BEFORE INSERT ON usage_ledger FOR EACH ROW EXECUTE FUNCTION slow();""")
    env = devstack.service_env(nats_server.env, pg_dsn, cluster=tmp_path / "none.yaml", time_scale=1.0,
                               epoch=time.time(), extra={"GPUSCHED_TICK_S": "0.05", "GPUSCHED_BATCH_SIZE": "120",
                                                         "GPUSCHED_STATEMENT_BY": ""})
    procs = devstack.ServiceProcesses(tmp_path / "logs", {"accounting": env["accounting"]})
    kills = 0
    positions = []
    try:
        for _ in range(6):
            procs.start("accounting")
            before = await sink.position(conn)
            await eventually(lambda: _past(conn, before), timeout_s=30, interval_s=0.005)  # it is projecting
            await eventually(lambda: _open_transactions(conn), timeout_s=30, interval_s=0.002)
            procs.kill("accounting")
            kills += 1
            # the killed transaction left nothing behind: rows match the position exactly
            position = await sink.position(conn)
            positions.append(position)
            if position >= last:
                break
            assert await conn.fetchval("SELECT count(*) FROM usage_ledger") == usage_at[min(position, len(events))]
        procs.start("accounting")
        await eventually(lambda: _at(conn, last), timeout_s=120, interval_s=0.2)
        assert kills >= 3
        assert len({p for p in positions if 0 < p < last}) >= 3, positions  # killed part way, more than once
        assert await conn.fetchval("SELECT count(*) FROM usage_ledger") == usage_at[len(events)]
        assert await conn.fetchval("SELECT sum(gpu_seconds) FROM usage_ledger") == pytest.approx(
            expected_gpu_seconds, rel=1e-12)
        assert await conn.fetchval("SELECT count(*) FROM applied_events") == len(events)
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE state <> 'succeeded'") == 0
        lost = await conn.fetchval("SELECT sum(lost_gpu_seconds) FROM usage_ledger")
        assert lost > 0
    finally:
        procs.stop_all()
        await conn.close()
    text = (tmp_path / "logs" / "accounting.log").read_text()
    assert "Traceback" not in text, text[-3000:]


async def _past(conn, seq: int) -> bool:
    return await sink.position(conn) > seq


async def _at(conn, seq: int) -> bool:
    return await sink.position(conn) >= seq
