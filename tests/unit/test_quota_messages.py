"""What a quota wait reason may claim: its numbers are the ones the verdict was computed from, on
the usage the log holds after the cycle (docs/quota.md, "What a reason may claim").

Seen on the demo stack before: "queue research nominal a100-40gb 8, used 16; needs 8; cohort
shared has 8 free a100-40gb to lend" with nothing free anywhere, and "used 9; needs 1; cohort
shared has 1 free h100-80gb to lend" on a job that kept waiting: the free count added back the
waiting queue's own borrowing, quota already lent (to that very queue)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (CohortConfigured, FlavorQuota, QueueConfigured, QuotaPendingReasonChanged, QuotaReleased,
                     QuotaReserved, QuotaWaitReason, new_event)
from services.quota.capacity import MILLI, Limits, Pool
from services.quota.domain import QuotaCore
from tests.unit.builders import T0, Log, admitted, drive, spec, submitted, succeeded

# Reads the free amount out of a cohort-exhausted message in the wording of today and of before,
# so that a test fails on the claim, not on the words.
FREE = re.compile(r"; needs ([\d.]+)(?:, would borrow ([\d.]+))?; cohort (\S+) has ([\d.]+) "
                  r"(?:free (\S+)|(\S+) of quota free) to lend")


def claimed(message: str) -> tuple[float, float]:
    """(needs, free to lend) as a cohort-exhausted message states them, in GPUs."""
    m = FREE.search(message)
    assert m is not None, f"no free amount in {message!r}"
    return float(m.group(1)), float(m.group(4))


def cq(name: str, cohort: str | None, flavor: str, nominal: int, borrowing_limit: int | None = None,
       lending_limit: int | None = None) -> QueueConfigured:
    return new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=T0,
                     key=f"{name}/{flavor}/{nominal}/{borrowing_limit}/{lending_limit}/{cohort}", name=name,
                     cohort=cohort, allowed_teams=("team-a",),
                     quotas=(FlavorQuota(flavor=flavor, nominal=nominal, borrowing_limit=borrowing_limit,
                                         lending_limit=lending_limit),))


def job(job_id: str, queue_: str, gpus: int, *, seq: int, at_s: float = 0):
    when = T0 + timedelta(seconds=at_s)
    return [submitted(job_id, spec(gpus=gpus, queue=queue_), seq=seq, when=when),
            admitted(job_id, queue_, 500, when=when)]


def snapshot_free(queues: list[QueueConfigured], log_events, waiting_queue: str) -> float:
    """Quota free to lend to ``waiting_queue`` in GPUs, folded from the log independently of the
    quota core: the other queues' unused nominal within their lending limits, less everything
    borrowed in the cohort."""
    used: dict[str, int] = {}
    for e in log_events:
        if isinstance(e, QuotaReserved):
            used[e.queue] = used.get(e.queue, 0) + e.milli_held
        elif isinstance(e, QuotaReleased):
            used[e.queue] = used.get(e.queue, 0) - e.milli_released
    lendable = borrowed = 0
    for q in queues:
        fq = q.quotas[0]
        n, u = fq.nominal * MILLI, used.get(q.name, 0)
        borrowed += max(0, u - n)
        if q.name != waiting_queue:
            cap = n if fq.lending_limit is None else min(n, fq.lending_limit * MILLI)
            lendable += max(0, min(cap, n - min(u, n)))
    return max(0, lendable - borrowed) / MILLI


@pytest.mark.parametrize(
    "queues, jobs, waiting, expect",
    [
        # "used 16; needs 8; cohort shared has 8 free a100-40gb to lend": product's 8 are lent to research already
        ([cq("research", "shared", "a100-40gb", 8), cq("product", "shared", "a100-40gb", 8)],
         [job("r1", "research", 16, seq=1), job("r2", "research", 8, seq=2, at_s=1)], "r2",
         "queue research nominal a100-40gb 8, used 16; needs 8, would borrow 8; cohort shared has 0 a100-40gb "
         "of quota free to lend; borrowed by: research 8"),
        # "used 9; needs 1; cohort shared has 1 free h100-80gb to lend" on a job that kept waiting
        ([cq("research", "shared", "h100-80gb", 8), cq("product", "shared", "h100-80gb", 1)],
         [job("r1", "research", 9, seq=1), job("r2", "research", 1, seq=2, at_s=1)], "r2",
         "queue research nominal h100-80gb 8, used 9; needs 1, would borrow 1; cohort shared has 0 h100-80gb "
         "of quota free to lend; borrowed by: research 1"),
        # some left, not enough: it said 4 free (as much as it needs) where 2 are
        ([cq("research", "shared", "a100", 8), cq("product", "shared", "a100", 4)],
         [job("r1", "research", 10, seq=1), job("r2", "research", 4, seq=2, at_s=1)], "r2",
         "queue research nominal a100 8, used 10; needs 4, would borrow 4; cohort shared has 2 a100 "
         "of quota free to lend; borrowed by: research 2"),
        # part of the request within its own nominal: it borrows only the rest, and the lending limit counts
        ([cq("research", "shared", "a100", 4), cq("product", "shared", "a100", 4, lending_limit=1),
          cq("ops", "shared", "a100", 2)],
         [job("o1", "ops", 3, seq=1), job("r2", "research", 6, seq=2, at_s=1)], "r2",
         "queue research nominal a100 4, used 0; needs 6, would borrow 2; cohort shared has 0 a100 "
         "of quota free to lend; borrowed by: ops 1"),
    ],
    ids=["a100-used-16-needs-8", "h100-used-9-needs-1", "some-free-not-enough", "lending-limit"],
)
def test_a_cohort_exhausted_reason_claims_only_the_quota_that_is_free(queues, jobs, waiting, expect):
    core, log = QuotaCore(), Log()
    drive(core, queues, T0, log=log)
    for k, batch in enumerate(jobs):
        drive(core, batch, T0 + timedelta(seconds=k), log=log)
    why = [e for e in log.events if isinstance(e, QuotaPendingReasonChanged) and e.aggregate_id == waiting]
    assert [e for e in log.events if isinstance(e, QuotaReserved) and e.aggregate_id == waiting] == []
    assert why and why[-1].reason == QuotaWaitReason.COHORT_EXHAUSTED
    needs, free = claimed(why[-1].message)
    assert free < needs
    assert free == snapshot_free(queues, log.events, queues[0].name)
    assert why[-1].message == expect


# -- properties -------------------------------------------------------------------------------------

limits = st.tuples(st.integers(0, 8), st.none() | st.integers(0, 8), st.none() | st.integers(0, 8))


@st.composite
def pools(draw):
    """A pool of 2 to 4 queues in one cohort with any usage (also one no cycle would reach: a
    lowered nominal leaves more borrowed than may be lent), a queue of it and a request."""
    n = draw(st.integers(2, 4))
    names = [f"q{i}" for i in range(n)]
    pool = Pool("a100", "c")
    for name in names:
        nominal, b, l_ = draw(limits)
        pool.limits[name] = Limits.in_milli(nominal, b, l_)
        pool.used[name] = draw(st.integers(0, 12)) * MILLI + draw(st.sampled_from([0, 0, 250, 500]))
    return pool, draw(st.sampled_from(names)), draw(st.integers(1, 12)) * MILLI - draw(st.sampled_from([0, 500]))


@settings(max_examples=400, deadline=None, database=None)
@given(pools())
def test_property_a_pool_reason_never_claims_what_the_snapshot_does_not_have(case):
    pool, q, need = case
    v = pool.check(q, need)
    lendable_others = sum(pool.lendable(p) for p in pool.limits if p != q)
    borrowed_all = sum(pool.borrowed(p) for p in pool.limits)
    unused_others = sum(max(0, pool.limits[p].nominal - pool.used[p]) for p in pool.limits if p != q)
    if v.reason == QuotaWaitReason.COHORT_EXHAUSTED:
        needs, free = claimed(v.message)
        assert needs == need / MILLI
        assert free < needs  # as much free would have let it in
        assert free * MILLI <= max(0, lendable_others - borrowed_all)  # never more than is unlent
        assert free * MILLI <= unused_others  # nor more than the others leave unused
        assert f"used {pool.used[q] / MILLI:g};" in v.message
    if v.fits:
        assert v.borrowed <= max(0, lendable_others - borrowed_all)


queue_limits = st.tuples(st.integers(0, 6), st.none() | st.integers(0, 6), st.none() | st.integers(0, 6))


@st.composite
def scenarios(draw):
    n = draw(st.integers(2, 3))
    queues = [cq(f"q{i}", "shared", "a100", *draw(queue_limits)) for i in range(n)]
    steps = draw(st.lists(st.tuples(st.sampled_from(["submit", "submit", "finish"]), st.integers(0, n - 1),
                                    st.integers(1, 8)), min_size=1, max_size=14))
    return queues, steps


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_every_quota_reason_states_the_snapshot_its_cycle_decided_on(scenario):
    """Through the core, cycle after cycle: each cohort-exhausted reason's free amount is the one
    the log's usage after that cycle gives, and is less than the job needs."""
    queues, steps = scenario
    core, log = QuotaCore(), Log()
    drive(core, queues, T0, log=log)
    needs: dict[str, int] = {}
    queue_of: dict[str, str] = {}
    for k, (kind, pick, gpus) in enumerate(steps, start=1):
        now = T0 + timedelta(seconds=40 * k)  # past the reason throttle: every change is told
        if kind == "submit":
            job_id = f"j{k}"
            needs[job_id], queue_of[job_id] = gpus, queues[pick].name
            drive(core, job(job_id, queues[pick].name, gpus, seq=k, at_s=40 * k), now, log=log)
        else:
            holding = sorted(j for j, held in core.state.jobs.items()
                             if held.reserved is not None and not held.finished)
            if holding:
                drive(core, [succeeded(holding[pick % len(holding)], started_at=now, when=now)], now, log=log)
    for i, e in enumerate(log.events):
        if isinstance(e, QuotaPendingReasonChanged) and e.reason == QuotaWaitReason.COHORT_EXHAUSTED \
                and "to lend" in e.message:
            needed, free = claimed(e.message)
            assert needed == needs[e.aggregate_id]
            assert free < needed
            assert free == snapshot_free(queues, log.events[:i], queue_of[e.aggregate_id]), e.message


