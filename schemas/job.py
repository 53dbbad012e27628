"""Job spec and job lifecycle events (subjects ``gpusched.job.<job_id>.<suffix>``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from .envelope import NAME_PATTERN, Contract, Event, Timestamp
from .notify import NotifySpec

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]

TOLERATION_PATTERN = (
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
    r"(=([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?)?(:(NoSchedule|PreferNoSchedule|NoExecute))?$"
)
"""A toleration: ``key``, ``key=value`` or ``key=value:Effect`` (Kubernetes label key and value;
Effect NoSchedule, PreferNoSchedule or NoExecute)."""

GPU_MODEL_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,126}[A-Za-z0-9])?$"
"""A GPU model as nodes report it (a Kubernetes label value, e.g. ``NVIDIA-A100-SXM4-80GB``)."""

MAX_GPUS_PER_NODE = 64
"""No GPU node built today has more; a larger per-node request is a typo, not a job."""
MAX_GANG_SIZE = 1024


class JobKind(StrEnum):
    """What the job is for; drives defaults such as priority class and preemptibility."""

    TRAINING = "training"
    INFERENCE = "inference"
    EVALUATION = "evaluation"
    BATCH = "batch"


class FailureReason(StrEnum):
    """Classified cause of a failed attempt."""

    EXIT_CODE = "exit-code"  # the process exited non-zero
    OOM_KILLED = "oom-killed"
    IMAGE_PULL = "image-pull"
    DEADLINE_EXCEEDED = "deadline-exceeded"  # ran past max_runtime_seconds
    NODE_LOST = "node-lost"
    EVICTED = "evicted"
    BACKEND_ERROR = "backend-error"  # the executor could not create or observe the job


class RejectReason(StrEnum):
    """Machine-readable reason codes of JobRejected."""

    SCHEMA_INVALID = "schema-invalid"
    PAYLOAD_TOO_LARGE = "payload-too-large"
    UNKNOWN_QUEUE = "unknown-queue"
    FORBIDDEN = "forbidden"  # the submitter may not use the queue or priority class
    UNKNOWN_FLAVOR = "unknown-flavor"
    UNSATISFIABLE = "unsatisfiable"  # no node in the inventory could ever host it
    DUPLICATE_IDEMPOTENCY_KEY = "duplicate-idempotency-key"
    DUPLICATE_JOB_ID = "duplicate-job-id"


def rejection_id(intake_sequence: int) -> str:
    """Aggregate id of a rejection that cannot be filed under a fresh job id (malformed command,
    duplicate id or key): derived from the command's intake sequence, so a publisher that knows
    the sequence from its publish ack can watch ``gpusched.job.<rejection_id>.rejected``."""
    return f"rejected-{intake_sequence}"


class QuotaWaitReason(StrEnum):
    """Why a queued attempt does not hold quota yet (QuotaPendingReasonChanged.reason)."""

    NOMINAL_EXHAUSTED = "nominal-exhausted"  # the queue's own quota is used and it has no cohort
    BORROWING_LIMIT = "borrowing-limit"  # borrowing it would exceed the queue's borrowing limit
    COHORT_EXHAUSTED = "cohort-exhausted"  # the cohort has no unused quota that may be lent
    NOMINAL_LENT = "nominal-lent"  # its own unused quota is lent to borrowers (reclaim applies)
    BLOCKED_BY_HEAD = "blocked-by-head"  # behind a refused head: of a strict-FIFO queue, or of a higher priority
    BUDGET_EXHAUSTED = "budget-exhausted"  # the queue's GPU-hour budget for this period is spent
    WEIGHTED_LIMIT = "weighted-limit"  # it would take the queue over its weighted limit
    CLASS_LIMIT = "class-limit"  # it would take its priority class over the class's share of the queue
    RETRY_BACKOFF = "retry-backoff"  # a retry waiting out its backoff
    QUEUE_MISSING = "queue-missing"  # the queue was deleted after admission
    NO_QUOTA_FOR_FLAVOR = "no-quota-for-flavor"  # none of the job's flavors has quota in the queue


class SchedulingWaitReason(StrEnum):
    """Why an attempt that holds quota is not placed yet (SchedulingPendingReasonChanged.reason)."""

    NO_NODE_OF_SHAPE = "no-node-of-shape"  # no schedulable node could ever host one member
    INSUFFICIENT_GPUS = "insufficient-gpus"  # fewer free GPUs of the flavor than requested, in all
    FRAGMENTATION = "fragmentation"  # enough free GPUs in all, but no node (or not enough nodes) has the block
    GANG_INCOMPLETE = "gang-incomplete"  # fewer nodes with the member's block free than gang_size
    CPU_MEMORY = "cpu-memory"  # GPUs are free, but not the CPU or memory beside them
    PREEMPTING = "preempting"  # lower-priority attempts are being stopped to make room for it


class DatasetRef(Contract):
    """A dataset the job reads."""

    uri: str = Field(min_length=1, max_length=1024, description="e.g. s3://bucket/prefix or pvc://name")
    locality_hint: str | None = Field(
        default=None, max_length=253, description="Node label value where the data is local or cached."
    )


class RetryPolicy(Contract):
    """How the platform retries failed attempts (Kubernetes backoffLimit is always 0)."""

    max_attempts: int = Field(default=1, ge=1, le=20, description="Attempts in all, the first included.")
    backoff_seconds: float = Field(default=30.0, ge=0, le=86_400, description="Wait before each retry.")
    retry_on: tuple[FailureReason, ...] = Field(
        default=(FailureReason.NODE_LOST, FailureReason.EVICTED, FailureReason.BACKEND_ERROR),
        description="Failure reasons that are retried; others end the job.",
    )
    backoff_factor: float = Field(
        default=1.0, ge=1.0, le=10.0,
        description="Exponential backoff: retry n waits backoff_seconds × backoff_factor^(n−1); 1: constant.",
    )
    max_backoff_seconds: float = Field(default=86_400, ge=0, le=86_400, description="Cap of the backoff.")

    def retries(self, reason: FailureReason, retryable: bool, failures: int) -> bool:
        """Whether a failed attempt is followed by another: the executor found it retryable, its
        reason is in ``retry_on`` and attempts are left (``failures`` counts this one). Quota
        decides retries by it; admission knows by it that a job has ended."""
        return retryable and reason in self.retry_on and failures < self.max_attempts

    def backoff_for(self, failures: int) -> float:
        """Seconds to wait before the retry that follows the ``failures``-th failure (1-based)."""
        return min(self.max_backoff_seconds, self.backoff_seconds * self.backoff_factor ** max(0, failures - 1))


class JobSpec(Contract):
    """What a team asks for. Resources are per node; the gang multiplies them."""

    # The cross-field rule JSON Schema can state (the models' validators below hold it too).
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"gpu_milli": {"type": "integer"}}, "required": ["gpu_milli"]},
        "then": {"properties": {"gpus": {"const": 1}}, "required": ["gpus"]},
    })

    kind: JobKind = Field(description="training, inference, evaluation or batch")
    queue: Name = Field(description="Queue to submit to")
    team: Name = Field(description="Owning team (chargeback)")
    project: Name | None = Field(default=None, description="Project within the team (chargeback)")
    priority_class: Name = Field(default="training", description="One of the configured priority classes")
    image: str = Field(min_length=1, max_length=512, description="Container image")
    command: tuple[Annotated[str, StringConstraints(max_length=4096)], ...] = Field(
        default=(), max_length=64, description="Entrypoint"
    )
    args: tuple[Annotated[str, StringConstraints(max_length=4096)], ...] = Field(default=(), max_length=256)
    env: dict[EnvName, Annotated[str, StringConstraints(max_length=8192)]] = Field(
        default_factory=dict, max_length=128, json_schema_extra={"additionalProperties": False},
    )
    datasets: tuple[DatasetRef, ...] = Field(default=(), max_length=32)
    gpus: int = Field(ge=0, le=MAX_GPUS_PER_NODE, description="GPUs per node (per gang member)")
    gpu_flavors: tuple[Name, ...] = Field(
        default=(), max_length=16, description="Allowed GPU flavors in preference order; empty = any"
    )
    gpu_models: tuple[Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=GPU_MODEL_PATTERN)], ...] = Field(
        default=(), max_length=16,
        description="Allowed GPU models, any one of them (a node's gpu_product, e.g. NVIDIA-A100-SXM4-80GB, "
                    "the nvidia.com/gpu.product label); empty = any",
    )
    min_gpu_memory_mib: int | None = Field(default=None, ge=1, le=1_048_576)
    cpu_millis: int = Field(default=1000, ge=1, le=1_024_000, description="CPU per node, millicores")
    memory_mib: int = Field(default=4096, ge=1, le=16_777_216, description="Memory per node, MiB")
    node_features: tuple[Annotated[str, StringConstraints(max_length=128)], ...] = Field(
        default=(), max_length=16, description="Required node features, e.g. 'rdma', 'zone=eu-1'"
    )
    gpu_milli: int | None = Field(
        default=None, ge=1, le=999,
        description="A fraction of one sharable GPU, in thousandths (needs gpus == 1); None: whole GPUs",
    )
    tolerations: tuple[Annotated[str, StringConstraints(max_length=317, pattern=TOLERATION_PATTERN)], ...] = Field(
        default=(), max_length=16,
        description="Node taints tolerated: 'key', 'key=value' or 'key=value:Effect'",
    )
    gang_size: int = Field(default=1, ge=1, le=MAX_GANG_SIZE, description="Nodes, all-or-nothing")
    max_runtime_seconds: int | None = Field(default=None, ge=1, le=90 * 86_400)
    expected_runtime_seconds: float | None = Field(
        default=None, gt=0, le=90 * 86_400, description="Declared runtime: ETAs; the sim runs this long"
    )
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)
    annotations: dict[Annotated[str, StringConstraints(max_length=253)], Annotated[str, StringConstraints(max_length=4096)]] = Field(
        default_factory=dict, max_length=64, description="Free-form; e.g. sim.gpusched.io/exit-code"
    )
    notify: NotifySpec = Field(
        default_factory=NotifySpec,
        description="Webhooks told about this job, beside the team's own (TeamConfigured) and its NATS subjects",
    )

    @model_validator(mode="after")
    def _runtime_within_max(self) -> "JobSpec":
        if (
            self.max_runtime_seconds is not None
            and self.expected_runtime_seconds is not None
            and self.expected_runtime_seconds > self.max_runtime_seconds
        ):
            raise ValueError(
                f"expected_runtime_seconds {self.expected_runtime_seconds} exceeds "
                f"max_runtime_seconds {self.max_runtime_seconds}"
            )
        return self

    @model_validator(mode="after")
    def _fraction_of_one_gpu(self) -> "JobSpec":
        if self.gpu_milli is not None and self.gpus != 1:
            raise ValueError(f"gpu_milli {self.gpu_milli} is a fraction of one GPU: it needs gpus 1, got {self.gpus}")
        return self

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.gang_size

    @property
    def total_milli(self) -> int:
        """What the job takes, in thousandths of a GPU: what quota counts (a fraction as itself)."""
        return (self.gpu_milli if self.gpu_milli is not None else self.gpus * 1000) * self.gang_size


class NodeAssignment(Contract):
    """One node's share of a placement."""

    node: str = Field(min_length=1, max_length=253)
    gpus: int = Field(ge=0, le=MAX_GPUS_PER_NODE)
    gpu_indices: tuple[int, ...] = Field(default=(), description="Device indices on the node")
    gpu_milli: int | None = Field(
        default=None, ge=1, le=999, description="Share of the one GPU in gpu_indices, in thousandths; None: whole"
    )


