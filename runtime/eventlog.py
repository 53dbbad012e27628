"""The event log on NATS JetStream: provisioning, append, durable consumption, dead letters, reading.

Contracts this module keeps:

* ``append`` sets ``Nats-Msg-Id`` to the event id, so a re-derived decision is de-duplicated
  within the duplicate window, and (when given) ``Nats-Expected-Last-Subject-Sequence`` scoped to
  the aggregate's wildcard, so a writer that has not seen the aggregate's latest event is refused
  with :class:`ConcurrencyConflict` instead of deciding on stale state.
* Consumers are durable pull consumers with explicit ack. A message is acked only after its
  effects are durable. An unacknowledged message is redelivered with growing delays
  (:data:`REDELIVERY_BACKOFF`), at most :data:`MAX_DELIVER` times: a consumer that naks must
  dead-letter on the last delivery (:func:`last_delivery`) instead, or the server drops it.
* A connection rides out a broker restart: :func:`connect` retries the first connection and
  reconnects for ever, logging one line per disconnect and reconnect (no traceback).
* A poison message (not JSON, not a valid event) is copied to ``gpusched.deadletter.<service>``
  with its reason and original bytes, then acked: it never blocks the stream and is never lost.
* Reading the log in order (rebuilding state, projections that keep their own position,
  replays) goes through one reader, :func:`read_batches` (per message: :func:`read`): nothing
  to acknowledge, nothing remembered between reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from runtime import health, observability
from runtime.settings import Settings
from schemas.envelope import Event
from schemas.registry import AGGREGATES, SUBJECT_PREFIX, aggregate_subjects, dumps, event_subject, parse_event

log = logging.getLogger(__name__)

EVENTS_STREAM = "GPUSCHED_EVENTS"
INTAKE_STREAM = "GPUSCHED_INTAKE"
DLQ_STREAM = "GPUSCHED_DLQ"

EVENT_SUBJECTS = [f"{SUBJECT_PREFIX}.{family}.>" for family in AGGREGATES]
INTAKE_SUBJECTS = [f"{SUBJECT_PREFIX}.intake.>"]
DLQ_SUBJECTS = [f"{SUBJECT_PREFIX}.deadletter.>"]
TENANT_STREAM_PREFIX = "GPUSCHED_TENANT_"


def tenant_stream(team: str) -> str:
    """The stream of one team's view of the platform (written by the notifier; docs/events.md)."""
    return TENANT_STREAM_PREFIX + team


def tenant_subjects(team: str) -> str:
    return f"{SUBJECT_PREFIX}.tenant.{team}.>"


def tenant_api(team: str) -> str:
    """The JetStream API of a team's own NATS account as the platform's account sees it: each
    team's tenant stream lives in the team's account (gpusched.permissions, "Accounts"), which
    exports its ``$JS.API.>`` to the platform under this prefix."""
    return f"$JS.tenant.{team}.API"


def tenant_js(js: JetStreamContext, team: str) -> JetStreamContext:
    """A JetStream context on ``team``'s account through ``js``'s connection (a platform
    credential's: the admin provisions the team's stream, the notifier reads and writes it)."""
    return client_of(js).jetstream(prefix=tenant_api(team))


def user_token(user: str) -> str:
    """A credential's name as one subject token or consumer name: ``.`` (``<team>.<user>``) as
    ``_``, which no team or user name holds."""
    return user.replace(".", "_")


def inbox_prefix(user: str) -> str:
    """Each credential receives replies and deliveries under its own inbox, ``_INBOX.<user>``, and
    may subscribe only there: no credential can read another's replies (``_INBOX.>``)."""
    return f"_INBOX.{user_token(user)}"


READER_SLOTS = 8
"""Consumer names a credential's readers (:func:`read_batches`) take turns on, per stream: the
permissions name them, so a credential can only touch consumers that are its own."""


def client_of(js: JetStreamContext) -> NATS:
    """The NATS client a JetStream context sends through (nats-py keeps it as a private field)."""
    return js._nc


