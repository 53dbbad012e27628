"""The wait-reason throttle the decision services share (quota's QuotaPendingReasonChanged, the
scheduler's SchedulingPendingReasonChanged).

Contract: an attempt that waits is told why with an event carrying a reason code and a message
with the numbers. Given the last such event of the attempt (or None) and the reason it would be
told now:

* no event yet, or a different code: write one now;
* the same code and the same message: write nothing, ever (the numbers did not move);
* the same code, another message: write one when the last is at least ``interval_s`` old;
  until then nothing, and ``recheck_at`` says when it may be written (a service that wants the
  newer numbers out wakes itself then).

A service that also rate-limits how often it looks at a waiting attempt at all uses
:func:`told_recently` with the same interval. Pure: no I/O, and ``now`` is always passed in.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol

REASON_INTERVAL_S = 30.0
"""Platform seconds between two events of one attempt with the same code and another message."""


class LastReason(Protocol):
    """What the throttle reads of the last reason event an attempt was given."""

    @property
    def reason(self) -> Any: ...

    @property
    def message(self) -> str: ...

    @property
    def occurred_at(self) -> datetime: ...


class Throttled(NamedTuple):
    write: bool  # write the reason event now
    recheck_at: datetime | None = None  # held back: when the changed message may be written


WRITE = Throttled(True)
UNCHANGED = Throttled(False)


def throttle(last: LastReason | None, reason: Any, message: str, now: datetime,
             interval_s: float = REASON_INTERVAL_S) -> Throttled:
    """Whether to tell an attempt ``reason`` / ``message`` now (module docstring)."""
    if last is None or last.reason != reason:
        return WRITE
    if last.message == message:
        return UNCHANGED
    due = last.occurred_at + timedelta(seconds=interval_s)
    return WRITE if now >= due else Throttled(False, due)


def told_recently(last: LastReason | None, now: datetime, interval_s: float = REASON_INTERVAL_S) -> bool:
    """True while the last reason event is younger than ``interval_s``."""
    return last is not None and now < last.occurred_at + timedelta(seconds=interval_s)
