"""Admission's answer to a command, written once, for every door: which event answers which
command (the rules), a small :class:`Waiter` that takes what a feed brings and resolves, the two
feeds, and the port's :class:`~gpusched.gateway.port.Answer` made of what resolved
(:func:`answer_of`), which the CLI prints and the API turns into its status codes.

A command's answer is an event on the job's (or the service's) subjects, or the intake's dead-
letter record of the command's intake sequence. The rules take events in any order (the
JobAdmitted may come before its JobSubmitted), so both feeds give the same answer.

Why two feeds:

- **the log reader** (:func:`wait_in_log`; the CLI and LogGateway: one short-lived process,
  one command): ordered reads of those subjects and of the intake's dead letters, each from its
  first message. Two ephemeral consumers per wait are cheap for one command; it finds an answer
  written before it started, and it sees the job's whole history (an earlier JobSubmitted and its
  spec: a keyed resend is a repeat only if that spec is the same).
- **the subscription** (:class:`Subscribed`; the HTTP API: one long-running process with many
  concurrent waits): one core subscription to the answer subjects for all requests, no consumer
  per request (a consumer per request costs JetStream a round trip and state per submission).
  It sees only what is published while it listens, so it keeps the last :data:`KEEP_S` of answers
  for a request whose publish acknowledgement came after them, and parses a message only when
  someone waits for its subject; a decision older than that the API finds by a direct get
  (gpusched.api.app.Commands.earlier_decision, which compares the spec as admission does)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gpusched.gateway.port import Answer
from runtime import eventlog
from schemas import (Event, JobAdmitted, JobCancelled, JobCancelRequested, JobCheckpointed, JobRejected, JobSubmitted,
                     JobSucceeded, parse_event)
from schemas.job import JobSpec, rejection_id
from schemas.registry import SUBJECT_PREFIX
from schemas.service import ServiceDeployed, ServiceSpec, ServiceUpdated

if TYPE_CHECKING:
    from nats.js import JetStreamContext

log = logging.getLogger(__name__)

INTAKE_DEAD_LETTERS = f"{SUBJECT_PREFIX}.deadletter.admission.intake"
REPEAT_SETTLE_S = 1.0
"""A command that records nothing (a keyed resend of the same spec, a deploy of the spec the
service has) is answered by the earlier decision once nothing else came this long after it."""
KEEP_S = 60.0
"""How long :class:`Subscribed` keeps answers for a request whose publish acknowledgement came after them."""


@dataclass(frozen=True)
class Decided:
    """What a rule resolved to: the event that decided the command (``repeat``: an earlier
    one, the command changed nothing), or admission's reason for dead-lettering it."""

    event: Event | None = None
    dead_letter: str | None = None
    repeat: bool = False


# -- the rules --------------------------------------------------------------------------------


class Rule(Protocol):
    def take(self, event: Event, now: float) -> Decided | None: ...
    def quiet(self, now: float) -> Decided | None: ...


class SubmitAnswers:
    """Which event answers the SubmitJob at ``intake_seq``: a JobRejected naming that intake
    sequence (filed under the rejection id), the job's decision once the job's JobSubmitted of
    that sequence has been seen, or, for a job submitted before with the same key, the earlier
    decision once nothing else came (an idempotent repeat produces no event). Only a keyed
    submission can be such a repeat (``keyed``), and only of the same spec (``spec``, when
    given: the earlier JobSubmitted's must equal it; another spec is admission's to reject
    ``duplicate-idempotency-key``). A job id resent without a key is always answered by its own
    rejection (duplicate-job-id), however long admission takes."""

    def __init__(self, intake_seq: int, keyed: bool = True, spec: JobSpec | None = None) -> None:
        self.intake_seq, self.keyed, self.spec = intake_seq, keyed, spec
        self.ours = False
        self.same_spec = spec is None
        self.decision: tuple[Event, float] | None = None

    def take(self, event: Event, now: float) -> Decided | None:
        if isinstance(event, JobRejected) and event.intake_sequence == self.intake_seq:
            return Decided(event)
        if isinstance(event, JobSubmitted):
            if event.intake_sequence == self.intake_seq:
                self.ours = True
            elif self.spec is not None:
                self.same_spec = event.spec.model_dump_json() == self.spec.model_dump_json()  # admission's digest
        elif isinstance(event, (JobAdmitted, JobRejected)):
            self.decision = (event, now)
        return Decided(self.decision[0]) if self.ours and self.decision is not None else None

    def quiet(self, now: float) -> Decided | None:
        if (self.keyed and self.same_spec and not self.ours and self.decision is not None
                and now - self.decision[1] >= REPEAT_SETTLE_S):
            return Decided(self.decision[0], repeat=True)
        return None


