"""Commands: what upstream systems send to the intake subjects. Not events: admission decides."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, TypeVar

from pydantic import Field, field_validator

from schemas.envelope import NAME_PATTERN, Contract, Timestamp
from schemas.job import JobSpec

MAX_COMMAND_BYTES = 64 * 1024
"""Admission rejects larger commands (PAYLOAD_TOO_LARGE); the intake stream refuses > 1 MiB."""
MAX_COMMAND_DEPTH = 32
"""Most levels of nested objects and arrays a command may have (a SubmitJob needs 4)."""


RESERVED_JOB_ID_PREFIX = "rejected-"
"""Aggregate ids of rejections filed by intake sequence (schemas.job.rejection_id)."""


class SubmitJob(Contract):
    """Published to ``gpusched.intake.<team>.submit``; ``spec.team`` must match the subject."""

    job_id: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Client-chosen id; derived from the idempotency key or intake position if absent",
        json_schema_extra={"not": {"pattern": f"^{RESERVED_JOB_ID_PREFIX}"}},
    )
    submitter: str = Field(min_length=1, max_length=253, description="User or system submitting")
    spec: JobSpec

    @field_validator("job_id")
    @classmethod
    def _not_reserved(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(RESERVED_JOB_ID_PREFIX):
            raise ValueError(f"job ids starting with {RESERVED_JOB_ID_PREFIX!r} are reserved for rejections")
        return value


class CancelJob(Contract):
    """Published to ``gpusched.intake.<team>.cancel``."""

    job_id: str = Field(pattern=NAME_PATTERN)
    requested_by: str = Field(min_length=1, max_length=253)
    reason: str = Field(default="", max_length=1024)


class ReportCheckpoint(Contract):
    """Published to ``gpusched.intake.<team>.checkpoint`` by a running job (or on its behalf):
    admission checks the job and attempt and records JobCheckpointed."""

    job_id: str = Field(pattern=NAME_PATTERN)
    attempt: int = Field(ge=1)
    checkpointed_at: Timestamp | None = Field(
        default=None, description="When the checkpoint was taken; omitted: when admission receives the report, "
                                  "on the platform clock (which may run faster than wall time)")
    step: int | None = Field(default=None, ge=0)
    location: str = Field(default="", max_length=1024)
    reported_by: str = Field(min_length=1, max_length=253)


def job_id_for_key(team: str, idempotency_key: str) -> str:
    """The job id of a keyed submission that names none: the same team and key, the same job."""
    return "j-" + uuid.uuid5(uuid.NAMESPACE_URL, f"gpusched:{team}:{idempotency_key}").hex[:20]


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
    return model.model_validate_json(raw, strict=True)


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