def credential_of(js: JetStreamContext) -> str | None:
    """The user name ``js``'s client connected as (None: no credential)."""
    return client_of(js).options.get("user")


def reader_names(user: str) -> list[str]:
    return [f"{user_token(user)}-r{slot}" for slot in range(READER_SLOTS)]

MAX_MSG_BYTES = 1024 * 1024
WRONG_LAST_SEQUENCE = 10071  # JetStream error code
WRONG_LAST_SEQUENCE_IN_FLIGHT = 10164
"""JetStream's "wrong last sequence" without the sequence: on a replicated stream the leader
refuses an expected-last-subject-sequence append while another append to that subject is still
being replicated (a concurrent writer's). The same conflict as :data:`WRONG_LAST_SEQUENCE`."""
MAX_DELIVER = 10
"""Deliveries of one message to a durable consumer; the last one must settle it (ack or dead-letter)."""
BACKOFF_STEPS = 5
"""Redelivery delays of a durable consumer: ack_wait, then doubling (ack_wait x 2, x 4, ...), the
last one repeated up to :data:`MAX_DELIVER`."""


class ConsumerLost(nats.errors.Error):
    """A reader's ephemeral consumer disappeared (the server restarted): read again from the
    reader's own position."""


class ReadEndedEarly(nats.errors.Error):
    """A read of the log ended before the sequence it was to reach, without an error from the
    broker (seen on a JetStream cluster while its leaders change): nothing past what was read
    may be taken as folded; read again from the reader's own position."""


TRANSIENT_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
                    nats.errors.OutboundBufferLimitError, nats.errors.FlushTimeoutError,
                    ServiceUnavailableError, asyncio.TimeoutError, ConsumerLost, ReadEndedEarly)
"""What a broker restart or a slow broker raises (JetStream answers 503 until it has recovered its
store): try again later, after :func:`retry_delay`."""


BROKER_ERRORS = (*TRANSIENT_ERRORS, APIError, nats.errors.Error)
"""Anything the broker may answer with while it restarts or misbehaves: a loop that meets one
waits (:func:`retry_delay`) and starts again from its own position; it does not exit."""


def retry_delay(failures: int, cap_s: float = 5.0) -> float:
    """Seconds to wait after the ``failures``-th consecutive transient failure: 0.5, 1, 2, 4, 5, 5, ..."""
    return min(cap_s, 0.5 * 2 ** max(0, failures - 1))


class ConcurrencyConflict(Exception):
    """The aggregate has an event this writer has not seen; re-decide after catching up."""


@dataclass(frozen=True)
class StreamLimits:
    replicas: int = 1
    duplicate_window_s: float = 120.0
    max_age_s: float = 0  # 0: keep forever (the log is the source of truth)
    max_bytes: int = -1
    immutable: bool = True
    """deny_delete and deny_purge: no message is ever deleted, nor the stream purged, by anyone
    (the server refuses; the flags cannot be cleared later). Only tests that need a gap turn it off."""

    @classmethod
    def from_settings(cls, settings: Settings) -> "StreamLimits":
        return cls(replicas=settings.stream_replicas, duplicate_window_s=settings.duplicate_window_s)


