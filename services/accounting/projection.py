"""The pure converter: one event (and its stream sequence) -> the operations on the read models.

Operations are (statement name, arguments); :mod:`services.accounting.sink` owns the SQL. Event
types that change no read model are listed in ``IGNORED``; an unknown type is logged, not fatal,
so an older accounting keeps running beside a newer producer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from schemas import (
    ChargebackStatementIssued,
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
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeLost,
    NodeRegistered,
    NodeTelemetryReported,
    NodeUpdated,
    QueueConfigured,
    QueueDeleted,
    QuotaPendingReasonChanged,
    QuotaReleased,
    QuotaReserved,
    PreemptionRequested,
    PriceBookUpdated,
    ReclaimRequested,
    SchedulingPendingReasonChanged,
)


class Op(NamedTuple):
    statement: str
    args: tuple


IGNORED: tuple[type[Event], ...] = ()


def _state(job_id: str, state: str, seq: int, **columns) -> Op:
    """Set the job's state and the named timestamp/detail columns (in the statement sorted by
    name, whatever order they are given in)."""
    statement, order = _state_statement(tuple(columns))
    values = tuple(columns.values())
    return Op(statement, (job_id, state, seq, *[values[i] for i in order]))


@functools.lru_cache(maxsize=None)
def _state_statement(names: tuple[str, ...]) -> tuple[str, tuple[int, ...]]:
    """Once per call site: the statement, and where each sorted name is in ``names``."""
    order = tuple(sorted(range(len(names)), key=names.__getitem__))
    return "set_state:" + ",".join(names[i] for i in order), order


def _usage(event: JobSucceeded | JobFailed | JobPreempted | JobCancelled, seq: int) -> Op | None:
    if event.started_at is None or event.attempt is None:
        return None
    seconds = max(0.0, (event.occurred_at - event.started_at).total_seconds())
    return Op("usage", (event.aggregate_id, event.attempt, event.started_at, event.occurred_at, seconds, event.type, seq))


def _job_submitted(e: JobSubmitted, j: str, t, seq: int) -> list[Op]:
    s = e.spec
    return [Op("job_submitted", (j, s.team, s.project, s.queue, s.kind.value, s.priority_class, e.submitter, s.gpus,
                                 s.gang_size, s.total_gpus, t, seq, s.cpu_millis * s.gang_size,
                                 s.memory_mib * s.gang_size))]


def _ended(e: JobSucceeded | JobFailed | JobPreempted | JobCancelled, seq: int, state_op: Op) -> list[Op]:
    """An attempt's end: the job's new state, and the attempt's ledger row if it ran."""
    return [state_op, u] if (u := _usage(e, seq)) else [state_op]


def _succeeded(e: JobSucceeded, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _state(j, "succeeded", seq, finished_at=t, exit_code=0))


def _failed(e: JobFailed, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _state(j, "failed", seq, finished_at=t, reason=e.reason.value, message=e.message,
                                 exit_code=e.exit_code))


def _preempted(e: JobPreempted, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _state(j, "preempted", seq, reason="preempted", message=e.reason))


def _cancelled(e: JobCancelled, j: str, t, seq: int) -> list[Op]:
    return _ended(e, seq, _state(j, "cancelled", seq, finished_at=t, message=e.reason))


def _node(e: NodeRegistered | NodeUpdated, j: str, t, seq: int) -> list[Op]:
    n = e.node
    return [Op("node", (n.name, n.gpu_flavor, n.gpu_product, n.gpu_count, n.gpu_memory_mib, json.dumps(n.labels),
                        n.unschedulable, seq))]


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
    JobAdmitted: lambda e, j, t, seq: [_state(j, "queued", seq, admitted_at=t), Op("attempt_queued", (j, 1, t, seq))],
    QuotaPendingReasonChanged: lambda e, j, t, seq: [Op("wait_reason", (j, e.reason.value, e.message, seq))],
    SchedulingPendingReasonChanged: lambda e, j, t, seq: [Op("wait_reason", (j, e.reason.value, e.message, seq))],
    QuotaReserved: lambda e, j, t, seq: [
        _state(j, "reserved", seq, reserved_at=t, attempt=e.attempt, flavor=e.flavor, reason=None, message=None),
        Op("reservation", (j, e.attempt, e.queue, e.flavor, e.gpus, e.borrowed, t, seq))],
    QuotaReleased: lambda e, j, t, seq: [Op("reservation_released", (j, e.attempt, t, seq))],
    ReclaimRequested: lambda e, j, t, seq: [_state(j, "preempting", seq, message=e.message)],
    PreemptionRequested: lambda e, j, t, seq: [_state(j, "preempting", seq, message=e.message)],
    CohortConfigured: lambda e, j, t, seq: [Op("cohort", (e.name, e.parent, seq))],
    # placed: the last wait reason (quota's or the scheduler's) no longer applies
    JobScheduled: lambda e, j, t, seq: [_state(j, "scheduled", seq, scheduled_at=t, nodes=[p.node for p in e.placement],
                                               flavor=e.flavor, reason=None, message=None)],
    JobStarted: lambda e, j, t, seq: [_state(j, "running", seq, started_at=t)],
    JobSucceeded: _succeeded,
    JobFailed: _failed,
    JobPreempted: _preempted,
    JobRetryScheduled: lambda e, j, t, seq: [_state(j, "retrying", seq, attempt=e.next_attempt, finished_at=None),
                                             Op("attempt_queued", (j, e.next_attempt, t, seq))],
    JobCheckpointed: lambda e, j, t, seq: [Op("checkpoint", (j, e.attempt, e.checkpointed_at, seq))],
    JobCancelRequested: lambda e, j, t, seq: [_state(j, "cancelling", seq)],
    JobCancelled: _cancelled,
    NodeRegistered: _node,
    NodeUpdated: _node,
    NodeLost: lambda e, j, t, seq: [Op("node_lost", (e.name, seq))],
    NodeTelemetryReported: _telemetry,
    QueueConfigured: _queue,
    QueueDeleted: lambda e, j, t, seq: [Op("queue_deleted", (e.name, seq)), Op("quota_history", (e.name, None, t, "{}", seq))],
    PriceBookUpdated: _price_book,
    ChargebackStatementIssued: _statement,
}


def convert(event: Event, seq: int) -> list[Op]:
    converter = _CONVERTERS.get(type(event))
    if converter is not None:
        return converter(event, event.aggregate_id, event.occurred_at, seq)
    if isinstance(event, IGNORED):
        return []
    raise LookupError(f"accounting has no projection for event type {event.type}")
