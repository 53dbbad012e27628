"""Commands: what upstream systems send to the intake subjects. Not events: admission decides."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import Field, ValidationError, field_validator

from .envelope import NAME_PATTERN, Contract, Timestamp
from .job import JobSpec
from .service import REPLICA_PREFIX, MAX_REPLICAS, ServiceName, ServiceSpec

MAX_COMMAND_BYTES = 64 * 1024
"""Admission rejects larger commands (PAYLOAD_TOO_LARGE); the intake stream refuses > 1 MiB."""
MAX_COMMAND_DEPTH = 32
"""Most levels of nested objects and arrays a command may have (a SubmitJob needs 4)."""


RESERVED_JOB_ID_PREFIX = "rejected-"
"""Aggregate ids of rejections filed by intake sequence (schemas.job.rejection_id)."""


INTAKE_VERBS = ("submit", "cancel", "checkpoint", "deploy", "scale", "delete", "load")
"""submit, cancel, checkpoint: jobs; deploy, scale, delete, load: inference services (schemas.service)."""
OPERATOR = "operator"
"""The user name of the operator credential, recorded as the submitter of what it sends."""


@dataclass(frozen=True)
class Principal:
    """Who sent a command, as its intake subject says; NATS permissions let each credential
    publish only on its own subjects, so the subject is the authenticated identity:

    ``gpusched.intake.<team>.<verb>``              the team's credential; the user is the team
    ``gpusched.intake.<team>.user.<user>.<verb>``  a user of the team (its credential, or the API)
    ``gpusched.intake.<team>.operator.<verb>``     the operator, for a user named in ``on_behalf_of``
    """

    team: str
    user: str
    verb: str
    operator: bool = False

    def subject(self, prefix: str = "gpusched") -> str:
        if self.operator:
            return f"{prefix}.intake.{self.team}.{OPERATOR}.{self.verb}"
        if self.user != self.team:
            return f"{prefix}.intake.{self.team}.user.{self.user}.{self.verb}"
        return f"{prefix}.intake.{self.team}.{self.verb}"


_NAME = re.compile(NAME_PATTERN)


def intake_principal(subject: str) -> Principal:
    """The :class:`Principal` of an intake subject; ValueError naming the accepted forms."""
    parts = subject.split(".")
    principal = None
    if len(parts) == 4:
        principal = Principal(team=parts[2], user=parts[2], verb=parts[3])
    elif len(parts) == 5 and parts[3] == OPERATOR:
        principal = Principal(team=parts[2], user=OPERATOR, verb=parts[4], operator=True)
    elif len(parts) == 6 and parts[3] == "user":
        principal = Principal(team=parts[2], user=parts[4], verb=parts[5])
    if (principal is None or principal.verb not in INTAKE_VERBS or not _NAME.match(principal.team)
            or not _NAME.match(principal.user)):
        raise ValueError(
            f"unknown intake subject {subject!r}; accepted: gpusched.intake.<team>.<verb>, "
            f"gpusched.intake.<team>.user.<user>.<verb>, gpusched.intake.<team>.operator.<verb> "
            f"with <verb> one of {', '.join(INTAKE_VERBS)}"
        )
    return principal


class _Identified(Contract):
    """What every command may say about who sends it. The sender is the authenticated
    :class:`Principal`; a document that names someone else is refused."""

    on_behalf_of: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Operator commands only (and required there): the user the operator acts for; recorded",
    )


def _not_reserved_schema(schema: dict[str, Any]) -> None:
    """JSON Schema of ``job_id``: the string branch refuses the reserved prefix (null stays valid)."""
    for branch in schema.get("anyOf", ()):
        if branch.get("type") == "string":
            branch["not"] = {"pattern": f"^{RESERVED_JOB_ID_PREFIX}"}


class SubmitJob(_Identified):
    """Published to an intake subject of the team (:class:`Principal`); ``spec.team`` must match it."""

    job_id: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Client-chosen id; derived from the idempotency key or intake position if absent",
        json_schema_extra=lambda schema: _not_reserved_schema(schema),
    )
    submitter: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Optional: must name the authenticated user (the intake subject's) when given",
    )
    spec: JobSpec

    @field_validator("job_id")
    @classmethod
    def _not_reserved(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(RESERVED_JOB_ID_PREFIX):
            raise ValueError(f"job ids starting with {RESERVED_JOB_ID_PREFIX!r} are reserved for rejections")
        if value is not None and value.startswith(REPLICA_PREFIX):
            raise ValueError(f"job ids starting with {REPLICA_PREFIX!r} are reserved for the replicas of services")
        return value


class CancelJob(_Identified):
    """Published to a ``cancel`` intake subject of the job's team."""

    job_id: str = Field(pattern=NAME_PATTERN)
    requested_by: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Optional: must name the authenticated user (the intake subject's) when given",
    )
    reason: str = Field(default="", max_length=1024)


