"""One platform with its API for every test of this package (tests/api/stack.py)."""

from __future__ import annotations

import pytest

from tests.api.stack import ApiStack


@pytest.fixture(scope="package")
def api_stack(postgres, tmp_path_factory) -> ApiStack:
    stack = ApiStack(tmp_path_factory.mktemp("api-stack"), postgres).start()
    yield stack
    crashed = stack.stop()
    assert not crashed, f"tracebacks in the logs of {crashed}: {[stack.log(n)[-2000:] for n in crashed]}"
