"""The pure converter: one event (and its stream sequence) -> the operations on the read models.

Operations are (statement name, arguments); :mod:`services.accounting.sink` owns the SQL. Event
types that change no read model are listed in ``IGNORED``; an unknown type is logged, not fatal,
so an older accounting keeps running beside a newer producer.
"""

from __future__ import annotations

import json
from typing import NamedTuple

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
    """Set the job's state and the named timestamp/detail columns."""
    names = tuple(sorted(columns))
    return Op("set_state:" + ",".join(names), (job_id, state, seq, *(columns[n] for n in names)))


def _usage(event: JobSucceeded | JobFailed | JobPreempted | JobCancelled, seq: int) -> Op | None:
    if event.started_at is None or event.attempt is None:
        return None
    seconds = max(0.0, (event.occurred_at - event.started_at).total_seconds())
    return Op("usage", (event.aggregate_id, event.attempt, event.started_at, event.occurred_at, seconds, event.type, seq))


def convert(event: Event, seq: int) -> list[Op]:
    j = event.aggregate_id
    t = event.occurred_at
    match event:
        case JobSubmitted():
            s = event.spec
            return [Op("job_submitted", (j, s.team, s.project, s.queue, s.kind.value, s.priority_class,
                                         event.submitter, s.gpus, s.gang_size, s.total_gpus, t, seq,
                                         s.cpu_millis * s.gang_size, s.memory_mib * s.gang_size))]
        case JobRejected():
            return [Op("job_rejected", (j, event.reason.value, event.message, t, seq))]
        case JobAdmitted():
            return [_state(j, "queued", seq, admitted_at=t), Op("attempt_queued", (j, 1, t, seq))]
        case QuotaPendingReasonChanged() | SchedulingPendingReasonChanged():
            return [Op("wait_reason", (j, event.reason.value, event.message, seq))]
        case QuotaReserved():
            return [_state(j, "reserved", seq, reserved_at=t, attempt=event.attempt, flavor=event.flavor,
                           reason=None, message=None),
                    Op("reservation", (j, event.attempt, event.queue, event.flavor, event.gpus, event.borrowed, t, seq))]
        case QuotaReleased():
            return [Op("reservation_released", (j, event.attempt, t, seq))]
        case ReclaimRequested() | PreemptionRequested():
            return [_state(j, "preempting", seq, message=event.message)]
        case CohortConfigured():
            return [Op("cohort", (event.name, event.parent, seq))]
        case JobScheduled():
            nodes = [p.node for p in event.placement]
            # placed: the last wait reason (quota's or the scheduler's) no longer applies
            return [_state(j, "scheduled", seq, scheduled_at=t, nodes=nodes, flavor=event.flavor,
                           reason=None, message=None)]
        case JobStarted():
            return [_state(j, "running", seq, started_at=t)]
        case JobSucceeded():
            return [_state(j, "succeeded", seq, finished_at=t, exit_code=0), _usage(event, seq)]
        case JobFailed():
            ops = [_state(j, "failed", seq, finished_at=t, reason=event.reason.value, message=event.message,
                          exit_code=event.exit_code)]
            return ops + [u] if (u := _usage(event, seq)) else ops
        case JobPreempted():
            ops = [_state(j, "preempted", seq, reason="preempted", message=event.reason)]
            return ops + [u] if (u := _usage(event, seq)) else ops
        case JobRetryScheduled():
            return [_state(j, "retrying", seq, attempt=event.next_attempt, finished_at=None),
                    Op("attempt_queued", (j, event.next_attempt, t, seq))]
        case JobCheckpointed():
            return [Op("checkpoint", (j, event.attempt, event.checkpointed_at, seq))]
        case JobCancelRequested():
            return [_state(j, "cancelling", seq)]
        case JobCancelled():
            ops = [_state(j, "cancelled", seq, finished_at=t, message=event.reason)]
            return ops + [u] if (u := _usage(event, seq)) else ops
        case NodeRegistered() | NodeUpdated():
            n = event.node
            return [Op("node", (n.name, n.gpu_flavor, n.gpu_product, n.gpu_count, n.gpu_memory_mib,
                                json.dumps(n.labels), n.unschedulable, seq))]
        case NodeLost():
            return [Op("node_lost", (event.name, seq))]
        case NodeTelemetryReported():
            return [Op("gpu_telemetry", (event.node, g.index, event.window_start, event.window_end, g.utilization,
                                         g.memory_used_mib, g.memory_total_mib, g.power_w, g.samples,
                                         g.allocated_samples, g.allocated_utilization, seq)) for g in event.gpus]
        case QueueConfigured():
            nominal = json.dumps({q.flavor: q.nominal for q in event.quotas}, sort_keys=True)
            owner = event.allowed_teams[0] if event.allowed_teams else None
            return [Op("queue", (event.name, event.cohort, event.model_dump_json(), seq)),
                    Op("quota_history", (event.name, owner, t, nominal, seq))]
        case QueueDeleted():
            return [Op("queue_deleted", (event.name, seq)), Op("quota_history", (event.name, None, t, "{}", seq))]
        case PriceBookUpdated():
            prices = json.dumps({p.flavor: p.gpu_hour for p in event.gpu_prices}, sort_keys=True)
            return [Op("price_book", (event.name, event.effective_from, event.currency, prices, event.cpu_core_hour,
                                      event.memory_gib_hour, event.idle_quota, seq))]
        case ChargebackStatementIssued():
            body = event.model_dump_json(include={"period", "group_by", "currency", "idle_quota", "lines",
                                                  "total_gpu_seconds", "total_cost"})
            return [Op("statement", (j, event.period, event.group_by, event.checksum, event.first_sequence,
                                     event.last_sequence, event.total_cost, body, seq))]
        case _ if isinstance(event, IGNORED):
            return []
    raise LookupError(f"accounting has no projection for event type {event.type}")
