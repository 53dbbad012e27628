"""Admission's pure core: is this submission well-formed, may this team use this queue, could it
ever run? No I/O, no clock.

Intake commands become events in two steps, so that a crash between them loses nothing:
``handle_submit`` turns a raw SubmitJob into JobSubmitted (or a JobRejected when it is malformed);
``decide`` then admits or rejects every submitted job that has no decision yet.

Inference services (docs/serving.md): ``handle_deploy``, ``handle_scale`` and ``handle_delete``
validate the service commands into ServiceDeployed, ServiceUpdated, ScaleRequested and
ServiceDeleted; ``decide`` also submits the replica jobs the serving controller asks for
(ReplicaRequested -> JobSubmitted) and cancels the ones it retires (ReplicaRetired ->
JobCancelRequested). A replica job is then admitted like any other.

Partitioned by team (``AdmissionCore(partition=Partition(n, k))``, docs/scaling.md): a core
decides for the teams :func:`runtime.teams.partition_of` maps to its partition ``k`` of ``n`` and
holds only their jobs and services. Job ids and service names are platform-wide, so it also
remembers which ids and names another partition's teams took (from their JobSubmitted and
ServiceDeployed, which every partition folds), to answer a command that reuses one. Every other
event of another partition's job or service changes nothing here (and the adapter need not
parse it: :meth:`AdmissionCore.foreign`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from pydantic import ValidationError

from runtime.policy import PolicyBook
from runtime.teams import Partition
from schemas import (
    DEFAULT_PRIORITY_CLASSES,
    CancelJob,
    Event,
    JobCheckpointed,
    JobPreempted,
    JobStarted,
    ReportCheckpoint,
    JobAdmitted,
    JobCancelRequested,
    JobRejected,
    JobSpec,
    JobSubmitted,
    NodeLost,
    NodeRegistered,
    NodeUpdated,
    PolicyConfigured,
    QueueConfigured,
    QueueDeleted,
    RejectReason,
    SubmitJob,
    new_event,
)
from schemas.commands import (
    MalformedCommand,
    Principal,
    identity_problem,
    job_id_of,
    load_command,
    parse_command,
    validate_command,
)
from schemas.commands import DeleteService, DeployService, ReportServiceLoad, ScaleService
from schemas.egress import Network, url_refusal
from schemas.job import JobCancelled, JobFailed, JobSucceeded, rejection_id
from schemas.node import NodeInfo
from schemas.registry import subject_token
from schemas.service import (
    ReplicaRequested,
    ReplicaRetired,
    ScaleRequested,
    ServiceDeleted,
    ServiceDeployed,
    ServiceLoadReported,
    ServiceSpec,
    ServiceUpdated,
)

PRODUCER = "admission"
CHECKPOINT_CLOCK_SKEW = timedelta(seconds=60)
"""How far in the future (by the platform clock) a reported checkpoint time may lie."""
TERMINAL = (JobRejected, JobSucceeded, JobCancelled)


class PoisonCommand(ValueError):
    """Not a command at all (not JSON, or a cancel that names nothing); goes to the dead-letter
    subject with this message."""


class SubmitRefused(Exception):
    """A submission refused with a JobRejected (reason code, message, the field at fault, what
    would be accepted, the job id it asked for)."""

    def __init__(self, reason: RejectReason, message: str, field: str | None = None, *,
                 accepted: tuple[str, ...] = (), requested: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.field = reason, message, field
        self.accepted, self.requested = accepted, requested


def spec_digest(spec: JobSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


@dataclass
class JobRecord:
    """A job admission has seen. Once it is decided and finished, its spec and submission are let
    go (None): what a later command needs of it (its team, the spec's digest and the intake
    sequence, to answer a reused id or key; finished, to answer a cancel) stays, so the state and
    its snapshot hold the history's ids, not its specs."""

    team: str
    spec: JobSpec | None
    digest: str
    intake_sequence: int | None  # None: a service's replica (no command)
    submitted: JobSubmitted | None
    decided: bool = False
    finished: bool = False
    cancel_requested: bool = False
    running: JobStarted | None = None  # the attempt that is running now, for checkpoint reports
    failures: int = 0  # attempts that failed (quota's retry rule counts them)


