"""What a user sees when an input is wrong: :class:`UserError` (shown as is, on one line) and
:func:`read_document`, the one reader of the files the CLI takes (job files, queues.yaml,
pricebook.yaml, the connection file), which refuses what it cannot read with the file, the
place and what is accepted.

A file is checked in the order that keeps every check cheap: its size (at most
:data:`MAX_FILE_BYTES`, read no further), its encoding (UTF-8 without a byte order mark), its
shape from the YAML event stream before any object is built (at most :data:`MAX_DEPTH` levels
and :data:`MAX_VALUES` values, aliases counted as what they expand to, so "billion laughs"
documents are refused in milliseconds), then its text (no NUL character or unpaired surrogate
in any key or value). JSON files are read as YAML (JSON is YAML's flow style)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.text import Text

from gpusched.errors import UserError  # noqa: F401 - re-exported: every importer of it here keeps working

MAX_FILE_BYTES = 1024 * 1024
"""Largest input file read (1 MiB)."""
MAX_DEPTH = 32
"""Most levels of nested mappings and sequences in a file (a queues.yaml needs 5)."""
MAX_VALUES = 100_000
"""Most values (scalars, mappings and sequences, aliases expanded) in a file."""
MAX_SHOWN = 60
"""Longest value quoted in an error message; longer ones are cut, with their length."""
MAX_LINE = 2000
"""Longest error line printed."""
CHECKED_AT = datetime(2000, 1, 1, tzinfo=UTC)
"""When a file is only checked, the time the events it would make are built at."""

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when the wheel has it (far faster)
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def shorten(value: object, limit: int = MAX_SHOWN) -> str:
    """``value`` as text, cut to ``limit`` characters with its full length when longer."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def field_path(parts: tuple | list) -> str:
    """A dotted field path for an error; a key that is empty or not printable is quoted."""
    shown = (shorten(p) if str(p).isprintable() and str(p) else shorten(repr(p)) for p in parts)
    return ".".join(shown) or "(root)"


def one_line(message: str) -> str:
    """An error message as one printable line of at most :data:`MAX_LINE` characters."""
    return shorten(" ".join(message.split()) if "\n" in message else message, MAX_LINE)


def print_error(console: Console, message: str) -> None:
    """``error: <message>`` on one line, without rich markup or wrapping (wrapping a long word
    costs rich quadratic time)."""
    console.print(Text.assemble(("error: ", "red"), one_line(message)), soft_wrap=True, highlight=False)


def first_error(err: ValidationError, source: str) -> str:
    """The first validation error as ``source: field.path: message``, with how many more there are."""
    errors = err.errors(include_url=False)
    first = errors[0]
    where = field_path(first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {where}: {shorten(first['msg'], 300)}{more}"


def validate(model: type[M], document: Any, source: str | Path) -> M:
    """``document`` as ``model``; UserError naming the file and the first field that is wrong."""
    check_text(document, str(source))
    return checked(lambda: model.model_validate(document), source)


def checked(build: Callable[[], T], source: str | Path) -> T:
    """``build()``; a ValidationError it raises becomes a UserError naming ``source`` and the field."""
    try:
        return build()
    except ValidationError as err:
        raise UserError(first_error(err, str(source))) from None


def read_document(path: Path) -> Any:
    """The YAML (or JSON) document in ``path``; UserError with the file, where and what is accepted."""
    text = _read_text(path)
    check_shape(text, str(path))
    try:
        document = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as err:
        raise UserError(_yaml_message(err, str(path))) from None
    check_text(document, str(path))
    return document


def _read_text(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise UserError(f"{path}: {err.strerror or err}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{path}: larger than {MAX_FILE_BYTES} bytes; accepted: files of at most 1 MiB")
    if raw.startswith(b"\xef\xbb\xbf"):
        raise UserError(f"{path}: starts with a UTF-8 byte order mark; accepted: UTF-8 without one")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line}: not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start}); "
                        "accepted: UTF-8 text") from None


