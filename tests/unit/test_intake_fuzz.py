"""Fuzzing the NATS intake (issue 21, deliverable 6): at least 1,000 generated inputs per command
(random bytes, broken UTF-8, deep nesting, huge strings, type-mangled valid documents) through
admission's core. Nothing may escape but the documented refusal: a SubmitJob becomes a
JobRejected naming the field (or a PoisonCommand when it is not JSON at all, dead-lettered with
the reason); a CancelJob or ReportCheckpoint a PoisonCommand saying what is wrong."""

from __future__ import annotations

import json
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import JobRejected
from services.admission.domain import AdmissionCore, PoisonCommand
from tests.unit.builders import sender, T0, node, queue, spec_dict, submit_payload

EXAMPLES = 1000
RUN = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
VALID = {
    "submit": submit_payload(spec_dict(gpus=1), job_id="j1"),
    "cancel": {"job_id": "j0", "requested_by": "team-a"},
    "checkpoint": {"job_id": "j0", "attempt": 1, "reported_by": "team-a", "step": 5},
}
ODD = st.sampled_from([True, None, -1, 0, 1.5, 10**30, "", "1", "\u0000", "x" * 70_000, [], {},
                       {"a": {"a": {"a": {}}}}])


def _mangled(document: dict) -> st.SearchStrategy[bytes]:
    """The valid document with one value (at any depth) replaced, a field added or dropped."""
    def paths(value, prefix=()):
        yield prefix
        if isinstance(value, dict):
            for k, v in value.items():
                yield from paths(v, (*prefix, k))

    def apply(path, replacement, drop):
        copy = json.loads(json.dumps(document))
        target = copy
        for key in path[:-1]:
            target = target[key]
        if path and drop:
            target.pop(path[-1])
        elif path:
            target[path[-1]] = replacement
        else:
            copy = replacement
        return json.dumps(copy).encode()

    return st.builds(apply, st.sampled_from(list(paths(document))), st.one_of(ODD, st.text(max_size=20),
                                                                               st.integers()), st.booleans())


def _nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def inputs(verb: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=200),
        st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.integers(1, 6000).map(_nested),
        st.just(b"\xef\xbb\xbf" + json.dumps(VALID[verb]).encode()),
        _mangled(VALID[verb]),
        st.just(json.dumps({**VALID[verb], "job_id": "x" * 100_000}).encode()),
    )


def _core() -> AdmissionCore:
    core = AdmissionCore()
    for e in (queue(), node("n1")):
        core.evolve(e)
    return core


def _check(verb: str, data: bytes, outcomes: Counter) -> None:
    core = _core()
    try:
        if verb == "submit":
            out = core.handle_submit(data, sender("team-a"), 9, T0)
        elif verb == "cancel":
            out = core.handle_cancel(data, sender("team-a"), T0)
        else:
            out = core.handle_checkpoint(data, sender("team-a"), 9, T0)
    except PoisonCommand as err:
        assert str(err).strip(), "a refusal says what was wrong"
        outcomes["dead-lettered"] += 1
        return
    for event in out:
        if isinstance(event, JobRejected):
            assert event.field, f"a rejection names the field: {event.message}"
            assert event.message
    outcomes["rejected" if any(isinstance(e, JobRejected) for e in out) else "accepted"] += 1


def _fuzz(verb: str) -> Counter:
    outcomes: Counter = Counter()

    @RUN
    @given(inputs(verb))
    def run(data):
        _check(verb, data, outcomes)

    run()
    assert sum(outcomes.values()) >= EXAMPLES, outcomes
    return outcomes


def test_submit_intake():
    outcomes = _fuzz("submit")
    assert outcomes["rejected"] and outcomes["dead-lettered"]


def test_cancel_intake():
    assert _fuzz("cancel")["dead-lettered"]


def test_checkpoint_intake():
    assert _fuzz("checkpoint")["dead-lettered"]
