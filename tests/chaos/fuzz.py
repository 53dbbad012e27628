"""Malformed commands for the tenant intake subjects, drawn from ``random.Random(seed)``: what a
buggy or hostile publisher sends with a team's own credentials. Each must end as a JobRejected
naming its intake sequence or a dead letter of it (or be refused by the stream at publish)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from tests.chaos.workload import QUEUE_OF, TEAMS

NEST = 5_000
"""Levels of the deeply nested documents (issue 21: 5,000 crashed admission)."""


@dataclass(frozen=True)
class Malformed:
    kind: str
    team: str  # whose credentials publish it
    verb: str  # the last token of gpusched.intake.<team>.<verb> (not always a verb admission knows)
    payload: bytes

    def describe(self, limit: int = 400) -> str:
        """What it was, for a violation's line: the kind, the subject's verb and the payload's start."""
        return f"{self.kind}, {len(self.payload)} bytes on .{self.verb}: {self.payload[:limit]!r}"


def valid_submit(rng: random.Random, team: str, job_id: str) -> dict:
    """A well-formed SubmitJob document, the base every mangling starts from."""
    return {"job_id": job_id,
            "spec": {"kind": "training", "queue": QUEUE_OF[team], "team": team, "image": "img", "gpus": 1,
                     "gpu_flavors": ["l4" if team == "team-c" else "a100"],
                     "expected_runtime_seconds": rng.uniform(10, 60)}}


def _dumps(document) -> bytes:
    return json.dumps(document).encode()


def _mangle(document: dict, path: str, value) -> bytes:
    """The document with the dotted ``path`` set to ``value``."""
    *parents, leaf = path.split(".")
    node = document
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return _dumps(document)


TYPE_MANGLINGS = (  # (path, value): each breaks the published JSON Schema
    ("spec.gpus", "1"), ("spec.gpus", True), ("spec.gpus", 1.5), ("spec.gpus", -1), ("spec.gpus", 10**40),
    ("spec.retry.max_attempts", True), ("spec.retry.backoff_seconds", "30"), ("spec", []), ("submitter", 123),
    ("spec.kind", "quantum"), ("spec.unknown_field", 1), ("job_id", "Upper_Case"), ("job_id", "rejected-1"),
    ("spec.env", {"1BAD": "x"}), ("spec.annotations", {"a": 5}), ("spec.expected_runtime_seconds", float("nan")),
    ("spec.retry.backoff_seconds", float("inf")), ("spec.gang_size", 0), ("spec.gpu_flavors", "a100"),
    ("spec.team", None),
)


def _random_bytes(rng, doc, team):
    return "submit", rng.randbytes(rng.randint(1, 2000))


def _broken_json(rng, doc, team):
    text = _dumps(doc)
    return "submit", rng.choice((text[:rng.randint(1, len(text) - 1)], text.replace(b'"', b"'"), text + b",}"))


def _deep_nesting(rng, doc, team):
    nested = b'{"a":' * NEST + b"1" + b"}" * NEST
    return "submit", rng.choice((nested, _dumps(doc)[:-1] + b', "extra": ' + nested + b"}"))


def _type_mangled(rng, doc, team):
    return "submit", _mangle(doc, *rng.choice(TYPE_MANGLINGS))


def _nul(rng, doc, team):
    if rng.random() < 0.5:
        return "submit", _mangle(doc, "submitter", "ci\u0000bot")
    text = _dumps(doc)
    cut = rng.randint(1, len(text) - 1)
    return "submit", text[:cut] + b"\x00" + text[cut:]


def _surrogate(rng, doc, team):
    return "submit", _dumps(doc).replace(b'"img"', b'"img\\ud800"')


def _bom(rng, doc, team):
    return "submit", b"\xef\xbb\xbf" + _dumps(doc)


def _oversized(rng, doc, team):
    size = rng.choice((100_000, 1_500_000))  # past admission's 64 KiB; past the stream's 1 MiB
    return "submit", _mangle(doc, "spec.image", "x" * size)


def _wrong_team(rng, doc, team):
    return "submit", _mangle(doc, "spec.team", rng.choice([t for t in TEAMS if t != team]))


def _bad_cancel(rng, doc, team):
    other = rng.choice([t for t in TEAMS if t != team])
    return "cancel", rng.choice((
        _dumps({"job_id": "no-such-job", "requested_by": "fuzz"}),
        _dumps({"job_id": 5, "requested_by": "fuzz"}),
        _dumps({"requested_by": "fuzz"}),
        _dumps({"job_id": f"cj-{rng.randint(0, 99):05d}", "requested_by": "fuzz", "team": other}),
        b"cancel everything",
    ))


def _bad_checkpoint(rng, doc, team):
    return "checkpoint", rng.choice((
        _dumps({"job_id": "no-such-job", "attempt": 1, "reported_by": "fuzz"}),
        _dumps({"job_id": doc["job_id"], "attempt": 0, "reported_by": "fuzz"}),
        _dumps({"job_id": doc["job_id"], "attempt": "1", "reported_by": "fuzz"}),
    ))


def _unknown_subject(rng, doc, team):
    return rng.choice(("purge", "submit.extra", "admin")), _dumps(doc)


MAKERS: dict[str, Callable] = {
    "random-bytes": _random_bytes, "broken-json": _broken_json, "deep-nesting": _deep_nesting,
    "type-mangled": _type_mangled, "nul": _nul, "surrogate": _surrogate, "bom": _bom, "oversized": _oversized,
    "wrong-team": _wrong_team, "bad-cancel": _bad_cancel, "bad-checkpoint": _bad_checkpoint,
    "unknown-subject": _unknown_subject,
}


def malformed(rng: random.Random, i: int) -> Malformed:
    """The ``i``-th malformed command: every kind in turn, the details drawn from ``rng``."""
    kind = list(MAKERS)[i % len(MAKERS)]
    team = rng.choice(TEAMS)
    verb, payload = MAKERS[kind](rng, valid_submit(rng, team, f"fz-{i:05d}"), team)
    return Malformed(kind, team, verb, payload)
