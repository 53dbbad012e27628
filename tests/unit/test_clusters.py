"""Many clusters, one executor each: the executor's core names and tags its nodes and acts on its
own attempts only; the scheduler keeps gangs inside one cluster and declares a silent cluster
lost; every executor ends the attempts a lost cluster held. Credentials per cluster executor."""

from __future__ import annotations

import pytest

from gpusched import permissions
from schemas import (
    new_event,
    ClusterLost,
    ClusterReported,
    FailureReason,
    JobFailed,
    JobPreempted,
    JobScheduled,
    NodeLost,
    NodeRegistered,
    SchedulingPendingReasonChanged,
)
from services.executor.lifecycle import BackendCore, SyncResult
from services.scheduler.domain import SchedulerCore
from tests.unit.builders import (
    T0,
    Log,
    admitted,
    at,
    cancel_requested,
    cluster_lost,
    cluster_reported,
    drive,
    failed,
    node,
    node_info,
    preemption_requested,
    reserved,
    scheduled,
    spec,
    started,
    submitted,
)


def types(events) -> list[str]:
    return [type(e).__name__ for e in events]


def executor(cluster: str | None, *events, per_cluster_quota: bool = False) -> BackendCore:
    c = BackendCore(cluster=cluster, heartbeat_s=10, cluster_flavors=per_cluster_quota)
    for e in events:
        c.evolve(e)
    return c


def settle(c, now=T0) -> list:
    return drive(c, (), now)


def registered(c: BackendCore, *names: str) -> list[NodeRegistered]:
    """The backend lists ``names``; what the core registers (folded back in)."""
    c.apply(SyncResult(inventory=[node_info(n) for n in names], reachable=True))
    return [e for e in settle(c) if isinstance(e, NodeRegistered)]


# -- the executor's core ---------------------------------------------------------------------


def test_a_clusters_nodes_carry_its_name_and_its_flavor_per_cluster_quota():
    c = executor("east")
    assert [(e.node.name, e.node.cluster, e.node.gpu_flavor) for e in registered(c, "gpu-0")] == [
        ("gpu-0.east", "east", "a100")]
    per = executor("east", per_cluster_quota=True)
    assert [e.node.gpu_flavor for e in registered(per, "gpu-0")] == ["a100-east"]
    single = executor(None)
    assert [(e.node.name, e.node.cluster) for e in registered(single, "gpu-0")] == [("gpu-0", None)]


def test_the_plan_holds_the_clusters_own_attempts_under_the_backends_node_names():
    east = node("gpu-0.east", cluster="east")
    west = node("gpu-0.west", cluster="west")
    c = executor("east", east, west, submitted("a"), scheduled("a", {"gpu-0.east": (0,)}),
                 submitted("b"), scheduled("b", {"gpu-0.west": (0,)}))
    plan = c.plan()
    assert [(w.job_id, [p.node for p in w.placement]) for w in plan.run] == [("a", ["gpu-0"])]
    assert plan.keep == {("a", 1)}  # b is west's: never an orphan here, never observed here


def test_only_its_own_nodes_are_reported_lost():
    c = executor("east", node("gpu-0.east", cluster="east"), node("gpu-0.west", cluster="west"))
    c.apply(SyncResult(inventory=[], reachable=True))
    assert [(type(e).__name__, e.aggregate_id) for e in settle(c) if isinstance(e, NodeLost)] == [
        ("NodeLost", "gpu-0.east")]


def test_a_heartbeat_per_interval_only_while_the_backend_answers():
    c = executor("east")
    c.apply(SyncResult(inventory=[node_info("gpu-0")], reachable=True))
    beats = [e for e in settle(c) if isinstance(e, ClusterReported)]
    assert [(b.cluster, b.nodes, b.interval_seconds) for b in beats] == [("east", 1, 10)]
    assert [e for e in settle(c, at(5)) if isinstance(e, ClusterReported)] == []  # within the interval
    # After the interval, only a pass that reached the backend earns the next one.
    c.apply(SyncResult(inventory=[node_info("gpu-0")], reachable=False))
    assert [e for e in settle(c, at(11)) if isinstance(e, ClusterReported)] == []
    c.apply(SyncResult(inventory=[node_info("gpu-0")], reachable=True))
    assert [e.occurred_at for e in settle(c, at(12)) if isinstance(e, ClusterReported)] == [at(12)]
    assert c.next_wake() == at(22)
    assert types(settle(executor(None), at(100))) == []  # a single cluster sends none


