"""Quota dimensions beyond GPUs per flavor: a queue's weighted limit (Σ GPUs held × the flavor's
weight) and its per-priority-class limits (max_share × nominal per flavor), borrowed GPUs counted
in both — table-driven cases of fits and waits at the boundary, the explanations, and that a job
refused by them holds nobody back; and fractions of a GPU (gpu_milli), which every dimension
counts in thousandths."""

from __future__ import annotations

import math
import pickle
from datetime import timedelta

import pytest
from pydantic import ValidationError

from schemas import CohortConfigured, FlavorQuota, QueueConfigured, QuotaPendingReasonChanged, QuotaReserved, new_event
from schemas.queue import ClassLimit
from services.quota.capacity import class_cap
from services.quota.domain import QuotaCore
from tests.unit.builders import T0, Log, admitted, drive, spec, submitted, succeeded


def q(name: str = "q", *, cohort: str | None = None, weighted: float | None = None,
      classes: dict[str, float] | None = None, strict_fifo: bool = False, **flavors) -> QueueConfigured:
    """A queue; each flavor is its nominal or (nominal, weight)."""
    quotas = tuple(FlavorQuota(flavor=f.replace("_", "-"), nominal=v if isinstance(v, int) else v[0],
                               weight=1.0 if isinstance(v, int) else v[1]) for f, v in flavors.items())
    limits = tuple(ClassLimit(priority_class=c, max_share=s) for c, s in (classes or {}).items())
    return new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=T0,
                     key=f"{name}/{flavors}/{cohort}/{weighted}/{classes}/{strict_fifo}", name=name, cohort=cohort,
                     allowed_teams=("team-a",), quotas=quotas, weighted_limit=weighted, class_limits=limits,
                     strict_fifo=strict_fifo)


def cohort(name: str) -> CohortConfigured:
    return new_event(CohortConfigured, aggregate_id=name, producer="config", occurred_at=T0, key=name, name=name)


_seq = iter(range(1, 1_000_000))


def job(job_id: str, gpus: int, *, queue: str = "q", cls: str = "training", priority: int = 500, at_s: float = 0,
        **fields):
    """JobSubmitted + JobAdmitted; jobs are queued in the order they are built (``at_s`` apart)."""
    when = T0 + timedelta(seconds=at_s)
    s = spec(gpus=gpus, queue=queue, priority_class=cls, **fields)
    return [submitted(job_id, s, seq=next(_seq), when=when), admitted(job_id, queue, priority, when=when)]


def run(config, *batches):
    """Each batch of jobs fed and decided in turn, one second apart; the core and the log."""
    core, log = QuotaCore(), Log()
    drive(core, config, T0, log=log)
    for i, batch in enumerate(batches, start=1):
        drive(core, [e for j in batch for e in j], T0 + timedelta(seconds=i), log=log)
    return core, log


def reserved(log) -> dict[str, tuple[str, int]]:
    return {e.aggregate_id: (e.flavor, e.gpus) for e in log.events if isinstance(e, QuotaReserved)}


def reasons(log) -> dict[str, QuotaPendingReasonChanged]:
    return {e.aggregate_id: e for e in log.events if isinstance(e, QuotaPendingReasonChanged)}


def waits(log) -> dict[str, tuple[str, str]]:
    got = reserved(log)
    return {j: (r.reason.value, r.message) for j, r in reasons(log).items() if j not in got}


# -- weighted limit ----------------------------------------------------------------------------