class _JobEvent(Event):
    aggregate: ClassVar[str] = "job"


class JobSubmitted(_JobEvent):
    type: Literal["JobSubmitted"] = "JobSubmitted"
    spec: JobSpec
    submitter: str = Field(min_length=1, max_length=253,
                           description="Who submitted: the authenticated user of the intake subject (docs/events.md)")
    on_behalf_of: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="The user an operator submitted for (operator intake subject only); null otherwise",
    )
    intake_sequence: int | None = Field(
        default=None, ge=1,
        description="Stream sequence of the SubmitJob command; null for a job no command submitted: a service's "
                    "replica, which admission submits for the service's ReplicaRequested (docs/serving.md)")


class JobAdmitted(_JobEvent):
    type: Literal["JobAdmitted"] = "JobAdmitted"
    queue: Name
    priority: int = Field(description="Resolved value of the priority class; higher runs first")
    preemptible: bool


class JobRejected(_JobEvent):
    type: Literal["JobRejected"] = "JobRejected"
    reason: RejectReason
    message: str = Field(max_length=4096, description="Human-readable: what, which value, what is accepted")
    field: str | None = Field(default=None, max_length=256, description="Dotted path of the offending field")
    accepted: tuple[str, ...] = Field(default=(), description="Accepted values, where a list applies")
    intake_sequence: int | None = Field(default=None, ge=1, description="Stream sequence of the command")
    requested_job_id: str | None = Field(
        default=None, max_length=256, description="Job id the command asked for, when it is not this aggregate"
    )
    team: str | None = Field(default=None, pattern=NAME_PATTERN,
                             description="The team whose intake subject the command came on")


