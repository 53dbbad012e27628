"""Inference services: a long-running workload of replicas (``gpusched.service.<name>.*``).

A service is deployed, scaled and deleted by commands on the team's intake subjects (admission
validates them and records ServiceDeployed, ServiceUpdated, ScaleRequested, ServiceDeleted). The
serving controller (services/serving) keeps it at its desired replicas: each replica is a job
(``replica-<service>-<generation>-<index>``) that it asks for with ReplicaRequested and admission
submits, so quota, placement, preemption, the executor and accounting treat a replica like any
other attempt. The controller follows the replica jobs and records what happened to each replica
(ReplicaScheduled, ReplicaReady, ReplicaLost) and retires the ones it no longer wants
(ReplicaRetired, which admission turns into a cancel). docs/serving.md has the whole lifecycle.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, StringConstraints, model_validator

from .envelope import NAME_PATTERN, Contract, Event
from .job import JobSpec, Name

SERVICE_NAME_MAX = 40
"""A service's name is part of its replicas' job ids (``replica-<name>-<generation>-<index>``),
which are at most 63 characters."""
REPLICA_PREFIX = "replica-"
"""Job ids of replicas; a SubmitJob may not use it."""
SERVICE_ANNOTATION = "gpusched.io/service"
"""On a replica job's spec: the service it belongs to."""
READINESS_PATH, READINESS_PORT, READINESS_DELAY = (
    "gpusched.io/readiness-path", "gpusched.io/readiness-port", "gpusched.io/readiness-delay")
"""On a replica job's spec, from the service's readiness: the kubernetes backend's readiness probe
(path and port, where the service has them) and the delay before a replica counts as ready
(every replica)."""
MAX_REPLICAS = 512

SERVICE_NAME_PATTERN = r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$"
"""A DNS-1035 label (it names the Kubernetes Service of the kubernetes backend): a letter first."""
ServiceName = Annotated[str, StringConstraints(pattern=SERVICE_NAME_PATTERN, max_length=SERVICE_NAME_MAX)]
PLATFORM_ANNOTATIONS = 4
"""Annotations the controller adds to a replica's spec (service, readiness path, port, delay)."""


def replica_job_id(service: str, generation: int, index: int) -> str:
    return f"{REPLICA_PREFIX}{service}-{generation}-{index}"


