"""The shared victim-selection policy (runtime/victims.py): table-driven over the default
priority classes and injected ones."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import pytest

from runtime.victims import DEFAULT_GRACE_SECONDS, VictimPolicy
from schemas.priority import DEFAULT_PRIORITY_CLASSES, PriorityClass
from tests.unit.builders import T0, at


@dataclass(frozen=True)
class A:
    """A candidate victim with the fields the policy reads (builder-style defaults)."""

    job_id: str = "v"
    priority: int = 100
    priority_class: str = "batch-low"
    preemptible: bool = True
    stopping: bool = False
    started_at: datetime | None = T0
    checkpoint_at: datetime | None = None
    held_gpus: float = 1.0
    held_since: datetime = T0
    preemptions: int | None = None


POLICY = VictimPolicy(DEFAULT_PRIORITY_CLASSES)


@pytest.mark.parametrize(("attempt", "now", "kwargs", "expected"), [
    (A(), at(10), {}, None),
    (A(priority=500), at(10), {"below": 500}, "equal or higher priority"),
    (A(priority=800), at(10), {"below": 500}, "equal or higher priority"),
    (A(priority=100), at(10), {"below": 500}, None),
    (A(preemptible=False), at(10), {}, "non-preemptible class"),
    (A(priority_class="inference-sla", priority=1000), at(10), {}, "non-preemptible class"),
    (A(stopping=True), at(10), {}, "already stopping"),
    (A(started_at=None), at(10), {}, None),  # holds quota, runs nothing: nothing to protect
    (A(started_at=None), at(10), {"started_only": True}, "not started"),
    (A(priority_class="training"), at(599), {}, "protection window"),  # training: 600 s
    (A(priority_class="training"), at(600), {}, None),
    (A(priority_class="deadline-training", preemptions=2), at(5000), {}, "preemption budget used"),  # 2 allowed
    (A(priority_class="deadline-training", preemptions=1), at(5000), {}, None),
    (A(priority_class="deadline-training", preemptions=None), at(5000), {}, None),  # no count kept: no budget
    (A(priority_class="unknown-class"), at(0), {}, None),  # no class: no window, no budget
])
def test_refusal(attempt, now, kwargs, expected):
    assert POLICY.refusal(attempt, now, **kwargs) == expected


@pytest.mark.parametrize(("attempt", "now", "expected"), [
    (A(held_gpus=4), at(100), 400.0),  # since it started
    (A(held_gpus=4, checkpoint_at=at(90)), at(100), 40.0),  # since its latest checkpoint
    (A(held_gpus=0.5, checkpoint_at=at(90)), at(100), 5.0),  # a fraction counts as its share
    (A(held_gpus=4, started_at=None), at(100), 0.0),  # not started: nothing lost
    (A(held_gpus=4, checkpoint_at=at(200)), at(100), 0.0),  # a checkpoint in the future loses nothing
])
def test_lost_work(attempt, now, expected):
    assert POLICY.lost_work(attempt, now) == pytest.approx(expected)


@pytest.mark.parametrize(("attempts", "expected"), [
    # least lost work first, whatever the priority
    ([A("long", held_gpus=4), A("short", held_gpus=1)], ["short", "long"]),
    ([A("hi", priority=800, priority_class="x", held_gpus=1), A("lo", priority=100, held_gpus=4)], ["hi", "lo"]),
    # checkpoints count: "old" ran longer but checkpointed recently
    ([A("old", checkpoint_at=at(950)), A("new", started_at=at(100))], ["old", "new"]),
    # equal loss: lowest priority, then the newest hold, then job id
    ([A("b", priority=500, priority_class="x"), A("a", priority=100)], ["a", "b"]),
    ([A("older", held_since=T0), A("newer", held_since=at(5))], ["newer", "older"]),
    ([A("b"), A("a")], ["a", "b"]),
    # ineligible ones are left out
    ([A("sla", priority_class="inference-sla"), A("ok")], ["ok"]),
])
def test_rank_orders_victims(attempts, expected):
    ranking = POLICY.rank(attempts, at(1000))
    assert [a.job_id for a in ranking.victims] == expected
    assert set(ranking.lost) == set(expected)


def test_rank_reports_when_the_first_protection_window_ends():
    ranking = POLICY.rank([A("t", priority_class="training", started_at=at(0)),
                           A("d", priority_class="deadline-training", started_at=at(0)),
                           A("e", priority_class="experiment", started_at=at(100))], at(50))
    assert ranking.victims == [] and ranking.wake_at == at(400)  # experiment: 300 s after 100
    assert POLICY.rank([A()], at(50)).wake_at is None


def test_rank_applies_below_and_started_only():
    attempts = [A("low", priority=100), A("high", priority=900, priority_class="x"), A("queued", started_at=None)]
    assert [a.job_id for a in POLICY.rank(attempts, at(10), below=500, started_only=True).victims] == ["low"]


def test_classes_are_injected():
    classes = {"gold": PriorityClass(name="gold", value=10, preemptible=True, protection_seconds=60,
                                     max_preemptions=1, preemption_grace_seconds=5)}
    policy = VictimPolicy(classes)
    assert policy.refusal(A(priority_class="gold"), at(30)) == "protection window"
    assert policy.refusal(A(priority_class="gold", preemptions=1), at(90)) == "preemption budget used"
    assert policy.refusal(A(priority_class="batch-low"), at(0)) is None  # not configured here: no rules
    assert policy.grace_seconds(A(priority_class="gold")) == 5
    assert policy.grace_seconds(A(priority_class="batch-low")) == DEFAULT_GRACE_SECONDS
    assert policy.protected_until(A(priority_class="gold", started_at=at(10))) == at(70)
    assert policy.protected_until(A(priority_class="gold", started_at=None)) is None
