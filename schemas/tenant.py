"""What a team reads from its tenant stream ``GPUSCHED_TENANT_<team>`` beside the copies of its
jobs' and services' events: notifications (``gpusched.tenant.<team>.notify.<job_id>.<kind>``, or
``….notify.<service>.<kind>`` for a service's own) and the webhook delivery log
(``gpusched.tenant.<team>.delivery.<job_id or service>``); and the commands of the team that
admission refused unread (``gpusched.tenant.<team>.refused.<intake sequence>``: a
:class:`CommandRefused`). The notifier writes them all."""

from __future__ import annotations

import re
from typing import Literal, TypeVar

from pydantic import Field

from .envelope import NAME_PATTERN, Contract, Event, Timestamp
from .job import JobPreempted, PreemptionRequested, ReclaimRequested
from .notify import NotificationKind

E = TypeVar("E", bound=Event)


class JobNotification(Contract):
    """One thing that happened to a team's job or inference service, in a line a person reads,
    with the numbers a program needs. Also the body of a webhook POST."""

    notification_id: str = Field(min_length=1, max_length=64,
                                 description="Deterministic (the event's id and the kind): a repeat is the same one")
    kind: NotificationKind
    team: str = Field(pattern=NAME_PATTERN)
    job_id: str | None = Field(min_length=1, max_length=253,
                               description="The job; a replica's job for replica-lost; null for a service's own "
                                           "notifications (service-deployed, -updated, -scaled, -deleted)")
    service: str | None = Field(default=None, max_length=64,
                                description="The inference service, for its notifications (kinds service-*, replica-*)")
    attempt: int | None = Field(default=None, ge=1)
    occurred_at: Timestamp = Field(description="When it happened, on the platform clock")
    event_id: str = Field(min_length=1, max_length=64, description="The event it reports")
    event_type: str = Field(min_length=1, max_length=64)
    summary: str = Field(max_length=4096, description="What happened and why, with the numbers")
    reason: str | None = Field(default=None, max_length=64,
                               description="rejected, waiting, failed, preempted, cancelled: the reason code")
    field: str | None = Field(default=None, max_length=256, description="rejected: the offending field")
    deadline: Timestamp | None = Field(
        default=None, description="preemption-notice: occurred_at + grace_seconds; checkpoint before it")
    grace_seconds: float | None = Field(default=None, ge=0, description="preemption-notice")
    by_job: str | None = Field(default=None, max_length=253, description="preemption-notice, preempted: for whom")
    exit_code: int | None = Field(default=None, description="failed")
    retryable: bool | None = Field(default=None, description="failed")
    next_attempt: int | None = Field(default=None, ge=1, description="retry-scheduled")
    not_before: Timestamp | None = Field(default=None, description="retry-scheduled")
    replicas: int | None = Field(default=None, ge=0, description="service-deployed, -updated, -scaled: desired replicas")
    replaced: bool | None = Field(default=None, description="replica-lost: another replica is asked for in its place")
    intake_sequence: int | None = Field(
        default=None, ge=1, description="command-refused: the intake sequence the command's JetStream ack gave; its "
                                        "dead letter is copied to gpusched.tenant.<team>.refused.<intake_sequence>")


class NotificationDelivery(Contract):
    """One try to deliver a notification to one webhook."""

    notification_id: str = Field(min_length=1, max_length=64)
    job_id: str | None = Field(min_length=1, max_length=253, description="As the notification's")
    service: str | None = Field(default=None, max_length=64, description="As the notification's")
    kind: NotificationKind
    url: str = Field(max_length=2048)
    outcome: Literal["delivered", "failed-attempt", "dead-lettered"]
    attempt: int = Field(ge=1)
    status_code: int | None = Field(default=None, description="The receiver's HTTP status; null: no answer")
    error: str = Field(default="", max_length=1024)
    duration_ms: float = Field(ge=0)
    at: Timestamp = Field(description="When the try ended (wall clock, UTC)")


class CommandRefused(Contract):
    """A command of the team that admission could not read or take (its dead letter), as the team
    reads it. The command's bytes are kept base64-encoded, never as they were: a team can make the
    server publish what its stream holds onto its own intake subjects (a push consumer's
    deliveries, a direct get's answer), so its stream holds no document a command parser would take."""

    intake_sequence: int = Field(ge=1, description="The sequence the command's JetStream ack gave (stream GPUSCHED_INTAKE)")
    subject: str = Field(max_length=512, description="The intake subject it was published on")
    reason: str = Field(max_length=2000, description="Why it was refused: what was wrong and what is accepted")
    refused_at: Timestamp = Field(description="When it was dead-lettered")
    document_base64: str = Field(description="The command's bytes, base64 (RFC 4648), unchanged")


OTHER_TEAMS_JOB = "a job of another team"
"""What a team reads where an event names another team's job (schemas.tenant.unnamed)."""
OTHER_TEAMS_QUEUE = "another-team"
"""What a team reads where a reclaim names another team's queue."""


def counterpart(event: Event) -> str | None:
    """The other job an event of a job names: the one a preemption or a reclaim is for, or the
    one that preempted it; None for every other event."""
    if isinstance(event, (PreemptionRequested, ReclaimRequested)):
        return event.for_job
    if isinstance(event, JobPreempted):
        return event.preempted_by
    return None


def unnamed(event: E) -> E:
    """``event`` as a team sees it when its counterpart (:func:`counterpart`) is another team's:
    that job's id, and a reclaim's lending queue, replaced in their fields and in the message by
    :data:`OTHER_TEAMS_JOB` and :data:`OTHER_TEAMS_QUEUE` (a JobPreempted's reason is said anew). The event id, attempt, grace and
    deadline stay: the team still learns when its attempt stops and why in general terms. Every
    door a team reads events through applies it (the notifier's copies and notifications, the
    API's and the console's histories): one team never reads another's job or queue names."""
    job = counterpart(event)
    if job is None:
        return event
    names = {job: OTHER_TEAMS_JOB}
    if isinstance(event, ReclaimRequested):
        update: dict = {"for_job": OTHER_TEAMS_JOB}
        if event.kind == "reclaim":  # the lender's queue; a priority reclaim's is the attempt's own
            names[event.for_queue] = update["for_queue"] = OTHER_TEAMS_QUEUE
        update["message"] = _unname(event.message, names)
    elif isinstance(event, PreemptionRequested):
        update = {"for_job": OTHER_TEAMS_JOB, "message": _unname(event.message, names)}
    else:  # its reason repeats the request's message, whose queue names it does not carry: said anew
        update = {"preempted_by": OTHER_TEAMS_JOB, "reason": f"its GPUs or quota went to {OTHER_TEAMS_JOB}"}
    return event.model_copy(update=update)


def _unname(text: str, names: dict[str, str]) -> str:
    """``text`` with each whole name (not part of a longer name) replaced."""
    for name, instead in names.items():
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", instead, text)
    return text
