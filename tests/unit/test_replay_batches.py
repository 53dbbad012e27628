"""The buffer a replay's reader hands a writer process: the batch comes back as it went."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from services.accounting.replay import pack, unpack


@example([])  # a writer's stop
@given(st.lists(st.tuples(st.integers(min_value=1, max_value=2**63 - 1), st.binary(max_size=600)), max_size=50))
def test_a_packed_batch_unpacks_to_itself(raw):
    assert unpack(pack(raw)) == raw

