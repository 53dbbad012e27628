"""The event log on NATS JetStream: provisioning, append, durable consumption, dead letters, replay.

Contracts this module keeps:

* ``append`` sets ``Nats-Msg-Id`` to the event id, so a re-derived decision is de-duplicated
  within the duplicate window, and (when given) ``Nats-Expected-Last-Subject-Sequence`` scoped to
  the aggregate's wildcard, so a writer that has not seen the aggregate's latest event is refused
  with :class:`ConcurrencyConflict` instead of deciding on stale state.
* Consumers are durable pull consumers with explicit ack. A message is acked only after its
  effects are durable; a transient failure is nak'ed and redelivered.
* A poison message (not JSON, not a valid event) is copied to ``gpusched.deadletter.<service>``
  with its reason and original bytes, then acked: it never blocks the stream and is never lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from runtime import observability
from runtime.settings import Settings
from schemas.envelope import Event
from schemas.registry import SUBJECT_PREFIX, aggregate_subjects, dumps, event_subject, parse_event

log = logging.getLogger(__name__)

EVENTS_STREAM = "GPUSCHED_EVENTS"
INTAKE_STREAM = "GPUSCHED_INTAKE"
DLQ_STREAM = "GPUSCHED_DLQ"

EVENT_SUBJECTS = [f"{SUBJECT_PREFIX}.{family}.>" for family in ("job", "queue", "cohort", "node", "pricebook", "statement")]
INTAKE_SUBJECTS = [f"{SUBJECT_PREFIX}.intake.>"]
DLQ_SUBJECTS = [f"{SUBJECT_PREFIX}.deadletter.>"]

MAX_MSG_BYTES = 1024 * 1024
WRONG_LAST_SEQUENCE = 10071  # JetStream error code


TRANSIENT_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError)


class ConcurrencyConflict(Exception):
    """The aggregate has an event this writer has not seen; re-decide after catching up."""


@dataclass(frozen=True)
class StreamLimits:
    replicas: int = 1
    duplicate_window_s: float = 120.0
    max_age_s: float = 0  # 0: keep forever (the log is the source of truth)
    max_bytes: int = -1

    @classmethod
    def from_settings(cls, settings: Settings) -> "StreamLimits":
        return cls(replicas=settings.stream_replicas, duplicate_window_s=settings.duplicate_window_s)


async def connect(settings: Settings, name: str) -> NATS:
    """Connect with reconnects that never give up: a broker restart pauses a service, it does
    not kill it."""
    kwargs: dict[str, Any] = {}
    if settings.nats_user:
        kwargs.update(user=settings.nats_user, password=settings.nats_password or "")
    return await nats.connect(
        settings.nats_url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        **kwargs,
    )


async def provision(js: JetStreamContext, limits: StreamLimits = StreamLimits()) -> None:
    """Create or update the three streams. Idempotent; run by the operator or the dev stack."""
    common = dict(
        storage=StorageType.FILE,
        num_replicas=limits.replicas,
        duplicate_window=limits.duplicate_window_s,
        max_msg_size=MAX_MSG_BYTES,
        discard=DiscardPolicy.NEW,  # a full log refuses writes; it never drops history
        max_bytes=limits.max_bytes,
        allow_direct=True,
    )
    configs = [
        StreamConfig(name=EVENTS_STREAM, subjects=EVENT_SUBJECTS, max_age=limits.max_age_s, **common),
        StreamConfig(name=INTAKE_STREAM, subjects=INTAKE_SUBJECTS, max_age=limits.max_age_s, **common),
        StreamConfig(name=DLQ_STREAM, subjects=DLQ_SUBJECTS, max_age=limits.max_age_s, **common),
    ]
    for config in configs:
        try:
            await js.stream_info(config.name)
            await js.update_stream(config)
        except NotFoundError:
            await js.add_stream(config)


async def wait_for_streams(js: JetStreamContext, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await js.stream_info(EVENTS_STREAM)
            return
        except (NotFoundError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(
                    f"stream {EVENTS_STREAM} does not exist; run `gpusched init` (or make run) first"
                ) from None
            await asyncio.sleep(0.5)


class EventLog:
    """Appends events; knows nothing about services."""

    def __init__(self, js: JetStreamContext, prefix: str = SUBJECT_PREFIX) -> None:
        self.js = js
        self.prefix = prefix

    async def append(
        self,
        event: Event,
        *,
        expected_last_seq: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> int:
        """Append one event; returns its stream sequence (the original one for a duplicate).

        ``expected_last_seq`` is the sequence of the newest event of this aggregate that the writer
        has seen (0: the aggregate must be new)."""
        hdrs = {"Nats-Msg-Id": event.event_id, "Gpusched-Type": event.type}
        if headers:
            hdrs.update(headers)
        observability.inject_trace(hdrs)
        if expected_last_seq is not None:
            hdrs["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_seq)
            hdrs["Nats-Expected-Last-Subject-Sequence-Subject"] = aggregate_subjects(
                type(event).aggregate, event.aggregate_id, self.prefix
            )
        try:
            ack = await self.js.publish(event_subject(event, self.prefix), dumps(event), headers=hdrs, timeout=10)
        except APIError as err:
            if err.err_code == WRONG_LAST_SEQUENCE:
                raise ConcurrencyConflict(f"{event.type} for {event.aggregate_id}: {err.description}") from err
            raise
        observability.EVENTS_APPENDED.labels(type=event.type, duplicate=str(bool(ack.duplicate)).lower()).inc()
        return ack.seq


def parse_message(msg: Msg) -> Event:
    """The event in a message; ValueError or ValidationError for a poison message."""
    return parse_event(msg.data)


async def dead_letter(js: JetStreamContext, service: str, msg: Msg, reason: str) -> None:
    """Record a poison message with its reason and original bytes, then it can be acked.
    ``service`` may be dotted (``admission.intake``): the subject is gpusched.deadletter.<service>."""
    meta = msg.metadata
    headers = {
        # One record per original message, however often it is redelivered.
        "Nats-Msg-Id": f"dlq:{service}:{meta.stream}:{meta.sequence.stream}",
        "Gpusched-Reason": reason[:2000].replace("\r", " ").replace("\n", " "),
        "Gpusched-Original-Subject": msg.subject,
        "Gpusched-Original-Stream": meta.stream,
        "Gpusched-Original-Sequence": str(meta.sequence.stream),
    }
    await js.publish(f"{SUBJECT_PREFIX}.deadletter.{service}", msg.data, headers=headers, timeout=10)
    observability.DEAD_LETTERS.labels(service=service).inc()
    log.warning(
        "dead-lettered message",
        extra={"subject": msg.subject, "sequence": meta.sequence.stream, "reason": reason[:500]},
    )


async def durable_consumer(
    js: JetStreamContext,
    *,
    stream: str,
    durable: str,
    filter_subjects: list[str] | None = None,
    start_seq: int | None = None,
    ack_wait_s: float = 30.0,
    max_ack_pending: int = 4096,
) -> JetStreamContext.PullSubscription:
    """Bind to (creating if absent) a durable pull consumer. ``start_seq`` applies only when the
    consumer is created: a service that just rebuilt its state to sequence N starts at N + 1."""
    try:
        await js.consumer_info(stream, durable)
    except NotFoundError:
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
            # Redelivery on transient failure with backoff; the last try stays (max_deliver -1):
            # a valid event is never dropped because a dependency was down for a while.
            max_deliver=-1,
            filter_subjects=filter_subjects,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq else DeliverPolicy.ALL,
            opt_start_seq=start_seq,
        )
        await js.add_consumer(stream, config)
    return await js.pull_subscribe_bind(durable=durable, stream=stream)


async def fetch(sub: JetStreamContext.PullSubscription, batch: int, timeout_s: float) -> list[Msg]:
    try:
        return await sub.fetch(batch, timeout=timeout_s)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []


async def tail(js: JetStreamContext, *, from_seq: int, batch: int, idle_s: float,
               stream: str = EVENTS_STREAM) -> AsyncIterator[list[Msg]]:
    """Every message from ``from_seq`` on, in stream order, forever: batches as they come, an
    empty batch when nothing came within ``idle_s``. For projections that keep their own position
    (in the same transaction as their rows): the consumer is ephemeral and ack-less, so nothing is
    ever redelivered out of order; after any error the caller starts again from its position."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if from_seq > 1 else DeliverPolicy.ALL,
        opt_start_seq=from_seq if from_seq > 1 else None,
        inactive_threshold=30.0,
        mem_storage=True,
    )
    sub = await js.pull_subscribe("", stream=stream, config=config)
    try:
        while True:
            yield await fetch(sub, batch, idle_s)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # ephemeral: the server reaps it anyway
            pass


