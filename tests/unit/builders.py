"""Builders for the unit tests of the pure cores.

Every builder returns a real, validated contract object with sensible defaults; keyword
arguments override any field. Events are built with :func:`schemas.new_event`, so their ids are
the deterministic ids the services would derive.

``drive`` simulates the log for one core: it feeds the given events through ``evolve``, then
repeatedly calls ``decide`` and feeds each decided event back (de-duplicated by event id, as
JetStream's duplicate window would) until a cycle decides nothing new.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Iterable

from schemas import (
    Event,
    FailureReason,
    FlavorQuota,
    JobAdmitted,
    JobCancelled,
    JobCheckpointed,
    JobCancelRequested,
    JobFailed,
    JobPreempted,
    JobRetryScheduled,
    JobScheduled,
    JobSpec,
    JobReady,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeAssignment,
    NodeLost,
    ClusterLost,
    ClusterReported,
    NodeRegistered,
    NodeTelemetryReported,
    NodeUpdated,
    PreemptionRequested,
    QueueConfigured,
    QuotaPendingReasonChanged,
    QuotaReleased,
    QuotaReserved,
    QuotaWaitReason,
    ReclaimRequested,
    SchedulingPendingReasonChanged,
    SchedulingWaitReason,
    new_event,
)
from schemas.commands import Principal
from schemas.node import GpuTelemetry, NodeInfo

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    """T0 plus ``seconds``."""
    return T0 + timedelta(seconds=seconds)


# -- specs and commands ------------------------------------------------------------------------

DEFAULT_SPEC: dict[str, Any] = {
    "kind": "training",
    "queue": "research",
    "team": "team-a",
    "image": "registry.example/train:1",
    "gpus": 1,
}


def spec(**overrides: Any) -> JobSpec:
    return JobSpec.model_validate({**DEFAULT_SPEC, **overrides})


def spec_dict(**overrides: Any) -> dict[str, Any]:
    """A raw spec as a publisher would send it (no defaults filled in)."""
    return {**DEFAULT_SPEC, **overrides}


def submit_payload(spec_: dict[str, Any] | None = None, *, job_id: str | None = None,
                   **extra: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"spec": spec_ if spec_ is not None else spec_dict()}
    if job_id is not None:
        payload["job_id"] = job_id
    payload.update(extra)
    return payload


def sender(team: str = "team-a", user: str | None = None, *, operator: bool = False,
           verb: str = "submit") -> Principal:
    """Who publishes a command: the team's credential, one of its users, or the operator."""
    if operator:
        return Principal(team=team, user="operator", verb=verb, operator=True)
    return Principal(team=team, user=user or team, verb=verb)


# -- configuration and inventory ---------------------------------------------------------------


def queue(name: str = "research", teams: Iterable[str] = ("team-a",), quotas: dict[str, int] | None = None,
          *, when: datetime = T0, **fields: Any) -> QueueConfigured:
    quotas = {"a100": 8} if quotas is None else quotas
    key = f"{name}/{sorted(quotas.items())}/{sorted(fields.items())}"
    return new_event(
        QueueConfigured, aggregate_id=name, producer="config", occurred_at=when, key=key,
        name=name, allowed_teams=tuple(teams),
        quotas=tuple(FlavorQuota(flavor=f, nominal=n) for f, n in quotas.items()), **fields,
    )


def node_info(name: str, flavor: str | None = "a100", gpus: int = 8, **fields: Any) -> NodeInfo:
    fields.setdefault("gpu_memory_mib", 81920)
    return NodeInfo(name=name, gpu_flavor=flavor, gpu_count=gpus, **fields)


def node(name: str, flavor: str | None = "a100", gpus: int = 8, *, when: datetime = T0,
         **fields: Any) -> NodeRegistered:
    info = node_info(name, flavor, gpus, **fields)
    return new_event(NodeRegistered, aggregate_id=name, producer="executor", occurred_at=when,
                     key=info.model_dump_json(), node=info)


def node_updated(name: str, flavor: str | None = "a100", gpus: int = 8, *, when: datetime = T0,
                 **fields: Any) -> NodeUpdated:
    info = node_info(name, flavor, gpus, **fields)
    return new_event(NodeUpdated, aggregate_id=name, producer="executor", occurred_at=when,
                     key=info.model_dump_json(), node=info)