class ReportCheckpoint(_Identified):
    """Published to a ``checkpoint`` intake subject of the job's team by a running job (or on its
    behalf): admission checks the job and attempt and records JobCheckpointed."""

    job_id: str = Field(pattern=NAME_PATTERN)
    attempt: int = Field(ge=1)
    checkpointed_at: Timestamp | None = Field(
        default=None, description="When the checkpoint was taken; omitted: when admission receives the report, "
                                  "on the platform clock (which may run faster than wall time)")
    step: int | None = Field(default=None, ge=0)
    location: str = Field(default="", max_length=1024)
    reported_by: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Optional: must name the authenticated user (the intake subject's) when given",
    )


class DeployService(_Identified):
    """Published to a ``deploy`` intake subject of the service's team: a new service, or a new
    spec for one of the team's (a changed replica template rolls out)."""

    spec: ServiceSpec


class ScaleService(_Identified):
    """Published to a ``scale`` intake subject of the service's team."""

    service: ServiceName
    replicas: int = Field(ge=0, le=MAX_REPLICAS)


class ReportServiceLoad(_Identified):
    """Published to a ``load`` intake subject of the service's team, by its ingress: the load the
    ``requests_per_replica`` autoscaling rule reads."""

    service: ServiceName
    requests_per_second: float = Field(ge=0, le=1e9, allow_inf_nan=False)


class DeleteService(_Identified):
    """Published to a ``delete`` intake subject of the service's team: its replicas are retired."""

    service: ServiceName


COMMAND_MODELS: dict[str, type[Contract]] = {
    "submit": SubmitJob, "cancel": CancelJob, "checkpoint": ReportCheckpoint, "deploy": DeployService,
    "scale": ScaleService, "delete": DeleteService, "load": ReportServiceLoad}
"""The command each intake verb carries (INTAKE_VERBS)."""


def identity_problem(command: Contract, principal: Principal) -> tuple[str, str] | None:
    """(field, message) when the document contradicts who sent it: it names another user than
    the authenticated one, or an operator command lacks ``on_behalf_of``, or another sender gives one."""
    claimed_field = {SubmitJob: "submitter", CancelJob: "requested_by", ReportCheckpoint: "reported_by"}.get(type(command))
    claimed = getattr(command, claimed_field) if claimed_field else None
    if claimed is not None and claimed != principal.user:
        return claimed_field, (
            f"{claimed_field} {claimed!r} is not the sender: this intake subject authenticates {principal.user!r}; "
            f"accepted: {principal.user!r} or no {claimed_field} (identity comes from the credential)")
    if principal.operator and command.on_behalf_of is None:
        return "on_behalf_of", ("the operator acts for a team only on behalf of a user: on_behalf_of is required "
                                "on gpusched.intake.<team>.operator.<verb>")
    if not principal.operator and command.on_behalf_of is not None:
        return "on_behalf_of", (f"on_behalf_of is for the operator's commands; {principal.user!r} acts only for "
                                "itself: leave it out")
    return None


def job_id_for_key(team: str, idempotency_key: str) -> str:
    """The job id of a keyed submission that names none: the same team and key, the same job."""
    return "j-" + uuid.uuid5(uuid.NAMESPACE_URL, f"gpusched:{team}:{idempotency_key}").hex[:20]


def job_id_of(command: SubmitJob, intake_seq: int | None = None) -> str:
    """The id of the job a SubmitJob creates: the one rule every door follows (the CLI and the
    API before they publish, admission when it records the job).

    - the command's own ``job_id``, when it names one;
    - with ``spec.idempotency_key``: :func:`job_id_for_key` (the same team and key, the same job);
    - else, at admission, which knows the command's intake sequence: ``j-<intake_seq>`` (a
      publisher that names no id and no key learns its job's id from the publish acknowledgement);
    - else (a client naming the id before it publishes, so that it can follow the job's subjects
      first): a fresh ``j-<16 hex>``.

    With an ``intake_seq`` the answer depends on the command and the sequence only, so admission's
    replay of the log assigns the ids its live run did.

    A job id that exists already is not reused: resent without an idempotency key (by any door)
    it is rejected ``duplicate-job-id`` under ``rejected-<intake seq>``; resent with the key and
    the same spec it is a repeat that records nothing (docs/publishing.md, "Resending")."""
    if command.job_id is not None:
        return command.job_id
    spec = command.spec
    if spec.idempotency_key:
        return job_id_for_key(spec.team, spec.idempotency_key)
    if intake_seq is not None:
        return f"j-{intake_seq}"
    return "j-" + uuid.uuid4().hex[:16]


