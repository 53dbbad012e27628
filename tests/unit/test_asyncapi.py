"""The AsyncAPI document (schemas/asyncapi.json): current, valid against the official AsyncAPI
3.0.0 schema (tests/unit/data/asyncapi-3.0.0.schema.json: schemas/3.0.0.json of the npm package
@asyncapi/specs 6.11.1), complete, and its payload schemas accept real messages."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

import jsonschema
import pytest

from gpusched.api import asyncapi
from schemas.commands import INTAKE_VERBS
from schemas.registry import ALL_EVENT_TYPES
from schemas.tenant import NotificationDelivery
from services.notifier import core as notifier
from tests.unit.test_schemas import sample_events

OFFICIAL = json.loads((Path(__file__).parent / "data" / "asyncapi-3.0.0.schema.json").read_text())
DOC = json.loads(asyncapi.rendered())


def test_the_committed_document_is_current():
    assert asyncapi.OUT.read_text() == asyncapi.rendered(), "run `make schemas`"


def test_it_is_a_valid_asyncapi_3_document():
    validator = jsonschema.Draft7Validator(OFFICIAL)
    errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(DOC)]
    assert not errors, "\n".join(errors[:10])
    broken = {**DOC, "channels": {**DOC["channels"], "x": {"address": 5}}}
    assert not validator.is_valid(broken)  # the official schema is really applied


def test_every_intake_form_event_type_and_team_subject_is_there():
    addresses = {c["address"] for c in DOC["channels"].values()}
    for verb in INTAKE_VERBS:
        assert {f"gpusched.intake.{{team}}.{verb}", f"gpusched.intake.{{team}}.user.{{user}}.{verb}",
                f"gpusched.intake.{{team}}.operator.{verb}"} <= addresses
    titles = {m["title"] for m in DOC["components"]["messages"].values() if "title" in m}
    assert {cls.model_fields["type"].default for cls in ALL_EVENT_TYPES} <= titles
    assert {"JobNotification", "NotificationDelivery", "SubmitJob", "CancelJob", "ReportCheckpoint"} <= titles
    assert "gpusched.tenant.{team}.notify.{job_id}.{kind}" in addresses
    assert any(a.startswith("gpusched.deadletter.") for a in addresses)


def test_every_address_parameter_is_declared_and_every_reference_resolves():
    for key, channel in DOC["channels"].items():
        for name in re.findall(r"\{(\w+)\}", channel["address"]):
            assert name in channel.get("parameters", {}), (key, name)
    text = json.dumps(DOC)
    for ref in set(re.findall(r'"\$ref": "#/([^"]+)"', text)):
        node = DOC
        for part in ref.split("/"):
            node = node[urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")]


def _payload_validator(message_id: str) -> jsonschema.Draft202012Validator:
    payload = DOC["components"]["messages"][message_id]["payload"]
    return jsonschema.Draft202012Validator({**payload, "components": DOC["components"]})


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.type)
def test_each_event_payload_accepts_a_real_event(event):
    validator = _payload_validator(f"event.{event.type}")
    document = json.loads(event.model_dump_json())
    assert not list(validator.iter_errors(document)), event.type
    assert not validator.is_valid({**document, "unexpected": 1})


def test_the_command_payloads_accept_a_command_and_refuse_a_bad_one():
    validator = _payload_validator("intake.submit")
    good = {"spec": {"kind": "training", "queue": "q", "team": "team-a", "image": "img", "gpus": 1}}
    assert validator.is_valid(good)
    assert not validator.is_valid({"spec": {**good["spec"], "gpus": "1"}})


def test_the_team_payloads_accept_what_the_notifier_writes():
    """The tenant subjects: each job event's copy, each notification the notifier derives from a
    real event, and a webhook delivery record."""
    copies, notes = _payload_validator("tenant.job-event"), _payload_validator("tenant.JobNotification")
    written = 0
    for event in sample_events():
        if event.aggregate != "job":
            continue
        assert copies.is_valid(json.loads(event.model_dump_json())), event.type
        if (note := notifier.notification(event, "team-a")) is not None:
            assert not list(notes.iter_errors(json.loads(note.model_dump_json()))), note.kind
            written += 1
    assert written >= 10
    delivery = NotificationDelivery(notification_id="n1", job_id="j1", kind="admitted", url="https://hooks.example/x",
                                    outcome="failed-attempt", attempt=2, status_code=503, error="HTTP 503",
                                    duration_ms=12.5, at="2026-12-05T10:00:00Z")
    validator = _payload_validator("tenant.NotificationDelivery")
    assert validator.is_valid(json.loads(delivery.model_dump_json()))
    assert not validator.is_valid({**json.loads(delivery.model_dump_json()), "outcome": "lost"})