WEIGHTED = [
    # a100 worth 10, l4 worth 2.5; 40 held: 2 more a100 reach the limit exactly
    pytest.param([q(weighted=60, a100=(8, 10.0), l4=(8, 2.5))], [[job("h", 4, gpu_flavors=["a100"])],
                                                                [job("j", 2, gpu_flavors=["a100"])]],
                 {"h": ("a100", 4), "j": ("a100", 2)}, {}, id="at-the-limit-fits"),
    pytest.param([q(weighted=60, a100=(8, 10.0), l4=(8, 2.5))], [[job("h", 4, gpu_flavors=["a100"])],
                                                                [job("j", 3, gpu_flavors=["a100"])]],
                 {"h": ("a100", 4)},
                 {"j": ("weighted-limit", "queue q holds 40 weighted units of its weighted_limit 60; needs 3 a100 × "
                                          "weight 10 = 30 more: would hold 70")}, id="one-over-waits"),
    # the l4s held count too: 4 × 2.5 + 5 × 10 = 60
    pytest.param([q(weighted=60, a100=(8, 10.0), l4=(8, 2.5))], [[job("h", 4, gpu_flavors=["l4"])],
                                                                [job("j", 5, gpu_flavors=["a100"]),
                                                                 job("k", 1, gpu_flavors=["l4"], at_s=1)]],
                 {"h": ("l4", 4), "j": ("a100", 5)},
                 {"k": ("weighted-limit", "queue q holds 60 weighted units of its weighted_limit 60; needs 1 l4 × "
                                          "weight 2.5 = 2.5 more: would hold 62.5")}, id="across-flavors"),
    # a job of several flavors takes the first within the limit
    pytest.param([q(weighted=30, a100=(8, 10.0), l4=(8, 2.5))], [[job("j", 4, gpu_flavors=["a100", "l4"])]],
                 {"j": ("l4", 4)}, {}, id="next-flavor-within-the-limit"),
    # float weights sum at the boundary: 3 × 0.1 is 0.3
    pytest.param([q(weighted=0.3, a100=(8, 0.1))], [[job("j", 3)]], {"j": ("a100", 3)}, {}, id="float-boundary"),
    pytest.param([q(weighted=0, a100=8)], [[job("j", 1)]], {},
                 {"j": ("weighted-limit", "queue q holds 0 weighted units of its weighted_limit 0; needs 1 a100 × "
                                          "weight 1 = 1 more: would hold 1")}, id="zero-limit"),
    # borrowed GPUs count: 2 own + 2 borrowed, worth 10 each
    pytest.param([cohort("c"), q("q", cohort="c", weighted=40, a100=(2, 10.0)), q("lender", cohort="c", a100=8)],
                 [[job("h", 4)], [job("j", 1)]], {"h": ("a100", 4)},
                 {"j": ("weighted-limit", "queue q holds 40 weighted units of its weighted_limit 40; needs 1 a100 × "
                                          "weight 10 = 10 more: would hold 50")}, id="borrowed-counted"),
]


@pytest.mark.parametrize("config, batches, expect_reserved, expect_waits", WEIGHTED)
def test_weighted_limit(config, batches, expect_reserved, expect_waits):
    _, log = run(config, *batches)
    assert reserved(log) == expect_reserved
    assert waits(log) == expect_waits


# -- class limits ------------------------------------------------------------------------------

