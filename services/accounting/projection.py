"""The pure converter: one event (and its stream sequence) -> the operations on the read models.

Operations are the typed values of :mod:`services.accounting.operations`;
:mod:`services.accounting.sink` owns the SQL. A job's state comes from the contract's map
(:mod:`schemas.jobstate`). An attempt's end is :class:`~services.accounting.operations.AttemptEnded`:
the ledger row it gives is computed by :mod:`services.accounting.ledger` from the facts logged
before it. Event types that change no
read model are listed in ``IGNORED``; a type with neither a conversion nor a place in that list
is logged (once per type) and skipped, not fatal, so an older accounting keeps running beside a
newer producer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from schemas import (
    ChargebackStatementIssued,
    ClusterLost,
    ClusterReported,
    CohortConfigured,
    Event,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobFailed,
    JobPreempted,
    JobRejected,
    JobRetryScheduled,
    JobScheduled,
    JobReady,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeLost,
    NodeRegistered,
    NodeTelemetryReported,
    NodeUpdated,
    PolicyConfigured,
    ReplicaLost,
    ReplicaReady,
    ReplicaRequested,
    ReplicaRetired,
    ReplicaScheduled,
    ScaledTo,
    ScaleRequested,
    ServiceDeleted,
    ServiceDeployed,
    ServiceLoadReported,
    ServiceUpdated,
    QueueConfigured,
    QueueDeleted,
    QuotaPendingReasonChanged,
    QuotaReleased,
    QuotaReserved,
    PreemptionRequested,
    PriceBookUpdated,
    ReclaimRequested,
    SchedulingPendingReasonChanged,
    TeamConfigured,
    ApiTokenIssued,
    ApiTokenRevoked,
)
from schemas.jobstate import EVENT_STATES, JobState, retry_state
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
    Operation,
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


log = logging.getLogger(__name__)


IGNORED: tuple[type[Event], ...] = ()


def _state(event_type: type[Event]) -> JobState:
    """The state a job event of this type leads to (the contract's map)."""
    return EVENT_STATES[event_type.model_fields["type"].default]


_QUEUED = _state(JobAdmitted)
_RESERVED = _state(QuotaReserved)
_PREEMPTING = _state(PreemptionRequested)
_RECLAIMING = _state(ReclaimRequested)
_SCHEDULED = _state(JobScheduled)
_RUNNING = _state(JobStarted)
_SUCCEEDED = _state(JobSucceeded)
_FAILED = _state(JobFailed)
_PREEMPTED = _state(JobPreempted)
_CANCELLING = _state(JobCancelRequested)
_CANCELLED = _state(JobCancelled)
_PREEMPTED_REASON = "preempted"  # the reason code a preempted job's row gives (the event's reason: its message)


def _usage(event: JobSucceeded | JobFailed | JobPreempted | JobCancelled, seq: int) -> AttemptEnded | None:
    """An attempt that ran has ended."""
    if event.started_at is None or event.attempt is None:
        return None
    seconds = max(0.0, (event.occurred_at - event.started_at).total_seconds())
    return AttemptEnded(event.aggregate_id, event.attempt, event.started_at, event.occurred_at, seconds, event.type,
                        seq)


def _job_submitted(e: JobSubmitted, j: str, t, seq: int) -> list[Operation]:
    s = e.spec
    return [InsertJob(j, s.team, s.project, s.queue, s.kind.value, s.priority_class, e.submitter, s.gpus, s.gang_size,
                      s.total_gpus, t, seq, s.cpu_millis * s.gang_size, s.memory_mib * s.gang_size, s.gpu_milli)]


def _ended(e: JobSucceeded | JobFailed | JobPreempted | JobCancelled, seq: int,
           change: SetJobState) -> list[Operation]:
    """An attempt's end: the job's new state, and the attempt's end for the ledger if it ran."""
    return [change, u] if (u := _usage(e, seq)) else [change]


def _succeeded(e: JobSucceeded, j: str, t, seq: int) -> list[Operation]:
    return _ended(e, seq, SetJobState(j, _SUCCEEDED, seq, {"finished_at": t, "exit_code": 0}))


def _failed(e: JobFailed, j: str, t, seq: int) -> list[Operation]:
    return _ended(e, seq, SetJobState(j, _FAILED, seq, {"finished_at": t, "reason": e.reason.value,
                                                         "message": e.message, "exit_code": e.exit_code}))


def _preempted(e: JobPreempted, j: str, t, seq: int) -> list[Operation]:
    return _ended(e, seq, SetJobState(j, _PREEMPTED, seq, {"reason": _PREEMPTED_REASON, "message": e.reason}))


def _cancelled(e: JobCancelled, j: str, t, seq: int) -> list[Operation]:
    return _ended(e, seq, SetJobState(j, _CANCELLED, seq, {"finished_at": t, "message": e.reason}))


def _retry(e: JobRetryScheduled, j: str, t, seq: int) -> list[Operation]:
    """The next attempt decided: ``queued`` again after a preemption, ``retrying`` after a
    failure (:func:`schemas.jobstate.retry_state`), with the new attempt number."""
    return [SetJobState(j, retry_state(e.after or ""), seq, {"attempt": e.next_attempt, "finished_at": None}),
            InsertAttempt(j, e.next_attempt, t, seq)]


def _node(e: NodeRegistered | NodeUpdated, j: str, t, seq: int) -> list[Operation]:
    n = e.node
    return [UpsertNode(n.name, n.gpu_flavor, n.gpu_product, n.gpu_count, n.gpu_memory_mib, json.dumps(n.labels),
                       n.unschedulable, seq, n.cluster)]


def _cluster_lost(e: ClusterLost, j: str, t, seq: int) -> list[Operation]:
    return [MarkClusterLost(e.cluster, e.last_report or t, t, e.reason, seq), MarkNodesLost(list(e.nodes), seq)]


def _telemetry(e: NodeTelemetryReported, j: str, t, seq: int) -> list[Operation]:
    return [InsertGpuTelemetry(e.node, g.index, e.window_start, e.window_end, g.utilization, g.memory_used_mib,
                               g.memory_total_mib, g.power_w, g.samples, g.allocated_samples, g.allocated_utilization,
                               seq, e.source) for g in e.gpus]


def _queue(e: QueueConfigured, j: str, t, seq: int) -> list[Operation]:
    nominal = json.dumps({q.flavor: q.nominal for q in e.quotas}, sort_keys=True)
    owner = e.allowed_teams[0] if e.allowed_teams else None
    return [UpsertQueue(e.name, e.cohort, e.model_dump_json(), seq), InsertQuotaVersion(e.name, owner, t, nominal, seq)]


def _price_book(e: PriceBookUpdated, j: str, t, seq: int) -> list[Operation]:
    prices = json.dumps({p.flavor: p.gpu_hour for p in e.gpu_prices}, sort_keys=True)
    return [InsertPriceBook(e.name, e.effective_from, e.currency, prices, e.cpu_core_hour, e.memory_gib_hour,
                            e.idle_quota, seq)]


def _policy(e: PolicyConfigured, j: str, t, seq: int) -> list[Operation]:
    classes = json.dumps([pc.model_dump(mode="json") for pc in e.priority_classes])
    return [InsertPolicy(seq, t, classes, e.preemption.model_dump_json())]


def _service_deployed(e: ServiceDeployed, j: str, t, seq: int) -> list[Operation]:
    s = e.spec
    return [UpsertService(j, s.team, s.queue, s.model_dump_json(), e.generation, s.replicas.desired, e.deployed_by, t,
                          seq)]


def _replica(state: str) -> Callable[..., list[Operation]]:
    """A replica's change (``state``: a replica's, not a job's). A lost replica whose job will
    not run again is ``replaced``."""
    def convert(e, j: str, t, seq: int) -> list[Operation]:
        nodes = list(e.nodes) if isinstance(e, ReplicaScheduled) else None
        now = "replaced" if getattr(e, "replaced", False) else state
        return [SetReplicaState(e.job_id, now, getattr(e, "attempt", None), nodes, getattr(e, "reason", None), t, seq)]
    return convert


def _token(e: ApiTokenIssued, j: str, t, seq: int) -> list[Operation]:
    return [InsertApiToken(e.token_id, e.name, e.role.value, e.team, e.token_hash, e.issued_by, t, e.expires_at, seq)]


def _statement(e: ChargebackStatementIssued, j: str, t, seq: int) -> list[Operation]:
    body = e.model_dump_json(include={"period", "group_by", "currency", "minor_unit", "idle_quota", "items",
                                      "adjustments", "lines", "total_gpu_hours", "total_cost", "checksum_alg"})
    return [InsertStatement(j, e.period, e.group_by, e.checksum, e.first_sequence, e.last_sequence,
                            Decimal(e.total_cost), body, seq)]


# event type -> (event, aggregate id, occurred_at, sequence) -> operations. A table, not a chain
# of isinstance checks: this runs once per event of every replay.
_CONVERTERS: dict[type[Event], Callable[[Any, str, Any, int], list[Operation]]] = {
    JobSubmitted: _job_submitted,
    JobRejected: lambda e, j, t, seq: [RejectJob(j, e.reason.value, e.message, t, seq)],
    JobAdmitted: lambda e, j, t, seq: [SetJobState(j, _QUEUED, seq, {"admitted_at": t}), InsertAttempt(j, 1, t, seq)],
    QuotaPendingReasonChanged: lambda e, j, t, seq: [SetWaitReason(j, e.reason.value, e.message, seq)],
    SchedulingPendingReasonChanged: lambda e, j, t, seq: [SetWaitReason(j, e.reason.value, e.message, seq)],
    QuotaReserved: lambda e, j, t, seq: [
        SetJobState(j, _RESERVED, seq, {"reserved_at": t, "attempt": e.attempt, "flavor": e.flavor, "reason": None,
                                        "message": None}),
        InsertReservation(j, e.attempt, e.queue, e.flavor, e.gpus, e.borrowed, e.gpu_milli, e.borrowed_milli, t, seq)],
    QuotaReleased: lambda e, j, t, seq: [ReleaseReservation(j, e.attempt, t, seq)],
    ReclaimRequested: lambda e, j, t, seq: [SetJobState(j, _RECLAIMING, seq, {"message": e.message})],
    PreemptionRequested: lambda e, j, t, seq: [SetJobState(j, _PREEMPTING, seq, {"message": e.message})],
    CohortConfigured: lambda e, j, t, seq: [UpsertCohort(e.name, e.parent, seq)],
    # placed: the last wait reason (quota's or the scheduler's) no longer applies
    JobScheduled: lambda e, j, t, seq: [SetJobState(j, _SCHEDULED, seq, {
        "scheduled_at": t, "nodes": [p.node for p in e.placement], "flavor": e.flavor, "reason": None,
        "message": None})],
    JobStarted: lambda e, j, t, seq: [SetJobState(j, _RUNNING, seq, {"started_at": t})],
    JobReady: lambda e, j, t, seq: [],  # a replica's: the service's ReplicaReady is what the read models keep
    JobSucceeded: _succeeded,
    JobFailed: _failed,
    JobPreempted: _preempted,
    JobRetryScheduled: _retry,
    JobCheckpointed: lambda e, j, t, seq: [InsertCheckpoint(j, e.attempt, e.checkpointed_at, seq)],
    JobCancelRequested: lambda e, j, t, seq: [SetJobState(j, _CANCELLING, seq, {})],
    JobCancelled: _cancelled,
    NodeRegistered: _node,
    NodeUpdated: _node,
    NodeLost: lambda e, j, t, seq: [MarkNodeLost(e.name, seq)],
    NodeTelemetryReported: _telemetry,
    ClusterReported: lambda e, j, t, seq: [RecordClusterReport(e.cluster, t, e.nodes, seq)],
    ClusterLost: _cluster_lost,
    QueueConfigured: _queue,
    QueueDeleted: lambda e, j, t, seq: [MarkQueueDeleted(e.name, seq), InsertQuotaVersion(e.name, None, t, "{}", seq)],
    PriceBookUpdated: _price_book,
    ChargebackStatementIssued: _statement,
    TeamConfigured: lambda e, j, t, seq: [UpsertTeam(e.name, e.notify.model_dump_json(), t, seq)],
    PolicyConfigured: _policy,
    ApiTokenIssued: _token,
    ApiTokenRevoked: lambda e, j, t, seq: [RevokeApiToken(e.token_id, t, e.revoked_by)],
    ServiceDeployed: _service_deployed,
    ServiceUpdated: lambda e, j, t, seq: [
        UpdateService(j, e.spec.model_dump_json(), e.generation, e.spec.replicas.desired, t, seq)],
    ScaleRequested: lambda e, j, t, seq: [RequestScale(j, e.replicas, e.requested_by, t, seq)],
    ScaledTo: lambda e, j, t, seq: [SetServiceScale(j, e.replicas, seq)],
    ServiceLoadReported: lambda e, j, t, seq: [SetServiceLoad(j, e.requests_per_second, t, seq)],
    ServiceDeleted: lambda e, j, t, seq: [MarkServiceDeleted(j, t, seq)],
    ReplicaRequested: lambda e, j, t, seq: [InsertReplica(e.job_id, j, e.generation, e.index, e.reason, t, seq)],
    ReplicaScheduled: _replica("scheduled"),
    ReplicaReady: _replica("ready"),
    ReplicaLost: _replica("lost"),
    ReplicaRetired: _replica("retired"),
}


_warned: set[str] = set()  # unknown types already logged


def convert(event: Event, seq: int) -> list[Operation]:
    converter = _CONVERTERS.get(type(event))
    if converter is not None:
        return converter(event, event.aggregate_id, event.occurred_at, seq)
    if not isinstance(event, IGNORED) and event.type not in _warned:
        _warned.add(event.type)
        log.warning("accounting has no projection for event type %s; skipping its events", event.type,
                    extra={"type": event.type, "sequence": seq})
    return []
