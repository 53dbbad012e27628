"""The replay's batch plumbing: the buffer a reader hands a writer process comes back as it
went, and the garbage collector is run per batch and given back as it was."""

from __future__ import annotations

import gc
import weakref

from hypothesis import example, given
from hypothesis import strategies as st

from services.accounting.replay import BatchCollector, pack, unpack


@example([])  # a writer's stop
@given(st.lists(st.tuples(st.integers(min_value=1, max_value=2**63 - 1), st.binary(max_size=600)), max_size=50))
def test_a_packed_batch_unpacks_to_itself(raw):
    assert unpack(pack(raw)) == raw


class _Node:
    pass


def _cycle() -> tuple[_Node, weakref.ref]:
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a  # only the collector frees these
    return a, weakref.ref(a)


def test_the_collector_runs_after_each_batch_and_is_given_back():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with BatchCollector(full_every=3) as collector:
        assert not gc.isenabled()
        refs = [_cycle()[1] for _ in range(5000)]  # far past the automatic threshold
        assert all(r() is not None for r in refs)  # nothing collected them meanwhile
        collector.after_batch()
        assert all(r() is None for r in refs)
        node, old = _cycle()
        gc.collect(1)  # it survives into the oldest generation, then becomes garbage
        del node
        collector.after_batch()  # the second: young generations only
        assert old() is not None
        collector.after_batch()  # the third: full
        assert old() is None
    assert gc.isenabled() and gc.get_freeze_count() == 0
