"""The API's side of NATS. What it publishes is declared with FastStream (which also writes
the AsyncAPI document of it, `gpusched.api.asyncapi`): the commands on the intake subjects. What it
listens to are plain nats-py core subscriptions (no consumer, nothing stored):

- the admission decisions (``gpusched.job.*.<token>`` of the answers, and the intake's dead
  letters), so that a request waits for the answer to its own command without a consumer per
  request (:func:`listen_for_answers` feeds gpusched.gateway.answers.Subscribed, whose rules and
  waiter the CLI's log reader shares);
- a team's copies of its jobs' events (``gpusched.tenant.<team>.job.>``, written by the
  notifier), subscribed while a server-sent-event stream of that team is open (:class:`Hub`).

Why not FastStream subscribers here: they run every message through their middlewares and
dependency injection (a thread hop per message for a ``NatsMessage`` argument) and parse it,
while the API needs only the few messages some request waits for. Measured: about 4 ms of the
API's CPU per job it never saw a request for (docs/performance.md, "Front door"). A raw callback
looks at the subject and parses only what a waiter or a stream needs.

Reading history (a job's events, dead letters) goes through JetStream direct gets on the same
nats-py connection (gpusched.api.history)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass

from faststream.nats import NatsBroker
from faststream.nats.security import NatsSecurity, NatsUserPassword
from faststream.security import BaseSecurity, SASLPlaintext
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gpusched import permissions
from gpusched.gateway import answers
from runtime import eventlog
from runtime.settings import Settings
from schemas.commands import COMMAND_MODELS
from schemas.registry import SUBJECT_PREFIX

log = logging.getLogger(__name__)
P = SUBJECT_PREFIX
ANSWER_SUBJECTS = permissions.api_answer_subjects()
"""The events that answer a command (gpusched.gateway.answers: SubmitAnswers, CancelAnswers, CheckpointAnswers,
ServiceAnswers)."""
TENANT_EVENTS = P + ".tenant.{team}.job.>"

API_USER = permissions.API_USER

def new_broker(settings: Settings) -> NatsBroker:
    return NatsBroker(settings.nats_servers, security=_security(settings),
                      inbox_prefix=eventlog.inbox_prefix(settings.nats_user or API_USER), name="gpusched-api",
                      max_reconnect_attempts=-1, graceful_timeout=5.0,
                      log_level=logging.DEBUG)  # not a line per message


def _security(settings: Settings) -> BaseSecurity | None:
    """The API's user and password; with GPUSCHED_NATS_TLS_*, over TLS from the first byte (as
    every other client: runtime.settings.NatsTls.connect_options)."""
    tls = settings.nats_tls
    if tls is None:
        return SASLPlaintext(username=settings.nats_user, password=settings.nats_password or "") \
            if settings.nats_user else None
    options = {"ssl_context": tls.context(), "tls_handshake_first": True}
    if settings.nats_user:
        return NatsUserPassword(username=settings.nats_user, password=settings.nats_password or "", **options)
    return NatsSecurity(**options)


# -- what the API publishes ----------------------------------------------------------------------

INTAKE_FORMS = {
    "user": P + ".intake.{team}.user.{user}.{verb}",
    "operator": P + ".intake.{team}.operator.{verb}",
}


def declare_publishers(broker: NatsBroker) -> dict[str, object]:
    """One publisher per intake verb and sender form; the subject is filled in per request."""
    out = {}
    for verb, model in COMMAND_MODELS.items():
        for form, template in INTAKE_FORMS.items():
            subject = template.replace("{verb}", verb)
            out[f"{verb}/{form}"] = broker.publisher(
                # no stream= here: FastStream would try to create it at start (the admin's); the
                # publish names it, for JetStream's acknowledgement (gpusched.api.app.Commands)
                subject, schema=model, title=f"{subject}:publish",
                description=f"{model.__name__} sent by the API for an authenticated {form} "
                            f"({'the token names the user' if form == 'user' else 'on_behalf_of names the user'})")
    return out


# -- admission's answers -------------------------------------------------------------------------


async def listen_for_answers(nc: NATS, subscribed: answers.Subscribed) -> list[Subscription]:
    """Core subscriptions to the answers and to the intake's dead letters, feeding ``subscribed``
    (gpusched.gateway.answers: the rules and the waiting, the CLI's too)."""

    async def on_answer(msg: Msg) -> None:
        subscribed.take(msg.subject.split(".", 3)[2], msg.data)  # gpusched.<job|service>.<id>.<token>

    async def on_dead_letter(msg: Msg) -> None:
        if (found := answers.dead_letter_of(msg.headers)) is not None:
            subscribed.take_dead_letter(*found)

    subs = [await nc.subscribe(subject, cb=on_answer) for subject in ANSWER_SUBJECTS]
    subs.append(await nc.subscribe(answers.INTAKE_DEAD_LETTERS, cb=on_dead_letter))
    await nc.flush()
    return subs


# -- the teams' events, to server-sent-event streams --------------------------------------------


@dataclass(frozen=True)
class TenantEvent:
    team: str
    job_id: str
    event_id: str
    type: str
    data: bytes


class Listener:
    """One open stream: its queue, and whether the hub ended it for falling behind."""

    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[TenantEvent] = asyncio.Queue(size)
        self.ended = asyncio.Event()


class Hub:
    """Fans each team's live job events out to the streams open for that team (or one of its
    jobs). The team's subjects are subscribed while at least one of its streams is open (with
    ``nc`` None, as in unit tests, events come only through :meth:`publish`). A stream that
    falls :data:`QUEUE` events behind is ended (its client reconnects and reads the history
    again) rather than slowing the others."""

    QUEUE = 1000

    def __init__(self, nc: NATS | None = None) -> None:
        self.nc = nc
        self.listeners: dict[str, set[Listener]] = defaultdict(set)
        self.subs: dict[str, Subscription] = {}
        self.lock = asyncio.Lock()  # (un)subscribing; rare, so one lock for all teams
        self.delivered = 0

    async def open(self, team: str) -> Listener:
        """A new listener of the team's events; the subscription is live when this returns."""
        listener = Listener(self.QUEUE)
        async with self.lock:
            if self.nc is not None and team not in self.subs:
                self.subs[team] = await self.nc.subscribe(TENANT_EVENTS.format(team=team), cb=self._on_message)
                await self.nc.flush()
            self.listeners[team].add(listener)
        return listener

    async def close(self, team: str, listener: Listener) -> None:
        async with self.lock:
            self._drop(team, listener)
            if not self.listeners.get(team) and (sub := self.subs.pop(team, None)) is not None:
                await sub.unsubscribe()

    def _drop(self, team: str, listener: Listener) -> None:
        listeners = self.listeners.get(team)
        if listeners is not None:
            listeners.discard(listener)
            if not listeners:
                del self.listeners[team]

    async def _on_message(self, msg: Msg) -> None:
        if (event := tenant_event(msg.subject, msg.data, msg.headers)) is not None:
            self.publish(event)

    def publish(self, event: TenantEvent) -> None:
        for listener in list(self.listeners.get(event.team, ())):
            try:
                listener.queue.put_nowait(event)
                self.delivered += 1
            except asyncio.QueueFull:
                self._drop(event.team, listener)  # its stream's close unsubscribes if it was the last
                listener.ended.set()


def tenant_event(subject: str, data: bytes, headers: dict[str, str] | None) -> TenantEvent | None:
    parts = subject.split(".")  # gpusched.tenant.<team>.job.<job id>.<token>
    if len(parts) != 6:
        return None
    headers = headers or {}
    return TenantEvent(team=parts[2], job_id=parts[4], event_id=headers.get("Nats-Msg-Id", ""),
                       type=headers.get("Gpusched-Type", parts[5]), data=data)