async def connect(settings: Settings, name: str) -> NATS:
    """Connect with reconnects that never give up: a broker restart pauses a service, it does
    not kill it. A broker that is not up yet is waited for (a warning every try), so a service
    started during a broker restart waits instead of exiting. Every server of GPUSCHED_NATS_URL
    (a comma-separated list: a JetStream cluster's) is in the client's pool: it connects to one and,
    when that one is lost, goes on with another (the cluster's other servers, which the servers
    also announce, are added to the pool)."""
    kwargs: dict[str, Any] = {}
    if settings.nats_user:
        kwargs.update(user=settings.nats_user, password=settings.nats_password or "",
                      inbox_prefix=inbox_prefix(settings.nats_user))
    if settings.nats_tls is not None:
        kwargs.update(settings.nats_tls.connect_options())
    servers = settings.nats_servers
    failures = 0
    health.start_heartbeat()
    last_error: list[Exception | None] = [None]  # what nats-py last reported (a failed handshake's reason)

    async def on_error(err: Exception) -> None:
        last_error[0] = err
        await _connection_error(err)

    while True:
        last_error[0] = None
        try:
            # Each try bounded: after a failed TLS handshake nats-py can wait for ever closing the
            # socket (nats-io/nats.py#718), and the service would hang instead of trying again.
            nc = await asyncio.wait_for(nats.connect(
                servers,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=5,
                error_cb=on_error,
                disconnected_cb=_disconnected,
                reconnected_cb=_reconnected,
                **kwargs,
            ), CONNECT_ATTEMPT_S)
            health.HEALTH.nats = True
            return nc
        except (nats.errors.NoServersError, OSError, asyncio.TimeoutError, nats.errors.TimeoutError) as err:
            failures += 1
            cause = last_error[0] or err
            if isinstance(cause, ssl.SSLError):
                log.warning("NATS refused: the TLS handshake failed (GPUSCHED_NATS_TLS_CA must be the CA that signed "
                            "the server's certificate, which must name the address in GPUSCHED_NATS_URL); retrying",
                            extra={"url": settings.nats_url, "error": repr(cause)})
            else:
                log.warning("NATS unavailable, retrying", extra={"url": settings.nats_url, "error": repr(err)})
            await asyncio.sleep(retry_delay(failures))


CONNECT_ATTEMPT_S = 20.0
"""The longest one try to connect may take before it is given up and tried again."""


async def close(nc: NATS) -> None:
    """Close a service's connection at shutdown; a broker already gone (stopped with the service,
    as a Ctrl-C of `make run` does) is logged, not raised: there is nothing left to flush to."""
    try:
        await nc.close()
    except (OSError, nats.errors.Error) as err:
        log.warning("NATS connection closed with an error (the broker is gone)", extra={"error": repr(err)})


async def _connection_error(err: Exception) -> None:
    # nats-py's default logs each failed reconnect with a traceback; one line says as much.
    log.warning("NATS connection error", extra={"error": repr(err)})


async def _disconnected() -> None:
    health.HEALTH.nats = False
    log.warning("NATS disconnected; reconnecting")


async def _reconnected() -> None:
    health.HEALTH.nats = True
    log.info("NATS reconnected")


async def provision(js: JetStreamContext, limits: StreamLimits = StreamLimits(), teams: tuple[str, ...] = ()) -> None:
    """Create or update the three streams and each team's tenant stream (in the team's own
    account, :func:`tenant_js`). Idempotent; run by the admin (`gpusched init`) or the dev stack.
    A team the broker has no account for is refused with :class:`UnknownTeam`."""
    common = dict(
        storage=StorageType.FILE,
        num_replicas=limits.replicas,
        duplicate_window=limits.duplicate_window_s,
        max_msg_size=MAX_MSG_BYTES,
        discard=DiscardPolicy.NEW,  # a full log refuses writes; it never drops history
        max_bytes=limits.max_bytes,
        allow_direct=True,
        max_age=limits.max_age_s,
        **({"deny_delete": True, "deny_purge": True} if limits.immutable else {}),
    )
    configs = [
        StreamConfig(name=EVENTS_STREAM, subjects=EVENT_SUBJECTS, **common),
        StreamConfig(name=INTAKE_STREAM, subjects=INTAKE_SUBJECTS, **common),
        StreamConfig(name=DLQ_STREAM, subjects=DLQ_SUBJECTS, **common),
    ]
    for config in configs:
        await _create_or_update(js, config)
    for team in teams:
        if not await team_account_exists(client_of(js), team):
            raise UnknownTeam(team)
        await _create_or_update(tenant_js(js, team),
                                StreamConfig(name=tenant_stream(team), subjects=[tenant_subjects(team)], **common))


async def team_account_exists(nc: NATS, team: str) -> bool:
    """Whether the broker has an account for ``team`` (its JetStream API answers through the
    platform's import; without the account nothing answers there). Other errors are raised."""
    try:
        await nc.request(f"{tenant_api(team)}.INFO", b"", timeout=5)
    except nats.errors.NoRespondersError:
        return False
    return True


