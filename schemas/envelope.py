"""The envelope every event carries, and how event ids are derived."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field

# Namespace for deterministic event ids. Changing it would change every re-derived id and
# defeat de-duplication of re-decided events, so it is fixed forever.
EVENT_ID_NAMESPACE = uuid.UUID("6f1d7f3a-9a43-4c55-9a0e-2b8a5c6f0e11")

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""Queue, team, cohort, flavor and job names: DNS labels, so they fit NATS subject tokens and
Kubernetes object names alike."""

DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$"
"""Node names follow Kubernetes (dots allowed); subjects encode '.' as '_'."""


RFC3339 = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})$"
"""How a time is written in the contract: RFC 3339 with an offset. The exported schemas state it
as a pattern (``format`` alone only annotates in Draft 2020-12)."""
_RFC3339 = re.compile(RFC3339)


def _rfc3339_text(value: Any) -> Any:
    """A time written as RFC 3339, parsed here (pydantic alone also reads Unix seconds in a
    string, "1", which the contract does not). What is not a string passes on to pydantic."""
    if not isinstance(value, str):
        return value
    if _RFC3339.match(value) is None:
        raise ValueError(f"{value[:40]!r} is not a time; accepted: RFC 3339 with a timezone offset, "
                         "e.g. 2026-11-02T09:00:00Z")
    return datetime.fromisoformat(value)


Timestamp = Annotated[AwareDatetime, BeforeValidator(_rfc3339_text)]
"""Every time field of the contract: a timezone-aware datetime, written as RFC 3339."""


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
    occurred_at: Timestamp = Field(description="Event time on the platform clock (UTC).")
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
