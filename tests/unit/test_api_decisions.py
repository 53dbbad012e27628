"""How a door finds admission's answer to its own command (gpusched.gateway.answers: the rules,
and the API's subscription feed): in any order the answer subscriptions deliver, before or after
the publish was acknowledged; the port's Answer made of it; and how the team event hub
(gpusched.api.bus) fans out and drops a stream that falls behind."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gpusched.api.bus import Hub, TenantEvent, tenant_event
from gpusched.gateway import answers
from gpusched.gateway.answers import Subscribed as Decisions
from schemas import JobRejected, RejectReason, new_event
from tests.unit.builders import T0, admitted, submitted


def rejected(seq: int, job_id: str | None = None) -> JobRejected:
    return new_event(JobRejected, aggregate_id=job_id or f"rejected-{seq}", producer="admission", occurred_at=T0,
                     key=str(seq), reason=RejectReason.UNKNOWN_QUEUE, message="no", intake_sequence=seq, team="team-a")


def take(decisions: Decisions, event) -> None:
    """As the answer subscription hands it over: the job id from the subject, the bytes."""
    decisions.take(event.aggregate_id, event.model_dump_json().encode())


@pytest.mark.parametrize("order", list(itertools.permutations(["submitted", "admitted", "other"])))
def test_the_submit_answer_does_not_depend_on_the_delivery_order(order):
    events = {"submitted": submitted("j1", seq=7), "admitted": admitted("j1"), "other": submitted("j2", seq=8)}
    answer = answers.SubmitAnswers(7)
    taken = [answer.take(events[name], 0.0) for name in order]
    first = next(i for i, a in enumerate(taken) if a is not None)
    assert taken[first].event.type == "JobAdmitted"
    assert first == max(order.index("submitted"), order.index("admitted"))  # not before both came


def test_a_repeat_is_answered_by_the_earlier_decision_once_nothing_else_came():
    answer = answers.SubmitAnswers(12)
    assert answer.take(submitted("j1", seq=3), 0.0) is None and answer.take(admitted("j1"), 0.0) is None
    assert answer.quiet(0.1) is None
    repeat = answer.quiet(answers.REPEAT_SETTLE_S)
    assert repeat is not None and repeat.repeat and repeat.event.type == "JobAdmitted"


def test_a_rejection_of_that_intake_sequence_answers_at_once():
    assert answers.SubmitAnswers(9).take(rejected(9), 0.0).event.type == "JobRejected"
    assert answers.SubmitAnswers(9).take(rejected(10), 0.0) is None


async def test_an_answer_that_came_before_the_wait_began_is_found():
    decisions = Decisions()
    take(decisions, admitted("j1"))
    take(decisions, submitted("j1", seq=3))
    answer = await decisions.wait(answers.for_submit("j1", 3, keyed=False), timeout_s=0.1)
    assert answer is not None and answer.event.type == "JobAdmitted" and not decisions.waiters


async def test_a_wait_is_answered_by_what_comes_later_or_times_out():
    decisions = Decisions()
    waiting = asyncio.create_task(decisions.wait(answers.for_submit("j2", 4, keyed=False), timeout_s=2))
    await asyncio.sleep(0.01)
    decisions.take("j2", b"not an event")  # logged and skipped; the wait goes on
    take(decisions, rejected(4))
    assert (await waiting).event.type == "JobRejected"
    assert await decisions.wait(answers.for_submit("j3", 5, keyed=False), timeout_s=0.05) is None
    assert not decisions.waiters and not decisions.dead_waiters


async def test_a_dead_letter_of_the_intake_sequence_answers():
    decisions = Decisions()
    waiting = asyncio.create_task(decisions.wait(answers.for_cancel("j4", 11), timeout_s=2))
    await asyncio.sleep(0.01)
    decisions.take_dead_letter(11, "not JSON")
    assert (await waiting).dead_letter == "not JSON"


async def test_the_hub_fans_out_by_team_and_ends_a_stream_that_falls_behind():
    hub = Hub()
    hub.QUEUE = 2
    a1, a2, b = await hub.open("team-a"), await hub.open("team-a"), await hub.open("team-b")
    event = TenantEvent("team-a", "j1", "e1", "JobStarted", b"{}")
    hub.publish(event)
    assert a1.queue.qsize() == a2.queue.qsize() == 1 and b.queue.qsize() == 0
    a2.queue.get_nowait()
    hub.publish(event)
    hub.publish(event)  # a1 holds 2: full, ended; a2 keeps up
    assert a1.ended.is_set() and not a2.ended.is_set() and a1 not in hub.listeners["team-a"]
    for listener in (a1, a2):
        await hub.close("team-a", listener)
    assert set(hub.listeners) == {"team-b"}


def test_a_tenant_subject_names_the_team_and_the_job():
    e = tenant_event("gpusched.tenant.team-a.job.j-1.admitted", b"{}", {"Nats-Msg-Id": "x", "Gpusched-Type": "JobAdmitted"})
    assert (e.team, e.job_id, e.event_id, e.type) == ("team-a", "j-1", "x", "JobAdmitted")
    assert tenant_event("gpusched.tenant.team-a.notify.j-1", b"{}", None) is None