def test_every_executor_ends_the_attempts_of_a_lost_cluster_with_the_same_ids():
    log = [node("gpu-0.east", cluster="east"), node("gpu-0.west", cluster="west"),
           submitted("a", spec(retry={"max_attempts": 3})), scheduled("a", {"gpu-0.west": (0,)}), started("a"),
           submitted("b"), scheduled("b", {"gpu-0.west": (1,)}), started("b"),
           preemption_requested("b", "x", attempt=1), submitted("c"), scheduled("c", {"gpu-0.east": (0,)})]
    decided = []
    for cluster in ("east", "other"):
        c = executor(cluster, *log)
        settle(c, at(1))
        c.evolve(cluster_lost("west", ("gpu-0.west",), when=at(100)))
        decided.append(settle(c, at(100)))
    east, other = decided
    assert [(type(e).__name__, e.aggregate_id) for e in east] == [("JobFailed", "a"), ("JobPreempted", "b")]
    failed = east[0]
    assert isinstance(failed, JobFailed) and failed.reason == FailureReason.NODE_LOST and failed.retryable
    assert isinstance(east[1], JobPreempted) and "lost" in east[1].reason
    assert {e.event_id for e in east} <= {e.event_id for e in other}  # the log keeps one of each


def test_its_own_cluster_declared_lost_while_unreachable_registers_nothing_from_its_stale_cache():
    c = executor("west")
    registered(c, "gpu-0")
    c.apply(SyncResult(inventory=[node_info("gpu-0")], reachable=False))
    c.evolve(cluster_lost("west", ("gpu-0.west",), when=at(100)))
    assert [e for e in settle(c, at(100)) if isinstance(e, (NodeRegistered, ClusterReported))] == []
    c.apply(SyncResult(inventory=[node_info("gpu-0")], reachable=True))  # it answers again
    assert types(settle(c, at(101))) == ["NodeRegistered", "ClusterReported"]


def test_its_own_cluster_declared_lost_while_it_lives_re_registers_and_stops_what_ran():
    c = executor("east")
    registered(c, "gpu-0")
    for e in (submitted("a"), scheduled("a", {"gpu-0.east": (0,)}), started("a")):
        c.evolve(e)
    c.evolve(cluster_lost("east", ("gpu-0.east",), when=at(100)))
    out = settle(c, at(100))
    assert ("NodeRegistered", "gpu-0.east") in [(type(e).__name__, e.aggregate_id) for e in out]
    assert [(type(e).__name__, e.reason) for e in out if isinstance(e, JobFailed)] == [
        ("JobFailed", FailureReason.NODE_LOST)]


# -- the scheduler ---------------------------------------------------------------------------


class Sched:
    def __init__(self, *events, lost_after: float = 60):
        self.core = SchedulerCore(cluster_lost_after_s=lost_after)
        self.log = Log()
        self.seq = 0
        self.feed(*events)

    def feed(self, *events, now=T0):
        return drive(self.core, events, now, log=self.log)

    def job(self, job_id, gpus=1, *, when=T0, priority=500, **fields):
        self.seq += 1
        s = spec(gpus=gpus, **fields)
        return self.feed(submitted(job_id, s, seq=self.seq, when=when), admitted(job_id, priority=priority, when=when),
                         reserved(job_id, gpus=s.total_gpus, when=when), now=when)


def nodes_of(events) -> dict[str, list[str]]:
    return {e.aggregate_id: [p.node for p in e.placement] for e in events if isinstance(e, JobScheduled)}


