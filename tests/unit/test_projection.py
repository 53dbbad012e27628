"""Accounting's pure converter: event -> read-model operations."""

from __future__ import annotations

import json
import logging
from decimal import Decimal

import pytest

from schemas import (
    ALL_EVENT_TYPES,
    CohortConfigured,
    Event,
    FailureReason,
    JobRejected,
    QueueDeleted,
    RejectReason,
    new_event,
)
from services.accounting import projection
from services.accounting.operations import (
    AttemptEnded,
    InsertApiToken,
    InsertAttempt,
    InsertCheckpoint,
    InsertGpuTelemetry,
    InsertJob,
    InsertPolicy,
    InsertPriceBook,
    InsertQuotaVersion,
    InsertReplica,
    InsertReservation,
    InsertStatement,
    MarkClusterLost,
    MarkNodeLost,
    MarkNodesLost,
    MarkQueueDeleted,
    MarkServiceDeleted,
    RecordClusterReport,
    RejectJob,
    ReleaseReservation,
    RequestScale,
    RevokeApiToken,
    SetJobState,
    SetReplicaState,
    SetServiceLoad,
    SetServiceScale,
    SetWaitReason,
    UpdateService,
    UpsertCohort,
    UpsertNode,
    UpsertQueue,
    UpsertService,
    UpsertTeam,
)
from services.accounting.projection import IGNORED, convert
from tests.unit.builders import (
    T0,
    service_samples,
    admitted,
    at,
    ready,
    cancel_requested,
    cancelled,
    failed,
    gpu,
    node,
    node_lost,
    cluster_lost,
    cluster_reported,
    node_updated,
    preempted,
    queue,
    released,
    pending_reason,
    price_book,
    policy_configured,
    team_configured,
    token_issued,
    token_revoked,
    reclaim_requested,
    sched_pending_reason,
    statement,
    preemption_requested,
    checkpointed,
    reserved,
    retry_scheduled,
    scheduled,
    spec,
    started,
    submitted,
    succeeded,
    telemetry,
)

SEQ = 42

REJECTED = new_event(JobRejected, aggregate_id="j1", producer="admission", occurred_at=at(1), key="decision",
                     reason=RejectReason.UNKNOWN_QUEUE, message="no queue 'x'", field="spec.queue")
QUEUE = queue("research", ("team-a",), {"a100": 8}, cohort="shared")
DELETED = new_event(QueueDeleted, aggregate_id="old", producer="config", occurred_at=T0, key="d", name="old")
COHORT = new_event(CohortConfigured, aggregate_id="shared", producer="config", occurred_at=T0, key="c", name="shared")
NODE = node("gpu-1.rack-1", "a100", 8, gpu_product="NVIDIA-A100", labels={"rack": "r1"})

STATEMENT = statement(lines=[{"key": "team-a", "gpu_hours": "1.000000", "guaranteed_gpu_hours": "1.000000",
                              "borrowed_gpu_hours": "0.000000", "lost_gpu_hours": "0.000000",
                              "idle_gpu_hours": "0.000000", "usage_cost": "3.00", "idle_cost": "0.00",
                              "total_cost": "3.00"}])

