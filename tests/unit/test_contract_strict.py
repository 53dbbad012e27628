"""Strict mode at every parse (issue 21, finding 3): JSON's own types only, no BOM, no NUL, times
as RFC 3339; a JobSubmitted records the values the submitter gave."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from schemas import JobStarted, JobSubmitted, RejectReason, new_event, parse_event
from services.admission.domain import AdmissionCore, PoisonCommand
from tests.unit.builders import sender, T0, node, queue, spec_dict, submit_payload


def admission() -> AdmissionCore:
    core = AdmissionCore()
    for e in (queue(), node("n1")):
        core.evolve(e)
    return core


def handle(payload: dict | bytes) -> list:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return admission().handle_submit(data, sender("team-a"), 7, T0)


@pytest.mark.parametrize("change, field", [
    ({"gpus": True}, "spec.gpus"),
    ({"gpus": "1"}, "spec.gpus"),
    ({"gpus": 1.5}, "spec.gpus"),
    ({"retry": {"max_attempts": True}}, "spec.retry.max_attempts"),
    ({"retry": {"backoff_seconds": "30"}}, "spec.retry.backoff_seconds"),
    ({"image": 5}, "spec.image"),
    ({"tolerations": ["gpu=reserved:Sometimes"]}, "spec.tolerations.0"),
])
def test_admission_refuses_what_the_schema_refuses(change, field):
    [event] = handle(submit_payload(spec_dict(**change), job_id="j1"))
    assert (event.type, event.reason, event.field) == ("JobRejected", RejectReason.SCHEMA_INVALID, field)


def test_a_byte_order_mark_is_refused():
    with pytest.raises(PoisonCommand, match="byte order mark"):  # not JSON: dead-lettered with the reason
        handle(b"\xef\xbb\xbf" + json.dumps(submit_payload(job_id="j1")).encode())


def test_the_recorded_spec_holds_the_values_submitted():
    given = spec_dict(gpus=2, expected_runtime_seconds=600, retry={"max_attempts": 3, "backoff_seconds": 5})
    submitted, *_ = handle(submit_payload(given, job_id="j1"))
    assert isinstance(submitted, JobSubmitted)
    recorded = json.loads(submitted.model_dump_json())["spec"]
    for key, value in given.items():
        if isinstance(value, dict):
            assert {k: recorded[key][k] for k in value} == value, key
        else:
            assert recorded[key] == (list(value) if isinstance(value, tuple) else value), key


def _started(**overrides) -> bytes:
    event = new_event(JobStarted, aggregate_id="j1", producer="executor", occurred_at=T0, key="1", attempt=1,
                      nodes=("n1",))
    return json.dumps({**json.loads(event.model_dump_json()), **overrides}).encode()


@pytest.mark.parametrize("overrides", [{"attempt": "1"}, {"attempt": True}, {"occurred_at": "1"},
                                       {"occurred_at": "2026-01-01T00:00:00"}, {"producer": "exec\u0000utor"}])
def test_events_parse_strictly_too(overrides):
    with pytest.raises((ValueError, ValidationError)):
        parse_event(_started(**overrides))
    assert parse_event(_started()).attempt == 1


def test_an_integer_written_with_a_zero_fraction_is_that_integer_as_json_schema_says():
    """JSON Schema's "integer" includes 8.0; admission reads it as 8. A fraction stays refused."""
    from schemas.commands import SubmitJob, parse_command

    doc = {"spec": {**spec_dict(), "gpus": 8.0, "cpu_millis": 2000.0, "expected_runtime_seconds": 60.0}}
    command = parse_command(SubmitJob, json.dumps(doc).encode())
    assert command.spec.gpus == 8 and isinstance(command.spec.gpus, int) and command.spec.cpu_millis == 2000
    with pytest.raises(ValidationError):
        parse_command(SubmitJob, json.dumps({"spec": {**spec_dict(), "gpus": 2.5}}).encode())


def test_admission_admits_an_integer_written_8_0_over_nats_as_the_schema_does():
    events = handle(submit_payload(spec_dict(gpus=8.0), job_id="j80"))
    assert events[0].type == "JobSubmitted"  # not a rejection
    assert events[0].spec.gpus == 8 and isinstance(events[0].spec.gpus, int)
