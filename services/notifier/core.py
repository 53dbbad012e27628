"""The notifier's pure core: which notification an event makes, where it goes, how it is signed
and how long a failed delivery waits. No I/O."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from datetime import datetime
from typing import NamedTuple

from schemas import (
    Event,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobFailed,
    JobPreempted,
    JobRejected,
    JobRetryScheduled,
    JobScheduled,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NotificationKind,
    NotifySpec,
    PreemptionRequested,
    QuotaPendingReasonChanged,
    ReclaimRequested,
    SchedulingPendingReasonChanged,
)
from schemas.commands import intake_principal
from schemas.envelope import NAME_PATTERN, derive_event_id
from schemas.service import ReplicaLost, ScaledTo, ServiceDeleted, ServiceDeployed, ServiceUpdated
from schemas.registry import SUBJECT_PREFIX, subject_suffix
from schemas.tenant import CommandRefused, JobNotification
from schemas.wording import describe, notice_deadline

K = NotificationKind
_NAME = re.compile(NAME_PATTERN)
KINDS: dict[type[Event], NotificationKind] = {
    JobSubmitted: K.SUBMITTED, JobAdmitted: K.ADMITTED, JobRejected: K.REJECTED,
    QuotaPendingReasonChanged: K.WAITING, SchedulingPendingReasonChanged: K.WAITING,
    JobScheduled: K.SCHEDULED, JobStarted: K.STARTED, JobCheckpointed: K.CHECKPOINTED,
    PreemptionRequested: K.PREEMPTION_NOTICE, ReclaimRequested: K.PREEMPTION_NOTICE,
    JobPreempted: K.PREEMPTED, JobRetryScheduled: K.RETRY_SCHEDULED, JobSucceeded: K.SUCCEEDED,
    JobFailed: K.FAILED, JobCancelRequested: K.CANCEL_REQUESTED, JobCancelled: K.CANCELLED,
}
"""The job events a team is told about; the others (quota held and released, a replica's
readiness) are only copied."""
SERVICE_KINDS: dict[type[Event], NotificationKind] = {
    ServiceDeployed: K.SERVICE_DEPLOYED, ServiceUpdated: K.SERVICE_UPDATED, ScaledTo: K.SERVICE_SCALED,
    ReplicaLost: K.REPLICA_LOST, ServiceDeleted: K.SERVICE_DELETED,
}
"""The service events a team is told about; the others (requests, placements, readiness of
replicas, load reports) are only copied."""


def durable_names(partition: int) -> tuple[str, str, str]:
    """The fan-out durables of one partition (jobs and services on the event log, refused
    commands on the dead letters): partition 0 keeps the names of the unpartitioned notifier, so
    going from one notifier to several continues where it was."""
    suffix = f"-p{partition}" if partition else ""
    return f"notifier{suffix}", f"notifier-services{suffix}", f"notifier-refused{suffix}"


REFUSED_COMMANDS = f"{SUBJECT_PREFIX}.deadletter.admission.intake"
"""Where admission dead-letters a command it cannot read or take (runtime.eventlog.dead_letter)."""


class RefusedCommand(NamedTuple):
    """A command admission dead-lettered, as its dead letter's headers tell it."""

    team: str
    subject: str  # the intake subject it was published on
    intake_sequence: int  # what the publisher's JetStream ack said
    reason: str
    refused_at: datetime


def refused_command(headers: dict[str, str] | None, refused_at: datetime) -> RefusedCommand | None:
    """The refused command a dead letter of admission's intake records, or None when its subject
    names no team (nobody to tell: only the operator's dead-letter list shows it)."""
    headers = headers or {}
    subject = headers.get("Gpusched-Original-Subject", "")
    try:
        team = intake_principal(subject).team
        sequence = int(headers.get("Gpusched-Original-Sequence", ""))
    except ValueError:
        return None
    return RefusedCommand(team, subject, sequence, headers.get("Gpusched-Reason", "no reason recorded"), refused_at)


def refused_subject(r: RefusedCommand) -> str:
    """``gpusched.tenant.<team>.refused.<intake sequence>``: the copy of the dead letter."""
    return f"{SUBJECT_PREFIX}.tenant.{r.team}.refused.{r.intake_sequence}"


def refused_copy(r: RefusedCommand, document: bytes) -> bytes:
    """What the team's stream holds of a refused command: a CommandRefused, the command's bytes
    base64-encoded (schemas.tenant.CommandRefused says why never as they were)."""
    return CommandRefused(intake_sequence=r.intake_sequence, subject=r.subject, reason=r.reason[:2000],
                          refused_at=r.refused_at,
                          document_base64=base64.b64encode(document).decode()).model_dump_json().encode()


def refused_notification(r: RefusedCommand, document: bytes) -> JobNotification:
    """The ``command-refused`` notification of a dead-lettered command: what was refused and why.
    It names the job when the document does (a readable one with a ``job_id``)."""
    verb = r.subject.rsplit(".", 1)[-1]
    record = f"dlq:admission.intake:{r.intake_sequence}"
    return JobNotification(
        notification_id=derive_event_id("JobNotification", record, K.COMMAND_REFUSED.value), kind=K.COMMAND_REFUSED,
        team=r.team, job_id=_job_id_in(document), intake_sequence=r.intake_sequence, occurred_at=r.refused_at,
        event_id=record, event_type="CommandRefused", reason="command-refused",
        summary=f"{verb} command refused (intake sequence {r.intake_sequence}, subject {r.subject}): {r.reason}"[:4096])