SERVICE = service_samples()
CASES = [
    (submitted("j1", spec(gpus=4, gang_size=2, project="vision"), submitter="bob", when=at(1)),
     [InsertJob("j1", "team-a", "vision", "research", "training", "training", "bob", 4, 2, 8, at(1), SEQ,
                             2000, 8192, None)]),
    (submitted("f1", spec(gpus=1, gpu_milli=250), submitter="bob", when=at(1)),
     [InsertJob("f1", "team-a", None, "research", "training", "training", "bob", 1, 1, 1, at(1), SEQ,
                             1000, 4096, 250)]),
    (REJECTED, [RejectJob("j1", "unknown-queue", "no queue 'x'", at(1), SEQ)]),
    (admitted("j1", when=at(2)), [SetJobState("j1", "queued", SEQ, {"admitted_at": at(2)}),
                                  InsertAttempt("j1", 1, at(2), SEQ)]),
    (reserved("j1", flavor="h100", attempt=2, when=at(3)),
     [SetJobState("j1", "reserved", SEQ, {"attempt": 2, "flavor": "h100", "message": None, "reason": None,
                                          "reserved_at": at(3)}),
      InsertReservation("j1", 2, "research", "h100", 1, 0, None, None, at(3), SEQ)]),
    (pending_reason("j1", message="queue q nominal a100 8, used 8"),
     [SetWaitReason("j1", "nominal-exhausted", "queue q nominal a100 8, used 8", SEQ)]),
    (scheduled("j1", {"n1": (0,), "n2": (1,)}, flavor="a100", when=at(4)),
     [SetJobState("j1", "scheduled", SEQ, {"flavor": "a100", "message": None, "nodes": ["n1", "n2"], "reason": None,
                                           "scheduled_at": at(4)})]),
    (started("j1", when=at(5)), [SetJobState("j1", "running", SEQ, {"started_at": at(5)})]),
    (ready("replica-chat-1-0", when=at(6)), []),
    (succeeded("j1", attempt=2, started_at=at(5), when=at(65)),
     [SetJobState("j1", "succeeded", SEQ, {"exit_code": 0, "finished_at": at(65)}),
      AttemptEnded("j1", 2, at(5), at(65), 60.0, "JobSucceeded", SEQ)]),
    (failed("j1", FailureReason.OOM_KILLED, exit_code=137, message="oom", started_at=at(5), when=at(15)),
     [SetJobState("j1", "failed", SEQ, {"exit_code": 137, "finished_at": at(15), "message": "oom",
                                        "reason": "oom-killed"}),
      AttemptEnded("j1", 1, at(5), at(15), 10.0, "JobFailed", SEQ)]),
    (failed("j1", FailureReason.IMAGE_PULL, exit_code=None, started_at=None, when=at(15)),
     [SetJobState("j1", "failed", SEQ, {"exit_code": None, "finished_at": at(15), "message": "",
                                        "reason": "image-pull"})]),
    (preempted("j1", started_at=at(5), when=at(35)),
     [SetJobState("j1", "preempted", SEQ, {"message": "make room", "reason": "preempted"}),
      AttemptEnded("j1", 1, at(5), at(35), 30.0, "JobPreempted", SEQ)]),
    (preempted("j1", started_at=None, when=at(35)),
     [SetJobState("j1", "preempted", SEQ, {"message": "make room", "reason": "preempted"})]),
    (retry_scheduled("j1", 1, not_before=at(99), when=at(40)),
     [SetJobState("j1", "retrying", SEQ, {"attempt": 2, "finished_at": None}),
      InsertAttempt("j1", 2, at(40), SEQ)]),
    (cancel_requested("j1"), [SetJobState("j1", "cancelling", SEQ, {})]),
    (cancelled("j1", attempt=1, started_at=at(5), when=at(25), reason="user"),
     [SetJobState("j1", "cancelled", SEQ, {"finished_at": at(25), "message": "user"}),
      AttemptEnded("j1", 1, at(5), at(25), 20.0, "JobCancelled", SEQ)]),
    (cancelled("j1", when=at(25)), [SetJobState("j1", "cancelled", SEQ, {"finished_at": at(25), "message": ""})]),
    (NODE, [UpsertNode("gpu-1.rack-1", "a100", "NVIDIA-A100", 8, 81920, json.dumps({"rack": "r1"}), False, SEQ, None)]),
    (node_updated("n1", None, 0, gpu_memory_mib=None, unschedulable=True),
     [UpsertNode("n1", None, None, 0, None, "{}", True, SEQ, None)]),
    (node_lost("n1"), [MarkNodeLost("n1", SEQ)]),
    (cluster_reported("east", when=at(30), nodes=12), [RecordClusterReport("east", at(30), 12, SEQ)]),
    (cluster_lost("east", ("a.east", "b.east"), last_report=at(30), when=at(130)),
     [MarkClusterLost("east", at(30), at(130), "no report", SEQ), MarkNodesLost(["a.east", "b.east"], SEQ)]),
    (telemetry("n1", [gpu(0, 0.75, power_w=300.0), gpu(2, 0.0, allocated=0, memory_used_mib=0)], start=at(60)),
     [InsertGpuTelemetry("n1", 0, at(60), at(120), 0.75, 1024, 81559, 300.0, 6, 6, 0.75, SEQ),
      InsertGpuTelemetry("n1", 2, at(60), at(120), 0.0, 0, 81559, None, 6, 0, None, SEQ)]),
    (QUEUE, [UpsertQueue("research", "shared", QUEUE.model_dump_json(), SEQ),
             InsertQuotaVersion("research", "team-a", T0, '{"a100": 8}', SEQ)]),
    (DELETED, [MarkQueueDeleted("old", SEQ), InsertQuotaVersion("old", None, T0, "{}", SEQ)]),
    (released("j1"), [ReleaseReservation("j1", 1, T0, SEQ)]),
    (COHORT, [UpsertCohort("shared", None, SEQ)]),
    (reclaim_requested("j1"), [SetJobState("j1", "preempting", SEQ, {
        "message": "queue research needs its guaranteed a100 back for job owner"})]),
    (preemption_requested("j1"), [SetJobState("j1", "preempting", SEQ, {"message": "preempted so that urgent fits"})]),
    (sched_pending_reason("j1", message="needs 8×a100 on one node"),
     [SetWaitReason("j1", "fragmentation", "needs 8×a100 on one node", SEQ)]),
    (checkpointed("j1", attempt=2, at_=at(30), when=at(31)), [InsertCheckpoint("j1", 2, at(30), SEQ)]),
    (price_book({"h100": 4.5, "a100": 2.0}, effective_from=at(-10), cpu_core_hour=0.05, idle_quota="charge-owner"),
     [InsertPriceBook("default", at(-10), "USD", '{"a100": 2.0, "h100": 4.5}', 0.05, None, "charge-owner", SEQ)]),
    (token_issued(when=at(3)), [InsertApiToken("abcdefghijk1", "alice", "member", "team-a", "0" * 64, "admin", at(3),
                                                  None, SEQ)]),
    (token_revoked(when=at(4)), [RevokeApiToken("abcdefghijk1", at(4), "admin")]),
    (team_configured("team-a", ("https://hooks.example/a",), when=at(2)),
     [UpsertTeam("team-a", '{"webhooks":[{"url":"https://hooks.example/a","kinds":[]}]}', at(2), SEQ)]),
    (policy_configured(("gold", 900, False), when=at(2), max_per_window=3),
     [InsertPolicy(SEQ, at(2), '[{"name": "gold", "value": 900, "preemptible": false, "protection_seconds": 0.0, '
                                '"max_preemptions": null, "preemption_grace_seconds": 30.0}]',
                    '{"enabled":true,"max_per_window":3,"window_seconds":300.0}')]),
    (STATEMENT, [InsertStatement(STATEMENT.aggregate_id, "2026-01", "team", "sha256:" + "0" * 64, 1, 10,
                                  Decimal("3.00"),
                                  STATEMENT.model_dump_json(include={"period", "group_by", "currency", "minor_unit",
                                                                     "idle_quota", "items", "adjustments", "lines",
                                                                     "total_gpu_hours", "total_cost", "checksum_alg"}),
                                  SEQ)]),
    *zip(SERVICE, [
        [UpsertService("chat", "team-a", "research", SERVICE[0].spec.model_dump_json(), 1, 2, "alice", T0,
                                 SEQ)],
        [UpdateService("chat", SERVICE[1].spec.model_dump_json(), 2, 2, T0, SEQ)],
        [RequestScale("chat", 3, "hpa", T0, SEQ)],
        [MarkServiceDeleted("chat", T0, SEQ)],
        [SetServiceLoad("chat", 120.5, T0, SEQ)],
        [SetServiceScale("chat", 4, SEQ)],
        [InsertReplica("replica-chat-2-0", "chat", 2, 0, "rollout", T0, SEQ)],
        [SetReplicaState("replica-chat-2-0", "retired", None, None, "scale-down", T0, SEQ)],
        [SetReplicaState("replica-chat-2-0", "scheduled", 2, ["n1"], None, T0, SEQ)],
        [SetReplicaState("replica-chat-2-0", "ready", 2, None, None, T0, SEQ)],
        [SetReplicaState("replica-chat-2-0", "replaced", 2, None, "JobFailed: node-lost", T0, SEQ)],
    ]),
]


