"""The serving controller's pure core: keep each inference service at its desired replicas.

A replica is a job (``replica-<service>-<generation>-<index>``): the controller asks for it with
ReplicaRequested (admission submits it), and from then on quota, the scheduler and the executor
treat it like any other attempt of its priority class — by default ``inference-sla``, first in
order and never a victim, so a scale-up that finds no free GPUs preempts lower classes through
the platform's limited, checkpoint-aware preemption. The controller follows each replica's job
and records what happened to it on the service: ReplicaScheduled (placed), ReplicaReady (its
executor's JobReady: past its readiness check and delay), ReplicaLost (its attempt ended: preempted or failed, when its job
retries itself; or its job ended for good, when another replica is asked for in its place).

Each cycle, per service:

1. answer a scale request: ScaledTo, the request clamped to the spec's [min, max]; or, for a
   service with an autoscaling rule, ScaledTo when its recommendation (from the load reports or
   the GPU telemetry of its replicas) has held for the stabilization window;
2. tell what happened to the replicas (scheduled, ready, lost);
3. reconcile: replicas of the current template (generation) up to ``desired``, at most
   ``rollout.max_surge`` above it while older ones remain; older replicas retired while at least
   ``desired - rollout.max_unavailable`` stay ready; surplus replicas of the current template
   retired, those not ready first; every replica retired once the service is deleted.

Everything is decided from the log and the clock, with deterministic event ids: a restarted
controller re-derives what it had not written and nothing else. docs/serving.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from schemas import (
    Event,
    FailureReason,
    JobCancelled,
    JobFailed,
    JobPreempted,
    JobReady,
    JobRejected,
    JobRetryScheduled,
    JobScheduled,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeTelemetryReported,
    new_event,
)
from schemas.job import RetryPolicy
from schemas.service import (
    READINESS_DELAY,
    READINESS_PATH,
    READINESS_PORT,
    REPLICA_PREFIX,
    SERVICE_ANNOTATION,
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
    replica_job_id,
    service_of,
)

PRODUCER = "serving"
REPLACEMENT_BACKOFF_CAP_S = 300.0
"""A replica whose job ended for good is replaced after 1 s, then 2, 4, ... up to this, counting
the replicas of the template that ended so (a server that exits at once must not spin)."""
REPLICA_RETRY = RetryPolicy(max_attempts=20, backoff_seconds=1.0, backoff_factor=3.0, max_backoff_seconds=300,
                            retry_on=tuple(FailureReason))
"""A replica's job retries every kind of failure (a service should come back), with a growing
backoff; after 20 failed attempts its job ends and the controller asks for a new one."""


def passes_over(aggregate: str, token: str) -> bool:
    """Whether the events of an aggregate (its kind and subject token, read from the subject)
    surely change nothing here: a job's, unless it is a replica's (``replica-…``). The adapter
    leaves those unparsed; :meth:`ServingCore.evolve` does nothing with them either."""
    return aggregate == "job" and not token.startswith(REPLICA_PREFIX)


@dataclass
class Replica:
    job_id: str
    generation: int
    index: int
    attempt: int = 1
    failures: int = 0
    placed: tuple[int, tuple[str, ...]] | None = None  # (attempt, nodes) of the current attempt
    gpus: tuple[int, ...] = ()  # device indices of the current attempt on its node
    utilization: float | None = None  # of its GPUs, the latest telemetry while it was ready
    started_at: datetime | None = None  # of the current attempt
    ready_at: datetime | None = None  # of the current attempt: its JobReady
    lost: tuple[int, str, bool] | None = None  # (attempt, reason, for good) not yet told
    told: set[tuple[str, int]] = field(default_factory=set)  # (event type, attempt) recorded
    ready: bool = False
    retired: bool = False
    ended: bool = False  # the job will not run again

    @property
    def live(self) -> bool:
        return not (self.retired or self.ended)


@dataclass
class Service:
    spec: ServiceSpec
    owner: str
    generation: int
    desired: int
    deleted: bool = False
    scale_requests: list[ScaleRequested] = field(default_factory=list)
    scales_answered: int = 0
    replicas: dict[str, Replica] = field(default_factory=dict)
    next_index: dict[int, int] = field(default_factory=dict)  # generation -> next replica index
    broken_generation: int | None = None  # a replica of it was rejected: ask for no more until an update
    # the autoscaling rule's recommendations, (time, replicas), within the longer stabilization window
    recommendations: list[tuple[datetime, int]] = field(default_factory=list)
    observed: int = 0  # recommendations so far (the autoscaler's event keys)
    ended: list[datetime] = field(default_factory=list)  # when replicas of this template ended for good
    incarnation: str = ""  # its ServiceDeployed's event id: a service deleted and deployed again is a new one
    scaled: int = 0  # ScaledTo events of this incarnation (the autoscaler's event keys)
    manual_at: int = -1  # ``observed`` when a user or operator last set the replicas: the rule waits for news

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.live]


class ServingCore:
    def __init__(self) -> None:
        self.services: dict[str, Service] = {}
        self.wake_at: datetime | None = None

    # -- evolve ------------------------------------------------------------------------------
    def evolve(self, event: Event) -> None:
        match event:
            case ServiceDeployed():
                old = self.services.get(event.aggregate_id)
                svc = self.services[event.aggregate_id] = Service(
                    event.spec, event.deployed_by, event.generation, event.spec.replicas.desired,
                    incarnation=event.event_id)
                if old is not None:  # deployed again after a delete: what still runs of the old one is retired
                    svc.replicas = {j: r for j, r in old.replicas.items() if r.live}
            case ServiceUpdated():
                if (svc := self.services.get(event.aggregate_id)) is not None:
                    if event.generation != svc.generation:
                        svc.broken_generation, svc.ended = None, []
                    svc.spec, svc.generation = event.spec, event.generation
                    svc.desired = event.spec.replicas.desired
            case ScaleRequested():
                if (svc := self.services.get(event.aggregate_id)) is not None:
                    svc.scale_requests.append(event)
            case ScaledTo():
                if (svc := self.services.get(event.aggregate_id)) is not None:
                    svc.scaled += 1
                    svc.desired = event.replicas
                    if event.by != "autoscaler":
                        svc.scales_answered += 1
                        svc.manual_at = svc.observed
            case ServiceDeleted():
                if (svc := self.services.get(event.aggregate_id)) is not None:
                    svc.deleted = True
            case ServiceLoadReported():
                svc = self.services.get(event.aggregate_id)
                rule = svc.spec.autoscaling if svc is not None else None
                if rule is not None and rule.metric == "requests_per_replica":
                    self._recommend(svc, event.occurred_at, math.ceil(event.requests_per_second / rule.target))
            case NodeTelemetryReported():
                self._telemetry(event)
            case ReplicaRequested():
                if (svc := self.services.get(event.aggregate_id)) is not None:
                    svc.replicas[event.job_id] = Replica(event.job_id, event.generation, event.index)
                    svc.next_index[event.generation] = max(svc.next_index.get(event.generation, 0), event.index + 1)
            case ReplicaRetired():
                if (r := self._replica(event.aggregate_id, event.job_id)) is not None:
                    r.retired = True
            case ReplicaScheduled() | ReplicaReady() | ReplicaLost():
                if (r := self._replica(event.aggregate_id, event.job_id)) is not None:
                    r.told.add((event.type, event.attempt))
                    if isinstance(event, ReplicaReady) and event.attempt == r.attempt and r.started_at is not None:
                        r.ready = True
            case _ if (name := service_of(event.aggregate_id)) is not None:
                if (r := self._replica(name, event.aggregate_id)) is not None:
                    self._follow(self.services[name], r, event)

    def _replica(self, service: str, job_id: str) -> Replica | None:
        svc = self.services.get(service)
        return svc.replicas.get(job_id) if svc is not None else None

    def _follow(self, svc: Service, r: Replica, event: Event) -> None:
        """A replica job's event."""
        match event:
            case JobScheduled() if event.attempt == r.attempt:
                r.placed = (event.attempt, tuple(p.node for p in event.placement))
                r.gpus = tuple(i for p in event.placement for i in p.gpu_indices)
            case JobStarted() if event.attempt == r.attempt:
                r.started_at = event.occurred_at
            case JobReady() if event.attempt == r.attempt and r.started_at is not None:
                r.ready_at = event.occurred_at
            case JobPreempted() if event.attempt == r.attempt:
                self._lose(svc, r, event, f"JobPreempted: {event.reason}", for_good=False)
            case JobFailed() if event.attempt == r.attempt:
                r.failures += 1
                for_good = not r.retired and not REPLICA_RETRY.retries(event.reason, event.retryable, r.failures)
                self._lose(svc, r, event, f"JobFailed: {event.reason.value}: {event.message}", for_good=for_good)
            case JobRetryScheduled():
                r.attempt, r.placed, r.started_at, r.ready_at, r.ready = event.next_attempt, None, None, None, False
            case JobSucceeded() | JobCancelled():
                self._lose(svc, r, event, event.type, for_good=True)
            case JobRejected():
                self._lose(svc, r, event, f"JobRejected: {event.message}", for_good=True)
                svc.broken_generation = r.generation
            case JobSubmitted():
                pass

    def _telemetry(self, report: NodeTelemetryReported) -> None:
        """The utilization of the GPUs ready replicas hold on the node; for each service whose
        rule reads it, a recommendation: ready replicas × their mean utilization / target."""
        by_index = {g.index: (g.allocated_utilization if g.allocated_utilization is not None else g.utilization)
                    for g in report.gpus}
        for svc in self.services.values():
            rule = svc.spec.autoscaling
            if rule is None or rule.metric != "gpu_utilization" or svc.deleted:
                continue
            touched = False
            for r in svc.replicas.values():
                seen = [by_index[i] for i in r.gpus if i in by_index]
                if r.ready and r.live and r.placed is not None and r.placed[1] == (report.node,) and seen:
                    r.utilization, touched = sum(seen) / len(seen), True
            ready = [r.utilization for r in svc.replicas.values() if r.ready and r.live and r.utilization is not None]
            if touched and ready:
                self._recommend(svc, report.occurred_at, math.ceil(len(ready) * (sum(ready) / len(ready)) / rule.target
                                                                   - 1e-9))

    @staticmethod
    def _recommend(svc: Service, at: datetime, replicas: int) -> None:
        rule = svc.spec.autoscaling
        lo, hi = svc.spec.replicas.min, svc.spec.replicas.max
        keep = timedelta(seconds=max(rule.scale_up_stabilization_seconds, rule.scale_down_stabilization_seconds))
        recs = svc.recommendations
        before = [(t, n) for t, n in recs if t <= at - keep][-1:]  # it held until the next one: maybe into a window
        svc.recommendations = before + [(t, n) for t, n in recs if t > at - keep] + [(at, min(max(replicas, lo), hi))]
        svc.observed += 1

    @staticmethod
    def _lose(svc: Service, r: Replica, event: Event, reason: str, *, for_good: bool) -> None:
        """The replica's current attempt ended (``for_good``: its job will not run again)."""
        was_serving = r.started_at is not None
        r.started_at, r.ready_at, r.ready, r.utilization = None, None, False, None
        if for_good:
            r.ended = True
            if not r.retired and r.generation == svc.generation:
                svc.ended.append(event.occurred_at)
        if not r.retired and (was_serving or r.placed is not None or for_good):
            r.lost = (getattr(event, "attempt", None) or r.attempt, reason[:256], for_good)

    # -- decide ------------------------------------------------------------------------------
    def decisions_refused(self) -> None:
        """Everything is re-derived from the state next cycle: nothing to do."""

    def next_wake(self) -> datetime | None:
        return self.wake_at

    def decide(self, now: datetime) -> list[Event]:
        self.wake_at = None
        out: list[Event] = []
        for name in sorted(self.services):
            svc = self.services[name]
            scaled = self._scale(name, svc, now)  # a user's request answered this cycle stands over the rule
            scaled = scaled or self._autoscale(name, svc, svc.desired, now)
            out += scaled
            out += self._tell(name, svc, now)
            out += self._reconcile(name, svc, scaled[-1].replicas if scaled else svc.desired, now)
        return out

    def _scale(self, name: str, svc: Service, now: datetime) -> list[ScaledTo]:
        """ScaledTo for each scale request not answered yet, the request clamped to [min, max]."""
        out = []
        lo, hi = svc.spec.replicas.min, svc.spec.replicas.max
        for n, request in enumerate(svc.scale_requests[svc.scales_answered:], start=svc.scales_answered + 1):
            replicas = min(max(request.replicas, lo), hi)
            message = "" if replicas == request.replicas else (
                f"{request.replicas} replicas asked; the spec allows {lo} to {hi}: scaled to {replicas}")
            out.append(new_event(ScaledTo, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                 key=f"scaled/{request.event_id}",
                                 cause=request, replicas=replicas, requested=request.replicas, by=request.by,
                                 message=message))
        return out

    def _autoscale(self, name: str, svc: Service, desired: int, now: datetime) -> list[ScaledTo]:
        """ScaledTo when the rule's latest recommendation differs from ``desired`` and has held
        for the stabilization window: up to the lowest recommendation of the up window, down to
        the highest of the down window. Wakes when a recommendation leaves a window."""
        rule, recs = svc.spec.autoscaling, svc.recommendations
        if rule is None or svc.deleted or not recs or svc.observed <= svc.manual_at:
            return []  # nothing new since a user set the replicas: theirs stands
        lo, hi = svc.spec.replicas.min, svc.spec.replicas.max
        latest = min(max(recs[-1][1], lo), hi)
        if latest == desired:
            return []
        up = latest > desired
        window = timedelta(seconds=rule.scale_up_stabilization_seconds if up else rule.scale_down_stabilization_seconds)
        # each recommendation holds until the next one; those that held at some time in the window
        spans = [(min(max(n, lo), hi), until) for (_, n), (until, _) in zip(recs, recs[1:])]
        spans.append((latest, None))
        held = [(n, until) for n, until in spans if until is None or until > now - window]
        target = min(n for n, _ in held) if up else max(n for n, _ in held)
        blocking = [until + window for n, until in held if until is not None and (n < latest if up else n > latest)]
        if blocking:
            wake = min(blocking)
            self.wake_at = wake if self.wake_at is None else min(self.wake_at, wake)
        if (target > desired) if up else (target < desired):
            what = ("requests per second" if rule.metric == "requests_per_replica" else "GPU utilization")
            return [new_event(ScaledTo, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                              key=f"auto/{svc.incarnation}/{svc.scaled}", replicas=target, requested=latest,
                              by="autoscaler",
                              message=f"autoscaler: {what} recommend {latest} replicas (target {rule.target:g} per "
                                      f"replica); {target} held for the {window.total_seconds():g} s window")]
        return []

    def _tell(self, name: str, svc: Service, now: datetime) -> list[Event]:
        """What happened to the replicas, each told once per attempt."""
        out: list[Event] = []
        for r in svc.replicas.values():
            if r.placed is not None and ("ReplicaScheduled", r.placed[0]) not in r.told and not r.retired:
                out.append(new_event(ReplicaScheduled, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                     key=f"{r.job_id}/{r.placed[0]}/scheduled", job_id=r.job_id,
                                     attempt=r.placed[0], nodes=r.placed[1]))
            if r.lost is not None and ("ReplicaLost", r.lost[0]) not in r.told:
                attempt, reason, for_good = r.lost
                out.append(new_event(ReplicaLost, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                     key=f"{r.job_id}/{attempt}/lost", job_id=r.job_id, attempt=attempt,
                                     reason=reason, replaced=for_good and not svc.deleted))
            if r.ready_at is not None and not r.ready and r.live and ("ReplicaReady", r.attempt) not in r.told:
                out.append(new_event(ReplicaReady, aggregate_id=name, producer=PRODUCER, occurred_at=r.ready_at,
                                     key=f"{r.job_id}/{r.attempt}/ready", job_id=r.job_id, attempt=r.attempt))
        return out

    def _reconcile(self, name: str, svc: Service, desired: int, now: datetime) -> list[Event]:
        live = svc.live()
        if svc.deleted:
            return [self._retire(name, r, "service deleted", now) for r in live]
        current = [r for r in live if r.generation == svc.generation]
        older = [r for r in live if r.generation != svc.generation]
        out: list[Event] = []
        # surplus of the current template: those not ready first, then the newest
        surplus = sorted(current, key=lambda r: (r.ready, -r.index))[:max(0, len(current) - desired)]
        out += [self._retire(name, r, "scale-down", now) for r in surplus]
        current = [r for r in current if r not in surplus]
        # older templates: retired while enough stay ready (those not ready cost nothing)
        ready = sum(r.ready for r in current + older)
        keep_ready = desired - svc.spec.rollout.max_unavailable
        for r in sorted(older, key=lambda r: (r.ready, r.generation, r.index)):
            if r.ready and ready - 1 < keep_ready:
                break
            out.append(self._retire(name, r, f"rollout to generation {svc.generation}", now))
            ready -= r.ready
        # more of the current template: up to desired, at most max_surge above it in all
        still_older = len(older) - sum(1 for e in out if isinstance(e, ReplicaRetired)
                                       and svc.replicas[e.job_id].generation != svc.generation)
        room = desired + (svc.spec.rollout.max_surge if still_older else 0) - len(current) - still_older
        wanted = min(desired - len(current), room)
        if svc.broken_generation == svc.generation:
            wanted = 0  # its replicas are rejected: asking again would loop
        elif wanted > 0 and svc.ended:
            not_before = svc.ended[-1] + timedelta(seconds=min(REPLACEMENT_BACKOFF_CAP_S, 2 ** (len(svc.ended) - 1)))
            if now < not_before:
                wanted = 0
                self.wake_at = not_before if self.wake_at is None else min(self.wake_at, not_before)
        first = svc.next_index.get(svc.generation, 0)
        for index in range(first, first + max(0, wanted)):
            out.append(self._request(name, svc, index, "scale-up" if not older else "rollout", now))
        return out

    @staticmethod
    def _request(name: str, svc: Service, index: int, reason: str, now: datetime) -> ReplicaRequested:
        job_id = replica_job_id(name, svc.generation, index)
        template, readiness = svc.spec.replica, svc.spec.readiness
        probe = {READINESS_DELAY: f"{readiness.delay_seconds:g}"}
        if readiness.port is not None:
            probe[READINESS_PORT] = str(readiness.port)
            if readiness.http_path is not None:
                probe[READINESS_PATH] = readiness.http_path
        spec = template.model_copy(update={
            "annotations": {**template.annotations, SERVICE_ANNOTATION: name, **probe},
            "retry": REPLICA_RETRY, "expected_runtime_seconds": None, "max_runtime_seconds": None,
            "idempotency_key": None})
        return new_event(ReplicaRequested, aggregate_id=name, producer=PRODUCER, occurred_at=now, key=job_id,
                         job_id=job_id, generation=svc.generation, index=index, spec=spec, submitter=svc.owner,
                         reason=reason)

    @staticmethod
    def _retire(name: str, r: Replica, reason: str, now: datetime) -> ReplicaRetired:
        return new_event(ReplicaRetired, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                         key=f"{r.job_id}/retired", job_id=r.job_id, reason=reason)
