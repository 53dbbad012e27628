"""Documents from a JSON Schema, for the contract's property tests: the subset of Draft 2020-12
that schemas/json uses ($ref, anyOf, type, enum, const, string length/pattern/date-time,
numeric bounds, arrays, objects with properties/patternProperties/additionalProperties), with
every draw filtered through the schema itself, so rules the generator does not build (if/then,
not, maxProperties) still hold. hypothesis-jsonschema would do this, but its 0.23 release does
not run on current Hypothesis (it uses an internal API Hypothesis removed)."""

from __future__ import annotations

from datetime import UTC
from typing import Any

import jsonschema
from hypothesis import strategies as st

from schemas.export import NO_NUL

SMALL = 6  # longest generated array or free-form string: enough to vary, small enough to run fast


def documents(schema: dict) -> st.SearchStrategy:
    """Documents valid against ``schema``."""
    validator = jsonschema.Draft202012Validator(schema)
    return _node(schema, schema.get("$defs", {})).filter(validator.is_valid)


def _node(node: dict, defs: dict) -> st.SearchStrategy:
    if "$ref" in node:
        return _node(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in node:
        return st.one_of([_node(option, defs) for option in node["anyOf"]])
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        return _number(node, kind)
    if kind == "string":
        return _string(node)
    if kind == "array":
        return st.lists(_node(node.get("items", {"type": "string"}), defs), min_size=node.get("minItems", 0),
                        max_size=min(node.get("maxItems", SMALL), SMALL))
    if kind == "object":
        return _object(node, defs)
    raise ValueError(f"schema node not covered by this generator: {node}")


def _number(node: dict, kind: str) -> st.SearchStrategy:
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if kind == "integer":
        low = None if low is None else int(low) + ("exclusiveMinimum" in node)
        high = None if high is None else int(high) - ("exclusiveMaximum" in node)
        return st.integers(low, high)
    return st.floats(low, high, allow_nan=False, allow_infinity=False,
                     exclude_min="exclusiveMinimum" in node, exclude_max="exclusiveMaximum" in node)


def _string(node: dict) -> st.SearchStrategy:
    low, high = node.get("minLength", 0), node.get("maxLength")
    if node.get("format") == "date-time":
        return st.datetimes(timezones=st.just(UTC)).map(lambda t: t.isoformat())
    pattern = node.get("pattern", NO_NUL)
    if pattern == NO_NUL:
        return st.text(min_size=low, max_size=min(high or SMALL, max(low, SMALL))).filter(lambda s: "\x00" not in s)
    strings = st.from_regex(pattern, fullmatch=True)
    return strings.filter(lambda s: low <= len(s) <= (high or len(s)))


def _object(node: dict, defs: dict) -> st.SearchStrategy:
    properties = node.get("properties", {})
    required = set(node.get("required", ()))
    fixed = st.fixed_dictionaries(
        {k: _node(v, defs) for k, v in properties.items() if k in required},
        optional={k: _node(v, defs) for k, v in properties.items() if k not in required})
    patterns = node.get("patternProperties", {})
    if not patterns:
        return fixed
    (key_pattern, value_schema), = patterns.items()
    extra = st.dictionaries(st.from_regex(key_pattern, fullmatch=True), _node(value_schema, defs), max_size=3)
    return st.tuples(fixed, extra).map(lambda pair: {**pair[1], **pair[0]})
