"""Exactly once, with the accounting service as a real process: killed with SIGKILL while a batch
transaction is open, again and again, then restarted, it counts every attempt once; events
appended a second time (at new sequences) change nothing."""

from __future__ import annotations

import time

import asyncpg
import pytest

from conftest import eventually
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas.registry import dumps, event_subject
from services.accounting import sink
from tests.integration.test_accounting_ledger import job

pytestmark = pytest.mark.e2e


async def _open_transactions(conn) -> int:
    return await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND xact_start IS NOT NULL AND state <> 'idle'")


async def _slow_ledger(conn) -> None:
    """Every ledger row takes a while, so that batches are long transactions to be killed in."""
    await conn.execute("""
        CREATE FUNCTION slow() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(0.003); RETURN NEW; END $$
        LANGUAGE plpgsql;
        CREATE TRIGGER slow BEFORE INSERT ON usage_ledger FOR EACH ROW EXECUTE FUNCTION slow();""")


def _env(nats_server, pg_dsn: str, tmp_path, **extra: str) -> dict[str, str]:
    """The accounting process's environment: small batches, frequent ticks, no statements."""
    return devstack.service_env(nats_server.env, pg_dsn, cluster=tmp_path / "none.yaml", time_scale=1.0,
                                epoch=time.time(), extra={"GPUSCHED_TICK_S": "0.05", "GPUSCHED_BATCH_SIZE": "120",
                                                          "GPUSCHED_STATEMENT_BY": "", **extra})["accounting"]


def lifecycles(n: int) -> list:
    return [e for i in range(n) for e in job(
        f"x{i:03d}", TEAMS[i % len(TEAMS)], gpus=1 + i % 4, borrowed=i % 2, start=10 + i, end=1000 + 7 * i,
        preempt_at=(500 + i) if i % 5 == 0 else None, checkpoint_at=100 + i)]


TEAMS = ("team-a", "team-b", "team-c", "team-d")  # two in each of two partitions


async def test_accounting_killed_mid_batch_counts_everything_once(nats_server, admin_js, pg_dsn, tmp_path):
    log = eventlog.EventLog(admin_js)
    events = lifecycles(300)
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
    await _slow_ledger(conn)
    procs = devstack.ServiceProcesses(tmp_path / "logs", {"accounting": _env(nats_server, pg_dsn, tmp_path)})
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


async def test_two_partitions_killed_mid_batch_count_everything_once(nats_server, admin_js, pg_dsn, tmp_path):
    """The same with two accounting partitions (services/accounting/partition.py) as real
    processes, killed with SIGKILL in turn while batches are being written and started again, the
    other running on: together they count every attempt once."""
    from runtime.teams import partition_of

    assert sorted(partition_of(t, 2) for t in TEAMS) == [0, 0, 1, 1]
    log = eventlog.EventLog(admin_js)
    events = lifecycles(300)
    for e in events:
        await log.append(e)
    last = await eventlog.last_sequence(admin_js)
    ends = [e for e in events if e.type in ("JobSucceeded", "JobPreempted")]
    conn = await asyncpg.connect(pg_dsn)
    await sink.migrate(conn)
    await _slow_ledger(conn)
    env = _env(nats_server, pg_dsn, tmp_path, GPUSCHED_ACCOUNTING_PARTITIONS="2")
    names = ("accounting-p0", "accounting-p1")
    procs = devstack.ServiceProcesses(
        tmp_path / "logs", {name: {**env, "GPUSCHED_ACCOUNTING_PARTITION": str(k)} for k, name in enumerate(names)},
        runs={name: "accounting" for name in names})
    killed: list[tuple[str, int]] = []
    try:
        procs.start_all()
        for round_ in range(6):
            name = names[round_ % 2]
            projection = "read-models" if name.endswith("p0") else "read-models/p1"
            before = await sink.position(conn, projection)
            await eventually(lambda: _moved(conn, projection, before), timeout_s=30, interval_s=0.005)
            await eventually(lambda: _open_transactions(conn), timeout_s=30, interval_s=0.002)
            procs.kill(name)
            killed.append((name, await sink.position(conn, projection)))
            if await sink.complete_position(conn) >= last:
                break
            procs.start(name)
        procs.restart_dead()
        await eventually(lambda: _complete(conn, last), timeout_s=120, interval_s=0.2)
        assert len([p for _, p in killed if 0 < p < last]) >= 3, killed  # killed part way, more than once
        assert {n for n, _ in killed} == set(names)
        assert await conn.fetchval("SELECT count(*) FROM usage_ledger") == len(ends)
        assert await conn.fetchval("SELECT count(*) FROM applied_events") == len(events)
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE state <> 'succeeded'") == 0
        teams = {r[0]: r[1] for r in await conn.fetch("SELECT team, count(*) FROM usage_ledger GROUP BY team")}
        assert teams == {t: sum(1 for e in ends if e.aggregate_id in _jobs_of(events, t)) for t in TEAMS}
    finally:
        procs.stop_all()
        await conn.close()
    for name in names:
        text = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in text, text[-3000:]


def _jobs_of(events: list, team: str) -> set[str]:
    return {e.aggregate_id for e in events if e.type == "JobSubmitted" and e.spec.team == team}


async def _moved(conn, projection: str, seq: int) -> bool:
    return await sink.position(conn, projection) > seq


async def _complete(conn, seq: int) -> bool:
    return await sink.complete_position(conn) >= seq
