"""What a team reads from its tenant stream ``GPUSCHED_TENANT_<team>`` beside the copies of its
jobs' and services' events: notifications (``gpusched.tenant.<team>.notify.<job_id>.<kind>``, or
``….notify.<service>.<kind>`` for a service's own) and the webhook delivery log
(``gpusched.tenant.<team>.delivery.<job_id or service>``); and the commands of the team that
admission refused unread (``gpusched.tenant.<team>.refused.<intake sequence>``: a
:class:`CommandRefused`). The notifier writes them all."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .envelope import NAME_PATTERN, Contract, Timestamp
from .notify import NotificationKind


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
