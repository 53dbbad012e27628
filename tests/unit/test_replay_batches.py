"""The replay's batch plumbing: the ranges dealt to writer processes cover the log exactly once,
in order, a delivery's stream sequence and pending count are read off its reply subject, and
the garbage collector is run per batch and given back as it was."""

from __future__ import annotations

import gc
import weakref

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtime.eventlog import delivery_position
from services.accounting.bulk.collector import BatchCollector
from services.accounting.bulk.writers import ranges


@example(1, 1, 1)
@example(5, 4, 3)  # nothing to read
@given(st.integers(min_value=1, max_value=10**12), st.integers(min_value=0, max_value=5000),
       st.integers(min_value=1, max_value=700))
def test_ranges_cover_the_log_once_in_order(start, length, batch):
    end = start + length - 1
    got = ranges(start, end, batch)
    assert [seq for lo, hi in got for seq in range(lo, hi + 1)] == list(range(start, end + 1))
    assert all(hi - lo + 1 == batch for lo, hi in got[:-1]) and all(0 < hi - lo + 1 <= batch for lo, hi in got)


@pytest.mark.parametrize(("reply", "position"), [
    (b"$JS.ACK.EVENTS.Xb2kQ.1.40007.12.1764855000000000000.3", (40007, 3)),
    (b"$JS.ACK.hub.ACCHASH.EVENTS.Xb2kQ.1.40007.12.1764855000000000000.3.tok", (40007, 3)),  # domain, account hash
])
def test_the_stream_sequence_and_pending_count_of_a_delivery(reply, position):
    assert delivery_position(reply) == delivery_position(reply.decode()) == position


@pytest.mark.parametrize("reply", [b"_INBOX.abc", b"", b"$JS.ACK.EVENTS.c.1.x.1.2.3",
                                   b"$JS.ACK.hub.ACCHASH.EVENTS.Xb2kQ.1.40007.12.1764855000000000000.3"])
def test_a_reply_subject_that_is_no_delivery_is_refused(reply):
    with pytest.raises(ValueError):
        delivery_position(reply)


def test_ranges_of_a_log_that_does_not_start_at_one():
    assert ranges(10, 109, 20) == [(10, 29), (30, 49), (50, 69), (70, 89), (90, 109)]
    assert ranges(10, 105, 20)[-1] == (90, 105)


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