class UnknownTeam(RuntimeError):
    def __init__(self, team: str) -> None:
        super().__init__(f"the broker has no account for team {team!r} (nothing answers at {tenant_api(team)}); "
                         "each team is a NATS account of its own: generate the nats-server configuration again "
                         "with --team for every team, this one included (`gpusched dev nats-config --team A --team "
                         "B ...`), and reload the server (a configuration from before team accounts has none)")
        self.team = team


async def _create_or_update(js: JetStreamContext, config: StreamConfig) -> None:
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
            if err.err_code in (WRONG_LAST_SEQUENCE, WRONG_LAST_SEQUENCE_IN_FLIGHT):
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


JS_API = "$JS.API"


class PullConsumer:
    """A durable pull consumer read with plain pull requests into one subscription callback.

    :meth:`fetch` asks for up to ``batch`` of what is there (``no_wait``) and, when nothing was,
    for the next message, waiting up to ``timeout`` (the request's ``expires``). It is what
    nats-py's ``PullSubscription.fetch`` does, without its wait per message (``next_msg`` with a
    timer of its own: about 40 µs of CPU an event on the development VM, the largest per-event
    cost of a service's loop; docs/performance.md, "The relay ceiling"). One timer per request
    still bounds a request the broker never answers (a consumer that is gone, a connection
    that dropped): the fetch returns nothing and the caller goes on as after an idle wait.

    A delivery that comes after its request was given up is kept for the next fetch; the loops
    that read through this pass over what they have already folded. The broker saying the
    consumer was deleted raises :class:`ConsumerLost` (the loops bind it again).

    ``api``: the JetStream API prefix of the consumer's account (:func:`tenant_api` for a team's)."""

    ANSWER_MARGIN_S = 0.5  # past a request's expiry, how long its end (a 408) may take to arrive

    def __init__(self, nc: NATS, stream: str, durable: str, api: str = JS_API) -> None:
        self.nc, self.durable = nc, durable
        self.next_subject = f"{api}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.msgs: list[Msg] = []
        self.want = 1
        self.over = asyncio.Event()  # the current request ended, or has brought ``want`` messages
        self.lost: str | None = None
        self.gave_up = False  # the current fetch's time is up
        self.sub: Subscription | None = None

    async def start(self) -> "PullConsumer":
        self.inbox = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(self.inbox, cb=self._take, pending_msgs_limit=-1, pending_bytes_limit=-1)
        return self

    async def _take(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self.msgs.append(msg)
            if len(self.msgs) >= self.want:
                self.over.set()
            return
        # 404 no messages, 408 expired, 409 a conflict (max waiting, leadership change, ...)
        if status == "409" and "deleted" in (msg.headers.get("Description") or "").lower():
            self.lost = f"the durable consumer {self.durable} was deleted"
        self.over.set()

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to ``batch`` messages; [] when none came within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.gave_up = False
        timer = loop.call_at(deadline + self.ANSWER_MARGIN_S, self._give_up)  # one per fetch, not per message
        try:
            for lingering in (False, True):
                left = deadline - loop.time()
                if self.msgs or self.gave_up or left <= 0:
                    break
                self.over.clear()
                self.want = 1 if lingering else batch
                request = {"batch": 1, "expires": int(left * 1e9)} if lingering else {"batch": batch, "no_wait": True}
                await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self.inbox)
                await self.over.wait()
                if self.lost is not None:
                    lost, self.lost = self.lost, None
                    raise ConsumerLost(lost)
        finally:
            timer.cancel()
        msgs, self.msgs = self.msgs[:batch], self.msgs[batch:]
        return msgs

    def _give_up(self) -> None:
        self.gave_up = True
        self.over.set()

    async def unsubscribe(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()


async def durable_consumer(js: JetStreamContext, *, stream: str, durable: str, api: str = JS_API,
                           **config) -> PullConsumer:
    """Bind to a durable pull consumer, creating it if absent (:func:`ensure_durable`, which takes
    ``config``); ``api``: the prefix of the JetStream API ``js`` speaks to (:class:`PullConsumer`)."""
    await ensure_durable(js, stream=stream, durable=durable, **config)
    return await PullConsumer(client_of(js), stream, durable, api).start()


async def ensure_durable(
    js: JetStreamContext,
    *,
    stream: str,
    durable: str,
    filter_subjects: list[str] | None = None,
    start_seq: int | None = None,
    ack_wait_s: float = 30.0,
    max_ack_pending: int = 4096,
    backoff: bool = True,
    description: str | None = None,
) -> None:
    """Create a durable pull consumer if absent. ``start_seq`` and ``description`` apply only when
    the consumer is created: a service that just rebuilt its state to sequence N starts at N + 1.

    Redelivery is bounded: at most :data:`MAX_DELIVER` deliveries, after ``ack_wait_s`` and then
    doubling delays (:data:`BACKOFF_STEPS`). A consumer created before these limits (or with
    another ``max_ack_pending``) is brought up to them. ``max_ack_pending=1`` keeps strict order
    across a consumer's crash or restart: nothing later is delivered while a delivered message is
    unacknowledged (a batch left behind would otherwise come back after later messages).
    ``backoff=False`` for a consumer that naks with its own delay: on a consumer with a backoff
    list nats-server honours a nak's delay once, then redelivers on the list (a 0.2 s re-decide would wait a minute; tests/integration/test_admission_redelivery.py)."""
    steps = [ack_wait_s * 2**i for i in range(BACKOFF_STEPS)] if backoff else None
    limits = {"max_deliver": MAX_DELIVER, "backoff": steps}
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        config = ConsumerConfig(
            name=durable,  # created on $JS.API.CONSUMER.CREATE.<stream>.<durable>: what permissions allow
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
            filter_subjects=filter_subjects,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq else DeliverPolicy.ALL,
            opt_start_seq=start_seq,
            description=description,
            **limits,
        )
        await js.add_consumer(stream, config)
    else:
        if (info.config.max_deliver != MAX_DELIVER or (info.config.backoff or None) != steps
                or info.config.max_ack_pending != max_ack_pending):
            await js.add_consumer(stream, info.config.evolve(ack_wait=ack_wait_s, max_ack_pending=max_ack_pending,
                                                             **limits))


def last_delivery(msg: Msg) -> bool:
    """This delivery of a durable consumer's message is its last (:data:`MAX_DELIVER`): a nak
    would drop it, so it must be acked or dead-lettered."""
    return msg.metadata.num_delivered >= MAX_DELIVER


async def fetch(sub: PullConsumer | JetStreamContext.PullSubscription, batch: int, timeout_s: float) -> list[Msg]:
    """Up to ``batch`` messages from a pull consumer; [] when none came within ``timeout_s``."""
    try:
        return await sub.fetch(batch, timeout=timeout_s)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []


async def last_sequence(js: JetStreamContext, stream: str = EVENTS_STREAM) -> int:
    info = await js.stream_info(stream)
    return info.state.last_seq


Payload = tuple[int, bytes]
"""A message as a payload read gives it: (stream sequence, payload)."""

CHECK_IDLE_S = 5.0
"""A reader that received nothing for this long asks the server about its consumer."""
READ_WINDOW = 20_000
"""Most messages a reader has in flight from the server (delivered, not yet acknowledged): bounds
its memory however long the log is."""


def delivery_position(reply: str | bytes) -> tuple[int, int]:
    """(stream sequence, messages pending after it for the consumer) from a JetStream delivery's
    reply subject, without building nats-py's metadata object:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<cseq>.<time>.<pending>`` (9 tokens) or, with
    domain and account hash, ``$JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<seq>...``
    (12 or more). ValueError for anything else."""
    tokens = reply.split(b"." if isinstance(reply, bytes) else ".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    if len(tokens) >= 12:
        return int(tokens[7]), int(tokens[10])
    raise ValueError(f"not a JetStream delivery's reply subject: {reply[:200]!r}")


def sequence(msg: Msg) -> int:
    """A delivered message's stream sequence."""
    return delivery_position(msg.reply)[0]


async def read_batches(
    js: JetStreamContext,
    *,
    stream: str = EVENTS_STREAM,
    subjects: list[str] | None = None,
    from_seq: int | None = None,
    from_time: datetime | None = None,
    to_seq: int | None = None,
    follow: bool = False,
    batch: int = 2048,
    idle_s: float = 1.0,
    client: NATS | None = None,
    payloads: bool = False,
) -> AsyncIterator[list[Msg] | list[Payload]]:
    """The log's reader: lists of at most ``batch`` messages, in stream order, from ``from_seq``
    or the first message stored at or after ``from_time`` (default: the first), up to ``to_seq``
    (default: the last sequence when the read starts), or with ``follow`` forever, yielding an
    empty list whenever nothing arrived for ``idle_s``. ``subjects`` filters (None: every message
    of the stream; a filter costs the server a scan when the consumer is created).

    Nothing is redelivered and nothing is remembered: the consumer is ephemeral, so a reader
    that fails starts again from its own position (a projection keeps it with its rows). A
    sequence deleted from the stream is absent. The server pushes to a callback that keeps the
    message (no request per message); it has at most ``READ_WINDOW`` messages (a few batches
    for a small ``batch``; one for a larger one) unacknowledged in flight, which bounds memory,
    and a bounded read acknowledges only as far as keeps the server from sending past
    ``to_seq``. A bounded read's lists hold ``batch`` messages but the last (or fewer, when they
    were slower than ``idle_s`` to come); a following read hands over what has arrived.

    ``client``: the NATS client ``js`` belongs to. Given, the reader subscribes to the
    consumer's deliveries with a core subscription, without JetStream's per-message
    subscription handling. ``payloads``: lists of (stream sequence, payload) pairs instead of
    messages (a rebuild's writers need nothing else); through a :class:`RawDeliveryClient` they
    skip nats-py's per-message handling."""
    end: float = float("inf") if follow else (to_seq if to_seq is not None else await last_sequence(js, stream))
    if end == 0 or (from_seq is not None and from_seq > end):
        return
    if from_time is not None:
        policy: dict[str, Any] = {"deliver_policy": DeliverPolicy.BY_START_TIME,
                                  "opt_start_time": from_time.isoformat()}
    elif from_seq is not None and from_seq > 1:
        policy = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": from_seq}
    else:
        policy = {"deliver_policy": DeliverPolicy.ALL}
    window = max(batch, min(READ_WINDOW, 4 * batch))
    if from_time is None and end != float("inf"):
        window = max(1, min(window, int(end) - (from_seq or 1) + 1))
    config = ConsumerConfig(
        ack_policy=AckPolicy.ALL, max_ack_pending=window, ack_wait=300.0, inactive_threshold=30.0, mem_storage=True,
        deliver_subject=client_of(js).new_inbox(), filter_subjects=subjects, **policy,
    )
    info = await _add_reader(js, stream, config)
    if not follow and info.num_pending == 0:
        await _delete_consumer(js, stream, info.name)
        return
    reader = _PushReader(client, end, window, payloads)
    if client is not None:
        sub = await client.subscribe(config.deliver_subject, cb=reader.take, pending_msgs_limit=-1,
                                     pending_bytes_limit=-1)
        if payloads and isinstance(client, RawDeliveryClient):
            client.deliver_raw(sub, reader.take_raw)
    else:
        sub = await js.subscribe_bind(stream=stream, config=info.config, consumer=info.name, cb=reader.take,
                                      manual_ack=True, pending_msgs_limit=-1, pending_bytes_limit=-1)
    idle = 0.0
    try:
        while True:
            msgs = await reader.next(1 if follow else batch, batch, idle_s)
            if msgs or follow:
                yield msgs
            await reader.acknowledge()
            if reader.finished():
                return
            idle = 0.0 if msgs else idle + idle_s
            if idle >= CHECK_IDLE_S:  # a quiet consumer: is it still there, is anything left?
                idle = 0.0
                try:
                    state = await js.consumer_info(stream, info.name)
                except NotFoundError:
                    raise ConsumerLost(f"the reader's consumer on {stream} is gone (a server restart?)") from None
                if follow and state.num_ack_pending and not reader.buffer:
                    # Nothing arrived for CHECK_IDLE_S, yet the consumer holds deliveries this reader
                    # has not acknowledged: lost on the way (a reconnect), or resent by a consumer that
                    # a restarted JetStream cluster brought back at its first sequence (taken already,
                    # so passed over above, unacknowledged). Nothing more comes before ack_wait.
                    raise ConsumerLost(f"the reader's consumer on {stream} holds {state.num_ack_pending} "
                                       f"deliveries this reader has not taken (a server restart?)")
                if not follow and state.num_pending == 0 and (state.delivered.stream_seq or 0) <= reader.top:
                    return
    finally:
        if isinstance(client, RawDeliveryClient):
            client.deliver_raw(sub, None)
        try:
            await sub.unsubscribe()
        except Exception:  # the connection is gone: the server reaps the consumer anyway
            pass
        await _delete_consumer(js, stream, info.name)


class _PushReader:
    """The receiving side of :func:`read_batches`: keeps what arrives in order, says when a
    bounded read is complete, and acknowledges (ack-all) as far as the window may move."""

    def __init__(self, client: NATS | None, end: float, window: int, payloads: bool) -> None:
        self.client, self.end, self.window, self.payloads = client, end, window, payloads
        self.buffer: list[Msg] | list[Payload] = []
        self.top = 0  # the newest sequence taken
        self.done = False
        self.arrived = asyncio.Event()  # set once ``want`` messages are buffered, or the read is complete
        self.want = 1
        self.unacked = 0
        self.ackable: Msg | bytes | None = None  # the newest delivery that may be acknowledged (or its reply)
        self.error: Exception | None = None

    async def take(self, msg: Msg) -> None:
        if msg.reply:  # else a status message: no deliveries in this consumer's mode
            self._keep(msg.reply, msg, msg.data)

    def take_raw(self, reply: bytes, data: bytes) -> None:
        """A delivery straight from :class:`RawDeliveryClient` (a payload read)."""
        self._keep(reply, None, data)

    def _keep(self, reply: str | bytes, msg: Msg | None, data: bytes) -> None:
        try:
            seq, pending = delivery_position(reply)
        except ValueError as err:
            self.error, self.done = err, True
            self.arrived.set()
            return
        if seq <= self.top:
            return  # redelivered after ack_wait: already taken
        self.top = seq
        if seq <= self.end:
            self.buffer.append((seq, data) if self.payloads else msg)
            self.unacked += 1
            # Acknowledging this one lets the server send up to ``window`` sequences past it.
            if seq + self.window <= self.end:
                self.ackable = reply if msg is None else msg
        if seq >= self.end or (pending == 0 and self.end != float("inf")):
            self.done = True
        if self.done or len(self.buffer) >= self.want:
            self.arrived.set()

    def finished(self) -> bool:
        return self.done and not self.buffer

    async def next(self, want: int, batch: int, idle_s: float) -> list[Msg] | list[Payload]:
        """Up to ``batch`` messages once ``want`` have arrived, the read is complete, or
        ``idle_s`` passed."""
        self.want = want
        if len(self.buffer) < want and not self.done:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout=idle_s)
            except asyncio.TimeoutError:
                pass
        if self.error is not None:
            raise self.error
        msgs, self.buffer = self.buffer[:batch], self.buffer[batch:]
        return msgs

    async def acknowledge(self) -> None:
        """After a batch was handed over: every tenth of the window, or when nothing is left to
        hand over (so that an idle follower's messages do not reach ack_wait)."""
        if self.ackable is not None and (self.unacked * 10 >= self.window or not self.buffer):
            delivery, self.ackable, self.unacked = self.ackable, None, 0
            if isinstance(delivery, Msg):
                await delivery.ack()
            else:  # a raw delivery's reply subject (ack-all: an empty message acknowledges)
                await self.client.publish(delivery.decode())


class RawDeliveryClient(NATS):
    """nats-py's client with a shortcut for bulk reads: the deliveries (messages with a reply
    subject) to a subscription registered with :meth:`deliver_raw` go from the protocol parser
    straight to a handler as ``(reply, payload)``, without nats-py's per-message
    handling (header parsing, a ``Msg``, a hop through the subscription's queue and task).
    Status messages (no reply subject) still reach the subscription's callback. A rebuild's
    writers connect with it.

    The one use of another package's private names in this project (allowed by name in
    tests/unit/test_layers.py): it overrides nats-py's ``Client._process_msg(sid, subject,
    reply, data, headers)``, the parser's entry point, and keys handlers by a subscription's
    sid, ``Subscription._id``. Where nats-py's signature differs, ``RAW`` is False and
    :meth:`deliver_raw` does nothing: the subscription's callback gets every message."""

    RAW = list(inspect.signature(NATS._process_msg).parameters) == ["self", "sid", "subject", "reply", "data",
                                                                      "headers"]

    def __init__(self) -> None:
        super().__init__()
        self._raw: dict[int, Callable[[bytes, bytes], None]] = {}

    def deliver_raw(self, sub: Subscription, handler: Callable[[bytes, bytes], None] | None) -> None:
        """Hand ``sub``'s deliveries to ``handler(reply, payload)`` (None: no longer).
        The handler runs inside the client's read loop: it must not raise."""
        if not self.RAW:
            return
        if handler is None:
            self._raw.pop(sub._id, None)
        else:
            self._raw[sub._id] = handler

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        handler = self._raw.get(sid)
        if handler is None or not reply:
            return await super()._process_msg(sid, subject, reply, data, headers)
        handler(reply, data)


CONSUMER_EXISTS = 10148  # JetStream error code: "consumer already exists" (a create that must not update)


async def _add_reader(js: JetStreamContext, stream: str, config: ConsumerConfig) -> ConsumerInfo:
    """The reader's consumer, created (never updated: action ``create``, which nats-py does not
    send) on the first of its credential's :func:`reader_names` that is free; one left by a reader
    that died is reaped after its inactive_threshold."""
    nc = client_of(js)
    user = credential_of(js) or "anonymous"
    for name in reader_names(user):
        request = {"stream_name": stream, "config": config.evolve(name=name).as_dict(), "action": "create"}
        reply = await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}.{name}", json.dumps(request).encode(), timeout=5)
        response = json.loads(reply.data)
        if response.get("error", {}).get("err_code") == CONSUMER_EXISTS:
            continue
        if "error" in response:
            APIError.from_error(response["error"])  # raises the matching nats-py error
        return ConsumerInfo.from_response(response)
    raise nats.errors.Error(f"all {READER_SLOTS} reader consumers of {user!r} on {stream} are in use; "
                            "wait for a read to end")


async def _delete_consumer(js: JetStreamContext, stream: str, name: str) -> None:
    try:
        await js.delete_consumer(stream, name)
    except Exception:  # ephemeral: the server reaps it after inactive_threshold anyway
        pass


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
    """:func:`read_batches` one message at a time (a bounded read)."""
    async for msgs in read_batches(js, stream=stream, subjects=subjects, from_seq=from_seq, from_time=from_time,
                                   to_seq=to_seq, batch=batch):
        for msg in msgs:
            yield msg


async def first_sequence_at(js: JetStreamContext, when: datetime, stream: str = EVENTS_STREAM) -> int | None:
    """The sequence of the first message stored at or after ``when`` (None: none is that recent)."""
    async with contextlib.aclosing(read_batches(js, stream=stream, from_time=when, batch=1)) as batches:
        async for msgs in batches:
            return sequence(msgs[0])
    return None
