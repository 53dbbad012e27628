"""The API's answers as typed values: times are ``datetime`` (aware, UTC offsets kept), a job's
state is the contract's :class:`~gpusched_sdk.contract.jobstate.JobState`. Fields a newer API
adds are kept (``model_extra``), and each result also reads as a mapping (``job["state"]``), as the
SDK's dict results did before."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from .contract.jobstate import JobState


class Result(BaseModel):
    """An answer of the API: typed fields, unknown ones kept, readable as ``result["field"]``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


class Submitted(Result):
    """Admission's answer to a submission: ``decision`` is ``admitted``, or ``pending`` when no
    answer came within the wait (a rejection raises :class:`~gpusched_sdk.Rejected`)."""

    job_id: str
    intake_sequence: int
    decision: str
    repeat: bool = False
    queue: str | None = None


class Answered(Result):
    """The answer to a cancel or a checkpoint report: the event that answered it, or ``pending``."""

    job_id: str
    intake_sequence: int
    outcome: str
    repeat: bool = False


class ServiceAnswer(Result):
    """The answer to a deploy, scale, load report or delete of a service."""

    service: str
    intake_sequence: int
    outcome: str
    repeat: bool = False
    generation: int | None = None


class Job(Result):
    """A job's row in the read models (``GET /v1/jobs/{id}``, an item of ``GET /v1/jobs``)."""

    job_id: str
    state: JobState
    team: str | None = None
    project: str | None = None
    queue: str | None = None
    kind: str | None = None
    priority_class: str | None = None
    submitter: str | None = None
    attempt: int | None = None
    total_gpus: int | None = None
    flavor: str | None = None
    nodes: list[str] | None = None
    reason: str | None = None
    message: str | None = None
    submitted_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    position: int | None = None
    """Its place in its queue's line (1: next) while it waits for quota; only in ``jobs()``."""


class WaitReason(Result):
    """Why quota (``code``: a QuotaWaitReason) or the scheduler (a SchedulingWaitReason) holds it."""

    code: str
    message: str | None = None
    since: datetime | None = None
    time: datetime | None = None
    attempt: int | None = None
    position: int | None = None
    flavor: str | None = None


class Why(Result):
    """Why a job waits (``GET /v1/jobs/{id}/why``): the current reasons and their history."""

    job_id: str
    queue: str | None = None
    last_event: str
    since: datetime | None = None
    waiting_for_quota: bool | None = None
    reason: WaitReason | None = None
    history: list[WaitReason] = []
    scheduling_reason: WaitReason | None = None
    scheduling_history: list[WaitReason] = []


class Me(Result):
    """The token's holder (``GET /v1/whoami``)."""

    name: str
    role: str
    team: str | None = None
    token_id: str | None = None