class CancelAnswers:
    """What answers a CancelJob: the job's JobCancelRequested (this one's or an earlier one's) or
    JobCancelled; or the end it had already reached (admission then records nothing)."""

    ENDS = (JobCancelRequested, JobCancelled, JobSucceeded, JobRejected)

    def take(self, event: Event, now: float) -> Decided | None:
        if isinstance(event, self.ENDS):
            return Decided(event, repeat=not isinstance(event, (JobCancelRequested, JobCancelled)))
        return None

    def quiet(self, now: float) -> Decided | None:
        return None


class CheckpointAnswers:
    """The JobCheckpointed admission recorded for the report at ``intake_seq``."""

    def __init__(self, intake_seq: int) -> None:
        self.intake_seq = intake_seq

    def take(self, event: Event, now: float) -> Decided | None:
        if isinstance(event, JobCheckpointed) and event.intake_sequence == self.intake_seq:
            return Decided(event)
        return None

    def quiet(self, now: float) -> Decided | None:
        return None


class ServiceAnswers:
    """The event admission recorded for the service command at ``intake_seq``. A deploy of the
    spec the service already has records nothing: ``unchanged`` is that spec, and the service's
    latest deploy or update with it answers once nothing else came."""

    def __init__(self, intake_seq: int, unchanged: ServiceSpec | None = None) -> None:
        self.intake_seq, self.unchanged = intake_seq, unchanged
        self.latest: tuple[Event, float] | None = None

    def take(self, event: Event, now: float) -> Decided | None:
        if getattr(event, "intake_sequence", None) == self.intake_seq:
            return Decided(event)
        if isinstance(event, (ServiceDeployed, ServiceUpdated)):
            self.latest = (event, now)
        return None

    def quiet(self, now: float) -> Decided | None:
        if (self.unchanged is not None and self.latest is not None and self.latest[0].spec == self.unchanged
                and now - self.latest[1] >= REPEAT_SETTLE_S):
            return Decided(self.latest[0], repeat=True)
        return None


# -- what to wait for -------------------------------------------------------------------------


@dataclass(frozen=True)
class Awaited:
    """A command's wait: the aggregates whose subjects carry its answer, its intake sequence, its rule."""

    kind: str  # "job" or "service": gpusched.<kind>.<aggregate>.>
    aggregates: tuple[str, ...]
    intake_seq: int
    rule: Any  # a Rule

    @property
    def subjects(self) -> list[str]:
        return [f"{SUBJECT_PREFIX}.{self.kind}.{a}.>" for a in self.aggregates]


def for_submit(job_id: str, intake_seq: int, *, keyed: bool, spec: JobSpec | None = None) -> Awaited:
    """The SubmitJob at ``intake_seq``: the job's subjects and its rejection's (rejected-<seq>)."""
    return Awaited("job", (job_id, rejection_id(intake_seq)), intake_seq, SubmitAnswers(intake_seq, keyed, spec))


def for_cancel(job_id: str, intake_seq: int) -> Awaited:
    return Awaited("job", (job_id,), intake_seq, CancelAnswers())


def for_checkpoint(job_id: str, intake_seq: int) -> Awaited:
    return Awaited("job", (job_id,), intake_seq, CheckpointAnswers(intake_seq))


def for_service(service: str, intake_seq: int, unchanged: ServiceSpec | None = None) -> Awaited:
    """A service command; ``unchanged``: the spec of a deploy (a repeat of it records nothing)."""
    return Awaited("service", (service,), intake_seq, ServiceAnswers(intake_seq, unchanged))


# -- the waiter -------------------------------------------------------------------------------