class JobCancelRequested(_JobEvent):
    type: Literal["JobCancelRequested"] = "JobCancelRequested"
    requested_by: str = Field(min_length=1, max_length=253, description="The authenticated user of the intake subject")
    on_behalf_of: str | None = Field(default=None, min_length=1, max_length=253,
                                     description="The user an operator cancelled for (operator intake subject only)")
    reason: str = Field(default="", max_length=1024)


class QuotaReserved(_JobEvent):
    type: Literal["QuotaReserved"] = "QuotaReserved"
    attempt: int = Field(ge=1)
    queue: Name
    flavor: Name
    gpus: int = Field(ge=0, description="GPUs held for the attempt (per node × gang), rounded up to whole GPUs")
    borrowed: int = Field(default=0, ge=0, description="Part of gpus borrowed from the cohort, rounded up")
    gpu_milli: int | None = Field(
        default=None, ge=0,
        description="What a fractional job (JobSpec.gpu_milli) holds, in thousandths of a GPU, all its members' "
                    "shares; None: gpus × 1000 (whole GPUs; reservations written before this field held whole "
                    "GPUs for fractional jobs too)")
    borrowed_milli: int | None = Field(
        default=None, ge=0,
        description="The borrowed part in thousandths of a GPU, for a fractional job or where it is not whole "
                    "GPUs; None: borrowed × 1000")

    @property
    def milli_held(self) -> int:
        return self.gpus * 1000 if self.gpu_milli is None else self.gpu_milli

    @property
    def milli_borrowed(self) -> int:
        return self.borrowed * 1000 if self.borrowed_milli is None else self.borrowed_milli