CLASSES = [
    # experiment may hold floor(0.25 × 8) = 2 a100
    pytest.param([q(classes={"experiment": 0.25}, a100=8)],
                 [[job("e1", 1, cls="experiment")], [job("e2", 1, cls="experiment")]],
                 {"e1": ("a100", 1), "e2": ("a100", 1)}, {}, id="at-the-limit-fits"),
    pytest.param([q(classes={"experiment": 0.25}, a100=8)],
                 [[job("e1", 1, cls="experiment")], [job("e2", 2, cls="experiment")]],
                 {"e1": ("a100", 1)},
                 {"e2": ("class-limit", "priority class experiment holds 1 a100 in queue q; needs 2: would hold 3, "
                                        "above its class limit 2 (0.25 × nominal 8)")}, id="one-over-waits"),
    # other classes are not limited by it
    pytest.param([q(classes={"experiment": 0.25}, a100=8)],
                 [[job("e1", 2, cls="experiment")], [job("t", 6, cls="training")]],
                 {"e1": ("a100", 2), "t": ("a100", 6)}, {}, id="other-classes-free"),
    # a limit naming a class no job has (no policy defines it) limits nobody
    pytest.param([q(classes={"no-such-class": 0.1}, a100=8)], [[job("t", 6), job("e", 2, cls="experiment", at_s=1)]],
                 {"t": ("a100", 6), "e": ("a100", 2)}, {}, id="unknown-class-limits-nobody"),
    # per flavor: the class is full on a100 and takes l4
    pytest.param([q(classes={"experiment": 0.5}, a100=4, l4=2)],
                 [[job("e1", 2, cls="experiment")], [job("e2", 1, cls="experiment", gpu_flavors=["a100", "l4"])]],
                 {"e1": ("a100", 2), "e2": ("l4", 1)}, {}, id="next-flavor-within-the-limit"),
    # borrowed GPUs count: with 0.5 × 4 = 2, the class may not borrow although the cohort could lend
    pytest.param([cohort("c"), q("q", cohort="c", classes={"experiment": 0.5}, a100=4),
                  q("lender", cohort="c", a100=8)],
                 [[job("e1", 2, cls="experiment"), job("t", 4, at_s=1)], [job("e2", 1, cls="experiment")]],
                 {"e1": ("a100", 2), "t": ("a100", 4)},
                 {"e2": ("class-limit", "priority class experiment holds 2 a100 in queue q; needs 1: would hold 3, "
                                        "above its class limit 2 (0.5 × nominal 4)")}, id="borrowed-counted"),
    # a queue with no nominal of a flavor gives a limited class none of it
    pytest.param([cohort("c"), q("q", cohort="c", classes={"experiment": 1.0}, a100=0),
                  q("lender", cohort="c", a100=8)],
                 [[job("e", 1, cls="experiment"), job("t", 1, at_s=1)]], {"t": ("a100", 1)},
                 {"e": ("class-limit", "priority class experiment holds 0 a100 in queue q; needs 1: would hold 1, "
                                       "above its class limit 0 (1 × nominal 0)")}, id="no-nominal-no-share"),
]


@pytest.mark.parametrize("config, batches, expect_reserved, expect_waits", CLASSES)
def test_class_limits(config, batches, expect_reserved, expect_waits):
    _, log = run(config, *batches)
    assert reserved(log) == expect_reserved
    assert waits(log) == expect_waits


@pytest.mark.parametrize("share, nominal, cap", [(0.25, 8, 2000), (0.25, 7, 1750), (0.29, 100, 29000),
                                                (0.1, 30, 3000), (1.0, 5, 5000), (0.3, 3, 900), (0.7, 10, 7000),
                                                (0.0003, 1, 0)])
def test_class_cap_is_share_times_nominal_in_thousandths(share, nominal, cap):
    assert class_cap(share, nominal) == cap


# -- refused by a limit, holding nobody back -----------------------------------------------------

HEADS = [
    # strict FIFO: a head over its class limit lets the job behind it go
    pytest.param([q(classes={"experiment": 0.25}, strict_fifo=True, a100=8)],
                 [[job("e1", 2, cls="experiment")], [job("e2", 1, cls="experiment"), job("t", 4, at_s=1)]],
                 {"e1": ("a100", 2), "t": ("a100", 4)}, {"e2": "class-limit"}, id="strict-fifo-class"),
    pytest.param([q(weighted=40, strict_fifo=True, a100=(8, 10.0))], [[job("big", 5), job("small", 4, at_s=1)]],
                 {"small": ("a100", 4)}, {"big": "weighted-limit"}, id="strict-fifo-weighted"),
    # priority before size: a higher-priority head refused by its class limit is no blocker
    pytest.param([q(classes={"experiment": 0.25}, a100=8)],
                 [[job("e1", 2, cls="experiment", priority=900)],
                  [job("e2", 1, cls="experiment", priority=900), job("low", 4, cls="batch-low", priority=100, at_s=1)]],
                 {"e1": ("a100", 2), "low": ("a100", 4)}, {"e2": "class-limit"}, id="priority-before-size-class"),
    pytest.param([q(weighted=40, a100=(8, 10.0))],
                 [[job("big", 5, priority=900), job("low", 4, cls="batch-low", priority=100, at_s=1)]],
                 {"low": ("a100", 4)}, {"big": "weighted-limit"}, id="priority-before-size-weighted"),
    # the control: a head short of quota still blocks the lower priorities behind it
    pytest.param([q(a100=8)], [[job("h", 4)], [job("big", 6, priority=900), job("low", 1, priority=100, at_s=1)]],
                 {"h": ("a100", 4)}, {"big": "nominal-exhausted", "low": "blocked-by-head"}, id="quota-short-blocks"),
    pytest.param([q(strict_fifo=True, a100=8)], [[job("h", 4)], [job("big", 6), job("small", 1, at_s=1)]],
                 {"h": ("a100", 4)}, {"big": "nominal-exhausted", "small": "blocked-by-head"}, id="strict-fifo-blocks"),
]