class Waiter:
    """One command's wait: takes events and dead letters from a feed, resolves once its rule
    answers (or the dead letter of its intake sequence comes)."""

    def __init__(self, awaited: Awaited) -> None:
        self.awaited = awaited
        self.future: asyncio.Future[Decided] = asyncio.get_running_loop().create_future()

    @property
    def done(self) -> bool:
        return self.future.done()

    def _resolve(self, decided: Decided | None) -> bool:
        if decided is not None and not self.future.done():
            self.future.set_result(decided)
        return self.future.done()

    def event(self, event: Event, now: float | None = None) -> bool:
        if self.future.done():
            return True
        return self._resolve(self.awaited.rule.take(event, time.monotonic() if now is None else now))

    def quiet(self, now: float | None = None) -> bool:
        if self.future.done():
            return True
        return self._resolve(self.awaited.rule.quiet(time.monotonic() if now is None else now))

    def dead_letter(self, intake_seq: int, reason: str) -> bool:
        if intake_seq == self.awaited.intake_seq:
            return self._resolve(Decided(dead_letter=reason))
        return self.future.done()

    async def result(self, timeout_s: float) -> Decided | None:
        """What resolved it; None after ``timeout_s``."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.future), timeout_s)
        except TimeoutError:
            return None


def dead_letter_of(headers: dict[str, str] | None) -> tuple[int, str] | None:
    """(intake sequence, reason) of an intake dead-letter record; None for another stream's."""
    headers = headers or {}
    if headers.get("Gpusched-Original-Stream") != eventlog.INTAKE_STREAM:
        return None
    try:
        seq = int(headers.get("Gpusched-Original-Sequence", ""))
    except ValueError:
        return None
    return seq, headers.get("Gpusched-Reason") or "(no reason recorded)"


# -- feed 1: the log (the CLI) ----------------------------------------------------------------


async def wait_in_log(js: "JetStreamContext", awaited: Awaited, timeout_s: float) -> Decided | None:
    """The answer to ``awaited`` read from the log: two following readers (its subjects, the
    intake's dead letters), each from the first message; None after ``timeout_s``."""
    waiter = Waiter(awaited)
    readers = [asyncio.create_task(_follow_events(js, waiter)), asyncio.create_task(_follow_dead_letters(js, waiter))]
    try:
        return await waiter.result(timeout_s)
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def _follow_events(js: "JetStreamContext", waiter: Waiter) -> None:
    clock = asyncio.get_running_loop().time
    batches = eventlog.read_batches(js, subjects=waiter.awaited.subjects, follow=True, batch=64, idle_s=0.25)
    async with contextlib.aclosing(batches):
        async for msgs in batches:
            for msg in msgs:
                if waiter.event(parse_event(msg.data), clock()):
                    return
            if not msgs and waiter.quiet(clock()):
                return


async def _follow_dead_letters(js: "JetStreamContext", waiter: Waiter) -> None:
    batches = eventlog.read_batches(js, stream=eventlog.DLQ_STREAM, subjects=[INTAKE_DEAD_LETTERS], follow=True,
                                    batch=64, idle_s=0.25)
    async with contextlib.aclosing(batches):
        async for msgs in batches:
            for msg in msgs:
                if (found := dead_letter_of(msg.headers)) is not None and waiter.dead_letter(*found):
                    return


# -- feed 2: the subscription (the API) -------------------------------------------------------