def gpu(index: int = 0, utilization: float = 0.5, *, samples: int = 6, allocated: int | None = None,
        allocated_utilization: float | None = None, **fields: Any) -> GpuTelemetry:
    """One GPU's window; by default allocated for every sample at the same utilization."""
    allocated = samples if allocated is None else allocated
    if allocated and allocated_utilization is None:
        allocated_utilization = utilization
    base: dict[str, Any] = {"memory_used_mib": 1024, "memory_total_mib": 81559}
    base.update(fields)
    return GpuTelemetry(index=index, samples=samples, utilization=utilization, allocated_samples=allocated,
                        allocated_utilization=allocated_utilization if allocated else None, **base)


def telemetry(name: str = "n1", gpus: Iterable[GpuTelemetry] | None = None, *, start: datetime = T0,
              seconds: float = 60.0, gpu_count: int = 8) -> NodeTelemetryReported:
    end = start + timedelta(seconds=seconds)
    return new_event(NodeTelemetryReported, aggregate_id=name, producer="executor", occurred_at=end,
                     key=start.isoformat(), node=name, window_start=start, window_end=end, gpu_count=gpu_count,
                     gpus=tuple(gpus) if gpus is not None else (gpu(0),))


def node_lost(name: str, *, when: datetime = T0) -> NodeLost:
    return new_event(NodeLost, aggregate_id=name, producer="executor", occurred_at=when, key="lost", name=name)


def cluster_reported(cluster: str, *, when: datetime = T0, nodes: int = 2, interval: float = 15.0) -> ClusterReported:
    return new_event(ClusterReported, aggregate_id=cluster, producer="executor", occurred_at=when,
                     key=when.isoformat(), cluster=cluster, nodes=nodes, interval_seconds=interval)


def cluster_lost(cluster: str, nodes: tuple[str, ...], *, last_report: datetime | None = T0,
                 when: datetime = T0) -> ClusterLost:
    return new_event(ClusterLost, aggregate_id=cluster, producer="scheduler", occurred_at=when, key="lost",
                     cluster=cluster, last_report=last_report, nodes=nodes, reason="no report")


# -- job lifecycle -----------------------------------------------------------------------------


def submitted(job_id: str, spec_: JobSpec | None = None, *, seq: int = 1, when: datetime = T0,
              submitter: str = "alice") -> JobSubmitted:
    return new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=when, key=str(seq),
                     spec=spec_ if spec_ is not None else spec(), submitter=submitter, intake_sequence=seq)


def admitted(job_id: str, queue_: str = "research", priority: int = 500, *, preemptible: bool = True,
             when: datetime = T0) -> JobAdmitted:
    return new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=when, key="decision",
                     queue=queue_, priority=priority, preemptible=preemptible)


def cancel_requested(job_id: str, *, when: datetime = T0, by: str = "alice", reason: str = "") -> JobCancelRequested:
    return new_event(JobCancelRequested, aggregate_id=job_id, producer="admission", occurred_at=when,
                     key="cancel", requested_by=by, reason=reason)


def reserved(job_id: str, queue_: str = "research", flavor: str = "a100", gpus: int = 1, *, attempt: int = 1,
             when: datetime = T0) -> QuotaReserved:
    return new_event(QuotaReserved, aggregate_id=job_id, producer="quota", occurred_at=when, key=str(attempt),
                     attempt=attempt, queue=queue_, flavor=flavor, gpus=gpus)


def released(job_id: str, queue_: str = "research", flavor: str = "a100", gpus: int = 1, *, attempt: int = 1,
             reason: str = "JobSucceeded", when: datetime = T0) -> QuotaReleased:
    return new_event(QuotaReleased, aggregate_id=job_id, producer="quota", occurred_at=when, key=str(attempt),
                     attempt=attempt, queue=queue_, flavor=flavor, gpus=gpus, reason=reason)


def pending_reason(job_id: str, reason: QuotaWaitReason = QuotaWaitReason.NOMINAL_EXHAUSTED, message: str = "full",
                   *, attempt: int = 1, position: int = 1, when: datetime = T0) -> QuotaPendingReasonChanged:
    return new_event(QuotaPendingReasonChanged, aggregate_id=job_id, producer="quota", occurred_at=when,
                     key=f"{attempt}/{reason.value}/{message}", attempt=attempt, reason=reason, message=message,
                     position=position)


