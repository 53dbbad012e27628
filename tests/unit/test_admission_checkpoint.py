"""AdmissionCore.handle_checkpoint: ReportCheckpoint -> JobCheckpointed for the running attempt,
or a clear refusal (PoisonCommand: the adapter records it on the dead-letter subject)."""

from __future__ import annotations

import json

import pytest

from schemas import JobCheckpointed
from services.admission.domain import AdmissionCore, PoisonCommand
from tests.unit.builders import sender, T0, at, preempted, spec, started, submitted


def core_running(attempt: int = 1) -> AdmissionCore:
    core = AdmissionCore()
    core.evolve(submitted("j1", spec(team="team-a")))
    core.evolve(started("j1", attempt=attempt, when=at(10)))
    return core


def report(**fields) -> bytes:
    payload = {"job_id": "j1", "attempt": 1, "checkpointed_at": at(50).isoformat(), "step": 1200, "location": "s3://ckpt/j1/1200"}
    payload.update(fields)
    return json.dumps(payload).encode()


def test_checkpoint_of_the_running_attempt():
    (event,) = core_running().handle_checkpoint(report(), sender("team-a"), 77, at(60))
    assert isinstance(event, JobCheckpointed)
    assert (event.aggregate_id, event.attempt, event.checkpointed_at, event.step, event.location,
            event.intake_sequence, event.occurred_at) == ("j1", 1, at(50), 1200, "s3://ckpt/j1/1200", 77, at(60))
    # a redelivered command re-derives the same event id
    (again,) = core_running().handle_checkpoint(report(), sender("team-a"), 77, at(61))
    assert again.event_id == event.event_id


@pytest.mark.parametrize("data, team, fragment", [
    (b"{", "team-a", "invalid ReportCheckpoint"),
    (report(attempt=0), "team-a", "attempt"),
    (report(job_id="nope"), "team-a", "job_id 'nope' does not exist"),
    (report(), "team-b", "job_id 'j1' does not exist (among the jobs of team 'team-b')"),
    (report(attempt=2), "team-a", "attempt 2 of job j1 is not running; accepted: 1"),
    (report(checkpointed_at=at(5).isoformat()), "team-a", "outside attempt 1's run"),
    (report(checkpointed_at=at(500).isoformat()), "team-a", "outside attempt 1's run"),
])
def test_refusals_are_clear(data, team, fragment):
    with pytest.raises(PoisonCommand, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        core_running().handle_checkpoint(data, sender(team), 5, at(60))


def test_no_running_attempt_after_it_ends():
    core = core_running()
    core.evolve(preempted("j1", started_at=at(10), when=at(40)))
    with pytest.raises(PoisonCommand, match="has no running attempt"):
        core.handle_checkpoint(report(checkpointed_at=at(30).isoformat()), sender("team-a"), 5, at(60))
    assert T0 < at(1)
