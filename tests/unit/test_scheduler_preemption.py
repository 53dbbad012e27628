"""SchedulerCore preemption: limited, checkpoint-aware, and never of the wrong victims."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import JobScheduled, PreemptionRequested, SchedulingPendingReasonChanged, SchedulingWaitReason
from schemas.priority import DEFAULT_PRIORITY_CLASSES
from services.scheduler.domain import PreemptionLimits, SchedulerCore
from tests.unit.builders import (
    T0, Log, admitted, at, checkpointed, drive, node, preempted, released, reserved, spec, started, submitted,
)

CLASSES = {"inference-sla": 1000, "deadline-training": 800, "training": 500, "experiment": 200, "batch-low": 100}


class H:
    def __init__(self, *nodes, limits=PreemptionLimits()):
        self.core = SchedulerCore(preemption=limits)
        self.log = Log()
        self.seq = 0
        self.feed(*nodes)

    def feed(self, *events, now=T0):
        return drive(self.core, events, now, log=self.log)

    def run(self, job_id, gpus, pc="batch-low", *, when=T0, start=True, **fields):
        """Submit, admit, reserve and (if placed) start a job of class ``pc``."""
        self.seq += 1
        s = spec(gpus=gpus, priority_class=pc, **fields)
        out = self.feed(submitted(job_id, s, seq=self.seq, when=when),
                        admitted(job_id, priority=CLASSES[pc], preemptible=DEFAULT_PRIORITY_CLASSES[pc].preemptible,
                                 when=when),
                        reserved(job_id, gpus=s.total_gpus, when=when), now=when)
        placed = [e for e in out if isinstance(e, JobScheduled)]
        if start and placed:
            out += self.feed(started(job_id, [a.node for a in placed[0].placement], when=when), now=when)
        return out


def preemptions(events):
    return {e.aggregate_id: e for e in events if isinstance(e, PreemptionRequested)}


def test_victims_lose_the_least_work_and_checkpoints_count():
    h = H(node("n1", gpus=4), node("n2", gpus=4))
    h.run("old", 4, when=at(0))  # n1
    h.run("new", 4, when=at(100))  # n2
    # "old" ran longer, but checkpointed at 950: it loses 4 × 50, "new" 4 × 900
    h.feed(checkpointed("old", at_=at(950), when=at(950)), now=at(950))
    out = h.run("urgent", 4, "inference-sla", when=at(1000))
    (p,) = preemptions(out).values()
    assert (p.aggregate_id, p.for_job, p.work_lost_gpu_seconds, p.grace_seconds) == ("old", "urgent", 200.0, 10.0)
    assert "since its last checkpoint" in p.message
    # the victim stops; the GPUs go to the preemptor
    out = h.feed(preempted("old", when=at(1010)), released("old", gpus=4, reason="JobPreempted", when=at(1010)),
                 now=at(1010))
    assert [(e.aggregate_id, e.placement[0].node) for e in out if isinstance(e, JobScheduled)] == [("urgent", "n1")]


def test_waiting_for_victims_is_a_reason_and_no_second_round():
    h = H(node("n1", gpus=4))
    h.run("v", 4)
    out = h.run("urgent", 4, "inference-sla", when=at(10))
    assert list(preemptions(out)) == ["v"]
    out = h.feed(node("other", "h100", 4, when=at(20)), now=at(20))
    assert preemptions(out) == {}


def test_protection_window_then_preempted_when_it_passes():
    h = H(node("n1", gpus=4))
    h.run("train", 4, "training", when=at(0))  # protected for 600 s
    out = h.run("urgent", 4, "inference-sla", when=at(100))
    assert preemptions(out) == {}
    assert any(isinstance(e, SchedulingPendingReasonChanged) and e.reason == SchedulingWaitReason.INSUFFICIENT_GPUS
               for e in out)
    out = h.feed(now=at(601))
    assert list(preemptions(out)) == ["train"]
    assert preemptions(out)["train"].grace_seconds == 60.0


def test_never_equal_or_higher_priority_nor_non_preemptible():
    h = H(node("n1", gpus=4), node("n2", gpus=4))
    h.run("peer", 4, "inference-sla")
    h.run("peer2", 4, "inference-sla")
    assert preemptions(h.run("urgent", 4, "inference-sla", when=at(5000))) == {}


def test_max_preemptions_per_job():
    h = H(node("n1", gpus=4))
    h.run("dl", 4, "deadline-training", when=at(0))
    h.core.state.jobs["dl"].preemptions = 2  # deadline-training allows 2
    assert preemptions(h.run("urgent", 4, "inference-sla", when=at(5000))) == {}


def test_global_rate_limit():
    h = H(*[node(f"n{i}", gpus=1) for i in range(4)], limits=PreemptionLimits(max_per_window=2, window_seconds=100))
    for i in range(4):
        h.run(f"b{i}", 1)
    out = {}
    for i in range(4):
        out.update(preemptions(h.run(f"u{i}", 1, "inference-sla", when=at(10))))
    assert len(out) == 2
    later = h.feed(now=at(111))
    assert len(preemptions(later)) == 2


def test_gang_preempts_on_the_cheapest_nodes():
    h = H(node("n1", gpus=8), node("n2", gpus=8), node("n3", gpus=8))
    h.run("a", 8, when=at(0))
    h.run("b", 8, when=at(500))
    h.run("c", 8, when=at(900))
    out = h.run("g", 8, "inference-sla", when=at(1000), gang_size=2)
    assert sorted(preemptions(out)) == ["b", "c"]  # the two that ran least


def test_disabled_preemption():
    h = H(node("n1", gpus=4), limits=PreemptionLimits(enabled=False))
    h.run("v", 4)
    assert preemptions(h.run("urgent", 4, "inference-sla", when=at(10))) == {}


# -- property ----------------------------------------------------------------------------------


@st.composite
def workloads(draw):
    nodes = [node(f"n{i}", gpus=draw(st.sampled_from([2, 4, 8]))) for i in range(draw(st.integers(1, 4)))]
    jobs = [(draw(st.sampled_from(list(CLASSES))), draw(st.sampled_from([1, 2, 4, 8])),
             draw(st.sampled_from([1, 1, 2])), draw(st.integers(0, 2000)), draw(st.booleans()))
            for _ in range(draw(st.integers(2, 12)))]
    return nodes, jobs


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_property_preemption_never_evicts_the_wrong_victims(workload):
    nodes, jobs = workload

    def play():
        h = H(*nodes)
        decided = []
        t = 0
        for i, (pc, gpus, gang, dt, checkpoint) in enumerate(jobs):
            t += dt
            state = {jid: (j.priority, j.started_at, j.preemptible, j.spec.priority_class, j.stopping)
                     for jid, j in h.core.state.jobs.items()}
            out = h.run(f"j{i}", gpus, pc, when=at(t), gang_size=gang)
            decided += out
            for p in preemptions(out).values():
                prio, started_at, preemptible, cls, stopping = state.get(p.aggregate_id, (None,) * 5)
                assert prio is not None and started_at is not None and not stopping
                assert prio < h.core.state.jobs[p.for_job].priority, "never equal or higher priority"
                c = DEFAULT_PRIORITY_CLASSES[cls]
                assert preemptible and c.preemptible, "never a non-preemptible class"
                assert (at(t) - started_at).total_seconds() >= c.protection_seconds, "never a protected job"
            if checkpoint:
                h.feed(checkpointed(f"j{i}", at_=at(t), when=at(t), seq=i + 1), now=at(t))
            # victims stop after their grace period
            for p in preemptions(out).values():
                decided += h.feed(preempted(p.aggregate_id, when=at(t)), now=at(t))
        return [e.model_dump() for e in decided]

    assert play() == play()  # deterministic
