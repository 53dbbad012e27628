"""Changing the platform: commands published on a team's intake subjects, which admission
validates and turns into events. The subject says who sends (schemas.commands.Principal): the
credential the CLI connects with decides it (:func:`sender`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from pydantic import BaseModel, ValidationError

from gpusched.userinput import UserError, checked, first_error, read_document
from runtime import eventlog, observability
from schemas import (CancelJob, Event, JobAdmitted, JobCancelled, JobCancelRequested, JobCheckpointed, JobRejected,
                     JobSubmitted, JobSucceeded, ReportCheckpoint, SubmitJob, parse_event)
from schemas.commands import (
    OPERATOR,
    DeleteService,
    DeployService,
    MalformedCommand,
    Principal,
    ReportServiceLoad,
    ScaleService,
    job_id_for_key,
    load_command,
    parse_command,
)
from schemas.service import ServiceDeployed, ServiceSpec, ServiceUpdated
from schemas.job import rejection_id
from schemas.registry import SUBJECT_PREFIX

INTAKE_DEAD_LETTERS = f"{SUBJECT_PREFIX}.deadletter.admission.intake"


def submit_command_from_file(path: Path) -> SubmitJob:
    """A job file is either a SubmitJob (with `spec:`) or a bare job spec. It is checked as
    admission checks a command (``schemas.commands.load_command``, then the model), so a file
    the CLI accepts is one admission can read; UserError names the file and the field."""
    raw = read_document(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: (root): expected a mapping with the job spec, got {type(raw).__name__}")
    if "spec" not in raw:
        raw = {"spec": raw}
    command = checked(lambda: parse_command(SubmitJob, _as_command(raw, path)), path)
    if command.job_id is None:
        command = command.model_copy(update={"job_id": new_job_id(command)})
    return command


def _as_command(document: dict, path: Path) -> bytes:
    """The document as the JSON bytes admission will receive, through the intake's checks."""
    try:
        raw = json.dumps(document, default=_json_value).encode()
        load_command(raw)
        return raw
    except TypeError as err:
        raise UserError(f"{path}: {err}; accepted: strings, numbers, booleans, null, mappings and lists") from None
    except MalformedCommand as err:
        where = "" if err.message.startswith(err.field) else f"{err.field}: "
        raise UserError(f"{path}: {where}{err.message}") from None


def _json_value(value: Any) -> Any:
    if isinstance(value, (datetime, date)):  # YAML reads an unquoted time as one
        return value.isoformat()
    raise TypeError(f"a {type(value).__name__} value (YAML tag such as !!binary or !!set) is not accepted")


def new_job_id(command: SubmitJob) -> str:
    if command.spec.idempotency_key:
        return job_id_for_key(command.spec.team, command.spec.idempotency_key)
    return "j-" + uuid.uuid4().hex[:16]


def sender(user: str | None, team: str, verb: str) -> Principal:
    """Who a command of ``team`` is sent as, by the credential's name: the team's own credential,
    one of its users' (``<team>.<user>``), or the operator (the admin acts as the operator).
    UserError for a tenant credential of another team."""
    if user in (None, OPERATOR, "admin"):
        return Principal(team=team, user=OPERATOR, verb=verb, operator=True)
    if user == team:
        return Principal(team=team, user=team, verb=verb)
    own_team, _, member = user.partition(".")
    if own_team == team and member:
        return Principal(team=team, user=member, verb=verb)
    raise UserError(f"the credential {user!r} acts only for team {own_team!r}, not {team!r}; "
                    "use that team's credential or the operator's")


def default_on_behalf_of() -> str:
    """Whom the operator acts for when ``--on-behalf-of`` is not given: this OS user."""
    return os.environ.get("USER") or "cli"