def sched_pending_reason(job_id: str, reason: SchedulingWaitReason = SchedulingWaitReason.FRAGMENTATION,
                         message: str = "needs 8×a100 on one node; largest free block is 6 on n3", *,
                         attempt: int = 1, n: int = 1, when: datetime = T0, **fields: Any) -> SchedulingPendingReasonChanged:
    numbers = dict(flavor="a100", requested_gpus=8, gang_size=1, free_gpus=14, free_nodes=5, largest_free_block=6,
                   largest_free_node="n3")
    numbers.update(fields)
    return new_event(SchedulingPendingReasonChanged, aggregate_id=job_id, producer="scheduler", occurred_at=when,
                     key=f"{attempt}/{n}", attempt=attempt, reason=reason, message=message, **numbers)


def reclaim_requested(job_id: str, for_job: str = "owner", *, attempt: int = 1, for_queue: str = "research",
                      flavor: str = "a100", when: datetime = T0) -> ReclaimRequested:
    return new_event(ReclaimRequested, aggregate_id=job_id, producer="quota", occurred_at=when,
                     key=f"{attempt}/{for_job}", attempt=attempt, for_job=for_job, for_queue=for_queue, flavor=flavor,
                     message=f"queue {for_queue} needs its guaranteed {flavor} back for job {for_job}")


def preemption_requested(job_id: str, for_job: str = "urgent", *, attempt: int = 1, grace_seconds: float = 30.0,
                         work_lost: float = 0.0, when: datetime = T0) -> PreemptionRequested:
    return new_event(PreemptionRequested, aggregate_id=job_id, producer="scheduler", occurred_at=when,
                     key=f"{attempt}/{for_job}", attempt=attempt, for_job=for_job, grace_seconds=grace_seconds,
                     work_lost_gpu_seconds=work_lost, message=f"preempted so that {for_job} fits")


def checkpointed(job_id: str, *, attempt: int = 1, at_: datetime = T0, step: int | None = None, seq: int = 1,
                 when: datetime | None = None) -> JobCheckpointed:
    return new_event(JobCheckpointed, aggregate_id=job_id, producer="admission", occurred_at=when or at_,
                     key=str(seq), attempt=attempt, checkpointed_at=at_, step=step, intake_sequence=seq)


def retry_scheduled(job_id: str, failed_attempt: int = 1, *, not_before: datetime | None = None,
                    when: datetime = T0) -> JobRetryScheduled:
    return new_event(JobRetryScheduled, aggregate_id=job_id, producer="quota", occurred_at=when,
                     key=str(failed_attempt), failed_attempt=failed_attempt, next_attempt=failed_attempt + 1,
                     not_before=not_before or when)


def scheduled(job_id: str, placement: dict[str, tuple[int, ...]] | None = None, *, flavor: str = "a100",
              attempt: int = 1, when: datetime = T0) -> JobScheduled:
    placement = {"n1": (0,)} if placement is None else placement
    return new_event(
        JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=when, key=str(attempt),
        attempt=attempt, flavor=flavor,
        placement=tuple(NodeAssignment(node=n, gpus=len(ix), gpu_indices=tuple(ix)) for n, ix in placement.items()),
    )


def started(job_id: str, nodes: Iterable[str] = ("n1",), *, attempt: int = 1, when: datetime = T0) -> JobStarted:
    return new_event(JobStarted, aggregate_id=job_id, producer="executor", occurred_at=when, key=str(attempt),
                     attempt=attempt, nodes=tuple(nodes))


def ready(job_id: str, *, attempt: int = 1, when: datetime = T0) -> JobReady:
    return new_event(JobReady, aggregate_id=job_id, producer="executor", occurred_at=when, key=f"{attempt}/ready",
                     attempt=attempt)


def succeeded(job_id: str, *, attempt: int = 1, started_at: datetime = T0,
              when: datetime | None = None) -> JobSucceeded:
    return new_event(JobSucceeded, aggregate_id=job_id, producer="executor",
                     occurred_at=when or started_at + timedelta(seconds=60), key=str(attempt),
                     attempt=attempt, started_at=started_at)


def failed(job_id: str, reason: FailureReason = FailureReason.EXIT_CODE, *, attempt: int = 1,
           retryable: bool | None = None, exit_code: int | None = 1, started_at: datetime | None = T0,
           when: datetime | None = None, message: str = "") -> JobFailed:
    if retryable is None:
        retryable = reason in (FailureReason.NODE_LOST, FailureReason.EVICTED, FailureReason.BACKEND_ERROR)
    return new_event(JobFailed, aggregate_id=job_id, producer="executor",
                     occurred_at=when or (started_at or T0) + timedelta(seconds=60), key=str(attempt),
                     attempt=attempt, started_at=started_at, reason=reason, exit_code=exit_code,
                     message=message, retryable=retryable)


