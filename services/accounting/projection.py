"""The pure converter: one event (and its stream sequence) -> the operations on the read models.

Operations are (statement name, arguments); :mod:`services.accounting.sink` owns the SQL. An
attempt's end is ``attempt_ended``: the ledger row it gives is computed by
:mod:`services.accounting.ledger` from the facts logged before it. Event types that change no
read model are listed in ``IGNORED``; a type with neither a conversion nor a place in that list
is logged (once per type) and skipped, not fatal, so an older accounting keeps running beside a
newer producer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

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


log = logging.getLogger(__name__)


class Op(NamedTuple):
    statement: str
    args: tuple


IGNORED: tuple[type[Event], ...] = ()


def _change(state: str, *columns: str) -> Callable[..., Op]:
    """A job change, built once per call site: ``(job id, sequence, *values of columns) -> Op``
    that sets the job's state and the named timestamp/detail columns (the statement names them
    sorted, whatever order they are given in). Replays run it for most events: no per-call
    sorting or keyword dicts."""
    order = sorted(range(len(columns)), key=columns.__getitem__)
    statement = "set_state:" + ",".join(columns[i] for i in order)
    if order == list(range(len(columns))):
        return lambda job_id, seq, *values: Op(statement, (job_id, state, seq, *values))
    return lambda job_id, seq, *values: Op(statement, (job_id, state, seq, *[values[i] for i in order]))


_QUEUED = _change("queued", "admitted_at")
_RESERVED = _change("reserved", "reserved_at", "attempt", "flavor", "reason", "message")
_PREEMPTING = _change("preempting", "message")
_SCHEDULED = _change("scheduled", "scheduled_at", "nodes", "flavor", "reason", "message")
_RUNNING = _change("running", "started_at")
_SUCCEEDED = _change("succeeded", "finished_at", "exit_code")
_FAILED = _change("failed", "finished_at", "reason", "message", "exit_code")
_PREEMPTED = _change("preempted", "reason", "message")
_CANCELLED = _change("cancelled", "finished_at", "message")
_RETRYING = _change("retrying", "attempt", "finished_at")
_REQUEUED = _change("preempted", "attempt", "finished_at")  # preempted, queued again for its next attempt
_CANCELLING = _change("cancelling")


def _usage(event: JobSucceeded | JobFailed | JobPreempted | JobCancelled, seq: int) -> Op | None:
    """An attempt that ran has ended: (job, attempt, started_at, ended_at, seconds, outcome, seq)."""
    if event.started_at is None or event.attempt is None:
        return None
    seconds = max(0.0, (event.occurred_at - event.started_at).total_seconds())
    return Op("attempt_ended", (event.aggregate_id, event.attempt, event.started_at, event.occurred_at, seconds,
                                event.type, seq))


def _job_submitted(e: JobSubmitted, j: str, t, seq: int) -> list[Op]:
    s = e.spec
    return [Op("job_submitted", (j, s.team, s.project, s.queue, s.kind.value, s.priority_class, e.submitter, s.gpus,
                                 s.gang_size, s.total_gpus, t, seq, s.cpu_millis * s.gang_size,
                                 s.memory_mib * s.gang_size, s.gpu_milli))]


def _ended(e: JobSucceeded | JobFailed | JobPreempted | JobCancelled, seq: int, state_op: Op) -> list[Op]:
    """An attempt's end: the job's new state, and the attempt's ledger row if it ran."""
    return [state_op, u] if (u := _usage(e, seq)) else [state_op]


def _succeeded(e: JobSucceeded, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _SUCCEEDED(j, seq, t, 0))


def _failed(e: JobFailed, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _FAILED(j, seq, t, e.reason.value, e.message, e.exit_code))


def _preempted(e: JobPreempted, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _PREEMPTED(j, seq, "preempted", e.reason))


def _cancelled(e: JobCancelled, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _CANCELLED(j, seq, t, e.reason))


def _node(e: NodeRegistered | NodeUpdated, j: str, t, seq: int) -> list[Op]:
    n = e.node
    return [Op("node", (n.name, n.gpu_flavor, n.gpu_product, n.gpu_count, n.gpu_memory_mib, json.dumps(n.labels),
                        n.unschedulable, seq, n.cluster))]