async def publish_command(js: JetStreamContext, team: str, verb: str, command: BaseModel,
                          headers: dict[str, str] | None = None, on_behalf_of: str | None = None) -> int:
    """Publish ``command`` on the intake subject of the connection's credential (:func:`sender`).
    As the operator it names the user it acts for: ``on_behalf_of``, the command's own, or
    :func:`default_on_behalf_of`."""
    who = sender(eventlog.credential_of(js), team, verb)
    if who.operator and command.on_behalf_of is None:
        command = command.model_copy(update={"on_behalf_of": on_behalf_of or default_on_behalf_of()})
    hdrs = dict(headers or {})
    observability.inject_trace(hdrs)
    ack = await js.publish(who.subject(SUBJECT_PREFIX), command.model_dump_json().encode(),
                           headers=hdrs or None, timeout=10)
    return ack.seq


WAIT_S = 15.0
"""How long a command waits for the platform's answer by default."""
REPEAT_SETTLE_S = 1.0
"""A submission of an existing job id is an idempotent repeat (no event of its own) when no
rejection of it comes this long after the job's earlier decision was read."""


@dataclass(frozen=True)
class Answer:
    """The platform's answer to one command: the event that decided it, or admission's reason
    for dead-lettering it. ``repeat``: the job existed and the command changed nothing."""

    event: Event | None = None
    dead_letter: str | None = None
    repeat: bool = False


class SubmitAnswers:
    """Which event answers the SubmitJob at ``intake_seq``, in whatever order the events come
    (the CLI reads the job's subjects in stream order; the API's core subscriptions, one per
    subject, may deliver a JobAdmitted before its JobSubmitted): a JobRejected naming that intake
    sequence (filed under the job id or the rejection id), the job's decision once the job's
    JobSubmitted of that sequence has been seen, or, for a job id submitted before, the earlier
    decision once nothing else came (an idempotent repeat produces no event)."""

    def __init__(self, intake_seq: int) -> None:
        self.intake_seq = intake_seq
        self.ours = False
        self.decision: tuple[Event, float] | None = None

    def take(self, event: Event, now: float) -> Answer | None:
        if isinstance(event, JobRejected) and event.intake_sequence == self.intake_seq:
            return Answer(event)
        if isinstance(event, JobSubmitted) and event.intake_sequence == self.intake_seq:
            self.ours = True
        elif isinstance(event, (JobAdmitted, JobRejected)):
            self.decision = (event, now)
        return Answer(self.decision[0]) if self.ours and self.decision is not None else None

    def quiet(self, now: float) -> Answer | None:
        if not self.ours and self.decision is not None and now - self.decision[1] >= REPEAT_SETTLE_S:
            return Answer(self.decision[0], repeat=True)
        return None


class CancelAnswers:
    """What answers a CancelJob: the job's JobCancelRequested (this one's or an earlier one's) or
    JobCancelled; or the end it had already reached (admission then records nothing)."""

    ENDS = (JobCancelRequested, JobCancelled, JobSucceeded, JobRejected)

    def take(self, event: Event, now: float) -> Answer | None:
        if isinstance(event, self.ENDS):
            return Answer(event, repeat=not isinstance(event, (JobCancelRequested, JobCancelled)))
        return None

    def quiet(self, now: float) -> Answer | None:
        return None


class CheckpointAnswers:
    """The JobCheckpointed admission recorded for the report at ``intake_seq``."""

    def __init__(self, intake_seq: int) -> None:
        self.intake_seq = intake_seq

    def take(self, event: Event, now: float) -> Answer | None:
        if isinstance(event, JobCheckpointed) and event.intake_sequence == self.intake_seq:
            return Answer(event)
        return None

    def quiet(self, now: float) -> Answer | None:
        return None


def job_subjects(*job_ids: str) -> list[str]:
    return [f"{SUBJECT_PREFIX}.job.{j}.>" for j in job_ids]