class _Shape(NamedTuple):
    """What admission's "could it ever run" check reads of a node (its cluster: a gang's members
    share one)."""
    flavor: str | None
    sharable: bool
    gpus: int
    product: str | None
    features: frozenset[str]
    memory_mib: int | None
    cluster: str | None

    @classmethod
    def of(cls, n: NodeInfo) -> "_Shape":
        return cls(n.gpu_flavor, n.gpu_sharable, n.gpu_count, n.gpu_product, frozenset(n.features), n.gpu_memory_mib,
                   n.cluster)


@dataclass
class AdmissionState:
    queues: dict[str, QueueConfigured] = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    keys: dict[tuple[str, str], str] = field(default_factory=dict)  # (team, key) -> job id
    undecided: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    policy: PolicyBook = field(default_factory=PolicyBook)
    services: dict[str, ServiceRecord] = field(default_factory=dict)
    # replica jobs the serving controller asked for and that are not submitted yet; and the ones
    # it retired whose job is not cancelled yet (job id -> the request)
    replicas_to_submit: dict[str, ReplicaRequested] = field(default_factory=dict)
    replicas_to_cancel: dict[str, ReplicaRetired] = field(default_factory=dict)
    # retired before their JobSubmitted was folded (it may still be in flight): cancelled once it is
    retired_early: dict[str, ReplicaRetired] = field(default_factory=dict)
    partition: Partition = field(default_factory=Partition)
    # the subject tokens (schemas.registry.subject_token) of the jobs and services of the teams of
    # other partitions -> their team: ids and names are platform-wide
    foreign_jobs: dict[str, str] = field(default_factory=dict)
    foreign_services: dict[str, str] = field(default_factory=dict)


@dataclass
class ServiceRecord:
    team: str
    spec: ServiceSpec
    generation: int
    deployed: ServiceDeployed | ServiceUpdated
    deleted: bool = False
    scales: int = 0  # ScaleRequested events so far (the next one's key)
    updates: int = 0  # ServiceUpdated events so far


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _validation_message(err: ValidationError) -> tuple[str, str]:
    """First error as (field, message), plus how many more there were."""
    errors = err.errors(include_url=False)
    first = errors[0]
    path = _field_path(first["loc"]) or "(root)"
    value = first.get("input")
    shown = json.dumps(value, default=str)[:120] if not isinstance(value, dict) else "{...}"
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return path, f"{path}: {first['msg']}; got {shown}{more}"