def _cluster_lost(e: ClusterLost, j: str, t, seq: int) -> list[Op]:
    return [Op("cluster_lost", (e.cluster, e.last_report or t, t, e.reason, seq)),
            Op("nodes_lost", (list(e.nodes), seq))]


def _telemetry(e: NodeTelemetryReported, j: str, t, seq: int) -> list[Op]:
    return [Op("gpu_telemetry", (e.node, g.index, e.window_start, e.window_end, g.utilization, g.memory_used_mib,
                                 g.memory_total_mib, g.power_w, g.samples, g.allocated_samples, g.allocated_utilization,
                                 seq)) for g in e.gpus]


def _queue(e: QueueConfigured, j: str, t, seq: int) -> list[Op]:
    nominal = json.dumps({q.flavor: q.nominal for q in e.quotas}, sort_keys=True)
    owner = e.allowed_teams[0] if e.allowed_teams else None
    return [Op("queue", (e.name, e.cohort, e.model_dump_json(), seq)), Op("quota_history", (e.name, owner, t, nominal, seq))]


def _price_book(e: PriceBookUpdated, j: str, t, seq: int) -> list[Op]:
    prices = json.dumps({p.flavor: p.gpu_hour for p in e.gpu_prices}, sort_keys=True)
    return [Op("price_book", (e.name, e.effective_from, e.currency, prices, e.cpu_core_hour, e.memory_gib_hour,
                              e.idle_quota, seq))]


def _team(e: TeamConfigured, j: str, t, seq: int) -> list[Op]:
    return [Op("team", (e.name, e.notify.model_dump_json(), t, seq))]


def _policy(e: PolicyConfigured, j: str, t, seq: int) -> list[Op]:
    classes = json.dumps([pc.model_dump(mode="json") for pc in e.priority_classes])
    return [Op("policy", (seq, t, classes, e.preemption.model_dump_json()))]


def _service_deployed(e: ServiceDeployed, j: str, t, seq: int) -> list[Op]:
    s = e.spec
    return [Op("service_deployed", (j, s.team, s.queue, s.model_dump_json(), e.generation, s.replicas.desired,
                                    e.deployed_by, t, seq))]


def _replica(state: str) -> Callable[..., list[Op]]:
    """A replica's change: (job, state, attempt, nodes, reason, time, sequence). A lost replica
    whose job will not run again is ``replaced``."""
    def convert(e, j: str, t, seq: int) -> list[Op]:
        nodes = list(e.nodes) if isinstance(e, ReplicaScheduled) else None
        now = "replaced" if getattr(e, "replaced", False) else state
        return [Op("replica_state", (e.job_id, now, getattr(e, "attempt", None), nodes, getattr(e, "reason", None),
                                     t, seq))]
    return convert


def _token(e: ApiTokenIssued, j: str, t, seq: int) -> list[Op]:
    return [Op("api_token", (e.token_id, e.name, e.role.value, e.team, e.token_hash, e.issued_by, t, e.expires_at, seq))]


def _statement(e: ChargebackStatementIssued, j: str, t, seq: int) -> list[Op]:
    body = e.model_dump_json(include={"period", "group_by", "currency", "idle_quota", "lines", "total_gpu_seconds",
                                      "total_cost"})
    return [Op("statement", (j, e.period, e.group_by, e.checksum, e.first_sequence, e.last_sequence, e.total_cost,
                             body, seq))]