async def wait_for_answer(js: JetStreamContext, subjects: list[str], intake_seq: int, answers,
                          timeout_s: float = WAIT_S) -> Answer | None:
    """The first answer to the command at ``intake_seq``: an event on ``subjects`` (a job's, a
    service's) that ``answers`` accepts, or the intake's dead-letter record for that sequence;
    None after ``timeout_s``. Two following readers (the subjects, the intake's dead letters),
    each from the first message, so an answer written before they start is found too."""
    readers = [asyncio.create_task(_follow_events(js, subjects, answers)),
               asyncio.create_task(_follow_dead_letters(js, intake_seq))]
    try:
        done, _ = await asyncio.wait(readers, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        return done.pop().result() if done else None
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def _follow_events(js: JetStreamContext, subjects: list[str], answers) -> Answer:
    clock = asyncio.get_running_loop().time
    batches = eventlog.read_batches(js, subjects=subjects, follow=True, batch=64, idle_s=0.25)
    async with contextlib.aclosing(batches):
        async for msgs in batches:
            for msg in msgs:
                if (answer := answers.take(parse_event(msg.data), clock())) is not None:
                    return answer
            if not msgs and (answer := answers.quiet(clock())) is not None:
                return answer
    raise RuntimeError("a following read ended")  # pragma: no cover - follow=True never ends


async def _follow_dead_letters(js: JetStreamContext, intake_seq: int) -> Answer:
    batches = eventlog.read_batches(js, stream=eventlog.DLQ_STREAM, subjects=[INTAKE_DEAD_LETTERS], follow=True,
                                    batch=64, idle_s=0.25)
    async with contextlib.aclosing(batches):
        async for msgs in batches:
            for msg in msgs:
                headers = msg.headers or {}
                if (headers.get("Gpusched-Original-Stream"), headers.get("Gpusched-Original-Sequence")) == (
                        eventlog.INTAKE_STREAM, str(intake_seq)):
                    return Answer(dead_letter=headers.get("Gpusched-Reason") or "(no reason recorded)")
    raise RuntimeError("a following read ended")  # pragma: no cover - follow=True never ends


async def wait_for_decision(js: JetStreamContext, job_id: str, intake_seq: int,
                            timeout_s: float = WAIT_S) -> Answer | None:
    """The answer to the SubmitJob at ``intake_seq`` (see :class:`SubmitAnswers`), or its dead letter."""
    return await wait_for_answer(js, job_subjects(job_id, rejection_id(intake_seq)), intake_seq, SubmitAnswers(intake_seq),
                                 timeout_s)


async def wait_for_cancel(js: JetStreamContext, job_id: str, intake_seq: int,
                          timeout_s: float = WAIT_S) -> Answer | None:
    """The answer to the CancelJob at ``intake_seq`` (see :class:`CancelAnswers`), or its dead letter."""
    return await wait_for_answer(js, job_subjects(job_id), intake_seq, CancelAnswers(), timeout_s)


def refused(what: str, answer: Answer | None, job_id: str, intake_seq: int, timeout_s: float = WAIT_S) -> None:
    """UserError when admission dead-lettered the command or did not answer in time."""
    if answer is None:
        raise UserError(f"no answer to the {what} (intake sequence {intake_seq}) within {timeout_s:.0f} s; "
                        f"see `gpusched events {job_id}` and `gpusched dlq`")
    if answer.dead_letter is not None:
        raise UserError(f"the platform refused the {what}: {answer.dead_letter}")


async def cancel(js: JetStreamContext, job_id: str, team: str, reason: str = "",
                 on_behalf_of: str | None = None) -> int:
    try:
        command = CancelJob(job_id=job_id, reason=reason)
    except ValidationError as err:
        raise UserError(first_error(err, "cancel")) from None
    return await publish_command(js, team, "cancel", command, on_behalf_of=on_behalf_of)


async def report_checkpoint(js: JetStreamContext, job_id: str, team: str, attempt: int, *,
                            checkpointed_at: datetime | None = None, step: int | None = None,
                            location: str = "", on_behalf_of: str | None = None) -> int:
    """Publish ReportCheckpoint on a ``checkpoint`` intake subject of ``team``; admission records
    JobCheckpointed, or dead-letters the report with the reason (see ``gpusched dlq``). Without
    ``checkpointed_at`` admission stamps the report with the platform clock."""
    try:
        command = ReportCheckpoint(job_id=job_id, attempt=attempt, checkpointed_at=checkpointed_at,
                                   step=step, location=location)
    except ValidationError as err:
        raise UserError(first_error(err, "checkpoint")) from None
    return await publish_command(js, team, "checkpoint", command, on_behalf_of=on_behalf_of)


async def wait_for_checkpoint(js: JetStreamContext, job_id: str, intake_seq: int,
                              timeout_s: float = WAIT_S) -> JobCheckpointed:
    """The JobCheckpointed admission recorded for the report at ``intake_seq``; UserError with
    admission's reason when it dead-lettered the report instead, or when neither came in time."""
    answer = await wait_for_answer(js, job_subjects(job_id), intake_seq, CheckpointAnswers(intake_seq), timeout_s)
    refused("checkpoint report", answer, job_id, intake_seq, timeout_s)
    return answer.event


# -- inference services (docs/serving.md) ----------------------------------------------------------


def deploy_command_from_file(path: Path) -> DeployService:
    """A service file is a DeployService (with ``spec:``) or a bare service spec, checked as
    admission checks the command; UserError names the file and the field."""
    raw = read_document(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: (root): expected a mapping with the service spec, got {type(raw).__name__}")
    if "spec" not in raw:
        raw = {"spec": raw}
    return checked(lambda: parse_command(DeployService, _as_command(raw, path)), path)


class ServiceAnswers:
    """The event admission recorded for the service command at ``intake_seq``. A deploy of the
    spec the service already has records nothing: ``unchanged`` is that spec, and the service's
    latest deploy or update with it answers once nothing else came."""

    def __init__(self, intake_seq: int, unchanged: ServiceSpec | None = None) -> None:
        self.intake_seq, self.unchanged = intake_seq, unchanged
        self.latest: tuple[Event, float] | None = None

    def take(self, event: Event, now: float) -> Answer | None:
        if getattr(event, "intake_sequence", None) == self.intake_seq:
            return Answer(event)
        if isinstance(event, (ServiceDeployed, ServiceUpdated)):
            self.latest = (event, now)
        return None

    def quiet(self, now: float) -> Answer | None:
        if (self.unchanged is not None and self.latest is not None and self.latest[0].spec == self.unchanged
                and now - self.latest[1] >= REPEAT_SETTLE_S):
            return Answer(self.latest[0], repeat=True)
        return None


async def service_command(js: JetStreamContext, team: str, verb: str, command: BaseModel, service: str,
                          on_behalf_of: str | None = None, timeout_s: float = WAIT_S) -> Answer:
    """Publish a service command and wait for admission's answer; UserError when it refuses
    the command (with its reason) or does not answer in time."""
    seq = await publish_command(js, team, verb, command, on_behalf_of=on_behalf_of)
    unchanged = command.spec if isinstance(command, DeployService) else None
    answer = await wait_for_answer(js, [f"{SUBJECT_PREFIX}.service.{service}.>"], seq,
                                   ServiceAnswers(seq, unchanged), timeout_s)
    if answer is None:
        raise UserError(f"no answer to the {verb} of service {service} (intake sequence {seq}) within "
                        f"{timeout_s:.0f} s; see `gpusched dlq`")
    if answer.dead_letter is not None:
        raise UserError(f"the platform refused the {verb} of service {service}: {answer.dead_letter}")
    return answer


def scale_command(service: str, replicas: int) -> ScaleService:
    try:
        return ScaleService(service=service, replicas=replicas)
    except ValidationError as err:
        raise UserError(first_error(err, "scale")) from None


def load_command_for(service: str, requests_per_second: float) -> ReportServiceLoad:
    try:
        return ReportServiceLoad(service=service, requests_per_second=requests_per_second)
    except ValidationError as err:
        raise UserError(first_error(err, "report-load")) from None


def delete_command(service: str) -> DeleteService:
    try:
        return DeleteService(service=service)
    except ValidationError as err:
        raise UserError(first_error(err, "delete-service")) from None
