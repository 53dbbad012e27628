"""What the read models say about a waiting job: its state in `gpusched jobs` and the congestion
metrics, from events applied by the real sink into a real Postgres."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from schemas import (
    JobAdmitted, JobRetryScheduled, JobScheduled, JobSpec, JobStarted, JobSubmitted, NodeAssignment, QuotaReserved,
    new_event,
)
from tests.unit.builders import failed, preempted
from services.accounting import metrics, projection, replay, sink

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def admitted(job_id: str, when: float) -> list:
    spec = JobSpec(kind="training", queue="q", team="team-a", image="img", gpus=2)
    return [
        new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=at(when), key="1", spec=spec,
                  submitter="u", intake_sequence=1),
        new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=at(when), key="d", queue="q",
                  priority=500, preemptible=True),
    ]


def reserved(job_id: str, when: float, attempt: int = 1) -> QuotaReserved:
    return new_event(QuotaReserved, aggregate_id=job_id, producer="quota", occurred_at=at(when), key=str(attempt),
                     attempt=attempt, queue="q", flavor="a100", gpus=2)


async def apply(pg_dsn: str, schema: str, events: list):
    await replay.reset(pg_dsn, schema)
    conn = await replay.connect(pg_dsn, schema)
    await sink.apply_batch(conn, [(i + 1, e.event_id, projection.convert(e, i + 1)) for i, e in enumerate(events)])
    return conn


async def test_pending_jobs_counts_jobs_holding_quota_but_waiting_for_a_node(pg_dsn):
    """Issue 21, finding 7: a job that holds quota but has no node yet waits too; the metric used
    to leave it out."""
    events = [*admitted("a", 0), *admitted("b", 10), *admitted("c", 20), reserved("b", 30), reserved("c", 40)]
    conn = await apply(pg_dsn, "pending_by_wait", events)
    try:
        samples = await metrics.gather(conn, at(100))
    finally:
        await conn.close()
    pending = {dict(s.labels)["waiting_for"]: s.value for s in samples if s.name == "gpusched_queue_pending_jobs"}
    oldest = {dict(s.labels)["waiting_for"]: s.value for s in samples
              if s.name == "gpusched_queue_oldest_pending_age_seconds"}
    assert pending == {"quota": 1, "node": 2}
    assert oldest == {"quota": 100.0, "node": 90.0}  # since queued: b at 10 s


def ran_and_ended(job_id: str, ending, after: str) -> list:
    return [
        reserved(job_id, 20),
        new_event(JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=at(21), key="1", attempt=1,
                  flavor="a100", placement=(NodeAssignment(node="n1", gpus=2),)),
        new_event(JobStarted, aggregate_id=job_id, producer="executor", occurred_at=at(22), key="1", attempt=1,
                  nodes=("n1",)),
        ending,
        new_event(JobRetryScheduled, aggregate_id=job_id, producer="quota", occurred_at=at(60), key="1",
                  failed_attempt=1, next_attempt=2, not_before=at(60), after=after),
    ]


async def test_a_requeued_job_is_queued_with_its_next_attempt_and_a_failed_one_retrying(pg_dsn):
    """The job state vocabulary (schemas/jobstate.py): a JobRetryScheduled after a preemption
    queues the job again (``queued``, its new attempt number), so that ``state=queued`` finds
    every job waiting for quota for a fresh attempt; after a failure it is ``retrying``. (Until
    then a preempted job shows ``preempted``.)"""
    events = [*admitted("p", 0), *ran_and_ended("p", preempted("p", started_at=at(22), when=at(50)), "JobPreempted"),
              *admitted("f", 0), *ran_and_ended("f", failed("f", started_at=at(22), when=at(50)), "JobFailed")]
    conn = await apply(pg_dsn, "preempted_state", events)
    try:
        states = dict(await conn.fetch("SELECT job_id, state FROM jobs"))
        attempts = dict(await conn.fetch("SELECT job_id, attempt FROM jobs"))
        await sink.apply_batch(conn, [(len(events) + 1, "r2", projection.convert(reserved("p", 70, attempt=2),
                                                                                  len(events) + 1))])
        after_reserve = await conn.fetchval("SELECT state FROM jobs WHERE job_id = 'p'")
    finally:
        await conn.close()
    assert states == {"p": "queued", "f": "retrying"}
    assert attempts == {"p": 2, "f": 2}
    assert after_reserve == "reserved"
