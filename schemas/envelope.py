"""The envelope every event carries, and how event ids are derived."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

# Namespace for deterministic event ids. Changing it would change every re-derived id and
# defeat de-duplication of re-decided events, so it is fixed forever.
EVENT_ID_NAMESPACE = uuid.UUID("6f1d7f3a-9a43-4c55-9a0e-2b8a5c6f0e11")

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""Queue, team, cohort, flavor and job names: DNS labels, so they fit NATS subject tokens and
Kubernetes object names alike."""

DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$"
"""Node names follow Kubernetes (dots allowed); subjects encode '.' as '_'."""


class Contract(BaseModel):
    """Base of every model in the contract: immutable, and unknown fields are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)


class Event(Contract):
    """Envelope fields; concrete events add their payload fields beside these."""

    # ClassVar hints for subclasses: the stream's aggregate family ("job", "queue", "node").
    aggregate: ClassVar[str] = ""

    event_id: str = Field(min_length=1, max_length=64, description="Unique id; also the Nats-Msg-Id.")
    type: str = Field(description="Event type name, past tense; the discriminator.")
    schema_version: int = Field(default=1, ge=1, description="Version of this type's payload.")
    aggregate_id: str = Field(min_length=1, max_length=253, description="Job id, queue name or node name.")
    occurred_at: AwareDatetime = Field(description="Event time on the platform clock (UTC).")
    producer: str = Field(min_length=1, max_length=64, description="Service that wrote the event.")
    causation_id: str | None = Field(default=None, max_length=64, description="Event that caused this one.")
    correlation_id: str | None = Field(
        default=None, max_length=64, description="First event of the chain (the submission)."
    )


E = TypeVar("E", bound=Event)


def derive_event_id(event_type: str, aggregate_id: str, key: str) -> str:
    """A deterministic id: the same decision re-derived after a restart gets the same id, so
    JetStream's duplicate window drops the second copy."""
    return str(uuid.uuid5(EVENT_ID_NAMESPACE, f"{event_type}/{aggregate_id}/{key}"))


def new_event(
    cls: type[E],
    *,
    aggregate_id: str,
    producer: str,
    occurred_at: datetime,
    key: str,
    cause: Event | None = None,
    **fields: Any,
) -> E:
    """Build an event with a deterministic id from (type, aggregate, key) and the causal links
    taken from ``cause``."""
    type_name = cls.model_fields["type"].default
    correlation = None
    if cause is not None:
        correlation = cause.correlation_id or cause.event_id
    return cls(
        event_id=derive_event_id(type_name, aggregate_id, key),
        aggregate_id=aggregate_id,
        producer=producer,
        occurred_at=occurred_at,
        causation_id=cause.event_id if cause is not None else None,
        correlation_id=correlation,
        **fields,
    )
