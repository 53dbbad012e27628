"""gpusched event contract: the one thing every service shares.

Every fact in the platform is an immutable event on the JetStream stream ``GPUSCHED_EVENTS``.
Upstream systems send *commands* (``SubmitJob``, ``CancelJob``, ``ReportCheckpoint``) to the intake subjects; the
admission service turns them into events. Each event type has exactly one producing service
(``PRODUCERS`` in :mod:`schemas.registry`), and NATS permissions enforce it.

Job state machine (one job, many attempts; ``attempt`` starts at 1)::

    (SubmitJob) ──► Submitted ──► Rejected                                   [terminal]
                        │
                        ▼
                    Admitted ──► QuotaReserved ──► Scheduled ──► Running ──► Succeeded [terminal]
                        ▲            (queued)                       │
                        │                                           ├──► Failed ──► RetryScheduled ─┐
                        │                                           │      └── no attempts left     │
                        │                                           │          [terminal]           │
                        │                                           └──► Preempted ─────────────────┤
                        └───────────────────── requeued with attempt + 1 ◄──────────────────────────┘

    CancelRequested may arrive in any non-terminal state; it ends in Cancelled [terminal].

Events and their producers:

==========================  ===========  ====================================================
event                       producer     meaning
==========================  ===========  ====================================================
JobSubmitted                admission    a well-formed SubmitJob arrived (the spec, verbatim)
JobAdmitted                 admission    the spec is valid, the queue exists, the submitter may use it
JobRejected                 admission    refused; reason code, the field and the accepted values
JobCancelRequested          admission    a valid CancelJob for a known, unfinished job
JobCheckpointed             admission    a running attempt reported a checkpoint
QuotaReserved               quota        quota for one attempt is held (flavor, borrowed part)
QuotaReleased               quota        that quota is free again (attempt ended)
QuotaPendingReasonChanged   quota        why a queued attempt still waits (when that changes)
ReclaimRequested            quota        a borrowing attempt must give its quota back (preempted)
JobRetryScheduled           quota        a failed attempt will be retried as attempt + 1
JobScheduled                scheduler    placement of one attempt on nodes
PreemptionRequested         scheduler    evict a lower-priority attempt so a higher one fits
SchedulingPending...Changed scheduler    why an attempt holding quota is not placed (when that changes)
JobStarted                  executor     the attempt runs (the whole gang)
JobReady                    executor     a service's replica passed its readiness check
JobSucceeded                executor     the attempt exited 0
JobFailed                   executor     the attempt failed; classified reason, retryable or not
JobPreempted                executor     the attempt was stopped to make room; not a failure
JobCancelled                executor     the job was stopped or dropped on request
NodeRegistered/Updated/Lost executor     node inventory as the backend sees it
NodeTelemetryReported       executor     GPU utilization, memory, power of a node over a window (NVML)
QueueConfigured/Deleted     config       queue definitions (``gpusched apply``)
CohortConfigured            config       cohort definitions
PolicyConfigured            config       priority classes and the preemption rate limit in force
PriceBookUpdated            config       prices per GPU-hour per flavor from a time on (``gpusched prices``)
ChargebackStatementIssued   accounting   a period's chargeback totals, log range and checksum
ApiTokenIssued/Revoked      admin        an HTTP API token (its hash, role, team) issued or revoked
==========================  ===========  ====================================================

Evolution: a change that an old reader cannot parse is a new ``schema_version`` with an upcaster
in :mod:`schemas.registry`; a retired type name is never reused.
"""

from .accounting import (
    ChargebackStatementIssued,
    FlavorPrice,
    PriceBookUpdated,
    StatementLine,
)
from .auth import ApiTokenIssued, ApiTokenRevoked, Role
from .commands import CancelJob, ReportCheckpoint, SubmitJob
from .envelope import Event, new_event
from .job import (
    DatasetRef,
    FailureReason,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobFailed,
    JobKind,
    JobPreempted,
    JobRejected,
    JobRetryScheduled,
    JobScheduled,
    JobSpec,
    JobReady,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeAssignment,
    PreemptionRequested,
    QuotaPendingReasonChanged,
    QuotaReleased,
    QuotaReserved,
    QuotaWaitReason,
    ReclaimRequested,
    RejectReason,
    RetryPolicy,
    SchedulingPendingReasonChanged,
    SchedulingWaitReason,
)
from .node import ClusterLost, ClusterReported, GpuTelemetry, NodeLost, NodeRegistered, NodeTelemetryReported, NodeUpdated
from .notify import NotificationKind, NotifySpec, TeamConfigured, Webhook
from .priority import DEFAULT_PRIORITY_CLASSES, POLICY_ID, PolicyConfigured, PreemptionRateLimit, PriorityClass
from .queue import CohortConfigured, FlavorQuota, QueueConfigured, QueueDeleted
from .service import (
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
    ServiceSpec,
    ServiceUpdated,
)
from .registry import (
    ALL_EVENT_TYPES,
    PRODUCERS,
    AnyEvent,
    dumps,
    event_subject,
    parse_event,
    subject_suffix,
)

__all__ = [name for name in dir() if not name.startswith("_")]