def preempted(job_id: str, *, attempt: int = 1, started_at: datetime | None = T0, when: datetime | None = None,
              by: str | None = None) -> JobPreempted:
    return new_event(JobPreempted, aggregate_id=job_id, producer="executor",
                     occurred_at=when or (started_at or T0) + timedelta(seconds=30), key=str(attempt),
                     attempt=attempt, started_at=started_at, preempted_by=by, reason="make room")


def cancelled(job_id: str, *, attempt: int | None = None, started_at: datetime | None = None,
              when: datetime = T0, reason: str = "") -> JobCancelled:
    return new_event(JobCancelled, aggregate_id=job_id, producer="executor", occurred_at=when, key="cancelled",
                     attempt=attempt, started_at=started_at, reason=reason)


# -- the simulated log -------------------------------------------------------------------------


class Log:
    """An append-only list of events that drops a second copy of an event id (the duplicate
    window), like the stream the services share."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ids: set[str] = set()

    def append(self, event: Event) -> bool:
        if event.event_id in self.ids:
            return False
        self.ids.add(event.event_id)
        self.events.append(event)
        return True


def drive(core: Any, events: Iterable[Event] = (), now: datetime = T0, *, log: Log | None = None,
          max_cycles: int = 100) -> list[Event]:
    """Evolve ``events``, then decide and feed the decisions back until nothing new is decided.

    Returns the newly decided events, in the order they were appended. ``log`` (optional) is the
    shared log: events already in it are not evolved again.
    """
    log = log if log is not None else Log()
    for event in events:
        if log.append(event):
            core.evolve(event)
    decided: list[Event] = []
    for _ in range(max_cycles):
        new = [e for e in core.decide(now) if log.append(e)]
        if not new:
            return decided
        for event in new:
            core.evolve(event)
        decided.extend(new)
    raise AssertionError(f"{type(core).__name__} still deciding after {max_cycles} cycles: {decided[-5:]}")


def types(events: Iterable[Event]) -> list[str]:
    return [e.type for e in events]


# -- price books and statements ----------------------------------------------------------------


def team_configured(name: str = "team-a", urls: tuple[str, ...] = ("https://hooks.example/a",), *,
                    when: datetime = T0, key: str = "1"):
    from schemas import NotifySpec, TeamConfigured, Webhook

    return new_event(TeamConfigured, aggregate_id=name, producer="config", occurred_at=when, key=key, name=name,
                     notify=NotifySpec(webhooks=tuple(Webhook(url=u) for u in urls)))


def policy_configured(*classes, when: datetime = T0, key: str = "1", **preemption):
    """A PolicyConfigured: ``classes`` as PriorityClass or (name, value, preemptible, **fields)
    tuples; the built-in classes when none are given; ``preemption``: the rate limit's fields."""
    from schemas import DEFAULT_PRIORITY_CLASSES, POLICY_ID, PolicyConfigured, PreemptionRateLimit, PriorityClass

    made = tuple(c if isinstance(c, PriorityClass) else PriorityClass(name=c[0], value=c[1], preemptible=c[2])
                 for c in classes) or tuple(DEFAULT_PRIORITY_CLASSES.values())
    return new_event(PolicyConfigured, aggregate_id=POLICY_ID, producer="config", occurred_at=when, key=key,
                     priority_classes=made, preemption=PreemptionRateLimit(**preemption))


def token_issued(token_id: str = "abcdefghijk1", name: str = "alice", role: str = "member", team: str | None = "team-a",
                 *, when: datetime = T0):
    from schemas import ApiTokenIssued

    return new_event(ApiTokenIssued, aggregate_id=token_id, producer="admin", occurred_at=when, key="issued",
                     token_id=token_id, name=name, role=role, team=team, token_hash="0" * 64, issued_by="admin")


def token_revoked(token_id: str = "abcdefghijk1", *, when: datetime = T0):
    from schemas import ApiTokenRevoked

    return new_event(ApiTokenRevoked, aggregate_id=token_id, producer="admin", occurred_at=when, key="revoked",
                     token_id=token_id, revoked_by="admin", reason="left the team")


def price_book(prices: dict[str, float] | None = None, *, effective_from: datetime = T0, when: datetime = T0,
               name: str = "default", key: str = "1", **fields: Any):
    from schemas import PriceBookUpdated

    return new_event(PriceBookUpdated, aggregate_id=name, producer="config", occurred_at=when, key=key, name=name,
                     effective_from=effective_from,
                     gpu_prices=tuple({"flavor": f, "gpu_hour": p} for f, p in (prices or {"a100": 2.0}).items()),
                     **fields)