class Subscribed:
    """The answers as they are published (gpusched.api.bus.listen_for_answers feeds it), kept
    unparsed for :data:`KEEP_S`: a waiter registered after its publish was acknowledged first
    sees what already came. A message is parsed only when a waiter waits for its aggregate.
    Quiet rules (a repeat) are asked once the recent answers are replayed and after each
    :data:`REPEAT_SETTLE_S` without news."""

    def __init__(self) -> None:
        self.recent: dict[str, list[bytes]] = defaultdict(list)
        self.order: deque[tuple[float, str]] = deque()
        self.dead: dict[int, tuple[float, str]] = {}
        self.waiters: dict[str, list[Waiter]] = defaultdict(list)
        self.dead_waiters: dict[int, Waiter] = {}

    def take(self, aggregate: str, data: bytes) -> None:
        """An answer event of ``aggregate`` (the job or service in its subject), as published."""
        now = time.monotonic()
        self.recent[aggregate].append(data)
        self.order.append((now, aggregate))
        waiters = self.waiters.get(aggregate)
        if waiters and (event := _parsed(data)) is not None:
            for waiter in list(waiters):
                waiter.event(event, now)
        self._prune(now)

    def take_dead_letter(self, intake_seq: int, reason: str) -> None:
        self.dead[intake_seq] = (time.monotonic(), reason)
        if (waiter := self.dead_waiters.get(intake_seq)) is not None:
            waiter.dead_letter(intake_seq, reason)

    def _prune(self, now: float) -> None:
        while self.order and now - self.order[0][0] > KEEP_S:
            _, aggregate = self.order.popleft()
            events = self.recent.get(aggregate)
            if events:
                events.pop(0)
                if not events:
                    del self.recent[aggregate]
        if len(self.dead) > 1000:
            self.dead = {s: v for s, v in self.dead.items() if now - v[0] <= KEEP_S}

    async def wait(self, awaited: Awaited, timeout_s: float) -> Decided | None:
        """The answer to ``awaited`` (None after ``timeout_s``)."""
        waiter = Waiter(awaited)
        if awaited.intake_seq in self.dead:
            return Decided(dead_letter=self.dead[awaited.intake_seq][1])
        for aggregate in awaited.aggregates:
            for data in list(self.recent.get(aggregate, ())):
                if (event := _parsed(data)) is not None:
                    waiter.event(event)
        if waiter.done:
            return waiter.future.result()
        for aggregate in awaited.aggregates:
            self.waiters[aggregate].append(waiter)
        self.dead_waiters[awaited.intake_seq] = waiter
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while (left := deadline - loop.time()) > 0:
                if (decided := await waiter.result(min(left, REPEAT_SETTLE_S))) is not None:
                    return decided
                if waiter.quiet():
                    return waiter.future.result()
            return None
        finally:
            for aggregate in awaited.aggregates:
                self.waiters[aggregate].remove(waiter)
                if not self.waiters[aggregate]:
                    del self.waiters[aggregate]
            self.dead_waiters.pop(awaited.intake_seq, None)


def _parsed(data: bytes) -> Event | None:
    """The event, or None for a message that is not one (logged; admission's own subjects carry
    only valid events, so this is a bug elsewhere, not a reason to fail a request)."""
    try:
        return parse_event(data)
    except ValueError as err:  # pydantic's ValidationError is one
        log.warning("an answer subject carried something that is not an event: %s", err)
        return None


# -- the port's Answer ------------------------------------------------------------------------


def answer_of(decided: Decided | None, intake_seq: int | None, **fields: Any) -> Answer:
    """The port's :class:`Answer` of what a command's wait resolved to, whichever door asked:
    None (no answer in time: ``decision`` None, ``pending``), a dead letter (``dead_letter``), or
    the deciding event (its type; a rejection's reason, field, message and the id it is filed
    under; an admission's queue; a service's generation; a checkpoint's time). ``fields``: what
    the caller knows (job_id, service, trace_id, repeat: JetStream dropped it as a duplicate)."""
    repeat = bool(fields.pop("repeat", False))
    if decided is None:
        return Answer(intake_seq, repeat=repeat, **fields)
    if decided.dead_letter is not None:
        return Answer(intake_seq, repeat=repeat, dead_letter=decided.dead_letter, **fields)
    event = decided.event
    out: dict[str, Any] = {"decision": event.type, "repeat": repeat or decided.repeat, **fields}
    if isinstance(event, JobRejected):
        out.update(reason=event.reason.value, field=event.field, message=event.message,
                   filed_under=event.aggregate_id)
    elif isinstance(event, JobAdmitted):
        out["queue"] = event.queue
    elif isinstance(event, JobCheckpointed):
        out["checkpointed_at"] = event.checkpointed_at
    if (generation := getattr(event, "generation", None)) is not None:
        out.setdefault("generation", generation)
    return Answer(intake_seq, **out)