async def last_sequence(js: JetStreamContext, stream: str = EVENTS_STREAM) -> int:
    info = await js.stream_info(stream)
    return info.state.last_seq


async def read(
    js: JetStreamContext,
    *,
    stream: str = EVENTS_STREAM,
    subjects: list[str] | None = None,
    from_seq: int | None = None,
    from_time: datetime | None = None,
    to_seq: int | None = None,
    batch: int = 2048,
) -> AsyncIterator[Msg]:
    """Replay reader: every message from a sequence or a time up to ``to_seq`` (default: the last
    sequence when the read started), in stream order, through an ephemeral consumer."""
    end = to_seq if to_seq is not None else await last_sequence(js, stream)
    if end == 0 or (from_seq is not None and from_seq > end):
        return
    if from_time is not None:
        policy, extra = DeliverPolicy.BY_START_TIME, {"opt_start_time": from_time.isoformat()}
    elif from_seq is not None and from_seq > 1:
        policy, extra = DeliverPolicy.BY_START_SEQUENCE, {"opt_start_seq": from_seq}
    else:
        policy, extra = DeliverPolicy.ALL, {}
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=policy,
        filter_subjects=subjects,
        inactive_threshold=30.0,
        mem_storage=True,
        **extra,
    )
    sub = await js.pull_subscribe("", stream=stream, config=config)
    try:
        while True:
            msgs = await fetch(sub, batch, 2.0)
            if not msgs:
                # Nothing more matched the filter up to the end sequence.
                info = await sub.consumer_info()
                if info.num_pending == 0:
                    return
                continue
            for msg in msgs:
                if msg.metadata.sequence.stream > end:
                    return
                yield msg
                if msg.metadata.sequence.stream == end:
                    return
            if msgs[-1].metadata.num_pending == 0:
                return
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the consumer is ephemeral; the server reaps it anyway
            pass
