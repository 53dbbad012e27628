"""schemas.tenant.unnamed: what a team reads of an event that names another team's job."""

from __future__ import annotations

import pytest

from schemas.tenant import OTHER_TEAMS_JOB, OTHER_TEAMS_QUEUE, counterpart, unnamed
from tests.unit.builders import admitted, preempted, preemption_requested, reclaim_requested, started


@pytest.mark.parametrize(("event", "field", "text_field", "text"), [
    (preemption_requested("mine", "theirs-1"), "for_job", "message", f"preempted so that {OTHER_TEAMS_JOB} fits"),
    (reclaim_requested("mine", "theirs-1", for_queue="q-theirs"), "for_job", "message",
     f"queue {OTHER_TEAMS_QUEUE} needs its guaranteed a100 back for job {OTHER_TEAMS_JOB}"),
    (preempted("mine", by="theirs-1"), "preempted_by", "reason", f"its GPUs or quota went to {OTHER_TEAMS_JOB}"),
])
def test_the_other_job_and_its_queue_are_unnamed_and_the_rest_stays(event, field, text_field, text):
    assert counterpart(event) == "theirs-1"
    seen = unnamed(event)
    assert getattr(seen, field) == OTHER_TEAMS_JOB and getattr(seen, text_field) == text
    assert "theirs-1" not in seen.model_dump_json() and "q-theirs" not in seen.model_dump_json()
    kept = {k: v for k, v in event.model_dump().items() if k not in (field, text_field, "for_queue")}
    assert {k: v for k, v in seen.model_dump().items() if k in kept} == kept  # ids, attempt, grace, times


def test_a_priority_reclaim_keeps_the_attempts_own_queue():
    event = reclaim_requested("mine", "theirs-1", for_queue="shared").model_copy(update={
        "kind": "priority", "message": "job theirs-1 (priority 900) of queue shared needs a100 quota"})
    seen = unnamed(event)
    assert seen.for_queue == "shared" and seen.message == f"job {OTHER_TEAMS_JOB} (priority 900) of queue shared needs a100 quota"


def test_only_whole_names_are_replaced():
    event = preemption_requested("mine", "b").model_copy(update={"message": "preempted so that b fits on node-b.b1 (b)"})
    assert unnamed(event).message == f"preempted so that {OTHER_TEAMS_JOB} fits on node-b.b1 ({OTHER_TEAMS_JOB})"


@pytest.mark.parametrize("event", [admitted("mine"), started("mine"), preempted("mine", by=None)])
def test_an_event_naming_no_other_job_is_the_same_object(event):
    assert unnamed(event) is event