@dataclass
class _Open:
    """A mapping or sequence being read: its anchor, and the deepest nesting and the values below it."""

    anchor: str | None
    depth: int = 0
    values: int = 0


def check_shape(text: str, source: str) -> None:
    """Refuse a document nested deeper than :data:`MAX_DEPTH` or with more than :data:`MAX_VALUES`
    values, aliases counted as what they expand to, from its events (libyaml's parser keeps no
    recursion), before any object is built."""
    stack: list[_Open] = []
    anchors: dict[str, tuple[int, int]] = {}  # a finished anchored node: (depth, values)
    total = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.CollectionStartEvent):
                total += 1
                _check_limits(len(stack) + 1, total, event, source)
                stack.append(_Open(event.anchor))
            elif isinstance(event, yaml.CollectionEndEvent):
                node = stack.pop()
                _finish(stack, anchors, node.anchor, (node.depth + 1, node.values + 1))
            elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
                shape = _alias(anchors, event, source) if isinstance(event, yaml.AliasEvent) else (0, 1)
                total += shape[1]
                _check_limits(len(stack) + shape[0], total, event, source)
                _finish(stack, anchors, event.anchor if isinstance(event, yaml.ScalarEvent) else None, shape)
    except yaml.YAMLError as err:
        raise UserError(_yaml_message(err, source)) from None


def _finish(stack: list[_Open], anchors: dict[str, tuple[int, int]], anchor: str | None,
            shape: tuple[int, int]) -> None:
    """A node is complete: remember its shape under its anchor and add it to its parent's."""
    if anchor is not None:
        anchors[anchor] = shape
    if stack:
        parent = stack[-1]
        parent.depth, parent.values = max(parent.depth, shape[0]), parent.values + shape[1]


def _alias(anchors: dict[str, tuple[int, int]], event: yaml.AliasEvent, source: str) -> tuple[int, int]:
    if event.anchor not in anchors:
        raise UserError(f"{source}: {_where(event.start_mark)}alias *{shorten(event.anchor)} refers to a node that "
                        "is not defined before it or contains it; accepted: aliases of earlier, complete nodes")
    return anchors[event.anchor]


def _check_limits(depth: int, total: int, event: yaml.Event, source: str) -> None:
    if depth > MAX_DEPTH:
        raise UserError(f"{source}: {_where(event.start_mark)}nested more than {MAX_DEPTH} levels deep; "
                        f"accepted: at most {MAX_DEPTH} levels")
    if total > MAX_VALUES:
        raise UserError(f"{source}: {_where(event.start_mark)}more than {MAX_VALUES} values (aliases expanded); "
                        f"accepted: at most {MAX_VALUES}")


def check_text(value: Any, source: str, path: tuple[str, ...] = ()) -> None:
    """Refuse a key or value holding a NUL character or an unpaired surrogate (text the platform
    cannot store), naming the field."""
    if isinstance(value, str):
        for offset, char in enumerate(value):
            if char == "\x00" or "\ud800" <= char <= "\udfff":
                what = "a NUL character" if char == "\x00" else "an unpaired UTF-16 surrogate"
                field = field_path(path)
                raise UserError(f"{source}: {field}: contains {what} at offset {offset}; "
                                "accepted: text without NUL characters or unpaired surrogates")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, source, path)
            check_text(item, source, (*path, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_text(item, source, (*path, str(index)))


def _where(mark: Any) -> str:
    return "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: "


def _yaml_message(err: yaml.YAMLError, source: str) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = " ".join(filter(None, (getattr(err, "context", None), getattr(err, "problem", None)))) or str(err)
    if "maximum nesting depth" in problem:  # libyaml's own limit, met while it scans ahead
        return f"{source}: {_where(mark)}nested more than {MAX_DEPTH} levels deep; accepted: at most {MAX_DEPTH} levels"
    return one_line(f"{source}: {_where(mark)}not valid YAML: {shorten(problem, 300)}")
