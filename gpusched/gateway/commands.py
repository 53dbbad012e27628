"""Changing the platform: the commands every door builds the same way (the job id, the
message id, whom an operator acts for), published on a team's intake subjects, which admission
validates and turns into events. The subject says who sends (schemas.commands.Principal): the
credential the CLI connects with decides it (:func:`sender`), the token for the API. The answer
is gpusched.gateway.answers'."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, TypeVar

from nats.js import JetStreamContext
from pydantic import BaseModel, ValidationError

from gpusched.gateway import answers, port
from gpusched.userinput import UserError, checked, first_error, read_document
from runtime import eventlog, eventtime, observability
from schemas import CancelJob, ReportCheckpoint, SubmitJob
from schemas.commands import (
    OPERATOR,
    DeleteService,
    DeployService,
    MalformedCommand,
    Principal,
    ReportServiceLoad,
    ScaleService,
    job_id_of,
    load_command,
    parse_command,
)
from schemas.job import JobSpec
from schemas.registry import SUBJECT_PREFIX

INTAKE_DEAD_LETTERS = answers.INTAKE_DEAD_LETTERS
C = TypeVar("C", bound=BaseModel)


def submit_command_from_file(path: Path) -> SubmitJob:
    """A job file is either a SubmitJob (with `spec:`) or a bare job spec. It is checked as
    admission checks a command (``schemas.commands.load_command``, then the model), so a file
    the CLI accepts is one admission can read; UserError names the file and the field."""
    raw = read_document(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: (root): expected a mapping with the job spec, got {type(raw).__name__}")
    if "spec" not in raw:
        raw = {"spec": raw}
    return submission(checked(lambda: parse_command(SubmitJob, _as_command(raw, path)), path))


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
    """The id the job will have (schemas.commands.job_id_of: the one rule, admission's too)."""
    return job_id_of(command)


def submission(command: SubmitJob) -> SubmitJob:
    """The command with the id its job will have (:func:`schemas.commands.job_id_of`), so that
    the sender can follow the job's subjects before admission answers."""
    return command if command.job_id is not None else command.model_copy(update={"job_id": job_id_of(command)})


def submit_message_id(command: SubmitJob) -> str:
    """The ``Nats-Msg-Id`` of a submission, whichever door sends it (docs/publishing.md,
    "Resending"): ``submit/<team>/<key>/<digest>`` for a keyed one, the digest of its job id and
    spec, so that JetStream drops a resend of the same command within its duplicate window (the
    first copy's answer is the answer, a repeat) while another spec under the same key always
    reaches admission, which rejects it ``duplicate-idempotency-key``; else one of its own, so
    that a job id resent without a key always reaches admission, which rejects it
    ``duplicate-job-id``."""
    team, key = command.spec.team, command.spec.idempotency_key
    if key:
        digest = hashlib.sha256(f"{command.job_id}\n{command.spec.model_dump_json()}".encode()).hexdigest()[:16]
        return f"submit/{team}/{key}/{digest}"
    return f"submit-id/{team}/{command.job_id}/{uuid.uuid4().hex[:12]}"


def acting_for(command: C, who: Principal, name: str) -> C:
    """An operator's command names the user it acts for: its own ``on_behalf_of``, else ``name``
    (the CLI: --on-behalf-of or the OS user; the API: the token's holder). A tenant's names none."""
    if who.operator and getattr(command, "on_behalf_of", None) is None:
        return command.model_copy(update={"on_behalf_of": name})
    return command


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
    seq, _ = await publish(js, team, verb, command, headers, on_behalf_of)
    return seq


async def publish(js: JetStreamContext, team: str, verb: str, command: BaseModel,
                  headers: dict[str, str] | None = None, on_behalf_of: str | None = None) -> tuple[int, bool]:
    """:func:`publish_command`, with whether JetStream dropped it as a duplicate (the same
    ``Nats-Msg-Id`` within the window: the sequence is then the first copy's)."""
    who = sender(eventlog.credential_of(js), team, verb)
    command = acting_for(command, who, on_behalf_of or default_on_behalf_of())
    hdrs = dict(headers or {})
    observability.inject_trace(hdrs)
    ack = await js.publish(who.subject(SUBJECT_PREFIX), command.model_dump_json().encode(),
                           headers=hdrs or None, timeout=10)
    return ack.seq, bool(ack.duplicate)


WAIT_S = port.WAIT_S
"""How long a command waits for the platform's answer by default."""
REPEAT_SETTLE_S = answers.REPEAT_SETTLE_S


def job_subjects(*job_ids: str) -> list[str]:
    return [f"{SUBJECT_PREFIX}.job.{j}.>" for j in job_ids]


async def wait_for_decision(js: JetStreamContext, job_id: str, intake_seq: int,
                            timeout_s: float = WAIT_S, keyed: bool = True,
                            spec: JobSpec | None = None) -> answers.Decided | None:
    """The answer to the SubmitJob at ``intake_seq`` read from the log (gpusched.gateway.answers)."""
    return await answers.wait_in_log(js, answers.for_submit(job_id, intake_seq, keyed=keyed, spec=spec), timeout_s)


def refused(what: str, answer: port.Answer, hint: str = "", timeout_s: float = WAIT_S) -> port.Answer:
    """``answer`` when it is a decision; UserError when admission dead-lettered the command or
    did not answer in time (``hint``: where to look)."""
    if answer.dead_letter is not None:
        raise UserError(f"the platform refused the {what}: {answer.dead_letter}")
    if answer.decision is None:
        raise UserError(f"no answer to the {what} (intake sequence {answer.intake_sequence}) within "
                        f"{timeout_s:.0f} s; {hint or 'see `gpusched dlq`'}")
    return answer


def job_hint(job_id: str) -> str:
    return f"see `gpusched events {job_id}` and `gpusched dlq`"


async def team_of(gateway: "port.Gateway", job_id: str) -> str:
    """The team that owns ``job_id`` (job ids are unique across teams), so that a command on a job
    needs no ``--team``: the read models' job, else (not projected yet, or the read models not
    ready) the job's JobSubmitted in the log. UserError when neither knows the job."""
    try:
        team = (await gateway.job(job_id)).get("team")
    except UserError:
        team = None
    if team:
        return team
    for event in await gateway.events(job_id):
        if event.get("type") == "JobSubmitted":
            return event["spec"]["team"]
    raise UserError(f"job {job_id!r} is unknown: neither the read models nor the event log have it; "
                    "check the id (`gpusched jobs`), or give its team with --team")


async def config_time(js: JetStreamContext) -> datetime:
    """When a configuration change the operator publishes (`gpusched apply`, a price file)
    happens: now, or the log's time when that is ahead (a platform clock faster than the wall, or
    one started ahead of it: `gpusched dev up --clock-start`). A change never takes effect in the
    platform's past, before events already logged."""
    now = datetime.now(UTC)
    logged = await eventtime.log_time(js, await eventlog.last_sequence(js))
    return max(now, logged) if logged is not None else now


def cancel_command(job_id: str, reason: str = "", on_behalf_of: str | None = None) -> CancelJob:
    """The CancelJob of ``job_id``; UserError naming the field (a door that validated its input
    first, the API, gets the same command)."""
    return _built("cancel", lambda: CancelJob(job_id=job_id, reason=reason, on_behalf_of=on_behalf_of))


def checkpoint_command(job_id: str, attempt: int, *, checkpointed_at: datetime | None = None, step: int | None = None,
                       location: str = "", on_behalf_of: str | None = None) -> ReportCheckpoint:
    """The ReportCheckpoint of a running attempt. Without ``checkpointed_at`` admission stamps
    the report with the platform clock."""
    return _built("checkpoint", lambda: ReportCheckpoint(job_id=job_id, attempt=attempt,
                                                         checkpointed_at=checkpointed_at, step=step,
                                                         location=location, on_behalf_of=on_behalf_of))


def _built(what: str, make):
    try:
        return make()
    except ValidationError as err:
        raise UserError(first_error(err, what)) from None


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


def scale_command(service: str, replicas: int) -> ScaleService:
    return _built("scale", lambda: ScaleService(service=service, replicas=replicas))


def load_command_for(service: str, requests_per_second: float) -> ReportServiceLoad:
    return _built("report-load", lambda: ReportServiceLoad(service=service, requests_per_second=requests_per_second))


def delete_command(service: str) -> DeleteService:
    return _built("delete-service", lambda: DeleteService(service=service))