def _job_id_in(document: bytes) -> str | None:
    try:
        job_id = json.loads(document).get("job_id")
    except (ValueError, AttributeError):
        return None
    return job_id if isinstance(job_id, str) and _NAME.fullmatch(job_id) else None


def copy_subject(team: str, event: Event) -> str:
    """``gpusched.tenant.<team>.job.<id>.<token>``, or ``….service.<name>.<token>``."""
    return f"{SUBJECT_PREFIX}.tenant.{team}.{type(event).aggregate}.{event.aggregate_id}.{subject_suffix(event.type)}"


def notify_subject(n: JobNotification) -> str:
    """``….notify.<job>.<kind>``, ``….notify.<service>.<kind>`` for a service's own, or
    ``….notify.command-<intake sequence>.command-refused`` for a refused command."""
    about = f"command-{n.intake_sequence}" if n.kind is K.COMMAND_REFUSED else n.job_id or n.service
    return f"{SUBJECT_PREFIX}.tenant.{n.team}.notify.{about}.{n.kind.value}"


def delivery_subject(team: str, job_or_service: str) -> str:
    return f"{SUBJECT_PREFIX}.tenant.{team}.delivery.{job_or_service}"


def notification(event: Event, team: str) -> JobNotification | None:
    """The notification ``event`` makes for its job's (or service's) ``team``, or None."""
    kind = KINDS.get(type(event)) or SERVICE_KINDS.get(type(event))
    if kind is None:
        return None
    if type(event).aggregate == "service":
        about = {"service": event.aggregate_id, "job_id": getattr(event, "job_id", None)}
        details = _service_details(event)
    else:
        about = {"job_id": event.aggregate_id}
        details = _details(event)
    return JobNotification(
        notification_id=derive_event_id("JobNotification", event.event_id, kind.value), kind=kind, team=team,
        attempt=getattr(event, "attempt", None), occurred_at=event.occurred_at, event_id=event.event_id,
        event_type=event.type, **about, **details,
    )


def _service_details(e: Event) -> dict:
    """The summary line and the fields of a service's kind."""
    match e:
        case ServiceDeployed():
            r = e.spec.replicas
            return {"summary": f"service {e.aggregate_id} deployed by {e.deployed_by}: {r.desired} replica(s) "
                               f"({r.min} to {r.max}) of {e.spec.replica.gpus} GPU(s) in queue {e.spec.queue}",
                    "replicas": r.desired}
        case ServiceUpdated():
            return {"summary": f"service {e.aggregate_id} updated by {e.updated_by}: {e.spec.replicas.desired} "
                               f"replica(s), replica template generation {e.generation}",
                    "replicas": e.spec.replicas.desired}
        case ScaledTo():
            asked = "" if e.requested == e.replicas else f" ({e.requested} asked)"
            return {"summary": f"service {e.aggregate_id} scaled to {e.replicas} replica(s) by the {e.by}{asked}"
                               + (f": {e.message}" if e.message else ""),
                    "replicas": e.replicas}
        case ReplicaLost():
            then = "another replica replaces it" if e.replaced else "its job retries"
            return {"summary": f"replica {e.job_id} of service {e.aggregate_id} lost (attempt {e.attempt}): "
                               f"{e.reason}; {then}", "replaced": e.replaced}
        case ServiceDeleted():
            return {"summary": f"service {e.aggregate_id} deleted by {e.deleted_by}; its replicas are retired"}
    raise AssertionError(f"no details for {e.type}")


def _details(e: Event) -> dict:
    """The summary line (schemas.wording's sentence, after ``attempt <n>:`` where the event is an
    attempt's, as the console's timeline words it) and the fields of the kind."""
    summary = describe(e)
    if summary is None:
        raise AssertionError(f"no details for {e.type}")
    attempt = getattr(e, "attempt", None)
    if attempt is not None and not isinstance(e, QuotaPendingReasonChanged | SchedulingPendingReasonChanged):
        summary = f"attempt {attempt}: {summary}"
    match e:
        case JobRejected():
            return {"summary": summary, "reason": e.reason.value, "field": e.field}
        case QuotaPendingReasonChanged() | SchedulingPendingReasonChanged():
            return {"summary": summary, "reason": e.reason.value}
        case PreemptionRequested() | ReclaimRequested():
            return {"summary": summary, "deadline": notice_deadline(e), "grace_seconds": e.grace_seconds,
                    "by_job": e.for_job}
        case JobPreempted():
            return {"summary": summary, "reason": "preempted", "by_job": e.preempted_by}
        case JobRetryScheduled():
            return {"summary": summary, "next_attempt": e.next_attempt, "not_before": e.not_before}
        case JobFailed():
            return {"summary": summary, "reason": e.reason.value, "exit_code": e.exit_code, "retryable": e.retryable}
        case JobCancelled():
            return {"summary": summary, "reason": "cancelled"}
    return {"summary": summary}


def webhooks_for(kind: NotificationKind, *specs: NotifySpec | None) -> list[str]:
    """The URLs a notification of ``kind`` goes to: every webhook of the given specs (the team's,
    the job's) that wants it, each URL once, in order."""
    urls: list[str] = []
    for spec in specs:
        for hook in spec.webhooks if spec is not None else ():
            if hook.wants(kind) and hook.url not in urls:
                urls.append(hook.url)
    return urls


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The ``Gpusched-Signature`` header: ``t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>``.
    A receiver recomputes it and compares in constant time; the timestamp bounds replays."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def backoff_s(failures: int, first_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Seconds before the next try after ``failures`` failed ones: 0.5, 1, 2, 4, ... at most 30."""
    return min(cap_s, first_s * 2 ** max(0, failures - 1))