def service_of(job_id: str) -> str | None:
    """The service a replica's job id belongs to (``replica-<service>-<generation>-<index>``), else None."""
    if not job_id.startswith(REPLICA_PREFIX):
        return None
    parts = job_id[len(REPLICA_PREFIX):].rsplit("-", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else None


def replica_service(job_id: str, spec: JobSpec) -> str | None:
    """The service a job is a replica of: its job id says so (only the serving controller's
    replica jobs have such ids: admission refuses them to submissions) and its spec agrees. A
    job's own ``gpusched.io/service`` annotation alone makes nothing a replica: it would put a
    team's Pod behind another team's Service."""
    name = service_of(job_id)
    return name if name is not None and spec.annotations.get(SERVICE_ANNOTATION) == name else None


def readiness_delay(job_id: str, spec: JobSpec) -> float | None:
    """Seconds after its start before a replica may count as ready (its spec's
    ``gpusched.io/readiness-delay``; 0 when absent or malformed); None for a job that is no
    replica (it is never ready, only started)."""
    if replica_service(job_id, spec) is None:
        return None
    try:
        return max(0.0, float(spec.annotations.get(READINESS_DELAY) or 0))
    except ValueError:
        return 0.0


class Replicas(Contract):
    """How many replicas: the controller keeps ``desired``, clamped to [``min``, ``max``]."""

    min: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    max: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    desired: int = Field(default=1, ge=0, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _ordered(self) -> "Replicas":
        if not self.min <= self.desired <= self.max:
            raise ValueError(f"replicas must satisfy min <= desired <= max, got min {self.min}, "
                             f"desired {self.desired}, max {self.max}")
        return self


class Readiness(Contract):
    """When a started replica counts as ready: when its backend says so and at least
    ``delay_seconds`` after it started. The kubernetes backend says so when the Pod is Ready
    (with ``http_path`` and ``port``, when its readiness probe passes, first tried after the
    delay); the sim and local backends from the start, so the delay is the model of a server
    loading its weights."""

    delay_seconds: float = Field(default=10.0, ge=0, le=3600)
    # NUL is refused in every string (schemas.registry.check_no_nul); the pattern says so too
    http_path: str | None = Field(default=None, max_length=256, pattern=r"^/[^\s\x00]*$",
                                  description="Readiness probe path on the replica's port (kubernetes backend)")
    port: int | None = Field(default=None, ge=1, le=65535,
                             description="The port the replicas serve on: the kubernetes backend's Service routes to it")


class Rollout(Contract):
    """A new image replaces the replicas a few at a time: at most ``max_surge`` replicas above
    desired, at most ``max_unavailable`` below it counted as ready."""

    max_surge: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    max_unavailable: int = Field(default=0, ge=0, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _moves(self) -> "Rollout":
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("rollout needs max_surge or max_unavailable above 0, or it could never replace a replica")
        return self


class Autoscaling(Contract):
    """Replicas from load, within [min, max] (the controller's rule, docs/serving.md):

    * ``requests_per_replica``: ``ceil(requests per second / target)``, from the service's load
      reports (ReportServiceLoad, which an ingress publishes on the team's ``load`` subject);
    * ``gpu_utilization``: ``ceil(ready replicas × their mean GPU utilization / target)``, from the
      executor's telemetry of the GPUs the ready replicas hold.

    A higher recommendation takes effect once every recommendation of the last
    ``scale_up_stabilization_seconds`` agrees (the lowest of them), a lower one once every one of
    the last ``scale_down_stabilization_seconds`` does (the highest of them)."""

    metric: Literal["requests_per_replica", "gpu_utilization"]
    target: float = Field(ge=0.001, le=1_000_000, allow_inf_nan=False,
                          description="Requests per second per replica, or GPU utilization per replica in (0, 1]")
    scale_up_stabilization_seconds: float = Field(default=0, ge=0, le=3600)
    scale_down_stabilization_seconds: float = Field(default=300, ge=0, le=3600)

    @model_validator(mode="after")
    def _utilization_is_a_fraction(self) -> "Autoscaling":
        if self.metric == "gpu_utilization" and self.target > 1:
            raise ValueError(f"a gpu_utilization target is a fraction in (0, 1], got {self.target}")
        return self


class ServiceSpec(Contract):
    """What a team deploys. ``replica`` is one replica's job: its resources, image, command,
    flavors and priority class (``inference-sla`` by default: never a victim, first in order).
    Its ``queue`` and ``team`` are the service's."""

    name: ServiceName
    team: Name
    queue: Name
    replicas: Replicas = Field(default_factory=Replicas)
    replica: JobSpec = Field(description="One replica's job; kind inference, queue and team the service's")
    readiness: Readiness = Field(default_factory=Readiness)
    rollout: Rollout = Field(default_factory=Rollout)
    autoscaling: Autoscaling | None = Field(default=None, description="None: replicas change only when asked")

    @model_validator(mode="after")
    def _replica_is_the_services(self) -> "ServiceSpec":
        r = self.replica
        if r.kind.value != "inference":
            raise ValueError(f"replica.kind must be inference, got {r.kind.value}")
        if (r.queue, r.team) != (self.queue, self.team):
            raise ValueError(f"replica.queue and replica.team must be the service's ({self.queue}, {self.team}), "
                             f"got ({r.queue}, {r.team})")
        if r.gang_size != 1:
            raise ValueError(f"replica.gang_size must be 1 (a replica runs on one node), got {r.gang_size}")
        room = 64 - PLATFORM_ANNOTATIONS
        if len(r.annotations) > room:
            raise ValueError(f"replica.annotations may hold at most {room} entries (the platform adds "
                             f"{PLATFORM_ANNOTATIONS}), got {len(r.annotations)}")
        return self


class _ServiceEvent(Event):
    aggregate: ClassVar[str] = "service"


class _Commanded(_ServiceEvent):
    """Recorded by admission for a command: the command's place in the intake stream, by which
    the sender finds its answer."""

    intake_sequence: int = Field(ge=1, description="Stream sequence of the command")


class ServiceDeployed(_Commanded):
    """A new service (admission, from a DeployService of its team)."""

    type: Literal["ServiceDeployed"] = "ServiceDeployed"
    spec: ServiceSpec
    deployed_by: str = Field(min_length=1, max_length=253, description="The authenticated user of the intake subject")
    generation: int = Field(default=1, ge=1, description="Above 1 when a deleted service of this name is deployed again")


class ServiceUpdated(_Commanded):
    """A new spec for a running service (admission): a new replica template rolls out by
    ``rollout``; the replica counts take effect at once."""

    type: Literal["ServiceUpdated"] = "ServiceUpdated"
    spec: ServiceSpec
    generation: int = Field(ge=1, description="The replica template's generation: it grows when the template "
                                              "changes, and replicas of older ones are replaced")
    updated_by: str = Field(min_length=1, max_length=253)


class ScaleRequested(_Commanded):
    type: Literal["ScaleRequested"] = "ScaleRequested"
    replicas: int = Field(ge=0, le=MAX_REPLICAS)
    by: Literal["user", "operator", "autoscaler"]
    requested_by: str = Field(min_length=1, max_length=253)


class ServiceLoadReported(_Commanded):
    """The service's load, as its ingress reported it (ReportServiceLoad): what the
    ``requests_per_replica`` autoscaling rule reads."""

    type: Literal["ServiceLoadReported"] = "ServiceLoadReported"
    requests_per_second: float = Field(ge=0, le=1e9, allow_inf_nan=False)
    reported_by: str = Field(min_length=1, max_length=253)


class ServiceDeleted(_Commanded):
    type: Literal["ServiceDeleted"] = "ServiceDeleted"
    deleted_by: str = Field(min_length=1, max_length=253)


class ScaledTo(_ServiceEvent):
    """The controller's desired replicas: a scale request answered (clamped to [min, max]), or
    the autoscaling rule's recommendation taking effect."""

    type: Literal["ScaledTo"] = "ScaledTo"
    replicas: int = Field(ge=0, le=MAX_REPLICAS)
    requested: int = Field(ge=0, le=MAX_REPLICAS, description="What was asked, or recommended, before clamping")
    by: Literal["user", "operator", "autoscaler"] = "user"
    message: str = Field(default="", max_length=1024)


class ReplicaRequested(_ServiceEvent):
    """The controller wants one more replica; admission submits ``job_id`` with ``spec``."""

    type: Literal["ReplicaRequested"] = "ReplicaRequested"
    job_id: Name
    generation: int = Field(ge=1)
    index: int = Field(ge=0)
    spec: JobSpec
    submitter: str = Field(min_length=1, max_length=253, description="Who the replica job is submitted for")
    reason: str = Field(max_length=256, description="scale-up, replacement of a lost replica, rollout")


class ReplicaRetired(_ServiceEvent):
    """The controller no longer wants a replica; admission cancels its job."""

    type: Literal["ReplicaRetired"] = "ReplicaRetired"
    job_id: Name
    reason: str = Field(max_length=256, description="scale-down, rollout, service deleted")


class ReplicaScheduled(_ServiceEvent):
    type: Literal["ReplicaScheduled"] = "ReplicaScheduled"
    job_id: Name
    attempt: int = Field(ge=1)
    nodes: tuple[str, ...] = Field(max_length=1)


class ReplicaReady(_ServiceEvent):
    type: Literal["ReplicaReady"] = "ReplicaReady"
    job_id: Name
    attempt: int = Field(ge=1)


class ReplicaLost(_ServiceEvent):
    """A replica stopped serving without being retired: its attempt was preempted or failed, or
    its job ended. ``replaced``: the controller asked for another replica in its place (its job
    will not run again); otherwise the job retries itself (quota requeues it)."""

    type: Literal["ReplicaLost"] = "ReplicaLost"
    job_id: Name
    attempt: int = Field(ge=1)
    reason: str = Field(max_length=256, description="The event that ended the attempt, and why")
    replaced: bool = False


SERVICE_EVENTS = (ServiceDeployed, ServiceUpdated, ScaleRequested, ServiceLoadReported, ServiceDeleted, ScaledTo,
                  ReplicaRequested, ReplicaRetired, ReplicaScheduled, ReplicaReady, ReplicaLost)
