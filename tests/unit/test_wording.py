"""How a job's events read to a person (schemas.wording) and how the console lays them out
(gpusched.api.readable): durations in human units, one plain sentence per event, no event type
names, and another team's job never named."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from gpusched.api.readable import money, timeline
from schemas import ALL_EVENT_TYPES, FailureReason, QuotaWaitReason
from schemas.tenant import unnamed
from schemas.wording import describe, duration, when
from services.notifier import core
from tests.unit.builders import (T0, admitted, cancel_requested, cancelled, checkpointed, failed, pending_reason,
                                 preempted, preemption_requested, ready, reclaim_requested, released, reserved,
                                 retry_scheduled, sched_pending_reason, scheduled, spec, started, submitted, succeeded)


@pytest.mark.parametrize("seconds, text", [
    (0, "0 s"), (0.04, "0 s"), (0.25, "0.3 s"), (7.24, "7.2 s"), (9.96, "10 s"), (10, "10 s"), (45.4, "45 s"),
    (59.6, "1 min 0 s"), (60, "1 min 0 s"), (125.4, "2 min 5 s"), (3599.7, "1 h 0 min"), (3600, "1 h 0 min"),
    (7199.8, "2 h 0 min"), (5400, "1 h 30 min"), (86_399, "1 d 0 h"), (3 * 86_400 + 4 * 3600 + 100, "3 d 4 h"),
    (-90, "-1 min 30 s"), (timedelta(hours=2), "2 h 0 min"), (None, "–"), (float("nan"), "–"),
])
def test_durations_read_in_the_two_largest_units(seconds, text):
    assert duration(seconds) == text


def test_a_time_reads_in_utc():
    assert when(T0 + timedelta(hours=10, seconds=30)) == "2026-01-01 10:00:30 UTC"
    assert when(None) == "–"


@pytest.mark.parametrize("amount, currency, text", [
    (1234.5, "EUR", "1,234.50 EUR"), (Decimal("0.004"), "USD", "0.00 USD"), ("12.345", "USD", "12.34 USD"),
    (12.355, "USD", "12.36 USD"), (1234.5, "JPY", "1,234 JPY"), (0, "CHF", "0.00 CHF"), (None, "USD", "–"),
])
def test_money_carries_its_currency(amount, currency, text):
    assert money(amount, currency) == text


SUCCEEDED_AFTER_2H = succeeded("j1", when=T0 + timedelta(seconds=7199.8))


@pytest.mark.parametrize("event, sentence", [
    (submitted("j1", spec(queue="q-a", gpus=2)), "submitted by alice to queue q-a: 2 GPUs"),
    (submitted("j1", spec(gpus=8, gang_size=2)), "submitted by alice to queue research: 8 GPUs on each of 2 nodes"),
    (admitted("j1", "q-a", 300), "admitted and queued in q-a at priority 300"),
    (admitted("j1", preemptible=False), "admitted and queued in research at priority 500 (never preempted)"),
    (pending_reason("j1", QuotaWaitReason.NOMINAL_EXHAUSTED, "queue q nominal a100 8 GPUs, used 8 GPUs"),
     "waiting for quota because queue q nominal a100 8 GPUs, used 8 GPUs (nominal-exhausted)"),
    (sched_pending_reason("j1"),
     "waiting for nodes because needs 8×a100 on one node; largest free block is 6 on n3 (fragmentation)"),
    (reserved("j1", gpus=4), "quota reserved: 4 GPUs of a100 in queue research"),
    (released("j1", reason="JobPreempted"), "quota released: attempt preempted"),
    (scheduled("j1", {"n1": (0, 1), "n2": (0, 1)}, flavor="h100"), "placed on n1, n2 (h100)"),
    (started("j1", ("n1",)), "started on n1"),
    (ready("j1"), "ready to serve"),
    (checkpointed("j1", at_=T0, step=7), "checkpointed at 2026-01-01 00:00:00 UTC, step 7"),
    (preemption_requested("j1", "urgent", grace_seconds=120),
     "preemption notice: it is stopped for higher-priority job urgent, which needs its GPUs; checkpoint before "
     "2026-01-01 00:02:00 UTC (120 s); it is requeued after. preempted so that urgent fits"),
    (reclaim_requested("j1", "owner", for_queue="q-b"),
     "preemption notice: it is stopped because the a100 quota its queue borrowed is reclaimed for job owner of "
     "queue q-b; checkpoint before 2026-01-01 00:00:30 UTC (30 s); it is requeued after. queue q-b needs its "
     "guaranteed a100 back for job owner"),
    (reclaim_requested("j1", "first").model_copy(update={"kind": "priority", "message": ""}),
     "preemption notice: it is stopped because job first, of higher priority in its queue, needs the a100 quota it "
     "holds; checkpoint before 2026-01-01 00:00:30 UTC (30 s); it is requeued after"),
    (preempted("j1", by="urgent"), "preempted for job urgent: make room; it is requeued"),
    (retry_scheduled("j1", 1, not_before=T0 + timedelta(minutes=1)),
     "retry scheduled: attempt 2 waits for quota, not before 2026-01-01 00:01:00 UTC"),
    (SUCCEEDED_AFTER_2H, "succeeded after 2 h 0 min"),
    (failed("j1", FailureReason.OOM_KILLED, exit_code=137, message="out of memory"),
     "failed after 1 min 0 s (oom-killed, exit code 137): out of memory"),
    (failed("j1", FailureReason.NODE_LOST, exit_code=None, started_at=None),
     "failed before it started (node-lost); it may be retried"),
    (cancel_requested("j1", by="alice", reason="wrong image"), "cancel requested by alice: wrong image"),
    (cancelled("j1"), "cancelled"),
])
def test_each_event_of_a_job_reads_as_one_plain_sentence(event, sentence):
    assert describe(event) == sentence
    assert event.type not in sentence


@pytest.mark.parametrize("event", [preemption_requested("j1", "their-job"),
                                   reclaim_requested("j1", "their-job", for_queue="q-theirs"),
                                   preempted("j1", by="their-job")])
def test_another_teams_job_is_never_named(event):
    said = describe(unnamed(event))
    assert "their-job" not in said and "q-theirs" not in said
    assert "of another team" in said
    if event.type == "PreemptionRequested":
        assert "for a higher-priority job of another team" in said


def test_every_job_event_type_has_a_sentence():
    from tests.unit.builders import service_samples

    job_types = {t.__name__ for t in ALL_EVENT_TYPES if t.aggregate == "job"}
    samples = [submitted("j1"), admitted("j1"), reserved("j1"), released("j1"), pending_reason("j1"),
               sched_pending_reason("j1"), scheduled("j1"), started("j1"), ready("j1"), checkpointed("j1"),
               preemption_requested("j1"), reclaim_requested("j1"), preempted("j1"), retry_scheduled("j1"),
               succeeded("j1"), failed("j1"), cancel_requested("j1"), cancelled("j1")]
    from schemas import JobRejected, RejectReason
    from schemas.envelope import new_event
    samples.append(new_event(JobRejected, aggregate_id="j1", producer="admission", occurred_at=T0, key="r",
                             reason=RejectReason.UNKNOWN_QUEUE, message="queue nope: unknown"))
    assert {e.type for e in samples} == job_types
    assert all(describe(e) for e in samples)
    assert all(describe(e) is None for e in service_samples())


def test_the_timeline_is_sentences_with_the_raw_event_aside():
    events = [submitted("j1"), pending_reason("j1", message="queue research is full"), SUCCEEDED_AFTER_2H]
    rows = timeline(list(enumerate(events, 1)))
    assert [r["text"] for r in rows] == ["Submitted by alice to queue research: 1 GPU",
                                         "Waiting for quota because queue research is full (nominal-exhausted)",
                                         "Succeeded after 2 h 0 min"]
    assert [r["attempt"] for r in rows] == [None, 1, 1]
    assert '"type": "QuotaPendingReasonChanged"' in rows[1]["raw"]


def test_the_notifier_says_what_the_console_says():
    for event in (scheduled("j1"), SUCCEEDED_AFTER_2H, preemption_requested("j1", "urgent")):
        assert core.notification(event, "team-a").summary == f"attempt 1: {describe(event)}"
    waiting = pending_reason("j1")
    assert core.notification(waiting, "team-a").summary == describe(waiting)
