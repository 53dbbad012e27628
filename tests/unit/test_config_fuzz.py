"""Fuzzing the CLI's file readers and the configuration parsers (issue 21, deliverable 6): at
least 1,000 generated inputs each (random bytes, broken encodings, deep nesting, valid documents
with a value replaced by one of another type, huge strings); none may raise anything but
UserError, and each UserError is one line that starts with the file (or source) and says where."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.gateway import commands
from gpusched.config import pricebook
from gpusched.config import queues as queueconfig
from gpusched.userinput import MAX_LINE, UserError

EXAMPLES = 1000
JOB = {"kind": "training", "queue": "research", "team": "team-a", "image": "img", "gpus": 2,
       "gpu_flavors": ["a100"], "env": {"A": "1"}, "args": ["--lr", "0.1"], "retry": {"max_attempts": 2}}
QUEUES = {"cohorts": [{"name": "shared", "parent": "org", "usage_half_life_seconds": 3600.0, "history_weight": 0.5}],
          "queues": [{"name": "research", "cohort": "shared", "allowed_teams": ["team-a"], "allowed_users": ["al"],
                      "allowed_priority_classes": ["training"], "strict_fifo": False,
                      "quotas": [{"flavor": "a100", "nominal": 8, "borrowing_limit": 4, "lending_limit": 2,
                                  "weight": 1.5}],
                      "preemption": {"within_queue": "lower-priority"}}]}
PRICES = {"price_books": [{"name": "default", "effective_from": "2026-11-01T00:00:00Z", "currency": "USD",
                           "gpu_prices": {"a100": 2.1}, "cpu_core_hour": 0.04, "memory_gib_hour": 0.005,
                           "idle_quota": "showback"}]}

HUGE = st.sampled_from(["x" * 100_000, "a" * 64, "\x00", "\ud800", "é" * 70_000, "rejected-1", "Q" * 300])
TEXT = st.text(max_size=20) | st.text(alphabet="a-\x00\ud800\udfff\n ", max_size=4) | HUGE
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | TEXT | st.datetimes() | st.binary(max_size=8)
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                     max_leaves=8)


def paths(doc, prefix=()):
    """Every place in a document: (container path, key or index)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield prefix, key
        yield from paths(value, (*prefix, key))


@st.composite
def mangled(draw, seed: dict) -> object:
    """``seed`` with one to three values replaced by others of any type or by odd text, deleted,
    or keys added."""
    doc = copy.deepcopy(seed)
    for _ in range(draw(st.integers(1, 3))):
        mangle(draw, doc)
    return doc


def mangle(draw, doc) -> None:
    action = draw(st.sampled_from(["replace", "text", "delete", "add"]))
    places = [(w, k) for w, k in paths(doc) if action != "text" or isinstance(at(doc, (*w, k)), str)]
    if not places:
        return
    where, key = draw(st.sampled_from(places))
    parent = at(doc, where)
    if action in ("replace", "text"):
        parent[key] = draw(TEXT if action == "text" else VALUE)
    elif action == "delete":
        del parent[key]
    elif isinstance(parent, dict):
        parent[draw(TEXT)] = draw(VALUE)
    else:
        parent.append(draw(VALUE))


def at(doc, where):
    for step in where:
        doc = doc[step]
    return doc


def as_bytes(doc) -> bytes:
    """JSON where it can be (it is YAML too, and escapes surrogates), else YAML."""
    try:
        return json.dumps(doc).encode()
    except (TypeError, ValueError):
        return yaml.safe_dump(doc, allow_unicode=True).encode("utf-8", "surrogatepass")


@st.composite
def broken(draw, seed: dict) -> bytes:
    """The seed's text with bytes inserted, replaced or cut, a BOM, or another encoding."""
    data = yaml.safe_dump(seed).encode()
    kind = draw(st.sampled_from(["insert", "cut", "bom", "utf16", "latin1"]))
    at = draw(st.integers(0, len(data)))
    if kind == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=6)) + data[at:]
    if kind == "cut":
        return data[:at]
    if kind == "bom":
        return b"\xef\xbb\xbf" + data
    return (data.decode() + "é\u2028").encode("utf-16" if kind == "utf16" else "latin-1", "replace")


def deep(seed: dict) -> st.SearchStrategy[bytes]:
    flow = st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n)
    block = st.integers(1, 200).map(lambda n: "".join("  " * i + "a:\n" for i in range(n)).encode())
    inside = st.integers(1, 100).map(lambda n: as_bytes({**seed, "x": json.loads("[" * n + "]" * n)}))
    return flow | block | inside


def file_inputs(seed: dict) -> st.SearchStrategy[bytes]:
    return (st.binary(max_size=512) | broken(seed) | deep(seed) | mangled(seed).map(as_bytes)
            | st.just(as_bytes(seed)))


def fuzz(strategy, check) -> int:
    """Run ``check`` on at least EXAMPLES generated inputs; how many ran."""
    ran = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def one(value):
        check(value)
        ran.append(1)

    one()
    assert len(ran) >= EXAMPLES
    return len(ran)


def refused_well(err: UserError, source: str) -> None:
    message = str(err)
    assert message.startswith(f"{source}: ") and "\n" not in message and len(message) <= MAX_LINE, message
    assert message[len(source) + 2:].strip(), message


def reads_or_refuses(read, path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        read(path)
    except UserError as err:
        refused_well(err, str(path))


@pytest.mark.parametrize("read, seed", [
    (commands.submit_command_from_file, JOB),
    (queueconfig.read_queues, QUEUES),
    (pricebook.read, PRICES),
], ids=["submit-f", "apply-f-queues", "prices-f"])
def test_file_readers_refuse_only_with_a_user_error(tmp_path, read, seed):
    path = tmp_path / "input.yaml"
    fuzz(file_inputs(seed), lambda data: reads_or_refuses(read, path, data))


@pytest.mark.parametrize("parse, seed", [
    (queueconfig.parse_queues, QUEUES),
    (pricebook.parse, PRICES),
], ids=["queues", "price-books"])
def test_config_parsers_refuse_only_with_a_user_error_naming_the_field(parse, seed):
    def check(document):
        try:
            parse(document, "f.yaml")
        except UserError as err:
            refused_well(err, "f.yaml")
            assert ": " in str(err)[len("f.yaml: "):], err  # "<field>: <what is wrong>"
    fuzz(mangled(seed) | VALUE, check)