# event type -> (event, aggregate id, occurred_at, sequence) -> operations. A table, not a chain
# of isinstance checks: this runs once per event of every replay.
_CONVERTERS: dict[type[Event], Callable[[Any, str, Any, int], list[Op]]] = {
    JobSubmitted: _job_submitted,
    JobRejected: lambda e, j, t, seq: [Op("job_rejected", (j, e.reason.value, e.message, t, seq))],
    JobAdmitted: lambda e, j, t, seq: [_QUEUED(j, seq, t), Op("attempt_queued", (j, 1, t, seq))],
    QuotaPendingReasonChanged: lambda e, j, t, seq: [Op("wait_reason", (j, e.reason.value, e.message, seq))],
    SchedulingPendingReasonChanged: lambda e, j, t, seq: [Op("wait_reason", (j, e.reason.value, e.message, seq))],
    QuotaReserved: lambda e, j, t, seq: [
        _RESERVED(j, seq, t, e.attempt, e.flavor, None, None),
        Op("reservation", (j, e.attempt, e.queue, e.flavor, e.gpus, e.borrowed, e.gpu_milli, e.borrowed_milli, t, seq))],
    QuotaReleased: lambda e, j, t, seq: [Op("reservation_released", (j, e.attempt, t, seq))],
    ReclaimRequested: lambda e, j, t, seq: [_PREEMPTING(j, seq, e.message)],
    PreemptionRequested: lambda e, j, t, seq: [_PREEMPTING(j, seq, e.message)],
    CohortConfigured: lambda e, j, t, seq: [Op("cohort", (e.name, e.parent, seq))],
    # placed: the last wait reason (quota's or the scheduler's) no longer applies
    JobScheduled: lambda e, j, t, seq: [_SCHEDULED(j, seq, t, [p.node for p in e.placement], e.flavor, None, None)],
    JobStarted: lambda e, j, t, seq: [_RUNNING(j, seq, t)],
    JobReady: lambda e, j, t, seq: [],  # a replica's: the service's ReplicaReady is what the read models keep
    JobSucceeded: _succeeded,
    JobFailed: _failed,
    JobPreempted: _preempted,
    JobRetryScheduled: lambda e, j, t, seq: [
        (_REQUEUED if e.after == "JobPreempted" else _RETRYING)(j, seq, e.next_attempt, None),
        Op("attempt_queued", (j, e.next_attempt, t, seq))],
    JobCheckpointed: lambda e, j, t, seq: [Op("checkpoint", (j, e.attempt, e.checkpointed_at, seq))],
    JobCancelRequested: lambda e, j, t, seq: [_CANCELLING(j, seq)],
    JobCancelled: _cancelled,
    NodeRegistered: _node,
    NodeUpdated: _node,
    NodeLost: lambda e, j, t, seq: [Op("node_lost", (e.name, seq))],
    NodeTelemetryReported: _telemetry,
    ClusterReported: lambda e, j, t, seq: [Op("cluster_reported", (e.cluster, t, e.nodes, seq))],
    ClusterLost: _cluster_lost,
    QueueConfigured: _queue,
    QueueDeleted: lambda e, j, t, seq: [Op("queue_deleted", (e.name, seq)), Op("quota_history", (e.name, None, t, "{}", seq))],
    PriceBookUpdated: _price_book,
    ChargebackStatementIssued: _statement,
    TeamConfigured: _team,
    PolicyConfigured: _policy,
    ApiTokenIssued: _token,
    ApiTokenRevoked: lambda e, j, t, seq: [Op("api_token_revoked", (e.token_id, t, e.revoked_by))],
    ServiceDeployed: _service_deployed,
    ServiceUpdated: lambda e, j, t, seq: [
        Op("service_updated", (j, e.spec.model_dump_json(), e.generation, e.spec.replicas.desired, t, seq))],
    ScaleRequested: lambda e, j, t, seq: [Op("service_scale_requested", (j, e.replicas, e.requested_by, t, seq))],
    ScaledTo: lambda e, j, t, seq: [Op("service_scaled", (j, e.replicas, seq))],
    ServiceLoadReported: lambda e, j, t, seq: [Op("service_load", (j, e.requests_per_second, t, seq))],
    ServiceDeleted: lambda e, j, t, seq: [Op("service_deleted", (j, t, seq))],
    ReplicaRequested: lambda e, j, t, seq: [
        Op("replica_requested", (e.job_id, j, e.generation, e.index, e.reason, t, seq))],
    ReplicaScheduled: _replica("scheduled"),
    ReplicaReady: _replica("ready"),
    ReplicaLost: _replica("lost"),
    ReplicaRetired: _replica("retired"),
}


_warned: set[str] = set()  # unknown types already logged


def convert(event: Event, seq: int) -> list[Op]:
    converter = _CONVERTERS.get(type(event))
    if converter is not None:
        return converter(event, event.aggregate_id, event.occurred_at, seq)
    if not isinstance(event, IGNORED) and event.type not in _warned:
        _warned.add(event.type)
        log.warning("accounting has no projection for event type %s; skipping its events", event.type,
                    extra={"type": event.type, "sequence": seq})
    return []