class QuotaPendingReasonChanged(_JobEvent):
    """Why the attempt is still waiting for quota, when that changes (rate-limited), so a job's
    wait history can be reconstructed from the log."""

    type: Literal["QuotaPendingReasonChanged"] = "QuotaPendingReasonChanged"
    attempt: int = Field(ge=1)
    reason: QuotaWaitReason
    message: str = Field(max_length=4096, description="With the numbers: nominal, used, borrowed, free")
    position: int = Field(ge=1, description="1-based position in the queue's order")
    flavor: Name | None = Field(default=None, description="The flavor the message is about")


class SchedulingPendingReasonChanged(_JobEvent):
    """Why an attempt that holds quota is still not placed, when that changes (rate-limited), with
    the numbers; the scheduler's counterpart of QuotaPendingReasonChanged."""

    type: Literal["SchedulingPendingReasonChanged"] = "SchedulingPendingReasonChanged"
    attempt: int = Field(ge=1)
    reason: SchedulingWaitReason
    message: str = Field(max_length=4096, description="e.g. needs 8×a100 on one node; largest free block is 6 ...")
    flavor: Name | None = Field(default=None, description="The flavor the numbers are about")
    requested_gpus: int = Field(ge=0, description="GPUs per node (per gang member)")
    gang_size: int = Field(ge=1)
    free_gpus: int = Field(ge=0, description="Whole free GPUs of the flavor on nodes that meet the constraints")
    free_nodes: int = Field(ge=0, description="Nodes of those with at least one free GPU")
    largest_free_block: int = Field(ge=0, description="Most whole free GPUs on one such node")
    largest_free_node: str | None = Field(default=None, description="A node with that block")
    eta: Timestamp | None = Field(
        default=None, description="When it would fit as running jobs end (declared runtimes); None: unknown"
    )


class ReclaimRequested(_JobEvent):
    """The quota this attempt holds is needed by another job: kind ``reclaim``, it borrowed quota
    its owner wants back; kind ``priority``, a higher-priority job of its own queue needs the
    queue's quota (the queue's ``preemption.within_queue``). The executor stops the attempt
    (after the grace period) and reports JobPreempted; the job is requeued."""

    type: Literal["ReclaimRequested"] = "ReclaimRequested"
    attempt: int = Field(ge=1)
    kind: Literal["reclaim", "priority"] = "reclaim"
    for_job: str = Field(description="The waiting job the quota goes to")
    for_queue: Name
    flavor: Name
    grace_seconds: float = Field(default=30.0, ge=0, description="Checkpoint window before the attempt is stopped")
    message: str = Field(default="", max_length=4096)