@pytest.mark.parametrize("config, batches, expect_reserved, expect_reasons", HEADS)
def test_a_job_refused_by_its_limits_holds_nobody_back(config, batches, expect_reserved, expect_reasons):
    _, log = run(config, *batches)
    assert reserved(log) == expect_reserved
    assert {j: reason for j, (reason, _) in waits(log).items()} == expect_reasons


def test_a_release_reopens_the_class_limit():
    core, log = run([q(classes={"experiment": 0.25}, a100=8)],
                    [job("e1", 2, cls="experiment")], [job("e2", 2, cls="experiment")])
    assert set(reserved(log)) == {"e1"}
    done = T0 + timedelta(seconds=10)
    drive(core, [succeeded("e1", started_at=T0, when=done)], done, log=log)
    assert reserved(log)["e2"] == ("a100", 2)
    assert core.state.class_used == {("q", "experiment", "a100"): 2000}


def test_a_lowered_limit_holds_new_jobs_and_leaves_holders_alone():
    core, log = run([q(weighted=100, classes={"experiment": 1.0}, a100=(8, 10.0))], [job("e1", 4, cls="experiment")])
    drive(core, [q(weighted=20, classes={"experiment": 0.25}, a100=(8, 10.0))], T0 + timedelta(seconds=5), log=log)
    drive(core, [e for e in job("e2", 1, cls="experiment", at_s=6)], T0 + timedelta(seconds=6), log=log)
    assert set(reserved(log)) == {"e1"}
    assert reasons(log)["e2"].reason.value == "weighted-limit"
    assert not any(e.type in ("ReclaimRequested", "QuotaReleased") for e in log.events)


def test_the_class_usage_travels_in_a_snapshot():
    core, log = run([q(classes={"experiment": 0.25}, a100=8)], [job("e1", 2, cls="experiment")])
    restored = QuotaCore()
    restored.restore_state(pickle.loads(pickle.dumps(core.snapshot_state())))
    assert restored.state.class_used == {("q", "experiment", "a100"): 2000}
    later = T0 + timedelta(seconds=5)
    assert drive(restored, job("e2", 1, cls="experiment", at_s=5), later, log=log)[-1].reason.value == "class-limit"


# -- fractions of a GPU ---------------------------------------------------------------------------


def quarter(job_id: str, **fields):
    return job(job_id, 1, gpu_milli=250, gpu_flavors=["l4"], **fields)


def test_four_quarter_gpu_jobs_take_one_gpu_of_quota():
    core, log = run([q(l4=1)], [quarter(f"f{i}", at_s=i) for i in range(5)])
    held = {e.aggregate_id: (e.gpus, e.gpu_milli, e.borrowed, e.borrowed_milli)
            for e in log.events if isinstance(e, QuotaReserved)}
    assert held == {f"f{i}": (1, 250, 0, 0) for i in range(4)}
    assert waits(log) == {"f4": ("nominal-exhausted", "queue q nominal l4 1, used 1; needs 0.25 more; "
                                                      "no cohort to borrow from")}
    assert core.state.used == {("q", "l4"): 1000}
    done = T0 + timedelta(seconds=10)
    drive(core, [succeeded("f0", started_at=T0, when=done)], done, log=log)
    assert "f4" in reserved(log) and core.state.used == {("q", "l4"): 1000}