class MalformedCommand(ValueError):
    """The bytes are not a command document admission can read: ``field`` (a dotted path, or
    ``(root)``) and what was wrong, with what is accepted. ``kind``: ``too-large``, ``not-json``
    (not UTF-8 JSON at all) or ``unreadable`` (too deep, or text the read models cannot store)."""

    def __init__(self, field: str, message: str, kind: str = "unreadable") -> None:
        super().__init__(message)
        self.field, self.message, self.kind = field, message, kind


_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_UNREADABLE = re.compile("[\x00\ud800-\udfff]")


def load_command(raw: bytes) -> Any:
    """A command's JSON document, checked before it is handed to a model: UTF-8 without a byte
    order mark, at most :data:`MAX_COMMAND_BYTES` and :data:`MAX_COMMAND_DEPTH` levels (checked
    before parsing, so no input can exhaust the parser), and no string (key or value) holding a
    NUL character or an unpaired UTF-16 surrogate (``"\\u0000"``, ``"\\ud800"``): text the read
    models cannot store. :class:`MalformedCommand` names the first offence."""
    if len(raw) > MAX_COMMAND_BYTES:
        raise MalformedCommand("(root)", f"command is {len(raw)} bytes; accepted: at most {MAX_COMMAND_BYTES} bytes",
                               "too-large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MalformedCommand("(root)", f"not JSON: not UTF-8 ({err}); accepted: UTF-8 JSON", kind="not-json") from None
    if text.startswith("\ufeff"):
        raise MalformedCommand("(root)", "not JSON: starts with a byte order mark; accepted: UTF-8 JSON without one",
                               kind="not-json")
    depth = deepest = 0
    for token in _STRUCTURE.finditer(raw):
        bracket = token.group()
        if bracket in (b"{", b"["):
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in (b"}", b"]"):
            depth -= 1
    if deepest > MAX_COMMAND_DEPTH:
        raise MalformedCommand("(root)", f"nested {deepest} levels deep; accepted: at most {MAX_COMMAND_DEPTH}")
    try:
        document = json.loads(text)
    except ValueError as err:
        raise MalformedCommand("(root)", f"not JSON: {err}", kind="not-json") from None
    _check_text(document, ())
    return document


C = TypeVar("C", bound=Contract)


def parse_command(model: type[C], raw: bytes) -> C:
    """A command from its bytes: :func:`load_command`'s checks, then ``model`` in strict mode, as
    the exported JSON Schemas say: JSON's own types only (no ``"1"`` or ``true`` for a number, no
    ``1`` for a string); times are RFC 3339 strings with an offset. MalformedCommand or
    pydantic.ValidationError."""
    load_command(raw)
    return validate_command(model, raw)


def validate_command(model: type[C], raw: bytes) -> C:
    """``model`` in strict mode from bytes :func:`load_command` has already checked (admission's
    path: it loads first to know the requested job id). pydantic.ValidationError."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as err:
        if not any(e["type"] == "int_type" and _integral(e["input"]) for e in err.errors()):
            raise
    # JSON Schema's "integer" is a number without a fraction, 7.0 included: read such a number
    # as the integer it is (a number with a fraction stays refused).
    return model.model_validate_json(json.dumps(json.loads(raw, parse_float=_number)), strict=True)


def _integral(value: Any) -> bool:
    return isinstance(value, float) and value.is_integer() and abs(value) <= 2**53


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if _integral(value) else value


def _check_text(value: Any, path: tuple[str, ...]) -> None:
    if isinstance(value, str):
        if (bad := _UNREADABLE.search(value)) is not None:
            what = "a NUL character" if bad.group() == "\x00" else "an unpaired UTF-16 surrogate"
            raise MalformedCommand(".".join(path) or "(root)",
                                   f"{'.'.join(path) or '(root)'}: contains {what} at offset {bad.start()}; "
                                   "accepted: text without NUL characters or unpaired surrogates")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(item, (*path, str(index)))