def test_a_gang_stays_in_one_cluster_and_single_jobs_go_anywhere():
    h = Sched(node("a.east", gpus=8, cluster="east"), node("a.west", gpus=8, cluster="west"),
              node("b.west", gpus=4, cluster="west"))
    out = h.job("g", 6, gang_size=2)
    waiting = [e for e in out if isinstance(e, SchedulingPendingReasonChanged)]
    assert nodes_of(out) == {} and waiting[0].reason.value == "gang-incomplete"
    assert "a gang stays in one: at most 1 in one cluster" in waiting[0].message
    assert {j: sorted(ns) for j, ns in nodes_of(h.job("g4", 4, gang_size=2)).items()} == {"g4": ["a.west", "b.west"]}
    assert nodes_of(h.job("one", 8)) == {"one": ["a.east"]}


def test_topology_labels_of_two_clusters_never_make_one_domain():
    rack = {"topology.gpusched.io/rack": "rack-1"}
    h = Sched(node("a.east", gpus=8, cluster="east", labels=rack), node("a.west", gpus=8, cluster="west", labels=rack),
              node("b.west", gpus=8, cluster="west"))
    assert nodes_of(h.job("g", 8, gang_size=2)) == {"g": ["a.west", "b.west"]}


def test_a_gang_makes_room_by_preemption_inside_one_cluster():
    from tests.unit.test_scheduler_preemption import H, preemptions

    # east's one node would be the cheapest victim, but a gang of two needs two nodes of one cluster
    h = H(node("a.east", gpus=8, cluster="east"), node("a.west", gpus=8, cluster="west"),
          node("b.west", gpus=8, cluster="west"))
    h.run("cheap", 8, when=at(100))
    h.run("w1", 8, when=at(0))
    h.run("w2", 8, when=at(0))
    placed = {e.aggregate_id: e.placement[0].node for e in h.log.events if isinstance(e, JobScheduled)}
    out = h.run("gang", 8, "inference-sla", when=at(200), gang_size=2)
    assert sorted(placed[v] for v in preemptions(out)) == ["a.west", "b.west"]


def test_a_silent_cluster_is_lost_once_then_back_when_it_reports():
    h = Sched(node("a.east", cluster="east"), node("a.west", cluster="west"), lost_after=60)
    h.feed(cluster_reported("east", when=T0), cluster_reported("west", when=T0))
    assert types(h.feed(now=at(59))) == []
    h.feed(cluster_reported("east", when=at(50)), now=at(59))
    out = h.feed(now=at(61))
    assert types(out) == ["ClusterLost"]
    (lost,) = out
    assert (lost.cluster, lost.nodes, lost.last_report) == ("west", ("a.west",), T0)
    assert "a.west" not in h.core.state.nodes
    assert [e.cluster for e in h.feed(now=at(200))] == ["east"]  # east fell silent since
    again = node_info("a.west", cluster="west")
    h.feed(cluster_reported("west", when=at(201)), new_event(
        NodeRegistered, aggregate_id="a.west", producer="executor", occurred_at=at(201), key="again", node=again),
        now=at(201))
    assert h.core.state.clusters["west"].lost is None and "a.west" in h.core.state.nodes
    assert nodes_of(h.job("j", 8, when=at(202))) == {"j": ["a.west"]}


def test_nothing_is_placed_on_a_cluster_in_the_cycle_that_declares_it_lost():
    h = Sched(node("a.west", gpus=8, cluster="west"), node("a.east", gpus=8, cluster="east"), lost_after=60)
    h.feed(cluster_reported("west", when=T0), cluster_reported("east", when=at(55)))
    h.job("big", 8, when=at(10))  # placed on a.east (name order) while both report
    out = h.job("j", 8, when=at(61))  # west has been silent for 61 s when j arrives
    assert types(out)[:1] == ["ClusterLost"] and nodes_of(out) == {}
    assert "a.west" not in h.core.state.nodes


