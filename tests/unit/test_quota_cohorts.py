"""Quota with cohorts: borrowing, lending limits, fair order, nested cohorts, and the reasons a
job waits — table-driven cases and a property over random configurations."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import CohortConfigured, FlavorQuota, QueueConfigured, QuotaPendingReasonChanged, QuotaReserved, new_event
from schemas.queue import PreemptionPolicy
from services.quota.capacity import Limits, Pool
from services.quota.domain import QuotaCore
from tests.unit.builders import T0, Log, admitted, drive, spec, submitted, succeeded


def cq(name: str, cohort: str | None, **flavors) -> QueueConfigured:
    """A queue; each flavor is nominal or (nominal, borrowing_limit, lending_limit[, weight])."""
    quotas = []
    for flavor, v in flavors.items():
        n, b, l_, w = (v, None, None, 1.0) if isinstance(v, int) else (tuple(v) + (1.0,))[:4]
        quotas.append(FlavorQuota(flavor=flavor.replace("_", "-"), nominal=n, borrowing_limit=b, lending_limit=l_,
                                  weight=w))
    return new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=T0,
                     key=f"{name}/{flavors}/{cohort}", name=name, cohort=cohort, allowed_teams=("team-a",),
                     quotas=tuple(quotas))


def cohort(name: str, parent: str | None = None) -> CohortConfigured:
    return new_event(CohortConfigured, aggregate_id=name, producer="config", occurred_at=T0, key=f"{name}/{parent}",
                     name=name, parent=parent)


def job(job_id: str, queue_: str, gpus: int, *, seq: int = 1, priority: int = 500, at_s: float = 0, **fields):
    when = T0 + timedelta(seconds=at_s)
    s = spec(gpus=gpus, queue=queue_, **fields)
    return [submitted(job_id, s, seq=seq, when=when), admitted(job_id, queue_, priority, when=when)]


def run(*batches, now=T0):
    core, log, out = QuotaCore(), Log(), []
    for batch in batches:
        flat = [e for x in batch for e in (x if isinstance(x, list) else [x])]
        out = drive(core, flat, now, log=log)
    return core, log, out


def reserved(log) -> dict[str, tuple[str, int, int]]:
    return {e.aggregate_id: (e.queue, e.gpus, e.borrowed) for e in log.events if isinstance(e, QuotaReserved)}


def reasons(log) -> dict[str, QuotaPendingReasonChanged]:
    return {e.aggregate_id: e for e in log.events if isinstance(e, QuotaPendingReasonChanged)}


@pytest.mark.parametrize(
    "queues, jobs, expect_reserved, expect_reason",
    [
        # borrowing the neighbour's unused quota
        ([cq("a", "c", a100=4), cq("b", "c", a100=4)], [job("j", "a", 6)], {"j": ("a", 6, 2)}, {}),
        # ...but not beyond the borrowing limit
        ([cq("a", "c", a100=(4, 1, None)), cq("b", "c", a100=4)], [job("j", "a", 6)], {},
         {"j": ("borrowing-limit", "queue a nominal a100 4, used 0 (borrowed 0); needs 6: would borrow 2, "
                                   "above its borrowingLimit 1")}),
        # ...nor beyond what the lender may lend
        ([cq("a", "c", a100=4), cq("b", "c", a100=(4, None, 1))], [job("j", "a", 6)], {},
         {"j": ("cohort-exhausted", "queue a nominal a100 4, used 0; needs 6, would borrow 2; cohort c has 1 a100 of quota free to lend; "
                                    "borrowed by: none")}),
        # a queue outside any cohort has only its own nominal
        ([cq("a", None, a100=4), cq("b", None, a100=4)], [job("j", "a", 6)], {},
         {"j": ("nominal-exhausted", "queue a nominal a100 4, used 0; needs 6 more; no cohort to borrow from")}),
        # nested cohorts share the root's pool
        ([cohort("root"), cohort("left", "root"), cohort("right", "root"),
          cq("a", "left", a100=2), cq("b", "right", a100=6)], [job("j", "a", 8)], {"j": ("a", 8, 6)}, {}),
        # what is lent is no longer free: the second borrower waits, naming the first
        ([cq("a", "c", a100=4), cq("b", "c", a100=4), cq("x", "c", a100=0)],
         [job("j1", "a", 6, seq=1), job("j2", "x", 3, seq=2, at_s=1)], {"j1": ("a", 6, 2)},
         {"j2": ("cohort-exhausted", "queue x nominal a100 0, used 0; needs 3, would borrow 3; cohort c has 2 a100 of quota free to lend; "
                                     "borrowed by: a 2")}),
    ],
    ids=["borrow", "borrowing-limit", "lending-limit", "no-cohort", "nested", "second-borrower"],
)
def test_borrowing_and_reasons(queues, jobs, expect_reserved, expect_reason):
    _, log, _ = run(queues, jobs)
    assert reserved(log) == expect_reserved
    assert {j: (r.reason.value, r.message) for j, r in reasons(log).items()} == expect_reason


def test_guaranteed_quota_returns_to_its_owner_when_the_borrower_finishes():
    core, log, _ = run([cq("a", "c", a100=4), cq("b", "c", a100=4)], [job("big", "a", 8)])
    assert reserved(log) == {"big": ("a", 8, 4)}
    drive(core, job("mine", "b", 4, seq=2, at_s=1), T0 + timedelta(seconds=1), log=log)
    assert "mine" not in reserved(log)
    why = reasons(log)["mine"]
    assert why.reason.value == "nominal-lent"
    assert why.message == ("queue b nominal a100 4, used 0; needs 4; its unused quota is lent out in cohort c; "
                           "borrowed by: a 4")
    drive(core, [succeeded("big", started_at=T0, when=T0 + timedelta(seconds=5))], T0 + timedelta(seconds=5), log=log)
    assert reserved(log)["mine"] == ("b", 4, 0)


def test_fair_order_gives_cohort_capacity_to_the_lower_share_first():
    # both use all their a100; "light" also has unused l4 quota, so its weighted share is lower
    # (4/8 against 4/4): it gets the lender's 2 a100 first
    queues = [cq("hog", "c", a100=4), cq("light", "c", a100=4, l4=4), cq("lender", "c", a100=2)]
    core, log, _ = run(queues, [job("h0", "hog", 4, seq=1), job("l0", "light", 4, seq=2, gpu_flavors=("a100",))])
    later = job("h1", "hog", 2, seq=3, at_s=1, gpu_flavors=("a100",)) + job("l1", "light", 2, seq=4, at_s=2,
                                                                             gpu_flavors=("a100",))
    drive(core, later, T0 + timedelta(seconds=2), log=log)
    got = reserved(log)
    assert "h1" not in got and got["l1"] == ("light", 2, 2)


def test_weights_rank_queues_in_weighted_units():
    core = QuotaCore()
    a = cq("a", "c", h100=(4, None, None, 4.0), l4=(4, None, None, 1.0))
    core.evolve(a)
    used = {("a", "h100"): 2000}  # thousandths of a GPU
    assert core.share(a, used) == pytest.approx(2 * 4.0 / (4 * 4.0 + 4 * 1.0))


def test_position_counts_only_jobs_still_waiting():
    _, log, _ = run([cq("a", None, a100=2)], [job(f"j{i}", "a", 2, seq=i + 1, at_s=i) for i in range(4)])
    assert reserved(log) == {"j0": ("a", 2, 0)}
    assert {j: r.position for j, r in reasons(log).items()} == {"j1": 1, "j2": 2, "j3": 3}


# -- property ------------------------------------------------------------------------------


@st.composite
def cohort_scenarios(draw):
    n_queues = draw(st.integers(2, 4))
    queues = []
    for i in range(n_queues):
        nominal = draw(st.integers(0, 6))
        b = draw(st.one_of(st.none(), st.integers(0, 6)))
        l_ = draw(st.one_of(st.none(), st.integers(0, 6)))
        queues.append(cq(f"q{i}", draw(st.sampled_from(["c", "c", None])), a100=(nominal, b, l_)))
    jobs = [(f"j{k}", f"q{draw(st.integers(0, n_queues - 1))}", draw(st.integers(1, 5)))
            for k in range(draw(st.integers(1, 10)))]
    finish = draw(st.lists(st.integers(0, 9), max_size=6))
    return queues, jobs, finish


def check_pools(core: QuotaCore) -> None:
    for pool in core.pools().values():
        total_borrowed, total_lendable = pool.totals()
        assert total_borrowed <= total_lendable
        for q, lim in pool.limits.items():
            assert pool.used.get(q, 0) >= 0
            if pool.cohort is None:
                assert pool.used.get(q, 0) <= lim.nominal
            elif lim.borrowing_limit is not None:
                assert pool.borrowed(q) <= lim.borrowing_limit


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cohort_scenarios())
def test_property_limits_hold_and_replay_decides_nothing_new(scenario):
    queues, jobs, finish = scenario
    core, log = QuotaCore(), Log()
    drive(core, queues, T0, log=log)
    for k, (job_id, q, gpus) in enumerate(jobs):
        drive(core, job(job_id, q, gpus, seq=k + 1, at_s=k), T0 + timedelta(seconds=k), log=log)
        check_pools(core)
    now = T0 + timedelta(seconds=len(jobs))
    for i in finish:
        running = sorted(j for j, job_ in core.state.jobs.items() if job_.reserved is not None and not job_.finished)
        if running:
            victim = running[i % len(running)]
            now += timedelta(seconds=1)
            drive(core, [succeeded(victim, started_at=T0, when=now)], now, log=log)
            check_pools(core)
    fresh = QuotaCore()
    for e in log.events:
        fresh.evolve(e)
    assert [e for e in fresh.decide(now) if e.event_id not in log.ids] == []


def test_pool_lent_by_attributes_borrowing_to_lenders_in_name_order():
    pool = Pool("a100", "c", {"a": Limits(4), "b": Limits(2), "c": Limits(2)}, {"a": 7, "b": 0, "c": 1})
    assert pool.totals() == (3, 3)
    assert pool.lent_by() == {"a": 0, "b": 2, "c": 1}


def test_the_worked_example_in_docs_quota_md():
    queues = [cq("research", "shared", a100=4), cq("product", "shared", a100=(4, None, 2)),
              cq("platform", "shared", a100=(0, 4, None))]
    core, log, _ = run(queues, [job("r1", "research", 6, seq=1)])
    assert reserved(log) == {"r1": ("research", 6, 2)}
    for k, (job_id, q) in enumerate([("p1", "platform"), ("d1", "product"), ("d2", "product")], start=1):
        drive(core, job(job_id, q, 2, seq=k + 1, at_s=k), T0 + timedelta(seconds=k), log=log)
    assert reserved(log) == {"r1": ("research", 6, 2), "d1": ("product", 2, 0)}
    assert {j: (r.reason.value, r.message) for j, r in reasons(log).items()} == {
        "p1": ("cohort-exhausted", "queue platform nominal a100 0, used 0; needs 2, would borrow 2; cohort shared has 0 "
                                   "a100 of quota free to lend; borrowed by: research 2"),
        "d2": ("nominal-lent", "queue product nominal a100 4, used 2; needs 2; its unused quota is lent out in "
                               "cohort shared; borrowed by: research 2"),
    }
    drive(core, [succeeded("r1", started_at=T0, when=T0 + timedelta(seconds=9))], T0 + timedelta(seconds=9), log=log)
    assert set(reserved(log)) == {"r1", "d1", "p1", "d2"}


def _reclaims(log) -> dict[str, str]:
    return {e.aggregate_id: e.for_job for e in log.events if e.type == "ReclaimRequested"}


def test_reclaim_names_the_lowest_priority_borrower_and_only_as_many_as_needed():
    queues = [cq("owner", "c", a100=4), cq("borrower", "c", a100=0)]
    core, log, _ = run(queues, [job("low", "borrower", 2, seq=1, priority=100), job("high", "borrower", 2, seq=2,
                                                                                   priority=800)])
    assert set(reserved(log)) == {"low", "high"}
    drive(core, job("mine", "owner", 2, seq=3, at_s=1), T0 + timedelta(seconds=1), log=log)
    assert _reclaims(log) == {"low": "mine"}
    assert reasons(log)["mine"].reason.value == "nominal-lent"
    # asked once: another cycle asks nothing more while the reclaim is under way
    drive(core, [], T0 + timedelta(seconds=2), log=log)
    assert _reclaims(log) == {"low": "mine"}
    # the victim is preempted: its quota goes to the owner, not back to a borrower
    from tests.unit.builders import preempted
    drive(core, [preempted("low", started_at=None, when=T0 + timedelta(seconds=3))], T0 + timedelta(seconds=3), log=log)
    assert reserved(log)["mine"] == ("owner", 2, 0)
    retried = [e for e in log.events if e.type == "QuotaReserved" and e.aggregate_id == "low"]
    assert [e.attempt for e in retried] == [1]  # requeued as attempt 2, waiting


def test_reclaim_spares_non_preemptible_and_protected_attempts():
    from tests.unit.builders import started
    queues = [cq("owner", "c", a100=2), cq("borrower", "c", a100=0)]
    sla = job("sla", "borrower", 1, seq=1, priority=1000, priority_class="inference-sla")
    sla[1] = sla[1].model_copy(update={"preemptible": False})
    fresh_run = job("young", "borrower", 1, seq=2, priority=500)
    core, log, _ = run(queues, [sla, fresh_run])
    drive(core, [started("young", when=T0)], T0, log=log)
    drive(core, job("big", "owner", 2, seq=3, at_s=60), T0 + timedelta(seconds=60), log=log)
    assert _reclaims(log) == {}  # sla is not preemptible; "young" is inside training's 600 s window
    drive(core, [], T0 + timedelta(seconds=601), log=log)
    assert _reclaims(log) == {}  # one victim is not enough (sla keeps its GPU): nothing is asked
    drive(core, job("small", "owner", 1, seq=4, at_s=602, priority=900), T0 + timedelta(seconds=602), log=log)
    assert _reclaims(log) == {"young": "small"}  # the window has passed and one GPU is enough


@pytest.mark.parametrize("checkpoint_s, expect", [
    (None, {"young": "mine"}),  # no checkpoint: "old" ran 1000 s, "young" 100 s
    (990, {"old": "mine"}),  # "old" checkpointed 10 s ago: it loses the least
])
def test_reclaim_takes_the_borrower_that_loses_least_work_since_its_checkpoint(checkpoint_s, expect):
    from tests.unit.builders import checkpointed, started
    queues = [cq("owner", "c", a100=2), cq("borrower", "c", a100=0)]
    core, log, _ = run(queues, [job("old", "borrower", 1, seq=1, priority_class="batch-low"),
                                job("young", "borrower", 1, seq=2, priority_class="batch-low")])
    drive(core, [started("old", when=T0), started("young", when=T0 + timedelta(seconds=900))], T0, log=log)
    if checkpoint_s is not None:
        drive(core, [checkpointed("old", at_=T0 + timedelta(seconds=checkpoint_s))], T0, log=log)
    drive(core, job("mine", "owner", 1, seq=3, at_s=1000), T0 + timedelta(seconds=1000), log=log)
    assert _reclaims(log) == expect


def test_reclaim_loses_least_work_before_it_spares_priority():
    """One victim order for reclaim and preemption (runtime/victims.py): least lost work first,
    priority breaks ties. A running low-priority borrower is spared for a higher-priority one
    that has not started (it loses nothing)."""
    from tests.unit.builders import started
    queues = [cq("owner", "c", a100=2), cq("borrower", "c", a100=0)]
    core, log, _ = run(queues, [job("low", "borrower", 1, seq=1, priority=100, priority_class="batch-low"),
                                job("queued", "borrower", 1, seq=2, priority=500, priority_class="batch-low")])
    drive(core, [started("low", when=T0)], T0, log=log)
    drive(core, job("mine", "owner", 1, seq=3, at_s=60), T0 + timedelta(seconds=60), log=log)
    assert _reclaims(log) == {"queued": "mine"}


def test_reclaim_takes_priority_classes_from_its_configuration():
    from schemas.priority import PriorityClass
    from tests.unit.builders import started
    classes = {"batch-low": PriorityClass(name="batch-low", value=100, preemptible=True, protection_seconds=3600)}
    core, log = QuotaCore(priority_classes=classes), Log()
    drive(core, [cq("owner", "c", a100=1), cq("borrower", "c", a100=0)], T0, log=log)
    drive(core, job("b", "borrower", 1, seq=1, priority_class="batch-low"), T0, log=log)
    drive(core, [started("b", when=T0)], T0, log=log)
    drive(core, job("mine", "owner", 1, seq=2, at_s=60), T0 + timedelta(seconds=60), log=log)
    assert _reclaims(log) == {}  # protected for an hour here (the built-in batch-low has no window)
    drive(core, [], T0 + timedelta(seconds=3600), log=log)  # the core woke itself when the window ended
    assert _reclaims(log) == {"b": "mine"}


def test_decayed_usage_puts_a_queue_that_used_a_lot_recently_behind_one_that_did_not():
    c = new_event(CohortConfigured, aggregate_id="c", producer="config", occurred_at=T0, key="h", name="c",
                  usage_half_life_seconds=3600, history_weight=1.0)
    queues = [c, cq("heavy", "c", a100=4), cq("light", "c", a100=4), cq("lender", "c", a100=2)]
    core, log, _ = run(queues, [job("h0", "heavy", 4, seq=1)])
    one_hour = T0 + timedelta(hours=1)
    drive(core, [succeeded("h0", started_at=T0, when=one_hour)], one_hour, log=log)
    # now both use nothing; each asks for 6 (its 4 plus 2 of the lender's 2): only one can borrow
    later = one_hour + timedelta(seconds=1)
    drive(core, job("h1", "heavy", 6, seq=2, at_s=3601) + job("l1", "light", 6, seq=3, at_s=3601), later, log=log)
    got = reserved(log)
    assert got.get("l1") == ("light", 6, 2) and "h1" not in got
    heavy, light = core.state.queues["heavy"], core.state.queues["light"]
    # heavy averaged 4 GPUs for one half-life: half of it remains in its history (4 × 0.5 = 2 of 4 nominal)
    assert core._decayed(heavy, one_hour) == pytest.approx(2.0)
    assert core.share(light, {}, later) < core.share(heavy, {}, later)


def test_without_a_half_life_only_current_usage_counts():
    queues = [cq("heavy", "c", a100=4), cq("light", "c", a100=4), cq("lender", "c", a100=2)]
    core, log, _ = run(queues, [job("h0", "heavy", 4, seq=1)])
    one_hour = T0 + timedelta(hours=1)
    drive(core, [succeeded("h0", started_at=T0, when=one_hour)], one_hour, log=log)
    later = one_hour + timedelta(seconds=1)
    drive(core, job("h1", "heavy", 6, seq=2, at_s=3601) + job("l1", "light", 6, seq=3, at_s=3601), later, log=log)
    assert reserved(log).get("h1") == ("heavy", 6, 2)  # tie on share: name order


def test_gpu_hour_budget_holds_jobs_until_the_period_renews():
    from schemas.queue import GpuHourBudget
    q = cq("q", None, a100=16).model_copy(update={"budget": GpuHourBudget(gpu_hours=10, period="day")})
    start = T0 + timedelta(hours=20)  # 2026-01-01 20:00
    core, log = QuotaCore(), Log()
    drive(core, [q], start, log=log)
    drive(core, job("a", "q", 4, seq=1, expected_runtime_seconds=3600) + job("b", "q", 8, seq=2,
                                                                         expected_runtime_seconds=3600),
          start, log=log)
    assert set(reserved(log)) == {"a"}
    why = reasons(log)["b"]
    assert why.reason.value == "budget-exhausted"
    assert why.message == ("queue q has used or committed 4.0 of its 10 GPU-hours this day (since 2026-01-01); "
                           "this job plans 8.0 more; the budget renews 2026-01-02T00:00:00+00:00")
    done = start + timedelta(hours=1)
    drive(core, [succeeded("a", started_at=start, when=done)], done, log=log)
    assert core.budget_spent(core.state.queues["q"], done) == pytest.approx(4.0)
    assert "b" not in reserved(log)  # 4 spent + 8 planned > 10
    next_day = T0 + timedelta(days=1, seconds=1)
    drive(core, [], next_day, log=log)
    assert reserved(log)["b"] == ("q", 8, 0)


# -- preemption policies -------------------------------------------------------------------


def _with_policy(queue: QueueConfigured, **policy) -> QueueConfigured:
    return queue.model_copy(update={"preemption": PreemptionPolicy(**policy)})


def _kinds(log) -> dict[str, str]:
    return {e.aggregate_id: e.kind for e in log.events if e.type == "ReclaimRequested"}


@pytest.mark.parametrize("within_queue, expect", [("never", {}), ("lower-priority", {"low": "high"})])
def test_within_queue_preemption_makes_room_for_higher_priority(within_queue, expect):
    queues = [_with_policy(cq("q", None, a100=4), within_queue=within_queue)]
    core, log, _ = run(queues, [job("low", "q", 2, seq=1, priority=100), job("mid", "q", 2, seq=2, priority=300)])
    drive(core, job("high", "q", 2, seq=3, at_s=1, priority=800), T0 + timedelta(seconds=1), log=log)
    assert _reclaims(log) == expect  # the lowest priority is the victim, and one is enough
    assert set(_kinds(log).values()) <= {"priority"}
    drive(core, job("same", "q", 2, seq=4, at_s=2, priority=100), T0 + timedelta(seconds=2), log=log)
    assert _reclaims(log) == expect  # never for equal or higher priority; one preemption at a time


def test_within_queue_preemption_never_crosses_queues_and_each_lone_queue_is_its_own_pool():
    queues = [_with_policy(cq("a", None, a100=2), within_queue="lower-priority"),
              _with_policy(cq("b", None, a100=2), within_queue="lower-priority")]
    core, log, _ = run(queues, [job("a-low", "a", 2, seq=1, priority=100), job("b-low", "b", 2, seq=2, priority=100)])
    drive(core, job("a-high", "a", 2, seq=3, priority=800) + job("b-high", "b", 2, seq=4, priority=800), T0, log=log)
    assert _reclaims(log) == {"a-low": "a-high", "b-low": "b-high"}


@pytest.mark.parametrize("policy, expect", [
    ("any", {"high-borrower": "mine"}),  # any borrower: the lowest priority first, here the only one
    ("lower-priority", {}),  # the borrower outranks the waiting job
    ("never", {}),
])
def test_reclaim_within_cohort_policy(policy, expect):
    queues = [_with_policy(cq("owner", "c", a100=2), reclaim_within_cohort=policy), cq("borrower", "c", a100=0)]
    core, log, _ = run(queues, [job("high-borrower", "borrower", 2, seq=1, priority=800)])
    drive(core, job("mine", "owner", 2, seq=2, at_s=1, priority=500), T0 + timedelta(seconds=1), log=log)
    assert _reclaims(log) == expect
    assert set(_kinds(log).values()) <= {"reclaim"}


def test_own_nominal_goes_before_any_borrowing_in_the_same_cycle():
    """Regression (found by the replay property): a queue's job that fits in its own nominal was
    passed over by another queue's borrower with a lower share, and the reclaim that followed
    was only decided by a replay."""
    queues = [cq("q0", "c", a100=1), cq("q1", "c", a100=3)]
    core, log, _ = run(queues)
    jobs = [("b", "q0", 2), ("wide", "q0", 3), ("big", "q1", 3), ("s1", "q0", 1), ("s2", "q0", 1),
            ("one", "q1", 1), ("own", "q1", 2)]
    for k, (job_id, q, gpus) in enumerate(jobs):
        drive(core, job(job_id, q, gpus, seq=k + 1, at_s=k), T0 + timedelta(seconds=k), log=log)
    assert _reclaims(log) == {"b": "big"}
    now = T0 + timedelta(seconds=10)
    drive(core, [succeeded("b", started_at=T0, when=now)], now, log=log)
    assert reserved(log)["own"] == ("q1", 2, 0)  # within q1's nominal, before q0 borrows again
    assert "wide" not in reserved(log)
    fresh = QuotaCore()
    for e in log.events:
        fresh.evolve(e)
    assert [e for e in fresh.decide(now) if e.event_id not in log.ids] == []


@st.composite
def lent_out_scenarios(draw):
    """An owner queue whose whole nominal is lent to borrowers of other queues in its cohort."""
    owner_nominal = draw(st.integers(1, 6))
    others = [(draw(st.integers(0, 4)), draw(st.one_of(st.none(), st.integers(owner_nominal, 12))))
              for _ in range(draw(st.integers(1, 3)))]
    borrowers = [(f"b{k}", draw(st.integers(0, len(others) - 1)), draw(st.integers(1, 4)),
                  draw(st.sampled_from([100, 200, 500])))
                 for k in range(draw(st.integers(1, 8)))]
    need = draw(st.integers(1, owner_nominal))
    return owner_nominal, others, borrowers, need


def _outstanding_reclaims(log) -> list:
    done = {(e.aggregate_id, e.attempt) for e in log.events if e.type == "JobPreempted"}
    return [e for e in log.events if e.type == "ReclaimRequested" and (e.aggregate_id, e.attempt) not in done]


def _preempt(core, log, asked, now) -> None:
    """What an executor does with ReclaimRequested: stop the attempts (here at once)."""
    from tests.unit.builders import preempted
    drive(core, [preempted(e.aggregate_id, attempt=e.attempt, started_at=None, when=now) for e in asked], now, log=log)


@settings(max_examples=150, deadline=None, database=None)
@given(lent_out_scenarios())
def test_property_owner_regains_its_quota_within_a_bounded_number_of_decisions(scenario):
    """A queue below its nominal with pending work gets its quota back within a bounded number
    of reclaim rounds (each asks the fewest victims at once; another queue's own guaranteed
    jobs may take quota first, so one round per queue at most), the victims are only ever
    borrowing attempts, and the requeued victims never take the quota back first."""
    owner_nominal, others, borrowers, need = scenario
    queues = [cq("owner", "c", a100=owner_nominal)] + [cq(f"o{i}", "c", a100=(n, b, None))
                                                      for i, (n, b) in enumerate(others)]
    core, log, _ = run(queues)
    now = T0
    for k, (job_id, q, gpus, priority) in enumerate(borrowers):
        drive(core, job(job_id, f"o{q}", gpus, seq=k + 1, priority=priority), now, log=log)
        for _ in range(len(borrowers) + 1):  # the other queues' own reclaims, settled first
            if not (asked := _outstanding_reclaims(log)):
                break
            now += timedelta(seconds=1)
            _preempt(core, log, asked, now)
        assert not _outstanding_reclaims(log)
    now += timedelta(seconds=1)
    drive(core, job("mine", "owner", need, seq=100, at_s=(now - T0).total_seconds()), now, log=log)
    rounds = 0
    while "mine" not in reserved(log):
        asked = _outstanding_reclaims(log)
        assert asked, "the owner waits and nothing is being reclaimed for it"
        assert {e.for_job for e in asked} == {"mine"}
        for e in asked:  # every victim's queue was borrowing when it was chosen
            victim_queue = core.state.jobs[e.aggregate_id].reserved.queue
            assert core.pool_of(core.pools(), victim_queue, "a100").borrowed(victim_queue) > 0
        rounds += 1
        assert rounds <= len(others), "more reclaim rounds than queues that could borrow"
        now += timedelta(seconds=1)
        _preempt(core, log, asked, now)
    r = [e for e in log.events if e.type == "QuotaReserved" and e.aggregate_id == "mine"]
    assert r[0].borrowed == 0
    check_pools(core)
