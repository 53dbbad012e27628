"""The shared wait-reason throttle (runtime/waits.py): table-driven."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import pytest

from runtime.waits import REASON_INTERVAL_S, Throttled, throttle, told_recently
from tests.unit.builders import T0, at


@dataclass(frozen=True)
class Told:
    reason: str
    message: str
    occurred_at: datetime


LAST = Told("quota", "needs 4; 2 free", T0)


@pytest.mark.parametrize(("last", "reason", "message", "now", "expected"), [
    (None, "quota", "needs 4; 2 free", T0, Throttled(True)),  # never told: now
    (LAST, "fragmentation", "needs 4; 2 free", at(1), Throttled(True)),  # another code: at once
    (LAST, "quota", "needs 4; 2 free", at(1), Throttled(False)),  # nothing moved: never again
    (LAST, "quota", "needs 4; 2 free", at(3600), Throttled(False)),  # ... however long it waits
    (LAST, "quota", "needs 4; 3 free", at(1), Throttled(False, at(REASON_INTERVAL_S))),  # held back until due
    (LAST, "quota", "needs 4; 3 free", at(REASON_INTERVAL_S), Throttled(True)),  # due exactly then
    (LAST, "quota", "needs 4; 3 free", at(90), Throttled(True)),
])
def test_throttle(last, reason, message, now, expected):
    assert throttle(last, reason, message, now) == expected


def test_the_interval_can_be_given():
    assert throttle(LAST, "quota", "other", at(5), interval_s=5) == Throttled(True)
    assert throttle(LAST, "quota", "other", at(4), interval_s=5) == Throttled(False, at(5))


@pytest.mark.parametrize(("last", "now", "expected"), [
    (None, T0, False),
    (LAST, at(1), True),
    (LAST, at(REASON_INTERVAL_S - 0.001), True),
    (LAST, at(REASON_INTERVAL_S), False),
])
def test_told_recently(last, now, expected):
    assert told_recently(last, now) is expected