def statement(period: str = "2026-01", group_by: str = "team", *, lines: Iterable[dict[str, Any]] = (),
              last_sequence: int = 10, when: datetime = T0):
    from schemas import ChargebackStatementIssued

    from decimal import Decimal

    lines = tuple(lines)
    sid = f"{period}-{group_by}-{last_sequence}"
    if any("gpu_seconds" in line for line in lines):  # figures as an earlier release wrote them: upcast
        from schemas.accounting import statement_v1_to_v2

        figures = statement_v1_to_v2({"lines": lines, "total_gpu_seconds": sum(line["gpu_seconds"] for line in lines),
                                      "total_cost": sum(line["total_cost"] for line in lines)})
        lines = figures.pop("lines")
        figures.pop("schema_version")
    else:
        figures = {"total_gpu_hours": str(sum((Decimal(line["gpu_hours"]) for line in lines), Decimal("0.000000"))),
                   "total_cost": str(sum((Decimal(line["total_cost"]) for line in lines), Decimal("0.00"))),
                   "checksum_alg": "jcs-sha256"}
    return new_event(ChargebackStatementIssued, aggregate_id=sid, producer="accounting", occurred_at=when, key=sid,
                     period=period, group_by=group_by, currency="USD", idle_quota="showback", lines=lines,
                     **figures, first_sequence=1, last_sequence=last_sequence, checksum="sha256:" + "0" * 64)


# -- inference services ---------------------------------------------------------------------------


def service_spec(desired=2, lo=1, hi=4, image="srv:1", delay=10.0, surge=1, unavailable=0, name="chat",
                 queue_="research", team="team-a", **replica):
    from schemas import ServiceSpec

    return ServiceSpec(name=name, team=team, queue=queue_, replicas={"min": lo, "max": hi, "desired": desired},
                       replica=spec(**{"kind": "inference", "priority_class": "inference-sla", "image": image,
                                       "queue": queue_, "team": team, "gpus": 1, **replica}),
                       readiness={"delay_seconds": delay}, rollout={"max_surge": surge, "max_unavailable": unavailable})


def service_deployed(s=None, *, when: datetime = T0, by: str = "alice"):
    from schemas import ServiceDeployed

    s = s or service_spec()
    return new_event(ServiceDeployed, aggregate_id=s.name, producer="admission", occurred_at=when, key="deploy/1",
                     spec=s, deployed_by=by, intake_sequence=1)


def service_samples() -> list[Event]:
    """One event of every service type (schemas.service)."""
    from schemas import (
        ReplicaLost, ReplicaReady, ReplicaRequested, ReplicaRetired, ReplicaScheduled, ScaledTo, ScaleRequested,
        ServiceDeleted, ServiceLoadReported, ServiceUpdated,
    )

    def make(cls, key, **fields):
        producer = "serving" if cls in (ScaledTo, ReplicaRequested, ReplicaRetired, ReplicaScheduled, ReplicaReady,
                                        ReplicaLost) else "admission"
        return new_event(cls, aggregate_id="chat", producer=producer, occurred_at=T0, key=key, **fields)

    job = "replica-chat-2-0"
    return [
        service_deployed(),
        make(ServiceUpdated, "u", spec=service_spec(image="srv:2"), generation=2, updated_by="alice", intake_sequence=2),
        make(ScaleRequested, "s", replicas=3, by="autoscaler", requested_by="hpa", intake_sequence=3),
        make(ServiceDeleted, "d", deleted_by="bob", intake_sequence=4),
        make(ServiceLoadReported, "lr", requests_per_second=120.5, reported_by="ingress", intake_sequence=5),
        make(ScaledTo, "t", replicas=4, requested=9, by="operator",
             message="9 replicas asked; the spec allows 1 to 4: scaled to 4"),
        make(ReplicaRequested, "r", job_id=job, generation=2, index=0, spec=service_spec().replica, submitter="alice",
             reason="rollout"),
        make(ReplicaRetired, "x", job_id=job, reason="scale-down"),
        make(ReplicaScheduled, "p", job_id=job, attempt=2, nodes=("n1",)),
        make(ReplicaReady, "y", job_id=job, attempt=2),
        make(ReplicaLost, "l", job_id=job, attempt=2, reason="JobFailed: node-lost", replaced=True),
    ]
