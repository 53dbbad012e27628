"""Generated test data kept between sessions: ``built_once(name, build)`` (a plain module, not a
conftest.py: tests/unit has no __init__.py, and a conftest here would take the name of the root
conftest that the other tiers import)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from types import CodeType
from typing import TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "test-data"
"""Inside the repository and ignored by git; `make clean` removes it."""
VERSIONED = ("pydantic", "pydantic-core", "sortedcontainers")
"""Libraries whose version is part of every key (the data are their objects, pickled)."""


def _sources() -> dict[str, str]:
    """Every module of the repository loaded now (not the tests), by path, with its content's hash."""
    out = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        if path.suffix != ".py" or not path.is_relative_to(ROOT):
            continue
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "tests") or ".venv" in rel.parts:
            continue
        out[str(rel)] = _digest(path)
    return out


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _code(code: CodeType) -> str:
    """A function's code: its bytecode, names and constants (nested functions' too), not its lines."""
    consts = [_code(c) if isinstance(c, CodeType) else repr(c) for c in code.co_consts]
    return repr((code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts))


def _environment(build: Callable) -> dict[str, str]:
    return {"python": sys.version, "build": hashlib.sha256(_code(build.__code__).encode()).hexdigest(),
            **{name: importlib.metadata.version(name) for name in VERSIONED}}


def built_once(name: str, build: Callable[[], T]) -> T:
    """``build()``, pickled into .cache/test-data/<name>.pickle and reused by later sessions while
    the code that built it is unchanged: ``build``'s own code (its constants included), the
    repository's modules loaded after the build (each file's content; the tests' are left out), the
    Python version and those of ``VERSIONED``. Any change to one of those (or a file gone) builds it
    again. ``build`` must be deterministic: same code, same data."""
    data_file, key_file = CACHE / f"{name}.pickle", CACHE / f"{name}.key.json"
    try:
        key = json.loads(key_file.read_text())
        if key["environment"] == _environment(build) and all(_digest(ROOT / p) == h for p, h in key["sources"].items()):
            with data_file.open("rb") as f:
                return pickle.load(f)
    except Exception:  # noqa: BLE001 - a cache that cannot be read is built again
        pass
    value = build()
    CACHE.mkdir(parents=True, exist_ok=True)
    key = {"environment": _environment(build), "sources": _sources()}
    for target, write in ((data_file, lambda f: pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)),
                          (key_file, lambda f: f.write(json.dumps(key, indent=0, sort_keys=True).encode()))):
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # concurrent sessions: whole files only
        with partial.open("wb") as f:
            write(f)
        os.replace(partial, target)
    return value
