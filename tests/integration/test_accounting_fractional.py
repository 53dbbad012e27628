"""Fractional GPUs charged by their fraction, through the real sink into a real Postgres: the
ledger row, an attempt whose submission an earlier batch wrote (read back from the jobs table),
a running attempt in a roll-up, the chargeback statement, the metrics, and a batch large enough
to go by COPY."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from schemas import (
    JobAdmitted, JobScheduled, JobSpec, JobStarted, JobSubmitted, JobSucceeded, NodeAssignment, QuotaReleased,
    QuotaReserved,
    new_event,
)
from gpusched.gateway import queue_usage as quota_usage
from services.accounting import chargeback, metrics, projection, queries, replay, sink
from services.accounting.bulk import copy
from tests.unit.builders import price_book, queue

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def run(job_id: str, *, milli: int | None, start: float = 0, end: float | None = 3600, gpus: int = 1,
        borrowed: int = 0, counted: bool = False) -> list:
    """A job's events from submission to its end (None: still running). ``counted``: quota holds
    the fraction (gpu_milli on QuotaReserved), else a whole GPU, as logs written before it did."""
    spec = JobSpec(kind="inference", queue="q", team="team-a", image="img", gpus=gpus, gpu_milli=milli)
    ev = [
        new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=at(start), key="1", spec=spec,
                  submitter="u", intake_sequence=1),
        new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=at(start), key="d", queue="q",
                  priority=500, preemptible=True),
        new_event(QuotaReserved, aggregate_id=job_id, producer="quota", occurred_at=at(start), key="1", attempt=1,
                  queue="q", flavor="l4", gpus=gpus, borrowed=borrowed,
                  gpu_milli=milli if counted else None, borrowed_milli=(borrowed * (milli or 0)) if counted else None),
        new_event(JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=at(start), key="1", attempt=1,
                  flavor="l4", placement=(NodeAssignment(node="l4-0", gpus=gpus, gpu_indices=tuple(range(gpus)),
                                                         gpu_milli=milli),)),
        new_event(JobStarted, aggregate_id=job_id, producer="executor", occurred_at=at(start), key="1", attempt=1,
                  nodes=("l4-0",)),
    ]
    if end is not None:
        ev.append(new_event(JobSucceeded, aggregate_id=job_id, producer="executor", occurred_at=at(end), key="1",
                            attempt=1, started_at=at(start)))
    return ev


async def fresh(pg_dsn: str):
    await replay.reset(pg_dsn, "fr")
    return await replay.connect(pg_dsn, "fr")


async def apply(conn, events: list, first_seq: int = 1) -> None:
    await sink.apply_batch(conn, [(first_seq + i, e.event_id, projection.convert(e, first_seq + i))
                                  for i, e in enumerate(events)])


async def test_a_quarter_of_a_gpu_is_charged_a_quarter(pg_dsn):
    conn = await fresh(pg_dsn)
    try:
        setup = [queue("q", ("team-a",), {"l4": 8}, when=at(-60)),
                 price_book({"l4": 2.0}, effective_from=datetime(2026, 10, 1, tzinfo=UTC), when=at(-60))]
        quarter = run("quarter", milli=250, borrowed=1)
        whole = run("whole", milli=None)
        later = run("later", milli=500)  # submitted in this batch, ends in the next
        running = run("running", milli=100, end=None)
        await apply(conn, setup + quarter + whole + later[:-1] + running)
        await apply(conn, later[-1:], first_seq=len(setup + quarter + whole + later[:-1] + running) + 1)

        assert await conn.fetchval("SELECT gpu_milli FROM jobs WHERE job_id = 'quarter'") == 250
        rows = {r["job_id"]: dict(r) for r in await conn.fetch("SELECT * FROM usage_ledger")}
        assert (rows["quarter"]["gpus"], rows["quarter"]["gpu_seconds"]) == (0.25, 900.0)
        assert (rows["quarter"]["borrowed_gpus"], rows["quarter"]["borrowed_gpu_seconds"]) == (0.25, 900.0)
        assert (rows["whole"]["gpus"], rows["whole"]["gpu_seconds"]) == (1.0, 3600.0)
        assert (rows["later"]["gpus"], rows["later"]["gpu_seconds"]) == (0.5, 1800.0)  # from the jobs table

        # a roll-up counts the running tenth up to the time asked for, priced by its fraction
        (team,) = await queries.rollup(conn, ["team"], as_of=at(3600))
        assert team["gpu_hours"] == pytest.approx(0.25 + 1 + 0.5 + 0.1)
        assert team["cost"] == pytest.approx(2.0 * (0.25 + 1 + 0.5 + 0.1))

        # the chargeback statement, from the same rows
        body = chargeback.statement(
            await queries.attempts(conn) + await queries.running_attempts(conn, at(3600)),
            await queries.price_versions(conn), await queries.quota_versions(conn),
            period="2026-11", group_by="team", first_sequence=1, last_sequence=99, as_of=at(3600))
        (line,) = body["lines"]
        assert line["gpu_hours"] == "1.850000"  # 0.25 + 1 + 0.5 + 0.1
        assert line["borrowed_gpu_hours"] == "0.250000"
        assert line["usage_cost"] == "3.70"

        # metrics: the running tenth is a tenth of a GPU allocated; the ledger's seconds and cost
        samples = {(s.name, s.labels): s.value for s in await metrics.gather(conn, at(3600))}
        assert samples[("gpusched_gpu_allocated", (("flavor", "l4"),))] == pytest.approx(0.1)
        assert samples[("gpusched_team_gpu_seconds", (("team", "team-a"), ("flavor", "l4")))] == pytest.approx(
            3600 * (0.25 + 1 + 0.5))
        assert samples[("gpusched_team_cost", (("team", "team-a"), ("currency", "USD")))] == pytest.approx(
            2.0 * (0.25 + 1 + 0.5))
    finally:
        await conn.close()


async def test_a_batch_written_by_copy_charges_fractions_too(pg_dsn):
    conn = await fresh(pg_dsn)
    try:
        n = copy.STAGE_MIN + 10  # enough jobs and ends for the COPY path
        await apply(conn, [e for i in range(n) for e in run(f"f{i}", milli=250, start=i)])
        assert await conn.fetchval("SELECT count(*) FROM usage_ledger WHERE gpus = 0.25") == n
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE gpu_milli = 250") == n
        assert await conn.fetchval("SELECT sum(gpu_seconds) FROM usage_ledger") == pytest.approx(
            sum(0.25 * (3600 - i) for i in range(n)))
    finally:
        await conn.close()


async def test_quota_held_in_thousandths_in_the_read_models_and_the_queue_report(pg_dsn):
    """Three quarter-GPU jobs running hold 0.75 of the queue's L4 quota; a released one holds
    nothing and is charged its quarter; GPU-hours held count quarters."""
    conn = await fresh(pg_dsn)
    try:
        setup = [queue("q", ("team-a",), {"l4": 8}, when=at(-60))]
        done = run("done", milli=250, counted=True)
        done.append(new_event(QuotaReleased, aggregate_id="done", producer="quota", occurred_at=at(3600), key="1",
                              attempt=1, queue="q", flavor="l4", gpus=1, gpu_milli=250, reason="JobSucceeded"))
        running = [e for i in range(3) for e in run(f"r{i}", milli=250, end=None, counted=True, borrowed=int(i == 0))]
        await apply(conn, setup + done + running)

        rows = {r["job_id"]: (r["gpus"], r["gpu_milli"], r["borrowed_milli"])
                for r in await conn.fetch("SELECT * FROM reservations")}
        assert rows == {"done": (1, 250, 0), "r0": (1, 250, 250), "r1": (1, 250, 0), "r2": (1, 250, 0)}
        (row,) = await quota_usage.queue_usage(conn)
        assert (row["nominal"], row["used"], row["borrowed"], row["lendable"]) == (8, 0.75, 0, 7.25)
        assert (await conn.fetchrow("SELECT gpus, borrowed_gpus FROM usage_ledger WHERE job_id = 'done'")) == (0.25, 0.0)
        hours = await queries.held_gpu_hours(conn, at(0), at(3600))
        assert hours[("q", "l4")] == pytest.approx(4 * 0.25)
    finally:
        await conn.close()
