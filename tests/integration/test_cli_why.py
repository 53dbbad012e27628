"""`gpusched why` against a real nats-server, Postgres and accounting: a recorded wait reason
carries the numbers of the cycle that recorded it, so `why` shows the queue's usage now beside
it, the same numbers `gpusched queues` shows (issue 21, finding 7)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

from conftest import eventually, service_settings
from runtime import eventlog
from schemas import JobAdmitted, JobSpec, JobSubmitted, QuotaPendingReasonChanged, QuotaReleased, QuotaReserved, new_event
from services.accounting import __main__ as accounting
from services.accounting import queries
from tests.unit.builders import queue

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def admitted(job_id: str, gpus: int) -> list:
    spec = JobSpec(kind="training", queue="research", team="team-a", image="img", gpus=gpus, gpu_flavors=("a100",))
    return [new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=at(0), key="1", spec=spec,
                      submitter="u", intake_sequence=1),
            new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=at(0), key="d",
                      queue="research", priority=500, preemptible=True)]


async def cli(nats_server, pg_dsn, *args: str) -> dict:
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gpusched.cli.main", *args, "-o", "json"],
                                   env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_why_shows_the_queue_usage_now_beside_the_recorded_reason(nats_server, admin_js, pg_dsn):
    log = eventlog.EventLog(admin_js)
    events = [queue("research", ("team-a",), {"a100": 4}), *admitted("holder", 4), *admitted("waiter", 2),
              new_event(QuotaReserved, aggregate_id="holder", producer="quota", occurred_at=at(5), key="1",
                        attempt=1, queue="research", flavor="a100", gpus=4),
              new_event(QuotaPendingReasonChanged, aggregate_id="waiter", producer="quota", occurred_at=at(6),
                        key="1", attempt=1, reason="nominal-exhausted", position=1, flavor="a100",
                        message="queue research nominal a100 4, used 4; needs 2 more; no cohort to borrow from"),
              # the holder's quota comes back; the waiter's reason is not recorded again until it changes
              new_event(QuotaReleased, aggregate_id="holder", producer="quota", occurred_at=at(9), key="1",
                        attempt=1, queue="research", flavor="a100", gpus=4, reason="JobSucceeded")]
    for e in events:
        await log.append(e)
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))
    try:
        async def caught_up():
            import asyncpg
            conn = await asyncpg.connect(pg_dsn)
            try:
                has = await conn.fetchval("SELECT to_regclass('projection_position') IS NOT NULL")
                return has and await queries.position(conn) >= len(events)
            finally:
                await conn.close()

        await eventually(caught_up)
        why = await cli(nats_server, pg_dsn, "why", "waiter")
        queues = await cli(nats_server, pg_dsn, "queues")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert why["reason"]["message"].endswith("used 4; needs 2 more; no cohort to borrow from")
    assert why["reason"]["since"].startswith("2026-11-02T09:00:06")
    [now] = why["queue_now"]["flavors"]
    [row] = [q for q in queues if q["queue"] == "research"]
    assert (now["used"], now["nominal"], now["pending_jobs"]) == (row["used"], row["nominal"], row["pending_jobs"]) \
        == (0, 4, 1)
    assert why["queue_now"]["position"] >= len(events)
