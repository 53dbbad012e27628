"""Telling a team about its jobs: where notifications go (``notify:`` in a job spec or a team's
configuration) and the team configuration event. The notifier service delivers them; the
messages it writes to a team's stream are in :mod:`schemas.tenant`."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field

from .envelope import NAME_PATTERN, Contract, Event

WEBHOOK_URL_PATTERN = r"^https?://[^\s/?#@\x00-\x1f\x7f]+(/[^\s#\x00-\x1f\x7f]*)?$"
"""An absolute http(s) URL without credentials or fragment; at most 2,048 characters."""

MAX_WEBHOOKS = 4
"""Most webhooks a job spec, or a team, may name."""


class NotificationKind(StrEnum):
    """What happened to a job or an inference service, as a team is told. One kind per event
    type that a team cares about; ``preemption-notice`` is sent when the preemption is decided,
    with the grace deadline, before the attempt is stopped. A service's kinds start with
    ``service-`` or ``replica-``."""

    SUBMITTED = "submitted"
    ADMITTED = "admitted"
    REJECTED = "rejected"
    WAITING = "waiting"
    SCHEDULED = "scheduled"
    STARTED = "started"
    CHECKPOINTED = "checkpointed"
    PREEMPTION_NOTICE = "preemption-notice"
    PREEMPTED = "preempted"
    RETRY_SCHEDULED = "retry-scheduled"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCEL_REQUESTED = "cancel-requested"
    CANCELLED = "cancelled"
    # an inference service's (docs/serving.md)
    SERVICE_DEPLOYED = "service-deployed"
    SERVICE_UPDATED = "service-updated"
    SERVICE_SCALED = "service-scaled"
    REPLICA_LOST = "replica-lost"
    SERVICE_DELETED = "service-deleted"
    # a command of the team that admission could not read or take (dead-lettered; docs/publishing.md)
    COMMAND_REFUSED = "command-refused"


class Webhook(Contract):
    """An HTTP endpoint that receives a team's notifications as signed JSON POSTs."""

    url: str = Field(min_length=8, max_length=2048, pattern=WEBHOOK_URL_PATTERN,
                     description="http:// or https:// URL the notifier POSTs to")
    kinds: tuple[NotificationKind, ...] = Field(
        default=(), max_length=len(NotificationKind),
        description="Notification kinds sent to this URL; empty = all",
    )

    def wants(self, kind: NotificationKind) -> bool:
        return not self.kinds or kind in self.kinds


class NotifySpec(Contract):
    """Where a job's (``JobSpec.notify``) or a team's (``TeamConfigured.notify``) notifications
    go, beside the team's own NATS subjects, which always receive them."""

    webhooks: tuple[Webhook, ...] = Field(default=(), max_length=MAX_WEBHOOKS)


class TeamConfigured(Event):
    """A team's settings, from the ``teams:`` section of `gpusched apply -f`; the latest one of a
    team is in force."""

    aggregate: ClassVar[str] = "team"
    type: Literal["TeamConfigured"] = "TeamConfigured"
    name: str = Field(pattern=NAME_PATTERN)
    notify: NotifySpec = Field(default_factory=NotifySpec,
                               description="Webhooks that receive every job's notifications of this team")
