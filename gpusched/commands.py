"""Changing the platform: commands published on a team's intake subjects
(``gpusched.intake.<team>.<verb>``), which admission validates and turns into events."""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import datetime
from pathlib import Path

from nats.js import JetStreamContext
from pydantic import BaseModel, ValidationError

from gpusched.history import job_events
from gpusched.userinput import UserError, first_error, load_yaml
from runtime import eventlog, observability
from schemas import CancelJob, Event, JobCheckpointed, ReportCheckpoint, SubmitJob
from schemas.commands import job_id_for_key
from schemas.job import rejection_id
from schemas.registry import SUBJECT_PREFIX

INTAKE_DEAD_LETTERS = f"{SUBJECT_PREFIX}.deadletter.admission.intake"


def submit_command_from_file(path: Path, submitter: str | None = None) -> SubmitJob:
    """A job file is either a SubmitJob (with `spec:`) or a bare job spec."""
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping with the job spec, got {type(raw).__name__}")
    if "spec" not in raw:
        raw = {"spec": raw}
    raw.setdefault("submitter", submitter or os.environ.get("USER") or "cli")
    try:
        command = SubmitJob.model_validate(raw)
    except ValidationError as err:
        raise UserError(first_error(err, str(path))) from None
    if command.job_id is None:
        command = command.model_copy(update={"job_id": new_job_id(command)})
    return command


def new_job_id(command: SubmitJob) -> str:
    if command.spec.idempotency_key:
        return job_id_for_key(command.spec.team, command.spec.idempotency_key)
    return "j-" + uuid.uuid4().hex[:16]


async def publish_command(js: JetStreamContext, team: str, verb: str, command: BaseModel,
                          headers: dict[str, str] | None = None) -> int:
    hdrs = dict(headers or {})
    observability.inject_trace(hdrs)
    ack = await js.publish(f"{SUBJECT_PREFIX}.intake.{team}.{verb}", command.model_dump_json().encode(),
                           headers=hdrs or None, timeout=10)
    return ack.seq


async def wait_for_decision(js: JetStreamContext, job_id: str, intake_seq: int, timeout_s: float = 15.0) -> Event | None:
    """JobAdmitted / JobRejected for this submission (filed under the job id, or under the
    rejection id derived from the intake sequence), or the existing job's JobSubmitted when the
    submission was an idempotent repeat."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for subject_id in (job_id, rejection_id(intake_seq)):
            for _, event in await job_events(js, subject_id):
                if event.type in ("JobAdmitted", "JobRejected"):
                    return event
        await asyncio.sleep(0.2)
    return None


async def cancel(js: JetStreamContext, job_id: str, team: str, requested_by: str, reason: str = "") -> int:
    return await publish_command(js, team, "cancel", CancelJob(job_id=job_id, requested_by=requested_by, reason=reason))


async def report_checkpoint(js: JetStreamContext, job_id: str, team: str, attempt: int, *, reported_by: str,
                            checkpointed_at: datetime | None = None, step: int | None = None,
                            location: str = "") -> int:
    """Publish ReportCheckpoint on ``gpusched.intake.<team>.checkpoint``; admission records
    JobCheckpointed, or dead-letters the report with the reason (see ``gpusched dlq``). Without
    ``checkpointed_at`` admission stamps the report with the platform clock."""
    try:
        command = ReportCheckpoint(job_id=job_id, attempt=attempt, checkpointed_at=checkpointed_at,
                                   step=step, location=location, reported_by=reported_by)
    except ValidationError as err:
        raise UserError(first_error(err, "checkpoint")) from None
    return await publish_command(js, team, "checkpoint", command)


async def wait_for_checkpoint(js: JetStreamContext, job_id: str, intake_seq: int,
                              timeout_s: float = 15.0) -> JobCheckpointed:
    """The JobCheckpointed admission recorded for the report at ``intake_seq``; UserError with
    admission's reason when it dead-lettered the report instead, or when neither came in time."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for _, event in await job_events(js, job_id):
            if isinstance(event, JobCheckpointed) and event.intake_sequence == intake_seq:
                return event
        async for msg in eventlog.read(js, stream=eventlog.DLQ_STREAM, subjects=[INTAKE_DEAD_LETTERS]):
            headers = msg.headers or {}
            if (headers.get("Gpusched-Original-Stream"), headers.get("Gpusched-Original-Sequence")) == (
                    eventlog.INTAKE_STREAM, str(intake_seq)):
                raise UserError(f"the platform refused the checkpoint report: {headers.get('Gpusched-Reason')}")
        await asyncio.sleep(0.2)
    raise UserError(f"no answer to the checkpoint report (intake sequence {intake_seq}) within {timeout_s:.0f} s; "
                    f"see `gpusched events {job_id}` and `gpusched dlq`")
