"""Inference services in the read models, through the real sink into a real Postgres: the
service's row and each replica's state from the service's events, what `gpusched services` and
the API read, and the service metrics (desired, replicas by state, SLA breach)."""

from __future__ import annotations

from datetime import timedelta

from schemas import new_event
from schemas.service import ReplicaLost, ReplicaReady, ReplicaRequested, ReplicaScheduled, ScaledTo
from services.accounting import metrics, projection, queries, replay, sink
from tests.unit.builders import T0, service_deployed, service_spec


def serving(cls, key: str, **fields):
    return new_event(cls, aggregate_id="chat", producer="serving", occurred_at=T0 + timedelta(seconds=5), key=key,
                     **fields)


async def test_the_service_and_its_replicas_in_the_read_models_and_metrics(pg_dsn):
    await replay.reset(pg_dsn, "sv")
    conn = await replay.connect(pg_dsn, "sv")
    try:
        jobs = [f"replica-chat-1-{i}" for i in range(3)]
        events = [service_deployed(service_spec(desired=2)),
                  *(serving(ReplicaRequested, j, job_id=j, generation=1, index=i, spec=service_spec().replica,
                            submitter="alice", reason="scale-up") for i, j in enumerate(jobs[:2])),
                  serving(ReplicaScheduled, "s0", job_id=jobs[0], attempt=1, nodes=("n1",)),
                  serving(ReplicaReady, "r0", job_id=jobs[0], attempt=1),
                  serving(ReplicaScheduled, "s1", job_id=jobs[1], attempt=1, nodes=("n2",)),
                  serving(ScaledTo, "t", replicas=3, requested=3),
                  serving(ReplicaRequested, jobs[2], job_id=jobs[2], generation=1, index=2,
                          spec=service_spec().replica, submitter="alice", reason="scale-up"),
                  serving(ReplicaLost, "l1", job_id=jobs[1], attempt=1, reason="JobPreempted: make room")]
        await sink.apply_batch(conn, [(i + 1, e.event_id, projection.convert(e, i + 1)) for i, e in enumerate(events)])

        (svc,) = await queries.services(conn, "team-a")
        assert (svc["service"], svc["desired"], svc["ready"], svc["starting"], svc["pending"]) == ("chat", 3, 1, 0, 2)
        assert await queries.services(conn, "team-b") == []
        states = {r["job_id"]: (r["state"], r["nodes"], r["reason"]) for r in await queries.service_replicas(conn, "chat")}
        assert states == {jobs[0]: ("ready", ["n1"], "scale-up"), jobs[1]: ("lost", ["n2"], "JobPreempted: make room"),
                          jobs[2]: ("requested", None, "scale-up")}

        samples = {(s.name, s.labels): s.value for s in await metrics.gather(conn, T0 + timedelta(seconds=10))}
        who = (("service", "chat"), ("team", "team-a"))
        assert samples[("gpusched_service_desired_replicas", who)] == 3
        assert samples[("gpusched_service_replicas", (*who, ("state", "ready")))] == 1
        assert samples[("gpusched_service_replicas", (*who, ("state", "pending")))] == 2
        assert samples[("gpusched_service_sla_breach", who)] == 1
        # requested and ready 5 s into the log here: asked-for to ready is 0 for the one ready replica
        assert samples[("gpusched_service_replica_ready_seconds", (("service", "chat"), ("quantile", "0.99")))] == 0
        assert samples[("gpusched_service_replica_ready_seconds_count", (("service", "chat"),))] == 1
    finally:
        await conn.close()
