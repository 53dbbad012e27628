"""`why` (gpusched.gateway.history.explain) follows the job's current attempt: after a retry or a
requeue the reason quota recorded for the next attempt is the current one (JobRetryScheduled
names ``next_attempt``, not ``attempt``)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from gpusched.gateway import history
from schemas import QuotaWaitReason
from tests.unit.builders import (T0, admitted, failed, pending_reason, preempted, released, reserved,
                                 retry_scheduled, scheduled, started, submitted)


def _t(seconds: float):
    return T0 + timedelta(seconds=seconds)


PLACED = [submitted("j"), admitted("j"), pending_reason("j", attempt=1, position=2, when=_t(1)),
          reserved("j", when=_t(2)), scheduled("j", when=_t(3)), started("j", when=_t(4))]
REQUEUED = [*PLACED, preempted("j", started_at=_t(4), when=_t(10)),
            released("j", reason="JobPreempted", when=_t(10)), retry_scheduled("j", when=_t(11))]
RETRIED = [*PLACED, failed("j", started_at=_t(4), when=_t(10)), released("j", reason="JobFailed", when=_t(10)),
           retry_scheduled("j", when=_t(11))]
LATER = pending_reason("j", QuotaWaitReason.COHORT_EXHAUSTED, "cohort full", attempt=2, position=3, when=_t(12))

CASES = [
    # (history, current attempt, waiting for quota, current reason code, its position)
    pytest.param(PLACED[:3], 1, True, "nominal-exhausted", 2, id="first attempt waits"),
    pytest.param(PLACED, 1, False, None, None, id="running: no reason"),
    pytest.param(REQUEUED, 2, True, None, None, id="requeued, no reason for attempt 2 yet"),
    pytest.param([*REQUEUED, LATER], 2, True, "cohort-exhausted", 3, id="requeued after preemption"),
    pytest.param([*RETRIED, LATER], 2, True, "cohort-exhausted", 3, id="retried after a failure"),
]


@pytest.mark.parametrize(("events", "attempt", "waiting", "code", "position"), CASES)
def test_why_follows_the_current_attempt(events, attempt, waiting, code, position):
    why = history.explain("j", list(enumerate(events, start=1)))
    assert why["attempt"] == attempt
    assert why["waiting_for_quota"] is waiting
    got = why["reason"]
    if code is None:
        assert got is None
    else:
        assert (got["code"], got["position"]) == (code, position)
    assert [h["attempt"] for h in why["history"]] == [e.attempt for e in events if e.type == "QuotaPendingReasonChanged"]


def test_current_attempt_reads_next_attempt_of_a_retry():
    assert history.current_attempt(REQUEUED) == 2
    assert history.current_attempt([]) == 1
