"""Commands: what upstream systems send to the intake subjects. Not events: admission decides."""

from __future__ import annotations

import uuid

from pydantic import AwareDatetime, Field, field_validator

from schemas.envelope import NAME_PATTERN, Contract
from schemas.job import JobSpec

MAX_COMMAND_BYTES = 64 * 1024
"""Admission rejects larger commands (PAYLOAD_TOO_LARGE); the intake stream refuses > 1 MiB."""


RESERVED_JOB_ID_PREFIX = "rejected-"
"""Aggregate ids of rejections filed by intake sequence (schemas.job.rejection_id)."""


class SubmitJob(Contract):
    """Published to ``gpusched.intake.<team>.submit``; ``spec.team`` must match the subject."""

    job_id: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Client-chosen id; derived from the idempotency key or intake position if absent",
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
    checkpointed_at: AwareDatetime
    step: int | None = Field(default=None, ge=0)
    location: str = Field(default="", max_length=1024)
    reported_by: str = Field(min_length=1, max_length=253)


def job_id_for_key(team: str, idempotency_key: str) -> str:
    """The job id of a keyed submission that names none: the same team and key, the same job."""
    return "j-" + uuid.uuid5(uuid.NAMESPACE_URL, f"gpusched:{team}:{idempotency_key}").hex[:20]
