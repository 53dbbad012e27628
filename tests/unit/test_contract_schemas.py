"""The exported JSON Schemas (schemas/json) and the models agree, both ways, for every command
and event type (issue 21, deliverable 1).

* A document generated from a type's schema is accepted by its model in strict mode, unless it
  breaks one of the cross-field rules JSON Schema cannot state, which docs/events.md lists
  (``MODEL_ONLY_RULES`` here, the same list).
* A valid document changed in one place (a wrong type, a bool or a string for a number, NUL in a
  string, an unknown field, a missing field, a value out of range) is refused by both or by
  neither.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.unit.schema_strategy import documents as from_schema
from pydantic import ValidationError

from schemas.commands import (
    CancelJob, DeleteService, DeployService, ReportCheckpoint, ReportServiceLoad, ScaleService, SubmitJob,
)
from schemas.export import rendered
from schemas.registry import ALL_EVENT_TYPES, check_no_nul
from schemas.tenant import CommandRefused, JobNotification, NotificationDelivery

MODELS = {m.__name__: m for m in (SubmitJob, CancelJob, ReportCheckpoint, DeployService, ScaleService,
                                   DeleteService, ReportServiceLoad, *ALL_EVENT_TYPES, JobNotification,
                                   NotificationDelivery, CommandRefused)}
SCHEMAS = {name.removesuffix(".json"): json.loads(text) for name, text in rendered().items()}

MODEL_ONLY_RULES = (
    "exceeds max_runtime_seconds",  # JobSpec: expected_runtime_seconds <= max_runtime_seconds
    "more than once",  # QueueConfigured quotas, PriceBookUpdated gpu_prices: one entry per flavor
    "exceeds memory_total_mib", "exceeds samples", "allocated_utilization must be set exactly",  # GpuTelemetry
    "differs from aggregate_id", "window_end - window_start", "entries but the node has gpu_count",
    "out of range for gpu_count", "listed more than once",  # NodeTelemetryReported
    "replica.kind must be inference", "replica.queue and replica.team must be the service's",
    "replica.gang_size must be 1", "min <= desired <= max", "rollout needs max_surge",  # ServiceSpec
    "gpu_utilization target is a fraction",
)
"""Rules JSON Schema cannot state (they compare two values); docs/events.md lists them."""

SLOW = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@functools.cache
def documents(name: str) -> st.SearchStrategy:
    """One strategy per type, built once and shared by the tests and their examples: building one
    (a regex strategy per pattern) costs more than drawing a document from it."""
    return from_schema(SCHEMAS[name])


def model_accepts(name: str, document: Any) -> tuple[bool, str]:
    raw = json.dumps(document)
    try:
        check_no_nul(raw)
        MODELS[name].model_validate_json(raw, strict=True)
    except (ValueError, ValidationError) as err:
        return False, str(err)
    return True, ""


def schema_accepts(name: str, document: Any) -> bool:
    return jsonschema.Draft202012Validator(SCHEMAS[name]).is_valid(document)


def test_every_command_and_event_type_has_a_schema():
    assert set(SCHEMAS) == set(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_documents_from_the_schema_are_accepted_by_the_model(name):
    @SLOW
    @given(documents(name))
    def check(document):
        ok, why = model_accepts(name, document)
        assert ok or any(rule in why for rule in MODEL_ONLY_RULES), why

    check()


def _mutations(value: Any) -> st.SearchStrategy:
    """One change to a scalar: another JSON type, or a value at the edges."""
    # No float with an integral value: JSON Schema's "integer" admits 1.0, the contract does not
    # (an integer is written without a fraction; docs/events.md lists it with the rules above).
    return st.one_of(
        st.sampled_from([True, False, None, 0, -1, 1.5, 10**12, "", "1", "30", "x\u0000y", [], {}]),
        st.text(max_size=5), st.integers(),
        st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()))


def _paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(document, dict):
        for k, v in document.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(document, list):
        for i, v in enumerate(document):
            out += _paths(v, (*prefix, i))
    return out


def _set(document: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    copy = json.loads(json.dumps(document))
    target = copy
    for key in path[:-1]:
        target = target[key]
    if value is _DROP:
        if isinstance(target, dict):
            target.pop(path[-1])
        else:
            target.pop(path[-1])
    else:
        target[path[-1]] = value
    return copy


_DROP = object()
_CHANGES = st.one_of(_mutations(None), st.just(_DROP), st.just("extra-field"))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_document_changed_in_one_place_is_refused_by_both_or_neither(name):
    @SLOW
    @given(st.data())
    def check(data):
        document = data.draw(documents(name))
        if not model_accepts(name, document)[0]:
            return  # broke a model-only rule already (the test above checks which)
        path = data.draw(st.sampled_from(_paths(document)))
        change = data.draw(_CHANGES)
        if change == "extra-field":
            path, change = (*path, "unknown_field"), 1
            if not isinstance(_get(document, path[:-1]), dict):
                return
        elif change is _DROP and not path:
            return
        changed = _set(document, path, change)
        ok, why = model_accepts(name, changed)
        if not ok and any(rule in why for rule in MODEL_ONLY_RULES):
            return
        assert ok == schema_accepts(name, changed), (path, change, why)

    check()


def _get(document: Any, path: tuple) -> Any:
    for key in path:
        document = document[key]
    return document


def test_the_schemas_state_the_rules_the_service_enforces():
    """Finding 3: the schema accepted env keys, gpus + gpu_milli combinations and reserved job
    ids that the service refuses, and neither side checked the toleration format."""
    base = {"submitter": "a", "spec": {"kind": "training", "queue": "q", "team": "t", "image": "i", "gpus": 1}}

    def with_spec(**spec):
        return {**base, "spec": {**base["spec"], **spec}}

    refused = {
        "env key": with_spec(env={"1-BAD": "x"}),
        "gpu_milli with gpus 2": with_spec(gpus=2, gpu_milli=500),
        "reserved job id": {**base, "job_id": "rejected-12"},
        "toleration": with_spec(tolerations=["key=value:Sometimes"]),
        "NUL": {**base, "submitter": "a\u0000b"},
        "bool for a number": with_spec(gpus=True),
        "string for a number": with_spec(gpus="1"),
    }
    for what, document in refused.items():
        assert not schema_accepts("SubmitJob", document), what
        assert not model_accepts("SubmitJob", document)[0], what
    accepted = with_spec(gpu_milli=500, tolerations=["gpu", "gpu=reserved", "example.com/pool=a:NoExecute"],
                         env={"HOME_DIR": "/x"})
    assert schema_accepts("SubmitJob", accepted) and model_accepts("SubmitJob", accepted)[0]


def test_schemas_refuse_nul_in_every_string_without_a_pattern_of_its_own():
    for name, schema in SCHEMAS.items():
        for node in _walk(schema):
            if node.get("type") == "string" and "enum" not in node and "const" not in node and "format" not in node:
                assert "pattern" in node, (name, node)


def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)
