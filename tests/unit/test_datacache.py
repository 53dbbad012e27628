"""Generated test data kept between sessions (tests/unit/datacache.py): reused while the code that
built it is unchanged, built again when a module it loaded, or the builder itself, changes."""

from __future__ import annotations

import importlib
import sys

import pytest

from tests.unit import datacache


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository of one module, ``gen_source``, loaded; its cache in ``.cache/test-data``."""
    (tmp_path / "gen_source.py").write_text("SIZE = 3\n")
    monkeypatch.setattr(datacache, "ROOT", tmp_path)
    monkeypatch.setattr(datacache, "CACHE", tmp_path / ".cache" / "test-data")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("gen_source", None)
    yield importlib.import_module("gen_source")
    sys.modules.pop("gen_source", None)


def counting(calls: list):
    def build():
        calls.append(1)
        return list(range(sys.modules["gen_source"].SIZE))
    return build


def test_a_second_session_loads_what_the_first_built(repo):
    calls: list = []
    assert datacache.built_once("d", counting(calls)) == [0, 1, 2]
    assert datacache.built_once("d", counting(calls)) == [0, 1, 2]
    assert len(calls) == 1
    assert (datacache.CACHE / "d.pickle").is_file()


def test_a_changed_module_builds_it_again(repo):
    calls: list = []
    datacache.built_once("d", counting(calls))
    (datacache.ROOT / "gen_source.py").write_text("SIZE = 4\n")
    importlib.reload(repo)
    assert datacache.built_once("d", counting(calls)) == [0, 1, 2, 3]
    assert len(calls) == 2


def test_a_changed_builder_builds_it_again(repo):
    assert datacache.built_once("d", lambda: "first") == "first"
    assert datacache.built_once("d", lambda: "second") == "second"


def test_a_damaged_file_builds_it_again(repo):
    datacache.built_once("d", lambda: "value")
    (datacache.CACHE / "d.pickle").write_bytes(b"not a pickle")
    calls: list = []

    def build():
        calls.append(1)
        return "value"

    assert datacache.built_once("d", build) == "value" and calls == [1]