def test_whole_gpu_jobs_get_what_fractions_leave():
    _, log = run([q(l4=2)], [quarter(f"f{i}", at_s=i) for i in range(3)],
                 [job("two", 2, gpu_flavors=["l4"]), job("one", 1, gpu_flavors=["l4"], at_s=1)])
    assert set(reserved(log)) == {"f0", "f1", "f2", "one"}
    assert waits(log)["two"][1].startswith("queue q nominal l4 2, used 1.75; needs 2 more")


def test_a_whole_gpu_job_borrows_a_fraction_and_a_fractional_job_borrows_its_share():
    _, log = run([cohort("c"), q("a", cohort="c", l4=1), q("b", cohort="c", l4=2)],
                 [quarter("f1", queue="a"), job("w", 1, queue="a", gpu_flavors=["l4"], at_s=1)],
                 [quarter("f2", queue="a")])
    got = {e.aggregate_id: e for e in log.events if isinstance(e, QuotaReserved)}
    assert (got["f1"].milli_held, got["f1"].milli_borrowed) == (250, 0)
    assert (got["w"].gpus, got["w"].gpu_milli, got["w"].borrowed, got["w"].borrowed_milli) == (1, None, 1, 250)
    assert (got["f2"].milli_held, got["f2"].milli_borrowed, got["f2"].borrowed) == (250, 250, 1)


def test_a_class_limit_counts_fractions():
    # 0.3 × 3 GPUs: 0.9 of a GPU for experiments; three quarters fit, a fourth would hold 1
    _, log = run([q(classes={"experiment": 0.3}, l4=3)], [quarter(f"e{i}", cls="experiment", at_s=i) for i in range(4)])
    assert set(reserved(log)) == {"e0", "e1", "e2"}
    assert waits(log)["e3"] == ("class-limit", "priority class experiment holds 0.75 l4 in queue q; needs 0.25: "
                                               "would hold 1, above its class limit 0.9 (0.3 × nominal 3)")


def test_a_reservation_written_before_fractions_were_counted_holds_a_whole_gpu():
    """Logs written before hold fractional jobs' reservations as whole GPUs (no gpu_milli); a
    replay keeps them so: history is not rewritten."""
    core, log = run([q(l4=1)], [quarter("new")])
    old = core.state.jobs["new"].reserved.model_copy(update={"gpu_milli": None, "borrowed_milli": None})
    assert old.milli_held == 1000
    fresh = QuotaCore()
    for e in log.events:
        fresh.evolve(old if isinstance(e, QuotaReserved) else e)
    assert fresh.state.used == {("q", "l4"): 1000}


# -- the contract --------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"weighted_limit": -1}, {"weighted_limit": math.inf}, {"weighted_limit": math.nan},
    {"class_limits": [{"priority_class": "experiment", "max_share": 0}]},
    {"class_limits": [{"priority_class": "experiment", "max_share": 1.5}]},
    {"class_limits": [{"priority_class": "experiment", "max_share": math.nan}]},
    {"class_limits": [{"priority_class": "Not A Name", "max_share": 0.5}]},
    {"class_limits": [{"priority_class": "experiment", "max_share": 0.5}, {"priority_class": "experiment",
                                                                           "max_share": 0.25}]},
])
def test_invalid_limits_are_refused(fields):
    with pytest.raises(ValidationError):
        QueueConfigured(event_id="x", aggregate_id="q", occurred_at=T0, producer="config", name="q", **fields)


def test_valid_limits():
    e = QueueConfigured(event_id="x", aggregate_id="q", occurred_at=T0, producer="config", name="q", weighted_limit=0,
                        class_limits=[{"priority_class": "experiment", "max_share": 1}])
    assert (e.weighted_limit, e.class_limits[0].max_share) == (0, 1)
