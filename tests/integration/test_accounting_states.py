"""What the read models say about a waiting job: its state in `gpusched jobs` and the congestion
metrics, from events applied by the real sink into a real Postgres."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from schemas import JobAdmitted, JobSpec, JobSubmitted, QuotaReserved, new_event
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