@pytest.mark.parametrize("event, ops", CASES, ids=[f"{i}-{c[0].type}" for i, c in enumerate(CASES)])
def test_convert(event, ops):
    assert convert(event, SEQ) == ops


def test_every_event_type_has_a_case():
    assert {type(e) for e, _ in CASES} == set(ALL_EVENT_TYPES)
    assert set(IGNORED) == set()  # every type changes a read model


def test_usage_never_negative():
    # a clock step backwards between start and end must not produce negative GPU time
    (_, usage) = convert(succeeded("j1", started_at=at(100), when=at(90)), 1)
    assert usage.seconds == 0.0


def test_an_unknown_event_type_is_logged_once_and_skipped(caplog):
    """Neither converted nor in IGNORED (a newer producer's type): warned about, once, and
    skipped, so that the projection keeps running."""
    class JobTeleported(Event):
        pass

    event = JobTeleported(event_id="x", type="JobTeleported", aggregate_id="j1", occurred_at=T0, producer="x")
    with caplog.at_level(logging.WARNING, logger="services.accounting.projection"):
        assert convert(event, 1) == [] and convert(event, 2) == []
    assert [r.getMessage() for r in caplog.records] == [
        "accounting has no projection for event type JobTeleported; skipping its events"]


def test_an_ignored_event_type_is_skipped_without_a_warning(caplog, monkeypatch):
    class JobWaved(Event):
        pass

    monkeypatch.setattr(projection, "IGNORED", (JobWaved,))
    event = JobWaved(event_id="y", type="JobWaved", aggregate_id="j1", occurred_at=T0, producer="x")
    with caplog.at_level(logging.WARNING, logger="services.accounting.projection"):
        assert convert(event, 1) == []
    assert caplog.records == []