class QuotaReleased(_JobEvent):
    type: Literal["QuotaReleased"] = "QuotaReleased"
    attempt: int = Field(ge=1)
    queue: Name
    flavor: Name
    gpus: int = Field(ge=0, description="As its QuotaReserved: whole GPUs, rounded up")
    gpu_milli: int | None = Field(default=None, ge=0, description="As its QuotaReserved; None: gpus × 1000")
    reason: str = Field(max_length=64, description="The terminal event type that released it")

    @property
    def milli_released(self) -> int:
        return self.gpus * 1000 if self.gpu_milli is None else self.gpu_milli


class JobRetryScheduled(_JobEvent):
    type: Literal["JobRetryScheduled"] = "JobRetryScheduled"
    failed_attempt: int = Field(ge=1)
    next_attempt: int = Field(ge=2)
    not_before: Timestamp
    after: Literal["JobFailed", "JobPreempted"] | None = Field(
        default=None, description="How the attempt before it ended; None in events written before this field")


class JobScheduled(_JobEvent):
    type: Literal["JobScheduled"] = "JobScheduled"
    attempt: int = Field(ge=1)
    flavor: Name
    placement: tuple[NodeAssignment, ...] = Field(min_length=1)


class JobStarted(_JobEvent):
    type: Literal["JobStarted"] = "JobStarted"
    attempt: int = Field(ge=1)
    nodes: tuple[str, ...]


class JobReady(_JobEvent):
    """A service's replica passed its readiness check: its backend says it is ready (the
    kubernetes backend: the Pod's Ready condition, which its readiness probe gates) and at least
    the service's readiness delay has passed since its start. Once per attempt; only replica jobs
    (docs/serving.md)."""

    type: Literal["JobReady"] = "JobReady"
    attempt: int = Field(ge=1)


class JobSucceeded(_JobEvent):
    type: Literal["JobSucceeded"] = "JobSucceeded"
    attempt: int = Field(ge=1)
    started_at: Timestamp


class JobFailed(_JobEvent):
    type: Literal["JobFailed"] = "JobFailed"
    attempt: int = Field(ge=1)
    started_at: Timestamp | None = Field(description="None when it never started")
    reason: FailureReason
    exit_code: int | None = None
    message: str = Field(default="", max_length=4096)
    retryable: bool


class JobPreempted(_JobEvent):
    type: Literal["JobPreempted"] = "JobPreempted"
    attempt: int = Field(ge=1)
    started_at: Timestamp | None
    preempted_by: str | None = Field(default=None, description="Job id that needed the GPUs")
    reason: str = Field(default="", max_length=1024)


class JobCheckpointed(_JobEvent):
    """A running attempt reported a checkpoint (via ``gpusched checkpoint``, the API or the
    ``gpusched.intake.<team>.checkpoint`` subject). Victim choice and lost-work accounting count
    work since the latest one."""

    type: Literal["JobCheckpointed"] = "JobCheckpointed"
    attempt: int = Field(ge=1)
    checkpointed_at: Timestamp = Field(description="When the checkpoint was taken, as the job reports it")
    step: int | None = Field(default=None, ge=0, description="Training step or other progress counter")
    location: str = Field(default="", max_length=1024, description="Where it was written (path or URL)")
    intake_sequence: int = Field(ge=1, description="Stream sequence of the ReportCheckpoint command")


class PreemptionRequested(_JobEvent):
    """The scheduler evicts this attempt so that a higher-priority job fits: the executor stops it
    after ``grace_seconds`` (SIGTERM first, the checkpoint window) and reports JobPreempted; the
    job is requeued and the preemption does not count as a failure."""

    type: Literal["PreemptionRequested"] = "PreemptionRequested"
    attempt: int = Field(ge=1)
    for_job: str = Field(description="The job that needs the GPUs")
    grace_seconds: float = Field(default=30.0, ge=0, description="Checkpoint window before the attempt is stopped")
    work_lost_gpu_seconds: float = Field(
        default=0.0, ge=0, description="GPUs × seconds since the last checkpoint (or start), at decision time"
    )
    message: str = Field(default="", max_length=4096)


class JobCancelled(_JobEvent):
    type: Literal["JobCancelled"] = "JobCancelled"
    attempt: int | None = Field(default=None, description="Attempt that was stopped, if one ran")
    started_at: Timestamp | None = None
    reason: str = Field(default="", max_length=1024)
