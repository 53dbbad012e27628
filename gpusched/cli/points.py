"""Times and log positions as the operator writes them on the command line.

A time is event time: the platform clock's ``occurred_at`` that producers stamp on events
(runtime/clock.py), in every command that takes one. It is never JetStream's stamp of when a
message was stored, which runs on the wall clock: at the demo's time scale (120) the two are
hours apart. A point in the log is a stream sequence or such a time;
:mod:`runtime.eventtime` finds the sequences a time falls between."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime

from gpusched.errors import UserError

TIME_FORMS = ("ISO 8601 with a zone such as 2026-11-30T12:00:00Z or 2026-11-30T12:00:00+01:00, "
              "or a date 2026-11-30 (UTC midnight)")


def parse_time(value: str, option: str) -> datetime:
    """ISO 8601 with a zone, or a date (midnight UTC); UserError naming ``option`` otherwise."""
    text = value.strip()
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            return datetime.combine(date.fromisoformat(text), datetime.min.time(), tzinfo=UTC)
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        t = None
    if t is None or t.tzinfo is None:
        raise UserError(f"{option} {value!r}: not a time with a zone; accepted: {TIME_FORMS}")
    return t


def parse_point(value: str | None, option: str) -> tuple[int | None, datetime | None]:
    """A point in the log: (stream sequence, None), (None, event time), or (None, None) for no value."""
    if value is None:
        return None, None
    text = value.strip()
    if text.isdigit():
        if int(text) < 1:
            raise UserError(f"{option} {value!r}: stream sequences start at 1")
        return int(text), None
    try:
        return None, parse_time(text, option)
    except UserError:
        raise UserError(f"{option} {value!r}: accepted: a stream sequence (e.g. 1200) or an event time "
                        f"({TIME_FORMS})") from None


def check_range(start: tuple[int | None, datetime | None], end: tuple[int | None, datetime | None]) -> None:
    """UserError when --from comes after --to (both sequences, or both times)."""
    (from_seq, from_time), (to_seq, to_time) = start, end
    if from_seq is not None and to_seq is not None and from_seq > to_seq:
        raise UserError(f"--from {from_seq} is after --to {to_seq}; accepted: --from at or before --to")
    if from_time is not None and to_time is not None and from_time > to_time:
        raise UserError(f"--from {from_time.isoformat()} is after --to {to_time.isoformat()}; "
                        "accepted: --from at or before --to")
