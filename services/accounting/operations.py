"""The read models' operations: what the converter (:mod:`.projection`) makes of an event, one
small named type per operation; the sink (:mod:`.sink`) owns the SQL each type is applied with
and the ledger (:mod:`.ledger`) reads the facts it needs from them by name.

Each type is a NamedTuple: as cheap to build as a tuple (the converter builds one or two per
event of every replay), compared by value in tests, and, for every operation but
:class:`SetJobState` and :class:`SetWaitReason` (folded into one job update per job by the
sink), its fields are the parameters of its statement in order, so that the sink passes it to
``executemany`` or COPY as it is. ``seq``: the stream sequence of the event the operation comes
from. Imports nothing of the project but the contract's job states.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, NamedTuple

from schemas.jobstate import JobState


# ---- jobs -------------------------------------------------------------------------------------

class InsertJob(NamedTuple):
    """A job's submission (JobSubmitted): its row, in state ``submitted``; the first stands."""
    job_id: str
    team: str
    project: str | None
    queue: str
    kind: str                  # JobKind's value
    priority_class: str
    submitter: str
    gpus_per_node: int
    gang_size: int
    total_gpus: int
    submitted_at: datetime
    seq: int
    cpu_millis: int | None     # the whole gang's (per replica × gang size)
    memory_mib: int | None     # the whole gang's
    gpu_milli: int | None      # thousandths of its one GPU each member asks for; None: whole GPUs


class RejectJob(NamedTuple):
    """Admission refused the job (JobRejected): its row in state ``rejected``."""
    job_id: str
    reason: str                # RejectReason's value
    message: str
    finished_at: datetime
    seq: int


class SetJobState(NamedTuple):
    """A job's state changed: the state, and the columns the change sets. The other columns keep
    their values."""
    job_id: str
    state: JobState
    seq: int
    columns: Mapping[str, Any]  # column -> new value; columns: services.accounting.sql.STATE_COLUMNS


class SetWaitReason(NamedTuple):
    """Why a job waits changed (quota's or the scheduler's pending reason); its state does not."""
    job_id: str
    reason: str                # the pending reason's value
    message: str
    seq: int


# ---- attempts ---------------------------------------------------------------------------------

class InsertAttempt(NamedTuple):
    """An attempt became eligible (admission, or a retry decision); the first stands."""
    job_id: str
    attempt: int
    queued_at: datetime
    seq: int


class InsertReservation(NamedTuple):
    """Quota reserved an attempt's GPUs (QuotaReserved); the first of an attempt stands."""
    job_id: str
    attempt: int
    queue: str                 # the queue whose quota holds it (a borrowing attempt: the lender's cohort's)
    flavor: str
    gpus: int                  # whole GPUs held
    borrowed: int              # of which borrowed, whole GPUs
    gpu_milli: int | None      # a fractional job's: thousandths held; None: whole GPUs
    borrowed_milli: int | None  # a fractional job's: thousandths borrowed
    reserved_at: datetime
    seq: int


class ReleaseReservation(NamedTuple):
    """Quota released an attempt's reservation (QuotaReleased); the first release stands."""
    job_id: str
    attempt: int
    released_at: datetime
    seq: int


class InsertCheckpoint(NamedTuple):
    """An attempt reported a checkpoint (JobCheckpointed)."""
    job_id: str
    attempt: int
    checkpointed_at: datetime  # when the checkpoint was taken (not when it was logged)
    seq: int


class AttemptEnded(NamedTuple):
    """An attempt that ran has ended (succeeded, failed, preempted, cancelled): the ledger
    computes its row (:func:`services.accounting.ledger.usage_row`); no statement of its own."""
    job_id: str
    attempt: int
    started_at: datetime
    ended_at: datetime
    seconds: float             # ended_at - started_at, never negative
    outcome: str               # the event type that ended it
    sequence: int


# ---- nodes and clusters -----------------------------------------------------------------------

class UpsertNode(NamedTuple):
    """A node registered or updated: its row, not lost."""
    name: str
    gpu_flavor: str | None
    gpu_product: str | None
    gpu_count: int
    gpu_memory_mib: int | None
    labels: str                # JSON object
    unschedulable: bool
    seq: int
    cluster: str | None


class MarkNodeLost(NamedTuple):
    """A node was lost (NodeLost)."""
    name: str
    seq: int


class MarkNodesLost(NamedTuple):
    """A lost cluster's nodes (ClusterLost)."""
    names: list[str]
    seq: int


class RecordClusterReport(NamedTuple):
    """A cluster reported (ClusterReported); a report newer than its loss brings it back."""
    name: str
    reported_at: datetime
    nodes: int
    seq: int


class MarkClusterLost(NamedTuple):
    """A cluster was lost (ClusterLost)."""
    name: str
    last_report: datetime      # the report the loss counted from (the event's time if none)
    lost_at: datetime
    reason: str
    seq: int


