"""SchedulerCore: best-fit placement of reserved attempts on nodes and GPU indices."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import FailureReason, JobScheduled, RetryPolicy, SchedulingPendingReasonChanged
from services.scheduler.domain import SchedulerCore
from tests.unit.builders import (
    T0,
    Log,
    admitted,
    at,
    cancel_requested,
    cancelled,
    drive,
    failed,
    node,
    node_lost,
    node_updated,
    preempted,
    released,
    reserved,
    spec,
    submitted,
    succeeded,
)


def scheduled_only(events) -> list[JobScheduled]:
    return [e for e in events if isinstance(e, JobScheduled)]


def placements(events) -> dict[str, dict[str, tuple[int, ...]]]:
    return {
        e.aggregate_id: {a.node: a.gpu_indices for a in e.placement} for e in events if isinstance(e, JobScheduled)
    }


class Harness:
    def __init__(self, *nodes):
        self.core = SchedulerCore()
        self.log = Log()
        self.seq = 0
        self.feed(*nodes)

    def feed(self, *events, now=T0):
        return drive(self.core, events, now, log=self.log)

    def job(self, job_id, gpus=1, *, flavor="a100", priority=500, attempt=1, when=T0, **spec_fields):
        """Submit, admit and reserve one attempt; returns what the scheduler decided."""
        self.seq += 1
        s = spec(gpus=gpus, **spec_fields)
        return self.feed(
            submitted(job_id, s, seq=self.seq, when=when), admitted(job_id, priority=priority, when=when),
            reserved(job_id, flavor=flavor, gpus=s.total_gpus, attempt=attempt, when=when), now=when,
        )


# -- placement ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpus, expected",
    [
        (2, "n3"),  # n3 has exactly 2 free
        (3, "n2"),  # n2 leaves 1
        (4, "n2"),  # n2 leaves 0
        (5, "n1"),  # only n1 is big enough
        (8, "n1"),
    ],
)
def test_best_fit_leaves_fewest_gpus_free(gpus, expected):
    h = Harness(node("n1", gpus=8), node("n2", gpus=4), node("n3", gpus=2))
    out = h.job("j", gpus)
    assert placements(out) == {"j": {expected: tuple(range(gpus))}}


def test_best_fit_counts_gpus_in_use_and_breaks_ties_by_name():
    h = Harness(node("n1", gpus=8), node("n2", gpus=4))
    assert placements(h.job("big", 6)) == {"big": {"n1": (0, 1, 2, 3, 4, 5)}}
    # n1 now has 2 free, n2 has 4: a 2-GPU job goes to n1's last two
    assert placements(h.job("two", 2)) == {"two": {"n1": (6, 7)}}
    h2 = Harness(node("b", gpus=4), node("a", gpus=4))
    assert placements(h2.job("j", 1)) == {"j": {"a": (0,)}}


def test_scheduled_event_fields():
    h = Harness(node("n1", gpus=8))
    h.seq += 1
    res = reserved("j", gpus=2, attempt=1, when=at(1))
    out = h.feed(submitted("j", spec(gpus=2)), admitted("j"), res, now=at(2))
    (event,) = scheduled_only(out)
    assert (event.aggregate_id, event.attempt, event.flavor) == ("j", 1, "a100")
    assert [(a.node, a.gpus, a.gpu_indices) for a in event.placement] == [("n1", 2, (0, 1))]
    assert event.occurred_at == at(2)
    assert event.causation_id == res.event_id
    assert event.producer == "scheduler"


@pytest.mark.parametrize(
    "nodes, job, expected",
    [
        # flavor: the reserved flavor only
        ([node("a", "a100", 8), node("h", "h100", 8)], dict(flavor="h100"), "h"),
        ([node("a", "a100", 8)], dict(flavor="h100"), None),
        # CPU-only work ignores flavors and may land on a CPU node
        ([node("c", None, 0, cpu_millis=4000, memory_mib=8192)], dict(gpus=0, flavor="a100"), "c"),
        # GPU memory
        ([node("small", gpus=8, gpu_memory_mib=40960), node("large", gpus=8, gpu_memory_mib=81920)],
         dict(min_gpu_memory_mib=50_000), "large"),
        ([node("small", gpus=8, gpu_memory_mib=40960)], dict(min_gpu_memory_mib=50_000), None),
        ([node("unknown-mem", gpus=8, gpu_memory_mib=None)], dict(min_gpu_memory_mib=1), None),
        # features: all of them
        ([node("plain", gpus=2), node("rdma", gpus=8, features=("rdma",))], dict(node_features=("rdma",)), "rdma"),
        ([node("rdma", gpus=8, features=("rdma",))], dict(node_features=("rdma", "zone=eu-1")), None),
        ([node("both", gpus=8, features=("zone=eu-1", "rdma"))], dict(node_features=("rdma", "zone=eu-1")), "both"),
        # GPU models: any one of them
        ([node("t4", gpus=8, gpu_product="T4"), node("a10", gpus=8, gpu_product="A10")], dict(gpu_models=("A10", "V100")),
         "a10"),
        ([node("t4", gpus=8, gpu_product="T4"), node("none", gpus=8)], dict(gpu_models=("A10",)), None),
        # cordoned
        ([node("cordoned", gpus=2, unschedulable=True), node("ok", gpus=8)], dict(), "ok"),
        ([node("cordoned", gpus=8, unschedulable=True)], dict(), None),
        # CPU and memory, where the node declares them
        ([node("tight", gpus=8, cpu_millis=500), node("roomy", gpus=8, cpu_millis=64000)], dict(), "roomy"),
        ([node("tight", gpus=8, memory_mib=1024)], dict(), None),
    ],
)
def test_constraints(nodes, job, expected):
    h = Harness(*nodes)
    job = dict(job)
    gpus = job.pop("gpus", 1)
    flavor = job.pop("flavor", "a100")
    out = h.job("j", gpus, flavor=flavor, **job)
    if expected is None:
        assert scheduled_only(out) == []
    else:
        assert placements(out) == {"j": {expected: tuple(range(gpus))}}


def test_cpu_and_memory_are_charged():
    h = Harness(node("n1", gpus=8, cpu_millis=2500, memory_mib=100_000))
    assert placements(h.job("a", 1, cpu_millis=1000)) == {"a": {"n1": (0,)}}
    assert placements(h.job("b", 1, cpu_millis=1000)) == {"b": {"n1": (1,)}}
    assert scheduled_only(h.job("c", 1, cpu_millis=1000)) == []
    out = h.feed(succeeded("a", when=at(5)), now=at(5))
    assert placements(out) == {"c": {"n1": (0,)}}


def test_gang_is_all_or_nothing_over_distinct_nodes():
    h = Harness(node("n1", gpus=8))
    # one node could hold 2 × 4 GPUs, but a gang needs distinct nodes
    assert scheduled_only(h.job("gang", 4, gang_size=2)) == []
    out = h.feed(node("n2", gpus=8), now=at(1))
    assert placements(out) == {"gang": {"n1": (0, 1, 2, 3), "n2": (0, 1, 2, 3)}}
    (event,) = scheduled_only(out)
    assert [a.gpus for a in event.placement] == [4, 4]


def test_gang_picks_the_best_fitting_nodes():
    h = Harness(node("n1", gpus=8), node("n2", gpus=4), node("n3", gpus=4), node("n4", gpus=2))
    assert placements(h.job("g", 4, gang_size=2)) == {"g": {"n2": (0, 1, 2, 3), "n3": (0, 1, 2, 3)}}


def test_gang_larger_than_fitting_nodes_places_nothing():
    h = Harness(node("n1", gpus=8), node("n2", gpus=8), node("n3", gpus=2))
    assert scheduled_only(h.job("g", 4, gang_size=3)) == []
    assert h.core.state.nodes["n1"].used_gpus == set()


def test_heads_in_priority_order_then_reservation_time():
    h = Harness(node("n1", gpus=4))
    h.job("running", 4)
    h.job("low", 4, priority=100, when=at(1))
    h.job("high", 4, priority=800, when=at(2))
    h.job("high-later", 4, priority=800, when=at(3))
    order = []
    running, t = "running", 10
    for _ in range(3):
        out = h.feed(succeeded(running, when=at(t)), now=at(t))
        (running,) = placements(out)
        order.append(running)
        t += 10
    assert order == ["high", "high-later", "low"]


def test_one_cycle_charges_its_own_decisions():
    h = Harness(node("n1", gpus=4))
    core = h.core
    for jid in ("a", "b", "c"):
        for e in (submitted(jid, spec(gpus=2)), admitted(jid), reserved(jid, gpus=2)):
            core.evolve(e)
    out = core.decide(T0)
    # charged in the cycle's snapshot, so that later heads see them ("c" does not fit) ...
    assert placements(out) == {"a": {"n1": (0, 1)}, "b": {"n1": (2, 3)}}
    # ... while the state holds only what the log holds: a refusal has nothing to undo
    assert core.state.nodes["n1"].used_gpus == set()
    core.decisions_refused()
    again = core.decide(T0)
    assert placements(again) == {"a": {"n1": (0, 1)}, "b": {"n1": (2, 3)}}
    for e in again:
        core.evolve(e)
    assert core.state.nodes["n1"].used_gpus == {0, 1, 2, 3}


def test_cordoned_node_skipped_then_uncordoned():
    h = Harness(node("n1", gpus=8))
    h.feed(node_updated("n1", gpus=8, unschedulable=True))
    assert scheduled_only(h.job("j", 1)) == []
    out = h.feed(node_updated("n1", gpus=8, unschedulable=False), now=at(1))
    assert placements(out) == {"j": {"n1": (0,)}}


def test_cordon_keeps_the_allocation_of_running_jobs():
    h = Harness(node("n1", gpus=4))
    h.job("a", 2)
    h.feed(node_updated("n1", gpus=4, unschedulable=True))
    h.feed(node_updated("n1", gpus=4, unschedulable=False, labels={"x": "y"}))
    assert placements(h.job("b", 2)) == {"b": {"n1": (2, 3)}}


@pytest.mark.parametrize(
    "ending",
    [
        lambda j: succeeded(j, when=at(9)),
        lambda j: failed(j, when=at(9)),
        lambda j: preempted(j, when=at(9)),
        lambda j: cancelled(j, attempt=1, started_at=T0, when=at(9)),
    ],
    ids=["succeeded", "failed", "preempted", "cancelled"],
)
def test_gpus_freed_when_the_attempt_ends(ending):
    h = Harness(node("n1", gpus=4))
    assert placements(h.job("a", 3)) == {"a": {"n1": (0, 1, 2)}}
    assert placements(h.job("b", 2)) == {}
    out = h.feed(ending("a"), now=at(9))
    assert placements(out) == {"b": {"n1": (0, 1)}}
    assert h.core.state.nodes["n1"].used_gpus == {0, 1}


def test_lowest_free_indices_are_assigned():
    h = Harness(node("n1", gpus=4))
    h.job("a", 1)
    h.job("b", 2)
    h.feed(succeeded("a", when=at(1)), now=at(1))
    assert placements(h.job("c", 2, when=at(2))) == {"c": {"n1": (0, 3)}}


def test_cancel_before_placement_and_release_without_run():
    h = Harness(node("n1", gpus=2))
    h.job("a", 2)
    h.job("b", 2)
    h.job("c", 2)
    h.feed(cancel_requested("b", when=at(1)), now=at(1))
    # quota released c's reservation (e.g. it was cancelled while queued): not placed either
    h.feed(released("c", gpus=2, reason="JobCancelled", when=at(1)), now=at(1))
    assert scheduled_only(h.feed(succeeded("a", when=at(2)), now=at(2))) == []
    assert h.core.state.heads == {}


def test_retry_attempt_is_placed_again():
    h = Harness(node("n1", gpus=2))
    h.job("a", 2, retry=RetryPolicy(max_attempts=2))
    out = h.feed(failed("a", FailureReason.NODE_LOST, when=at(1)),
                 released("a", gpus=2, reason="JobFailed", when=at(1)),
                 reserved("a", gpus=2, attempt=2, when=at(2)), now=at(2))
    (event,) = scheduled_only(out)
    assert (event.attempt, event.placement[0].gpu_indices) == (2, (0, 1))
    first = next(e for e in h.log.events if isinstance(e, JobScheduled))
    assert first.attempt == 1 and event.event_id != first.event_id  # a new id for the new attempt


@pytest.mark.parametrize("last, forgotten", [
    (lambda: succeeded("a", when=at(1)), True),
    (lambda: cancelled("a", when=at(1)), True),
    (lambda: failed("a", when=at(1)), True),  # exit code: not in retry_on, quota retries no such failure
    (lambda: failed("a", FailureReason.NODE_LOST, when=at(1)), False),  # retried (2 attempts): the job stays
    (lambda: preempted("a", when=at(1)), False),  # requeued
])
def test_a_job_no_attempt_follows_is_forgotten(last, forgotten):
    """The scheduler's state holds live work only (quota's retry rule says what is over)."""
    h = Harness(node("n1", gpus=2))
    h.job("a", 2, retry=RetryPolicy(max_attempts=2))
    h.feed(last(), now=at(1))
    assert ("a" in h.core.state.jobs) is not forgotten
    assert h.core.state.running == {"a100": set()} and h.core.state.heads == {}


def test_node_lost_is_not_used_and_new_nodes_wake_heads():
    h = Harness(node("n1", gpus=8), node("n2", gpus=2))
    h.feed(node_lost("n2"))
    assert placements(h.job("a", 2)) == {"a": {"n1": (0, 1)}}
    assert scheduled_only(h.job("big", 8)) == []
    out = h.feed(node("n3", gpus=8), now=at(1))
    assert placements(out) == {"big": {"n3": tuple(range(8))}}


def test_no_heads_no_decisions():
    assert SchedulerCore().decide(T0) == []
    h = Harness(node("n1"))
    assert h.feed(submitted("j"), admitted("j")) == []


# -- property ----------------------------------------------------------------------------------


@st.composite
def scenarios(draw):
    nodes = [
        node(f"n{i}", draw(st.sampled_from(["a100", "a100", "h100"])), draw(st.integers(1, 8)),
             unschedulable=draw(st.integers(0, 5)) == 0)
        for i in range(draw(st.integers(1, 5)))
    ]
    jobs = [
        dict(gpus=draw(st.integers(0, 5)), gang_size=draw(st.sampled_from([1, 1, 1, 2, 3])),
             flavor=draw(st.sampled_from(["a100", "a100", "h100"])), priority=draw(st.sampled_from([100, 500])))
        for _ in range(draw(st.integers(2, 10)))
    ]
    kinds = ["reserve"] * 4 + ["end"] * 3 + ["cancel", "unplaced-release", "cordon"]
    endings = ["succeeded", "failed", "preempted", "cancelled"]
    steps = draw(st.lists(
        st.tuples(st.sampled_from(kinds), st.integers(0, 20), st.sampled_from(endings), st.booleans()),
        min_size=10, max_size=50,
    ))
    return nodes, jobs, steps


def check_allocations(log: Log, live: dict[tuple[str, int], JobScheduled], gpu_count: dict[str, int]):
    by_node: dict[str, list[int]] = {}
    for ev in live.values():
        names = [a.node for a in ev.placement]
        assert len(names) == len(set(names)), "a gang uses distinct nodes"
        for a in ev.placement:
            assert len(a.gpu_indices) == a.gpus
            by_node.setdefault(a.node, []).extend(a.gpu_indices)
    for name, indices in by_node.items():
        assert len(indices) == len(set(indices)), f"a GPU of {name} assigned twice: {sorted(indices)}"
        assert len(indices) <= gpu_count[name]
        assert all(0 <= i < gpu_count[name] for i in indices)


def run_scenario(nodes, jobs, steps, policy="best-fit"):
    core, log = SchedulerCore(policy), Log()
    gpu_count = {n.node.name: n.node.gpu_count for n in nodes}
    cordoned = {n.node.name: n.node.unschedulable for n in nodes}
    specs = [spec(gpus=j["gpus"], gang_size=j["gang_size"]) for j in jobs]
    attempt = [0] * len(jobs)  # current attempt; 0: never reserved
    state = ["new"] * len(jobs)  # new, reserved, placed, ended, cancelled
    live: dict[tuple[str, int], JobScheduled] = {}
    now = 0

    def step(*events):
        for ev in drive(core, events, at(now), log=log):
            if not isinstance(ev, JobScheduled):
                continue
            i = int(ev.aggregate_id[1:])
            assert state[i] == "reserved" and ev.attempt == attempt[i], (ev, state[i])
            assert ev.flavor == jobs[i]["flavor"]
            assert len(ev.placement) == jobs[i]["gang_size"]
            for a in ev.placement:
                assert not cordoned[a.node]
                assert a.gpus == jobs[i]["gpus"]
            state[i] = "placed"
            live[(ev.aggregate_id, ev.attempt)] = ev
        check_allocations(log, live, gpu_count)

    step(*nodes)
    for i, s in enumerate(specs):
        step(submitted(f"j{i}", s, seq=i + 1), admitted(f"j{i}", priority=jobs[i]["priority"]))
    for action in steps:
        now += 1
        kind, pick, ending, flag = action
        i = pick % len(jobs)
        jid = f"j{i}"
        if kind == "reserve" and state[i] in ("new", "ended"):
            attempt[i] += 1
            state[i] = "reserved"
            step(reserved(jid, flavor=jobs[i]["flavor"], gpus=specs[i].total_gpus, attempt=attempt[i],
                          when=at(now)))
        elif kind == "end" and state[i] == "placed":
            n = attempt[i]
            event = {
                "succeeded": lambda: succeeded(jid, attempt=n, when=at(now)),
                "failed": lambda: failed(jid, attempt=n, when=at(now)),
                "preempted": lambda: preempted(jid, attempt=n, when=at(now)),
                "cancelled": lambda: cancelled(jid, attempt=n, started_at=T0, when=at(now)),
            }[ending]()
            live.pop((jid, n))
            state[i] = "cancelled" if ending == "cancelled" else "ended"
            step(event, released(jid, flavor=jobs[i]["flavor"], gpus=specs[i].total_gpus, attempt=n,
                                 reason=event.type, when=at(now)))
        elif kind == "cancel" and state[i] in ("new", "reserved", "placed", "ended"):
            n = attempt[i]
            was = state[i]
            state[i] = "cancelled"
            events = [cancel_requested(jid, when=at(now))]
            step(*events)
            # the job may have been placed by a decision before the request came back: find out
            if was in ("reserved", "placed") or (jid, n) in live:
                live.pop((jid, n), None)
                step(cancelled(jid, attempt=n, started_at=None, when=at(now)),
                     released(jid, flavor=jobs[i]["flavor"], gpus=specs[i].total_gpus, attempt=n,
                              reason="JobCancelled", when=at(now)))
            else:
                step(cancelled(jid, when=at(now)))
        elif kind == "unplaced-release" and state[i] == "reserved":
            state[i] = "ended"
            step(released(jid, flavor=jobs[i]["flavor"], gpus=specs[i].total_gpus, attempt=attempt[i],
                          reason="JobCancelled", when=at(now)))
        elif kind == "cordon":
            name = f"n{pick % len(nodes)}"
            if name in gpu_count:
                flavor = next(n.node.gpu_flavor for n in nodes if n.node.name == name)
                cordoned[name] = flag
                step(node_updated(name, flavor, gpu_count[name], unschedulable=flag, labels={"v": str(now)},
                                  when=at(now)))
    return core, log, at(now)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from(["first-fit", "best-fit", "fgd"]))
def test_property_no_gpu_is_assigned_twice(scenario, policy):
    nodes, jobs, steps = scenario
    core, log, end = run_scenario(nodes, jobs, steps, policy)
    _, log2, _ = run_scenario(nodes, jobs, steps, policy)
    assert [e.model_dump() for e in log.events] == [e.model_dump() for e in log2.events]
    # the live allocation in the core is exactly what the log says
    fresh = SchedulerCore()
    for e in log.events:
        fresh.evolve(e)
    assert {n: s.used_gpus for n, s in fresh.state.nodes.items()} == {n: s.used_gpus for n, s in core.state.nodes.items()}
    # and a fresh core replaying the log has nothing new to place or preempt: no decision was
    # skipped. (A wait reason may be refreshed: the live core keeps a head's last reason until its
    # shape is looked at again, while a fresh core looks at every head in its first cycle.)
    assert [e for e in fresh.decide(end)
            if e.event_id not in log.ids and not isinstance(e, SchedulingPendingReasonChanged)] == []


def test_a_second_cycle_before_the_log_answers_decides_nothing_twice():
    h = Harness(node("n1", gpus=4))
    core = h.core
    for jid in ("a", "b"):
        for e in (submitted(jid, spec(gpus=2)), admitted(jid), reserved(jid, gpus=2)):
            core.evolve(e)
    first = core.decide(T0)
    core.evolve(node_updated("n1", gpus=4, labels={"x": "1"}))  # something changed meanwhile
    assert scheduled_only(core.decide(at(1))) == []
    for e in first:
        core.evolve(e)
    assert core.state.nodes["n1"].used_gpus == {0, 1, 2, 3}
    core.decisions_refused()  # nothing tentative is left to undo
    assert core.state.nodes["n1"].used_gpus == {0, 1, 2, 3}