def test_borrowing_closed_for_an_owner_says_so_and_claims_no_reclaim_that_is_not_under_way():
    """Queue a's own quota is lent to b's job, which may not be preempted: a waits (nominal-lent)
    and, while it does, nobody borrows in the cohort, so x waits although c's idle quota would
    fit it. Its reason said "quota is being reclaimed" where nothing is."""
    queues = [cq("a", "shared", "a100", 4), cq("b", "shared", "a100", 4), cq("c", "shared", "a100", 2),
              cq("x", "shared", "a100", 0)]
    core, log = QuotaCore(), Log()
    drive(core, queues, T0, log=log)
    hog = [submitted("b1", spec(gpus=8, queue="b"), seq=1, when=T0), admitted("b1", "b", 500, preemptible=False)]
    drive(core, hog, T0, log=log)
    later = T0 + timedelta(seconds=1)
    drive(core, job("a1", "a", 4, seq=2, at_s=1) + job("x1", "x", 1, seq=3, at_s=1), later, log=log)
    assert [e.aggregate_id for e in log.events if isinstance(e, QuotaReserved)] == ["b1"]
    assert not [e for e in log.events if e.type == "ReclaimRequested"]
    why = {e.aggregate_id: e for e in log.events if isinstance(e, QuotaPendingReasonChanged)}
    assert why["a1"].reason == QuotaWaitReason.NOMINAL_LENT
    assert why["x1"].reason == QuotaWaitReason.COHORT_EXHAUSTED
    assert why["x1"].message == ("queue x a100: would borrow 1, but borrowing is closed in its cohort this cycle: "
                                 "queue a waits for its own a100 quota, lent out, and takes what is freed first")