class InsertGpuTelemetry(NamedTuple):
    """One GPU's telemetry over one window; the first report of a window stands."""
    node: str
    gpu: int                   # the GPU's index on the node
    window_start: datetime
    window_end: datetime
    utilization: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    power_w: float | None
    samples: int
    allocated_samples: int     # samples taken while an attempt held the GPU
    allocated_utilization: float | None
    seq: int
    source: str = "nvml"       # NodeTelemetryReported.source: nvml (measured) or simulated (the sim executor)


# ---- queues, prices, teams, policy, tokens, statements ----------------------------------------

class UpsertCohort(NamedTuple):
    name: str
    parent: str | None
    seq: int


class UpsertQueue(NamedTuple):
    """A queue configured: its row, not deleted."""
    name: str
    cohort: str | None
    config: str                # the QueueConfigured event as JSON
    seq: int


class MarkQueueDeleted(NamedTuple):
    name: str
    seq: int


class InsertQuotaVersion(NamedTuple):
    """A queue's quota from a time on (what idle quota is charged by); the first of a time stands."""
    queue: str
    owner: str | None          # the team charged for its idle quota: the first allowed team; None when deleted
    effective_from: datetime
    quotas: str                # JSON object flavor -> nominal GPUs ("{}" when deleted)
    seq: int


class InsertPriceBook(NamedTuple):
    """A price book version; the first of a name and time stands."""
    name: str
    effective_from: datetime
    currency: str
    gpu_prices: str            # JSON object flavor -> price of a GPU-hour
    cpu_core_hour: float | None
    memory_gib_hour: float | None
    idle_quota: str            # how idle quota is charged
    seq: int


class UpsertTeam(NamedTuple):
    name: str
    notify: str                # the team's notification settings as JSON
    configured_at: datetime
    seq: int


class InsertPolicy(NamedTuple):
    """A policy version, keyed by its sequence."""
    seq: int
    configured_at: datetime
    priority_classes: str      # JSON array
    preemption: str            # JSON object


class InsertApiToken(NamedTuple):
    token_id: str
    name: str
    role: str                  # the role's value
    team: str | None
    token_hash: str
    issued_by: str
    issued_at: datetime
    expires_at: datetime | None
    seq: int


class RevokeApiToken(NamedTuple):
    """A token revoked; the first revocation stands. (No sequence: its row keeps the issue's.)"""
    token_id: str
    revoked_at: datetime
    revoked_by: str


class InsertStatement(NamedTuple):
    """A chargeback statement issued."""
    statement_id: str
    period: str
    group_by: str
    checksum: str
    first_sequence: int        # the log range the statement covers
    last_sequence: int
    total_cost: Decimal        # numeric in Postgres: money is never a binary float
    body: str                  # the statement's figures as JSON
    seq: int


# ---- services and replicas --------------------------------------------------------------------

class UpsertService(NamedTuple):
    """A service deployed (again): its row, not deleted, no scale request pending."""
    name: str
    team: str
    queue: str
    spec: str                  # ServiceSpec as JSON
    generation: int
    desired: int               # replicas
    deployed_by: str
    deployed_at: datetime
    seq: int


class UpdateService(NamedTuple):
    name: str
    spec: str                  # ServiceSpec as JSON
    generation: int
    desired: int
    updated_at: datetime
    seq: int


class RequestScale(NamedTuple):
    name: str
    replicas: int
    requested_by: str
    requested_at: datetime
    seq: int


class SetServiceScale(NamedTuple):
    """The service's replicas scaled to ``desired`` (ScaledTo)."""
    name: str
    desired: int
    seq: int


class SetServiceLoad(NamedTuple):
    name: str
    requests_per_second: float
    reported_at: datetime
    seq: int


class MarkServiceDeleted(NamedTuple):
    name: str
    deleted_at: datetime
    seq: int


class InsertReplica(NamedTuple):
    """A replica requested: its row, state ``requested``; the first stands."""
    job_id: str                # the replica's job
    service: str
    generation: int
    replica_index: int
    reason: str
    requested_at: datetime
    seq: int


class SetReplicaState(NamedTuple):
    """A replica's state changed (scheduled, ready, lost, replaced, retired); None keeps a value."""
    job_id: str
    state: str                 # a replica's state (not a job's)
    attempt: int | None
    nodes: list[str] | None
    reason: str | None
    changed_at: datetime
    seq: int


Operation = (InsertJob | RejectJob | SetJobState | SetWaitReason | InsertAttempt | InsertReservation
             | ReleaseReservation | InsertCheckpoint | AttemptEnded | UpsertNode | MarkNodeLost | MarkNodesLost
             | RecordClusterReport | MarkClusterLost | InsertGpuTelemetry | UpsertCohort | UpsertQueue
             | MarkQueueDeleted | InsertQuotaVersion | InsertPriceBook | UpsertTeam | InsertPolicy | InsertApiToken
             | RevokeApiToken | InsertStatement | UpsertService | UpdateService | RequestScale | SetServiceScale
             | SetServiceLoad | MarkServiceDeleted | InsertReplica | SetReplicaState)
"""Any operation."""
