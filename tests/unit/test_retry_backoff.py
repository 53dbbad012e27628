"""Per-job retry policy: exponential backoff (RetryPolicy.backoff_factor, max_backoff_seconds),
applied by quota when it schedules the retry of a failed attempt."""

from __future__ import annotations

from datetime import timedelta

import pytest

from schemas import FailureReason, JobRetryScheduled, RetryPolicy
from tests.unit.builders import at, failed, queue, started
from tests.unit.test_quota_core import Harness, job


@pytest.mark.parametrize("policy,delays", [
    ({"backoff_seconds": 30}, [30, 30, 30]),  # factor 1: constant, as before
    ({"backoff_seconds": 10, "backoff_factor": 2}, [10, 20, 40]),
    ({"backoff_seconds": 10, "backoff_factor": 3, "max_backoff_seconds": 50}, [10, 30, 50]),
    ({"backoff_seconds": 0, "backoff_factor": 2}, [0, 0, 0]),
])
def test_backoff_for(policy, delays):
    assert [RetryPolicy(**policy).backoff_for(n) for n in (1, 2, 3)] == delays


def test_quota_waits_longer_after_each_failure():
    h = Harness(queue("research", ("team-a",), {"a100": 8}))
    h.feed(job("j1", 1, retry={"max_attempts": 3, "backoff_seconds": 10, "backoff_factor": 2}))
    out = h.feed(failed("j1", FailureReason.NODE_LOST, started_at=at(1), when=at(5)), now=at(5))
    first = [e for e in out if isinstance(e, JobRetryScheduled)][0]
    assert first.not_before == at(5) + timedelta(seconds=10)
    assert h.tick(at(15))  # attempt 2 reserved
    h.feed(started("j1", attempt=2, when=at(16)), now=at(16))
    out = h.feed(failed("j1", FailureReason.NODE_LOST, attempt=2, started_at=at(16), when=at(20)), now=at(20))
    second = [e for e in out if isinstance(e, JobRetryScheduled)][0]
    assert (second.next_attempt, second.not_before) == (3, at(20) + timedelta(seconds=20))