def test_a_lost_node_registered_again_is_not_freed_by_the_end_of_an_attempt_it_held():
    h = Sched(node("a.west", gpus=8, cluster="west"), lost_after=600)
    h.feed(cluster_reported("west", when=T0))
    assert nodes_of(h.job("x", 8)) == {"x": ["a.west"]}
    h.feed(cluster_lost("west", ("a.west",), when=at(10)), now=at(10))
    again = new_event(NodeRegistered, aggregate_id="a.west", producer="executor", occurred_at=at(20), key="again",
                      node=node_info("a.west", cluster="west"))
    h.feed(cluster_reported("west", when=at(20)), again, now=at(20))
    assert nodes_of(h.job("y", 8, when=at(21))) == {"y": ["a.west"]}
    h.feed(failed("x", FailureReason.NODE_LOST, when=at(22)), now=at(22))  # x's end, after the return
    assert nodes_of(h.job("z", 8, when=at(23))) == {}  # y still holds every GPU of a.west
    assert h.core.state.nodes["a.west"].used_cpu >= 0


def test_an_unreachable_clusters_own_cancel_concludes_when_the_cluster_is_lost():
    c = executor("west")
    registered(c, "gpu-0")
    for e in (submitted("a"), scheduled("a", {"gpu-0.west": (0,)}), started("a"), cancel_requested("a")):
        c.evolve(e)
    settle(c, at(1))
    c.apply(SyncResult(inventory=[node_info("gpu-0")], reachable=False))  # its API is gone
    c.evolve(cluster_lost("west", ("gpu-0.west",), when=at(100)))
    assert types(e for e in settle(c, at(100)) if not isinstance(e, ClusterReported)) == ["JobCancelled"]


def test_a_restarted_scheduler_gives_the_clusters_a_full_period_first():
    h = Sched(lost_after=60)
    h.feed(cluster_reported("east", when=T0), now=at(3600))  # first cycle an hour after the last report
    assert types(h.feed(now=at(3659))) == []
    assert types(h.feed(now=at(3660))) == ["ClusterLost"]


def test_a_cluster_lost_decision_refused_is_decided_again_with_the_same_id():
    h = Sched(lost_after=10)
    h.feed(cluster_reported("east", when=T0))
    first = h.core.decide(at(20))
    assert h.core.decide(at(21)) == []  # on its way to the log
    h.core.decisions_refused()
    again = h.core.decide(at(22))
    assert [e.event_id for e in again] == [e.event_id for e in first]
    assert isinstance(first[0], ClusterLost)


def test_next_wake_is_the_next_silence_limit():
    h = Sched(lost_after=60)
    h.feed(cluster_reported("east", when=at(10)))
    assert h.core.next_wake() == at(70)


# -- credentials -----------------------------------------------------------------------------


def test_a_cluster_executor_has_the_executors_rights_under_its_own_name():
    perms = permissions.permissions("executor-east")["publish"]["allow"]
    assert "$JS.API.CONSUMER.MSG.NEXT.GPUSCHED_EVENTS.executor-east" in perms
    assert "$JS.API.CONSUMER.MSG.NEXT.GPUSCHED_EVENTS.executor" not in perms
    assert "$KV.lease-executor-east.>" in perms and "$KV.lease-executor.>" not in perms
    assert "gpusched.deadletter.executor-east" in perms
    assert "gpusched.cluster.*.lost" not in perms  # the scheduler's
    with pytest.raises(ValueError, match="executor-<cluster>"):
        permissions.tenant_permissions("executor-east")
    assert "gpusched.cluster.east.reported" in perms and "gpusched.cluster.*.reported" not in perms  # its own only
    # a cluster named like a reader slot would share consumer names with another credential's readers
    for name in ("r0", "east-r1"):
        assert not permissions.cluster_executor(f"executor-{name}") and not permissions.valid_cluster(name)


def test_cluster_heartbeat_and_lost_validate_their_names():
    with pytest.raises(ValueError, match="differs from aggregate_id"):
        ClusterReported(aggregate_id="a", event_id="x" * 32, producer="executor", occurred_at=T0, cluster="b",
                        nodes=1, interval_seconds=1)
    with pytest.raises(ValueError, match="differs from aggregate_id"):
        new_event(ClusterLost, aggregate_id="a", producer="scheduler", occurred_at=T0, key="x", cluster="b")
