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
taking the newest time among them (one late event cannot mislead it), then a step over the events
within ``SKEW`` of the answer to find it exactly, which stops after ``LATE_RUN`` events in a row
older than T − ``SKEW`` (every event before those is older than T). Cost: about
``LATE_RUN × log2(N)`` reads by sequence plus one per event within ``SKEW`` of T. Reads by
sequence need only the stream read permission that every reader of the log has (the API's
credential, which creates no consumers, too).

The module reads the log through nats-py's JetStream context and belongs beside
``runtime.eventlog`` (whose ``first_sequence_at`` uses JetStream's stamp instead).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from runtime.eventlog import EVENTS_STREAM
from schemas.registry import SUBJECT_PREFIX

SKEW = timedelta(minutes=5)
"""How far out of event-time order an event may be appended (see the module's docstring)."""

LATE_RUN = 16
"""Late events in a row that the lookups pass over: fewer than this many."""

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


async def first_at(js: JetStreamContext, when: datetime, *, hi: int | None = None, skew: timedelta = SKEW,
                   strictly: bool = False) -> int | None:
    """The first stream sequence, up to ``hi`` (default: the log's last), whose event happened at
    or after ``when`` (``strictly``: after it); None when none did."""
    lo, hi = await _span(js, hi)
    reached = (lambda t: t > when) if strictly else (lambda t: t >= when)
    window_end = await _crossing(js, lo, hi, reached)
    # The first event that reached ``when`` is in the window found or before it: step back until
    # LATE_RUN events in a row are older than ``when - skew`` (every event before them is older than ``when``).
    found, older, seq = None, 0, hi if window_end is None else window_end
    while seq >= lo and older < LATE_RUN:
        at = await event_time(js, seq)
        if at is not None:
            if reached(at):
                found = seq
            older = older + 1 if at < when - skew else 0
        seq -= 1
    return found


async def last_at(js: JetStreamContext, when: datetime, *, hi: int | None = None, skew: timedelta = SKEW) -> int:
    """The end of the log as of ``when``: the last stream sequence, up to ``hi`` (default: the
    log's last), whose event happened at or before ``when``, of those logged before the log's
    time passed ``when + skew``; 0 when none did (see the module's docstring)."""
    lo, hi = await _span(js, hi)
    passed = await first_at(js, when + skew, hi=hi, skew=skew, strictly=True)
    seq = hi if passed is None else passed - 1
    while seq >= lo:  # over the events after ``when`` (within ``skew`` of it) back to the last before
        at = await event_time(js, seq)
        if at is not None and at <= when:
            return seq
        seq -= 1
    return 0


async def _span(js: JetStreamContext, hi: int | None) -> tuple[int, int]:
    """(first, last) sequence stored, the last capped at ``hi``."""
    state = (await js.stream_info(EVENTS_STREAM)).state
    last = state.last_seq if hi is None else min(hi, state.last_seq)
    return max(1, state.first_seq), last


async def _window(js: JetStreamContext, seq: int, hi: int) -> tuple[int, int, datetime] | None:
    """The first ``LATE_RUN`` events with a time stored from ``seq`` up to ``hi``: (sequence of the
    first, of the last, the newest time among them); None when there is none."""
    first, last, newest, taken = 0, 0, None, 0
    while seq <= hi and taken < LATE_RUN:
        try:
            msg = await js.get_msg(EVENTS_STREAM, seq=seq, subject=_EVERY_EVENT, next=True)
        except NotFoundError:
            break
        if msg.seq > hi:
            break
        seq = msg.seq + 1
        at = occurred_at(msg.data)
        if at is None:
            continue
        taken += 1
        first, last = first or msg.seq, msg.seq
        newest = at if newest is None or at > newest else newest
    return None if newest is None else (first, last, newest)


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
