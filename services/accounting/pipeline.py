"""Accounting's one ingest pipeline: the log's messages → the converter → a batch → the sink.

The live projection (``__main__``), a catch-up replay and every writer of a rebuild
(:mod:`.bulk.writers`) run the same steps; they differ only in where the batches come from
(:func:`runtime.eventlog.read_batches`, following or up to an end) and in what they do around
them (dead letters and traces live; the turn between writers in a rebuild).

* :func:`convert`: each message parsed and converted (:func:`.projection.convert`) into an entry
  (sequence, event id, operations). A poison message (not JSON, not a valid event) becomes an
  entry without operations, so that the position still moves past it, and is returned with its
  reason for the caller to record.
* :func:`.sink.prepare` plans a batch without the database; :func:`.sink.apply_batch` applies
  it and the position in one transaction.
* :func:`run`: the steps over a reader's batches, one batch stored while the next is read and
  converted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from pydantic import ValidationError

from runtime import eventlog, observability
from schemas import Event
from schemas.registry import parse_event
from services.accounting import projection, sink


@dataclass
class Converted:
    """A batch of messages converted: one entry and one event (None: poison) per message, in
    the messages' order, and the poison among them."""
    entries: list[sink.Entry] = field(default_factory=list)
    poison: list[tuple[Msg, str]] = field(default_factory=list)  # (message, reason)
    messages: Sequence[Msg] = ()
    events: list[Event | None] = field(default_factory=list)

    def keep(self, owned: Sequence[bool]) -> None:
        """Only the entries owned (a partition's: :mod:`.partition`); every other one stays
        without operations or id, so that the position still moves past it."""
        self.entries = [e if mine else (e[0], None, []) for e, mine in zip(self.entries, owned, strict=True)]

    @property
    def last_sequence(self) -> int:
        return self.entries[-1][0] if self.entries else 0


def convert(msgs: Sequence[Msg], *, trace: str | None = None,
            observe: Callable[[Event, int], None] | None = None,
            skip: Callable[[str, int], bool] | None = None) -> Converted:
    """The converter over a batch. ``trace``: a span per message named ``f"{trace} {type}"``,
    continuing the producer's trace from the headers (the live service); ``observe``: called
    with each event converted and its sequence; ``skip``: messages (subject, sequence) not to parse, each an entry
    without operations or id (another partition's: :mod:`.partition`)."""
    out = Converted(messages=msgs)
    entries, events, poison, sequence = out.entries, out.events, out.poison, eventlog.sequence
    # Without an exporter a span would be seen by no one, and nothing appended inside a
    # conversion needs the producer's trace context: the projection writes rows, not events.
    trace = trace if observability.recording() else None
    for msg in msgs:
        seq = sequence(msg)
        if skip is not None and skip(msg.subject, seq):
            entries.append((seq, None, []))
            events.append(None)
            continue
        if trace:
            with _span(trace, msg, seq):
                entry, event, reason = _convert_one(seq, msg.data)
        else:
            entry, event, reason = _convert_one(seq, msg.data)
        entries.append(entry)
        events.append(event)
        if reason is not None:
            poison.append((msg, reason))
        elif observe is not None:
            observe(event, seq)
    return out


def entries(payloads: Sequence[eventlog.Payload]) -> list[sink.Entry]:
    """The converter over (stream sequence, payload) pairs (a payload read: a rebuild's
    writers), without traces; a poison message is an entry without operations."""
    return [_entry(seq, data) for seq, data in payloads]


def _entry(seq: int, data: bytes) -> sink.Entry:
    """:func:`_convert_one`'s entry alone (every message of a rebuild passes here)."""
    try:
        event = parse_event(data)
        return seq, event.event_id, projection.convert(event, seq)
    except Exception:  # poison, whatever it raised: the live path dead-letters the same message
        return seq, None, []


def _convert_one(seq: int, data: bytes) -> tuple[sink.Entry, Event | None, str | None]:
    """(entry, event, None), or for a poison message (entry without operations, None, reason).
    Anything parsing or converting raises makes the message poison: a message cannot stop the
    projection, and the converter is pure, so the same message fails the same way on replay."""
    try:
        event = parse_event(data)
        return (seq, event.event_id, projection.convert(event, seq)), event, None
    except (ValueError, ValidationError) as err:
        return (seq, None, []), None, f"cannot project: {err}"
    except Exception as err:
        return (seq, None, []), None, f"cannot project (a converter bug, reported): {type(err).__name__}: {err}"


def _span(trace: str, msg: Msg, seq: int):
    kind = (msg.headers or {}).get("Gpusched-Type", "event")
    return observability.span_from_headers(f"{trace} {kind}", msg.headers, sequence=seq)


async def run(batches: AsyncGenerator[list[Msg], None], store: Callable[[Converted], Awaitable[None]], *,
              trace: str | None = None, observe: Callable[[Event, int], None] | None = None,
              skip: Callable[[str, int], bool] | None = None,
              after: Callable[[Converted], None] | None = None) -> None:
    """Convert each non-empty batch from the reader (``trace``, ``observe``, ``skip``: see :func:`convert`)
    and store it, in order: a batch is stored while the next one is read and converted (one
    store at a time; a failed store ends the run). ``after``: called with each batch once
    stored. The reader is closed here, in this task, however the run ends: left to the garbage
    collector, a reader abandoned by a failed store was closed from another task while it still
    ran ("aclose(): asynchronous generator is already running", seen once when Postgres restarted)."""
    pending: asyncio.Task | None = None
    async with contextlib.aclosing(batches):
        try:
            async for msgs in batches:
                if not msgs:
                    continue
                converted = convert(msgs, trace=trace, observe=observe, skip=skip)
                if pending is not None:
                    await pending
                pending = asyncio.create_task(_stored(store, converted, after))
            if pending is not None:
                task, pending = pending, None
                await task
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)


async def _stored(store: Callable[[Converted], Awaitable[None]], converted: Converted,
                  after: Callable[[Converted], None] | None) -> None:
    await store(converted)
    if after is not None:
        after(converted)
