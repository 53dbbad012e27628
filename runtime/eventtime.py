"""Event time in the log: where a time on the platform clock falls among the stream sequences.

A time an operator gives (`gpusched replay --from/--to`, `gpusched log --from/--to`) and a
statement's period are event time: the ``occurred_at`` a producer stamped from the platform clock
(runtime/clock.py), never the time JetStream stored the message. The two differ by the clock's
scale: the demo's platform runs 120 times as fast as the wall clock, so a log written in five wall
minutes spans ten platform hours, and a JetStream stamp says nothing about event time.

The log is in sequence order, and event time follows it only roughly. Each producer stamps an
event when it decides it and appends it a moment later, so the events of different producers
interleave a little out of time order: the lookups assume that

    an event is never appended after one stamped more than ``SKEW`` later than it
    (for sequences i < j: occurred_at[j] >= occurred_at[i] - SKEW),

``SKEW`` being 5 minutes of event time. What comes nearest to it is the sim executor, which stamps
an outcome with the time it happened and appends it on its next tick (0.5 s wall: one platform
minute at the demo's scale of 120). A *late* event breaks it: one stamped long before the events
around it (an executor reporting, after a restart, what finished while it was down; a config event
that `gpusched apply` stamps with the wall clock while the demo's platform runs hours ahead). The
lookups pass over late events as long as fewer than ``LATE_RUN`` come in a row.

The answers, exact under those two bounds (a brute-force scan gives the same):

* :func:`first_at` ``T``: the first event that happened at or after T. It is also where the log's
  time (the newest event time so far) reaches T, so a late event never moves it.
* :func:`last_at` ``T``: the end of the log as of T, the last event that happened at or before T,
  among the events logged before the log's time passed ``T + SKEW``. Under the skew bound that
  is every event at or before T; a late event logged after that is not "in the log as of T" (a
  prefix of the log cannot hold it without everything logged before it).

How: a binary search over sequences, each probe reading ``LATE_RUN`` consecutive events and
taking the newest time among them (one late event cannot mislead it), then a step back over the
events within ``SKEW`` of the answer to find it exactly, which stops after ``LATE_RUN`` events in
a row older than T − ``SKEW`` (every event before those is older than T). The reads are batched
direct gets (one request answers up to ``BATCH`` messages from a sequence): about log2(N)
requests for the search, and the events within ``SKEW`` of T read a thousand at a time. Direct
gets need only the stream read permission that every reader of the log has (the API's
credential, which creates no consumers, too).

``runtime.eventlog.first_sequence_at`` answers a different question: where JetStream's storage
stamp falls (what a reader's ``from_time`` start means).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from runtime.eventlog import EVENTS_STREAM, client_of
from schemas.registry import SUBJECT_PREFIX

SKEW = timedelta(minutes=5)
"""How far out of event-time order an event may be appended (see the module's docstring)."""

LATE_RUN = 16
"""Late events in a row that the lookups pass over: fewer than this many."""

BATCH = 1000
"""Messages one batched direct get asks for."""

TIMEOUT_S = 10.0
"""How long a batched direct get may take to complete."""

_EVERY_EVENT = f"{SUBJECT_PREFIX}.>"


def occurred_at(data: bytes) -> datetime | None:
    """The event time of a message's payload; None for a message that is not an event with one
    (a poison message has no place in time: lookups pass over it, as a replay does)."""
    try:
        raw = json.loads(data)
        at = datetime.fromisoformat(raw["occurred_at"])
    except (ValueError, TypeError, KeyError):
        return None
    return at if at.tzinfo is not None else None


async def event_time(js: JetStreamContext, seq: int) -> datetime | None:
    """The event time of the message stored at ``seq`` (None: none there, or not an event)."""
    if seq < 1:
        return None
    try:
        msg = await js.get_msg(EVENTS_STREAM, seq=seq)
    except NotFoundError:
        return None
    return occurred_at(msg.data)


async def log_time(js: JetStreamContext, seq: int) -> datetime | None:
    """The log's time at ``seq``: the newest event time among the events up to it, the lookups'
    notion below (a late event never moves it back). Read from the last ``LATE_RUN + 1``
    messages up to ``seq``, the most late events in a row the lookups pass over; None when none
    of them is an event with a time. A function of ``seq`` alone: every reader asking at one
    position gets one time."""
    if seq < 1:
        return None
    lo = max(1, seq - LATE_RUN)
    return max((at for _, at in await _read(js, lo, seq, seq - lo + 1) if at is not None), default=None)


async def first_at(js: JetStreamContext, when: datetime, *, hi: int | None = None, skew: timedelta = SKEW,
                   strictly: bool = False) -> int | None:
    """The first stream sequence, up to ``hi`` (default: the log's last), whose event happened at
    or after ``when`` (``strictly``: after it); None when none did."""
    lo, hi = await _span(js, hi)
    reached = (lambda t: t > when) if strictly else (lambda t: t >= when)
    window_end = await _crossing(js, lo, hi, reached)
    # The first event that reached ``when`` is in the window found or before it: step back until
    # LATE_RUN events in a row are older than ``when - skew`` (every event before them is older than ``when``).
    found, older = None, 0
    async with contextlib.aclosing(_backward(js, lo, hi if window_end is None else window_end)) as stamps:
        async for seq, at in stamps:
            if at is None:
                continue
            if reached(at):
                found = seq
            older = older + 1 if at < when - skew else 0
            if older == LATE_RUN:
                break
    return found


async def last_at(js: JetStreamContext, when: datetime, *, hi: int | None = None, skew: timedelta = SKEW) -> int:
    """The end of the log as of ``when``: the last stream sequence, up to ``hi`` (default: the
    log's last), whose event happened at or before ``when``, of those logged before the log's
    time passed ``when + skew``; 0 when none did (see the module's docstring)."""
    lo, hi = await _span(js, hi)
    passed = await first_at(js, when + skew, hi=hi, skew=skew, strictly=True)
    # back over the events after ``when`` (within ``skew`` of it) to the last one before
    async with contextlib.aclosing(_backward(js, lo, hi if passed is None else passed - 1)) as stamps:
        async for seq, at in stamps:
            if at is not None and at <= when:
                return seq
    return 0


async def _span(js: JetStreamContext, hi: int | None) -> tuple[int, int]:
    """(first, last) sequence stored, the last capped at ``hi``."""
    state = (await js.stream_info(EVENTS_STREAM)).state
    last = state.last_seq if hi is None else min(hi, state.last_seq)
    return max(1, state.first_seq), last


async def _read(js: JetStreamContext, seq: int, hi: int, count: int) -> list[tuple[int, datetime | None]]:
    """Up to ``count`` messages stored from ``seq`` up to ``hi``, in order, as (sequence, event
    time or None): one batched direct get, answered by the messages and then a status (204 at
    the batch's end, 404 when none is stored from ``seq``)."""
    if seq > hi:
        return []
    nc = client_of(js)
    inbox = nc.new_inbox()
    found: list[tuple[int, datetime | None]] = []
    complete = asyncio.Event()

    async def take(msg: Msg) -> None:
        headers = msg.headers or {}
        if "Status" in headers:
            complete.set()
        else:
            found.append((int(headers["Nats-Sequence"]), occurred_at(msg.data)))
    sub = await nc.subscribe(inbox, cb=take)
    try:
        request = {"seq": seq, "batch": min(count, hi - seq + 1), "next_by_subj": _EVERY_EVENT}
        await nc.publish(f"$JS.API.DIRECT.GET.{EVENTS_STREAM}", json.dumps(request).encode(), reply=inbox)
        await asyncio.wait_for(complete.wait(), TIMEOUT_S)
    finally:
        await sub.unsubscribe()
    return [(s, at) for s, at in found if s <= hi]


async def _backward(js: JetStreamContext, lo: int, start: int) -> AsyncIterator[tuple[int, datetime | None]]:
    """The messages from ``start`` back to ``lo``, newest first, read ``BATCH`` at a time."""
    while start >= lo:
        first = max(lo, start - BATCH + 1)
        for stamp in reversed(await _read(js, first, start, BATCH)):
            yield stamp
        start = first - 1


async def _window(js: JetStreamContext, seq: int, hi: int) -> tuple[int, int, datetime] | None:
    """The first ``LATE_RUN`` messages stored from ``seq`` up to ``hi`` that hold an event with a
    time among them: (sequence of the first and of the last event, the newest time among them);
    None when no event is stored there."""
    while (stamps := await _read(js, seq, hi, LATE_RUN)):
        timed = [(s, at) for s, at in stamps if at is not None]
        if timed:
            return timed[0][0], timed[-1][0], max(at for _, at in timed)
        seq = stamps[-1][0] + 1  # messages that are not events: the window starts after them
    return None


async def _crossing(js: JetStreamContext, lo: int, hi: int, reached: Callable[[datetime], bool]) -> int | None:
    """The last sequence of a window (:func:`_window`) in which an event ``reached``, where the
    window one event earlier had none: a binary search over where windows start. None when the
    last window has none."""
    a, b, found = lo, hi + 1, None
    # found: the end of the window starting at b (None: b is past the last window), which reached;
    # the window starting at a - 1 did not.
    while a < b:
        mid = (a + b) // 2
        window = await _window(js, mid, hi)
        if window is None:
            b = mid
        elif reached(window[2]):
            b, found = mid, window[1]
        else:
            a = window[0] + 1
    return found