class AdmissionCore:
    def __init__(self, priority_classes=DEFAULT_PRIORITY_CLASSES, partition: Partition = Partition(),
                 webhook_allow: tuple[Network, ...] = ()) -> None:
        self.state = AdmissionState(policy=PolicyBook.starting_with(priority_classes), partition=partition)
        # networks a job's webhooks may reach beside public addresses (GPUSCHED_WEBHOOK_ALLOW): configuration,
        # not state, so a snapshot does not carry it
        self.webhook_allow = webhook_allow
        self._shapes: dict[_Shape, int] | None = None  # the nodes by shape, worked out again after they change

    def foreign(self, kind: str, token: str) -> bool:
        """Whether an event of this aggregate (its kind and subject token), other than its first,
        surely changes nothing here: a job or service of another partition's team. Ownership is
        the team that the aggregate's first event before this one names, as in :meth:`evolve`."""
        s = self.state
        if kind == "job":
            return token in s.foreign_jobs
        if kind == "service":
            return token in s.foreign_services
        return False

    def _elsewhere(self, event: Event) -> bool:
        """Whether ``event`` belongs to a job or service of another partition's team (nothing to
        fold). Its first event (a JobSubmitted, a ServiceDeployed) decides: one naming another
        partition's team makes the id or name taken here, and everything after it is passed over."""
        s = self.state
        kind = type(event).aggregate
        if s.partition.count == 1 or kind not in ("job", "service"):
            return False
        token = subject_token(event.aggregate_id)
        if self.foreign(kind, token):
            return True
        first = (isinstance(event, JobSubmitted) and event.aggregate_id not in s.jobs
                 or isinstance(event, ServiceDeployed) and event.aggregate_id not in s.services)
        if first and not s.partition.owns(event.spec.team):
            taken = s.foreign_jobs if kind == "job" else s.foreign_services
            taken[token] = sys.intern(event.spec.team)
            return True
        return False

    # -- evolve ------------------------------------------------------------------------------
    def evolve(self, event: Event) -> None:
        s = self.state
        if self._elsewhere(event):
            return
        match event:
            case QueueConfigured():
                s.queues[event.name] = event
            case QueueDeleted():
                s.queues.pop(event.name, None)
            case PolicyConfigured():
                s.policy.apply(event)
            case NodeRegistered() | NodeUpdated():
                s.nodes[event.node.name] = event.node
                self._shapes = None
            case NodeLost():
                s.nodes.pop(event.name, None)
                self._shapes = None
            case JobSubmitted():
                spec = event.spec
                s.jobs[event.aggregate_id] = JobRecord(
                    team=spec.team, spec=spec, digest=spec_digest(spec),
                    intake_sequence=event.intake_sequence, submitted=event,
                )
                if spec.idempotency_key:
                    s.keys[(spec.team, spec.idempotency_key)] = event.aggregate_id
                s.undecided[event.aggregate_id] = None
            case JobAdmitted() | JobRejected():
                if (job := s.jobs.get(event.aggregate_id)) is not None:
                    job.decided = True
                    job.finished = isinstance(event, JobRejected)
                s.undecided.pop(event.aggregate_id, None)
            case JobSucceeded() | JobCancelled():
                if (job := s.jobs.get(event.aggregate_id)) is not None:
                    job.finished = True
                    job.running = None
            case JobFailed() | JobPreempted():
                if (job := s.jobs.get(event.aggregate_id)) is None or job.finished:
                    return  # a finished job stays finished
                if job.running is not None and job.running.attempt == event.attempt:
                    job.running = None
                if isinstance(event, JobFailed):
                    # Ended for good when quota will not retry it (the same rule quota applies):
                    # a later cancel then has nothing to cancel.
                    job.failures += 1
                    job.finished = not job.spec.retry.retries(event.reason, event.retryable, job.failures)
            case JobStarted():
                if (job := s.jobs.get(event.aggregate_id)) is not None:
                    job.running = event
            case JobCancelRequested():
                if (job := s.jobs.get(event.aggregate_id)) is not None:
                    job.cancel_requested = True
                s.replicas_to_cancel.pop(event.aggregate_id, None)
            case ServiceDeployed():
                s.services[event.aggregate_id] = ServiceRecord(event.spec.team, event.spec, event.generation, event)
            case ServiceUpdated():
                if (svc := s.services.get(event.aggregate_id)) is not None:
                    svc.spec, svc.generation, svc.deployed = event.spec, event.generation, event
                    svc.updates += 1
            case ScaleRequested():
                if (svc := s.services.get(event.aggregate_id)) is not None:
                    svc.scales += 1
            case ServiceDeleted():
                if (svc := s.services.get(event.aggregate_id)) is not None:
                    svc.deleted = True
            case ReplicaRequested():
                if event.job_id not in s.jobs:
                    s.replicas_to_submit[event.job_id] = event
            case ReplicaRetired():
                s.replicas_to_submit.pop(event.job_id, None)
                job = s.jobs.get(event.job_id)
                if job is None:
                    s.retired_early[event.job_id] = event  # its submission may already be on its way
                elif not job.finished and not job.cancel_requested:
                    s.replicas_to_cancel[event.job_id] = event
        if isinstance(event, JobSubmitted):
            s.replicas_to_submit.pop(event.aggregate_id, None)
            if (retired := s.retired_early.pop(event.aggregate_id, None)) is not None:
                s.replicas_to_cancel[event.aggregate_id] = retired
        if (job := s.jobs.get(event.aggregate_id)) is not None and job.finished:
            s.replicas_to_cancel.pop(event.aggregate_id, None)  # nothing left to cancel
        if (job := s.jobs.get(event.aggregate_id)) is not None and job.finished and job.decided:
            job.spec = job.submitted = None  # an undecided job (cancelled early) still needs them

    # -- intake ------------------------------------------------------------------------------
    def handle_submit(self, raw: bytes, sender: Principal, intake_seq: int, now: datetime) -> list[Event]:
        """A SubmitJob command that ``sender`` published: JobSubmitted (its submitter is the
        sender's user), a JobRejected when it is malformed, contradicts the sender or collides
        with an existing job, or nothing when it is already recorded."""
        try:
            command = self._parse_submit(raw, sender)
            job_id = self._new_job_id(command, intake_seq)
        except SubmitRefused as refused:
            return [
                new_event(
                    JobRejected, aggregate_id=rejection_id(intake_seq), producer=PRODUCER, occurred_at=now,
                    key=str(intake_seq), reason=refused.reason, message=refused.message, field=refused.field,
                    accepted=refused.accepted, intake_sequence=intake_seq, requested_job_id=refused.requested,
                    team=sender.team,
                )
            ]
        if job_id is None:
            return []
        return [
            new_event(
                JobSubmitted, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(intake_seq),
                spec=command.spec, submitter=sender.user, on_behalf_of=command.on_behalf_of,
                intake_sequence=intake_seq,
            )
        ]

    @staticmethod
    def _parse_submit(raw: bytes, sender: Principal) -> SubmitJob:
        """The command, if it is one this team may send (PoisonCommand when it is not JSON)."""
        try:
            payload = load_command(raw)
        except MalformedCommand as err:
            if err.kind == "not-json":
                raise PoisonCommand(err.message) from None
            reason = RejectReason.PAYLOAD_TOO_LARGE if err.kind == "too-large" else RejectReason.SCHEMA_INVALID
            raise SubmitRefused(reason, err.message, err.field) from None
        requested = payload.get("job_id") if isinstance(payload, dict) else None
        requested = requested if isinstance(requested, str) else None
        try:
            command = validate_command(SubmitJob, raw)  # checked by load_command above
        except ValidationError as err:
            path, message = _validation_message(err)
            raise SubmitRefused(RejectReason.SCHEMA_INVALID, message, path, requested=requested) from None
        if command.spec.team != sender.team:
            raise SubmitRefused(
                RejectReason.FORBIDDEN,
                f"spec.team {command.spec.team!r} does not match the intake subject's team {sender.team!r}; "
                f"a team submits on gpusched.intake.<team>.submit",
                "spec.team", accepted=(sender.team,), requested=command.job_id,
            )
        if (problem := identity_problem(command, sender)) is not None:
            raise SubmitRefused(RejectReason.FORBIDDEN, problem[1], problem[0], requested=command.job_id)
        return command

    def _new_job_id(self, command: SubmitJob, intake_seq: int) -> str | None:
        """The id of the job the command creates; None when it creates nothing (a redelivery,
        or an idempotent resubmission of an existing job)."""
        s, spec = self.state, command.spec
        job_id = job_id_of(command, intake_seq)  # the contract's rule: given, keyed, else j-<intake_seq>
        if spec.idempotency_key and (owner := s.keys.get((spec.team, spec.idempotency_key))) is not None:
            original = s.jobs[owner]
            if original.intake_sequence == intake_seq:
                return None  # redelivered command, already recorded
            if owner == job_id and original.digest == spec_digest(spec):
                return None  # an idempotent resubmission: the job exists, nothing new happens
            raise SubmitRefused(
                RejectReason.DUPLICATE_IDEMPOTENCY_KEY,
                f"spec.idempotency_key {spec.idempotency_key!r} already identifies job {owner} "
                f"(submitted at intake sequence {original.intake_sequence}) with a different spec or job id; "
                f"resubmit the same spec, or use a new key",
                "spec.idempotency_key", requested=job_id,
            )
        if subject_token(job_id) in s.foreign_jobs:
            raise SubmitRefused(
                RejectReason.DUPLICATE_JOB_ID,
                f"job_id {job_id!r} already exists (a job of another team); job ids are never reused; omit job_id "
                f"to have one assigned", "job_id", requested=job_id,
            )
        if (existing := s.jobs.get(job_id)) is not None:
            if existing.intake_sequence == intake_seq:
                return None
            raise SubmitRefused(
                RejectReason.DUPLICATE_JOB_ID,
                f"job_id {job_id!r} already exists (intake sequence {existing.intake_sequence}); "
                f"job ids are never reused; omit job_id to have one assigned",
                "job_id", requested=job_id,
            )
        return job_id

    def _team_job(self, command: str, job_id: str, subject_team: str) -> JobRecord:
        """The job a command of ``subject_team`` names; PoisonCommand when the team has no such job.
        Another team's job is refused in the same words as one that does not exist: the refusal
        is the team's to read (its tenant stream), and tells it nothing of another team's jobs."""
        job = self.state.jobs.get(job_id)
        if self.state.foreign_jobs.get(subject_token(job_id)) is not None or job is None or job.team != subject_team:
            raise PoisonCommand(f"{command}: job_id {job_id!r} does not exist (among the jobs of team {subject_team!r})")
        return job

    def handle_cancel(self, raw: bytes, sender: Principal, now: datetime) -> list[Event]:
        command = _parse_command(CancelJob, raw, sender)
        job = self._team_job("CancelJob", command.job_id, sender.team)
        if job.finished or job.cancel_requested:
            return []  # nothing to cancel, or already asked: idempotent
        return [
            new_event(
                JobCancelRequested, aggregate_id=command.job_id, producer=PRODUCER, occurred_at=now,
                key="cancel", cause=job.submitted, requested_by=sender.user,
                on_behalf_of=command.on_behalf_of, reason=command.reason,
            )
        ]

    def handle_checkpoint(self, raw: bytes, sender: Principal, intake_seq: int, now: datetime) -> list[Event]:
        """A ReportCheckpoint that ``sender`` published: JobCheckpointed
        for the job's running attempt. A report that names no running attempt of a job of this
        team is refused with a PoisonCommand (the dead-letter subject, with this message)."""
        command = _parse_command(ReportCheckpoint, raw, sender)
        job = self._team_job("ReportCheckpoint", command.job_id, sender.team)
        running = job.running
        if running is None:
            raise PoisonCommand(
                f"ReportCheckpoint: job {command.job_id} has no running attempt (attempt {command.attempt} "
                f"given); checkpoints are accepted while an attempt runs"
            )
        if running.attempt != command.attempt:
            raise PoisonCommand(
                f"ReportCheckpoint: attempt {command.attempt} of job {command.job_id} is not running; "
                f"accepted: {running.attempt}"
            )
        taken = command.checkpointed_at or now
        if taken < running.occurred_at or taken > now + CHECKPOINT_CLOCK_SKEW:
            raise PoisonCommand(
                f"ReportCheckpoint: checkpointed_at {taken.isoformat()} is outside attempt "
                f"{command.attempt}'s run; accepted: from its start {running.occurred_at.isoformat()} "
                f"to now {now.isoformat()} (+{CHECKPOINT_CLOCK_SKEW.total_seconds():.0f} s)"
            )
        return [
            new_event(
                JobCheckpointed, aggregate_id=command.job_id, producer=PRODUCER, occurred_at=now,
                key=str(intake_seq), cause=running, attempt=command.attempt,
                checkpointed_at=taken, step=command.step, location=command.location,
                intake_sequence=intake_seq,
            )
        ]

    # -- inference services --------------------------------------------------------------------
    def handle_deploy(self, raw: bytes, sender: Principal, seq: int, now: datetime) -> list[Event]:
        """ServiceDeployed for a new service (or one deleted before: a new generation), or
        ServiceUpdated with the next generation when the spec changed; nothing for the same spec.
        PoisonCommand when the team may not deploy it: its replica would not be admitted."""
        command = _parse_command(DeployService, raw, sender)
        spec = command.spec
        if spec.team != sender.team:
            raise PoisonCommand(f"DeployService: spec.team {spec.team!r} does not match the intake subject's team "
                                f"{sender.team!r}; accepted: {sender.team!r}")
        existing = self.state.services.get(spec.name)
        if existing is not None and existing.team != sender.team or subject_token(spec.name) in self.state.foreign_services:
            raise PoisonCommand(f"DeployService: spec.name {spec.name!r} is a service of another team; "
                                "accepted: a name no other team uses")
        user = command.on_behalf_of or sender.user
        if (refused := self._refusal(spec.replica, user, "on_behalf_of" if command.on_behalf_of else "(sender)")):
            _, message, field_, _ = refused
            raise PoisonCommand(f"DeployService: its replicas would not be admitted: "
                                f"{field_.replace('spec.', 'spec.replica.', 1)}: {message}")
        if existing is None or existing.deleted:
            generation = 1 if existing is None else existing.generation + 1
            return [new_event(ServiceDeployed, aggregate_id=spec.name, producer=PRODUCER, occurred_at=now,
                              key=f"deploy/{generation}/{seq}", spec=spec, deployed_by=user, generation=generation,
                              intake_sequence=seq)]
        if existing.spec == spec:
            return []  # redelivered, or deployed again unchanged
        template_changed = existing.spec.replica != spec.replica
        generation = existing.generation + 1 if template_changed else existing.generation
        return [new_event(ServiceUpdated, aggregate_id=spec.name, producer=PRODUCER, occurred_at=now,
                          key=f"update/{existing.generation}/{existing.updates + 1}", cause=existing.deployed, spec=spec,
                          generation=generation, updated_by=user, intake_sequence=seq)]

    def handle_scale(self, raw: bytes, sender: Principal, seq: int, now: datetime) -> list[Event]:
        command = _parse_command(ScaleService, raw, sender)
        svc = self._team_service("ScaleService", command.service, sender.team)
        return [new_event(ScaleRequested, aggregate_id=command.service, producer=PRODUCER, occurred_at=now,
                          key=f"scale/{svc.generation}/{svc.scales + 1}", cause=svc.deployed, replicas=command.replicas,
                          by="operator" if sender.operator else "user",
                          requested_by=command.on_behalf_of or sender.user, intake_sequence=seq)]

    def handle_load(self, raw: bytes, sender: Principal, seq: int, now: datetime) -> list[Event]:
        """A ReportServiceLoad of the team's service: ServiceLoadReported, stamped now."""
        command = _parse_command(ReportServiceLoad, raw, sender)
        svc = self._team_service("ReportServiceLoad", command.service, sender.team)
        return [new_event(ServiceLoadReported, aggregate_id=command.service, producer=PRODUCER, occurred_at=now,
                          key=f"load/{seq}", cause=svc.deployed, requests_per_second=command.requests_per_second,
                          reported_by=command.on_behalf_of or sender.user, intake_sequence=seq)]

    def handle_delete(self, raw: bytes, sender: Principal, seq: int, now: datetime) -> list[Event]:
        command = _parse_command(DeleteService, raw, sender)
        svc = self._team_service("DeleteService", command.service, sender.team)
        return [new_event(ServiceDeleted, aggregate_id=command.service, producer=PRODUCER, occurred_at=now,
                          key=f"delete/{svc.generation}", cause=svc.deployed,
                          deleted_by=command.on_behalf_of or sender.user, intake_sequence=seq)]

    def _team_service(self, command: str, name: str, team: str) -> ServiceRecord:
        """The live service of ``team`` a command names; PoisonCommand otherwise (another team's
        in the same words as none, as :meth:`_team_job`)."""
        svc = self.state.services.get(name)
        if (self.state.foreign_services.get(subject_token(name)) is not None or svc is None or svc.deleted
                or svc.team != team):
            raise PoisonCommand(f"{command}: service {name!r} does not exist (among the services of team {team!r})")
        return svc

    # -- decide ------------------------------------------------------------------------------
    def decisions_refused(self) -> None:
        """Undecided jobs stay undecided until their decision is in the log: nothing to do."""

    def snapshot_state(self) -> AdmissionState:
        return self.state

    def restore_state(self, state: AdmissionState) -> None:
        if state.partition != self.state.partition:
            raise ValueError(f"the snapshot holds {state.partition}'s state; this core is {self.state.partition}'s")
        self.state = state
        self._shapes = None

    def _node_shapes(self) -> dict[_Shape, int]:
        """How many known nodes have each shape: what admission's checks look at, so that a
        check costs in proportion to the shapes (a handful per flavor), not to the nodes."""
        if self._shapes is None:
            self._shapes = Counter(_Shape.of(n) for n in self.state.nodes.values())
        return self._shapes

    def decide(self, now: datetime) -> list[Event]:
        out: list[Event] = []
        for job_id in list(self.state.undecided):
            job = self.state.jobs[job_id]
            out.append(self._decide_one(job_id, job, now))
        for job_id, request in self.state.replicas_to_submit.items():
            out.append(new_event(
                JobSubmitted, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key="replica", cause=request,
                spec=request.spec, submitter=request.submitter))
        for job_id, retired in self.state.replicas_to_cancel.items():
            out.append(new_event(
                JobCancelRequested, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key="cancel",
                cause=retired, requested_by="serving", reason=f"replica of service {retired.aggregate_id} retired: "
                                                              f"{retired.reason}"))
        return out

    def _decide_one(self, job_id: str, job: JobRecord, now: datetime) -> Event:
        spec, cause = job.spec, job.submitted
        user = cause.on_behalf_of or cause.submitter  # the operator acts for on_behalf_of
        refused = self._refusal(spec, user, "on_behalf_of" if cause.on_behalf_of else "submitter")
        if refused is not None:
            reason, message, field_, accepted = refused
            return new_event(
                JobRejected, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key="decision",
                cause=cause, reason=reason, message=message, field=field_, accepted=tuple(sorted(accepted)),
                intake_sequence=job.intake_sequence,
            )
        pc = self.state.policy.classes[spec.priority_class]
        return new_event(
            JobAdmitted, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key="decision", cause=cause,
            queue=spec.queue, priority=pc.value, preemptible=pc.preemptible,
        )

    def _refusal(self, spec: JobSpec, user: str, user_field: str
                 ) -> tuple[RejectReason, str, str, tuple[str, ...] | list[str]] | None:
        """Why this job may not be admitted for ``user`` (reason, message, field, accepted), or
        None: its webhooks, queue, team, user, priority class, flavors and whether it could ever run."""

        def reject(reason: RejectReason, message: str, field_: str, accepted=()):
            return reason, message, field_, tuple(accepted)

        for i, hook in enumerate(spec.notify.webhooks):
            # only what the URL spells is judged here; the notifier judges what a name resolves to
            if (refused := url_refusal(hook.url, self.webhook_allow)) is not None:
                field_ = f"spec.notify.webhooks[{i}].url"
                return reject(RejectReason.FORBIDDEN, refused.message(hook.url, field_), field_)
        queue = self.state.queues.get(spec.queue)
        # A rejection is the team's to read (its tenant stream): it names the team's own queues
        # only, never another team's queue or team.
        own = sorted(name for name, q in self.state.queues.items() if spec.team in q.allowed_teams)
        if queue is None:
            return reject(
                RejectReason.UNKNOWN_QUEUE,
                f"spec.queue {spec.queue!r} does not exist; accepted: the queues of team {spec.team!r}: "
                f"{', '.join(own) or '(none configured)'}",
                "spec.queue", own,
            )
        if spec.team not in queue.allowed_teams:
            return reject(
                RejectReason.FORBIDDEN,
                f"team {spec.team!r} may not submit to queue {queue.name!r}; accepted: the queues of team "
                f"{spec.team!r}: {', '.join(own) or '(none configured)'}",
                "spec.queue", own,
            )
        if queue.allowed_users and user not in queue.allowed_users:
            return reject(
                RejectReason.FORBIDDEN,
                f"user {user!r} may not submit to queue {queue.name!r}; accepted users: "
                f"{', '.join(queue.allowed_users)}",
                user_field, queue.allowed_users,
            )
        classes = self.state.policy.classes
        pc = classes.get(spec.priority_class)
        allowed_classes = [c for c in queue.allowed_priority_classes or classes if c in classes]
        if pc is None or spec.priority_class not in allowed_classes:
            return reject(
                RejectReason.FORBIDDEN if pc is not None else RejectReason.SCHEMA_INVALID,
                f"spec.priority_class {spec.priority_class!r} is not accepted on queue {queue.name!r}; "
                f"accepted: {', '.join(sorted(allowed_classes))}",
                "spec.priority_class", allowed_classes,
            )
        queue_flavors = [q.flavor for q in queue.quotas]
        wanted = spec.gpu_flavors or tuple(queue_flavors)
        unknown = [f for f in spec.gpu_flavors if f not in queue_flavors]
        if spec.gpus > 0 and (unknown or not wanted):
            return reject(
                RejectReason.UNKNOWN_FLAVOR,
                f"spec.gpu_flavors {list(spec.gpu_flavors)} includes flavor(s) {unknown} that queue "
                f"{queue.name!r} has no quota for; accepted: {', '.join(queue_flavors) or '(none)'}",
                "spec.gpu_flavors", queue_flavors,
            )
        if spec.gpus > 0 and (problem := self._unsatisfiable(spec, wanted)):
            field_, message = problem
            return reject(RejectReason.UNSATISFIABLE, message, field_)
        return None

    def _unsatisfiable(self, spec: JobSpec, flavors: tuple[str, ...]) -> tuple[str, str] | None:
        """Resource sanity against the inventory: could any known node shape ever host one gang
        member (a fraction of a GPU only on nodes whose GPUs are shared), and are there enough such
        nodes for the gang? Free capacity is the scheduler's
        business. A flavor with no node registered yet is given the benefit of the doubt (its
        nodes may still be registering), so only a flavor whose nodes are all too small rejects.
        Returns (the field whose value rules the nodes out, the message), or None."""
        shapes = {shape: count for shape, count in self._node_shapes().items() if shape.flavor in flavors}
        if {shape.flavor for shape in shapes} != set(flavors):
            return None
        # Each requirement in turn narrows the shapes; the first that leaves none is at fault.
        requirements = (
            ("spec.gpu_milli", lambda n: spec.gpu_milli is None or n.sharable),
            ("spec.gpus", lambda n: n.gpus >= spec.gpus),
            ("spec.gpu_models", lambda n: not spec.gpu_models or n.product in spec.gpu_models),
            ("spec.node_features", lambda n: set(spec.node_features) <= n.features),
            ("spec.min_gpu_memory_mib",
             lambda n: spec.min_gpu_memory_mib is None or (n.memory_mib or 0) >= spec.min_gpu_memory_mib),
        )
        field_ = "spec.gang_size"
        for name, holds in requirements:
            left = {shape: count for shape, count in shapes.items() if holds(shape)}
            if not left:
                field_ = name
                break
            shapes = left
        else:
            # a gang's members are of one flavor and in one cluster (the scheduler's rule)
            per_group = Counter()
            for shape, count in shapes.items():
                per_group[(shape.flavor, shape.cluster)] += count
            if max(per_group.values()) >= spec.gang_size:
                return None
        if field_ == "spec.gpu_milli":
            queue = self.state.queues.get(spec.queue)
            quota_flavors = {q.flavor for q in queue.quotas} if queue is not None else set()
            shared = sorted({n.flavor for n in self._node_shapes() if n.sharable and n.flavor in quota_flavors})
            return field_, (
                f"spec.gpu_milli: {spec.gpu_milli} thousandths of a GPU needs a node whose GPUs are shared, and none "
                f"of the nodes of flavors {list(flavors)} shares its GPUs; accepted: whole GPUs (no gpu_milli), or "
                f"gpu_flavors with shared GPUs on queue {spec.queue!r}: {', '.join(shared) or '(none)'}"
            )
        largest = "; ".join(self._largest_node(f) for f in sorted(flavors))
        return field_, (
            f"{field_}: spec.gpus {spec.gpus} × gang_size {spec.gang_size} with min_gpu_memory_mib "
            f"{spec.min_gpu_memory_mib}, gpu_models {list(spec.gpu_models)} and node_features "
            f"{list(spec.node_features)} fits no "
            f"{spec.gang_size} node(s) of flavors {list(flavors)} (of one flavor, in one cluster); largest node per "
            f"flavor: {largest}"
        )

    def _largest_node(self, flavor: str) -> str:
        """A flavor's most GPUs, most GPU memory and features, over its known node shapes."""
        shapes = [n for n in self._node_shapes() if n.flavor == flavor]
        memory = max((n.memory_mib or 0) for n in shapes)
        features = sorted({f for n in shapes for f in n.features})
        models = sorted({n.product for n in shapes if n.product})
        return (f"{flavor}: {max(n.gpus for n in shapes)} GPUs, {memory} MiB each, features {features}, "
                f"models {models}")


def _parse_command(model, raw: bytes, sender: Principal):
    """A command other than a submission (which gets a JobRejected) in strict mode, sent by
    ``sender`` itself; else PoisonCommand naming the field and what is accepted."""
    try:
        command = parse_command(model, raw)
    except MalformedCommand as err:
        raise PoisonCommand(f"invalid {model.__name__}: {err.message}") from None
    except ValidationError as err:
        raise PoisonCommand(f"invalid {model.__name__}: {_validation_message(err)[1]}") from None
    if (problem := identity_problem(command, sender)) is not None:
        raise PoisonCommand(f"{model.__name__}: {problem[1]}")
    return command
