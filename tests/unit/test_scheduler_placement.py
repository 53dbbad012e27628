"""SchedulerCore placement: policies, topology-aware gangs, fractional GPUs, taints, data
locality, pending reasons and the fragmentation index."""

from __future__ import annotations

import pytest

from schemas import JobScheduled, SchedulingPendingReasonChanged, SchedulingWaitReason
from schemas.envelope import derive_event_id
from schemas.job import DatasetRef
from services.scheduler.domain import SchedulerCore
from services.scheduler.fragmentation import typical_request
from services.scheduler.placement import Policy, node_fragmentation, parse_policy, spread_rank, spread_score, unusable
from tests.unit.builders import T0, Log, admitted, at, drive, node, reserved, scheduled, spec, started, submitted, succeeded


def placements(events):
    return {e.aggregate_id: {a.node: a.gpu_indices for a in e.placement} for e in events if isinstance(e, JobScheduled)}


def reasons(events):
    return [e for e in events if isinstance(e, SchedulingPendingReasonChanged)]


class H:
    def __init__(self, *nodes, policy=Policy.BEST_FIT):
        self.core = SchedulerCore(policy)
        self.log = Log()
        self.seq = 0
        self.feed(*nodes)

    def feed(self, *events, now=T0):
        return drive(self.core, events, now, log=self.log)

    def job(self, job_id, gpus=1, *, flavor="a100", priority=500, when=T0, **fields):
        self.seq += 1
        s = spec(gpus=gpus, **fields)
        return self.feed(submitted(job_id, s, seq=self.seq, when=when), admitted(job_id, priority=priority, when=when),
                         reserved(job_id, flavor=flavor, gpus=s.total_gpus, when=when), now=when)


# -- policies ----------------------------------------------------------------------------------


def test_parse_policy_error_names_accepted_values():
    assert parse_policy("fgd") is Policy.FGD
    with pytest.raises(ValueError, match="accepted: first-fit, best-fit, fgd"):
        parse_policy("random")


@pytest.mark.parametrize("policy, expected", [
    (Policy.FIRST_FIT, "a"),  # first by name
    (Policy.BEST_FIT, "c"),  # least left over (c has 2 free)
])
def test_first_fit_and_best_fit(policy, expected):
    h = H(node("a", gpus=8), node("b", gpus=4), node("c", gpus=2), policy=policy)
    assert placements(h.job("j", 2)) == {"j": {expected: (0, 1)}}


def test_fgd_keeps_the_large_block_for_large_jobs():
    # The workload is mostly 8-GPU jobs; a node with 3 free is useless to them already, one with 8 is not.
    h = H(node("a", gpus=8), node("b", gpus=8), policy=Policy.FGD)
    h.job("big1", 8)
    h.feed(succeeded("big1", when=at(1)), now=at(1))  # distribution: mostly 8s
    h.job("big2", 8, when=at(2))
    h.job("five", 5, when=at(3))  # b: 3 free
    out = h.job("one", 1, when=at(4))
    # FGD puts the 1-GPU job on b (3 free, already stranded for 8-GPU jobs), not on a fresh node
    assert list(placements(out)["one"]) == ["b"]


@pytest.mark.parametrize("growth, score", [
    (0, -50), (-1000, -73), (1000, -26), (10, -49), (30, -49), (-30, -50), (-50, -51), (10**9, 0), (-10**9, -100),
])
def test_fgd_spread_scores_growth_as_the_papers_simulator(growth, score):
    """int(100 × sigmoid(−growth in GPUs)), negated (lower is better): growths within a few
    hundredths of a GPU score alike."""
    assert spread_score(growth) == score


def test_fgd_spread_breaks_ties_by_the_nodes_fixed_pseudo_random_order():
    names = [f"n{i}" for i in range(6)]
    h = H(*(node(n, gpus=8) for n in names), policy=Policy.FGD_SPREAD)
    first = min(names, key=spread_rank)
    assert first != "n0"  # not by name
    assert list(placements(h.job("j", 1))["j"]) == [first]
    # the score comes before the order: with 7-GPU and 1-GPU jobs in the workload, the last GPU of
    # the node holding the 7-GPU job is useless to a 7-GPU job, so a 1-GPU job takes it, not the
    # first node of the order (fresh: too little CPU for the 7-GPU job, enough for the 1-GPU one)
    h2 = H(*(node(n, gpus=8, **({"cpu_millis": 1500} if n == first else {})) for n in names),
           policy=Policy.FGD_SPREAD)
    (seven_on,) = placements(h2.job("seven", 7, cpu_millis=2000))["seven"]
    assert seven_on != first
    assert list(placements(h2.job("one", 1, when=at(1)))["one"]) == [seven_on]


def test_each_flavor_places_by_its_own_policy():
    # a100 packs by best fit (the node with 2 free); h100 takes the first by name
    h = H(node("a-big", "a100", gpus=8), node("a-small", "a100", gpus=2), node("h-big", "h100", gpus=8),
          node("h-small", "h100", gpus=2))
    h.core.flavor_policies = {"h100": Policy.FIRST_FIT}
    assert placements(h.job("ja", 2, flavor="a100")) == {"ja": {"a-small": (0, 1)}}
    assert placements(h.job("jh", 2, flavor="h100")) == {"jh": {"h-big": (0, 1)}}


def test_node_fragmentation_definitions():
    whole = [1000, 1000, 1000, 0]
    assert unusable(whole, 4) == 3000  # 3 free cannot hold 4
    assert unusable(whole, 2) == 0
    partial = [1000, 400, 0, 0]
    assert unusable(partial, 1) == 400  # the partial GPU is lost to whole-GPU tasks
    assert unusable(partial, -500) == 400  # and to a 0.5 fraction
    assert unusable(partial, -300) == 0
    assert node_fragmentation(whole, {4: 0.5, 1: 0.5}) == 1500


# -- gangs and topology ------------------------------------------------------------------------


def test_gang_prefers_the_smallest_topology_domain():
    nodes = [
        node("r1-a", gpus=8, rack="r1", nvlink_domain="nv1"), node("r1-b", gpus=8, rack="r1", nvlink_domain="nv2"),
        node("r2-a", gpus=8, rack="r2", nvlink_domain="nv3"), node("r2-b", gpus=8, rack="r2", nvlink_domain="nv3"),
        node("r2-c", gpus=8, rack="r2", nvlink_domain="nv3"),
    ]
    h = H(*nodes)
    # nv3 holds 3 nodes: a 2-node gang fits inside one NVLink domain
    assert set(placements(h.job("g2", 8, gang_size=2))["g2"]) == {"r2-a", "r2-b"}
    # 2 nodes left in rack r1 (two NVLink domains of 1): a 2-node gang takes rack r1
    assert set(placements(h.job("g2b", 8, gang_size=2))["g2b"]) == {"r1-a", "r1-b"}


def test_gang_takes_the_policys_best_nodes_of_the_domain():
    h = H(*[node(f"r1-{x}", gpus=8, rack="r1", nvlink_domain=f"nv-{x}") for x in "abc"], node("r2-a", gpus=8, rack="r2"))
    for name in ("r1-b", "r1-c"):
        h.feed(submitted(f"fill-{name}", spec(gpus=4)), admitted(f"fill-{name}"),
               scheduled(f"fill-{name}", {name: (0, 1, 2, 3)}))
    # rack r1 is the only domain with two candidates; best fit: the two half-full nodes
    assert set(placements(h.job("g", 4, gang_size=2))["g"]) == {"r1-b", "r1-c"}


def test_topology_from_labels_when_fields_are_absent():
    nodes = [node("x", gpus=8, labels={"topology.gpusched.io/rack": "r9"}),
             node("y", gpus=8, labels={"topology.gpusched.io/rack": "r1"}),
             node("z", gpus=8, labels={"topology.gpusched.io/rack": "r9"})]
    h = H(*nodes)
    assert set(placements(h.job("g", 4, gang_size=2))["g"]) == {"x", "z"}


def test_gang_spanning_domains_when_no_domain_holds_it():
    h = H(node("a", gpus=8, rack="r1"), node("b", gpus=8, rack="r2"))
    assert set(placements(h.job("g", 8, gang_size=2))["g"]) == {"a", "b"}


# -- fractional GPUs, taints, locality ---------------------------------------------------------


def test_fractions_pack_onto_sharable_gpus():
    h = H(node("shared", gpus=2, gpu_sharable=True), node("plain", gpus=2))
    out = h.job("f1", 1, gpu_milli=500)
    (ev,) = [e for e in out if isinstance(e, JobScheduled)]
    assert (ev.placement[0].node, ev.placement[0].gpu_indices, ev.placement[0].gpu_milli) == ("shared", (0,), 500)
    assert placements(h.job("f2", 1, gpu_milli=300)) == {"f2": {"shared": (0,)}}  # the fuller GPU first
    assert placements(h.job("f3", 1, gpu_milli=300)) == {"f3": {"shared": (1,)}}  # 0.2 left on GPU 0
    # a whole-GPU job cannot use the partly used GPUs of "shared"
    assert placements(h.job("w", 2)) == {"w": {"plain": (0, 1)}}


def test_fraction_needs_gpus_one():
    with pytest.raises(ValueError, match="gpu_milli 500 is a fraction of one GPU: it needs gpus 1, got 2"):
        spec(gpus=2, gpu_milli=500)


@pytest.mark.parametrize("taint, tolerations, fits", [
    ("gpu=reserved:NoSchedule", (), False),
    ("gpu=reserved:NoSchedule", ("gpu=reserved",), True),
    ("gpu=reserved:NoSchedule", ("gpu",), True),
    ("gpu=reserved:NoSchedule", ("gpu=other",), False),
    ("gpu=reserved:NoExecute", ("gpu=reserved:NoSchedule",), False),
    ("gpu=reserved:PreferNoSchedule", (), True),
])
def test_taints_and_tolerations(taint, tolerations, fits):
    h = H(node("t", gpus=8, taints=(taint,)))
    assert bool(placements(h.job("j", 1, tolerations=tolerations))) is fits


def test_data_locality_is_preferred():
    h = H(node("a", gpus=8), node("b", gpus=8, labels={"cache.gpusched.io/zone": "cache-eu"}))
    ds = (DatasetRef(uri="s3://x/y", locality_hint="cache-eu"),)
    assert list(placements(h.job("j", 1, datasets=ds))["j"]) == ["b"]
    assert list(placements(h.job("k", 1))["k"]) == ["b"]  # best fit: b now has 7 free


# -- reasons -----------------------------------------------------------------------------------


def test_fragmentation_reason_with_numbers():
    h = H(node("n1", gpus=8), node("n2", gpus=8), node("n3", gpus=8))
    for name, used in (("n1", 5), ("n2", 5), ("n3", 2)):
        h.feed(submitted(f"fill-{name}", spec(gpus=used)), admitted(f"fill-{name}"),
               scheduled(f"fill-{name}", {name: tuple(range(used))}))
    out = h.job("big", 8, when=at(1))
    (r,) = reasons(out)
    assert r.reason == SchedulingWaitReason.FRAGMENTATION
    assert (r.free_gpus, r.free_nodes, r.largest_free_block, r.largest_free_node) == (12, 3, 6, "n3")
    assert r.message == ("needs 8×a100 on one node; largest free block is 6 on n3; "
                         "12 a100 free across 3 node(s): fragmentation")


def test_no_node_of_shape_and_insufficient_and_gang_reasons():
    h = H(node("n1", gpus=4), node("n2", gpus=8))
    (r,) = reasons(h.job("huge", 8, gang_size=2))
    assert r.reason == SchedulingWaitReason.NO_NODE_OF_SHAPE
    h.job("fill", 6)
    (r,) = reasons(h.job("g", 3, gang_size=2, when=at(1)))
    assert r.reason == SchedulingWaitReason.GANG_INCOMPLETE
    (r,) = reasons(h.job("seven", 7, when=at(2)))
    assert r.reason == SchedulingWaitReason.INSUFFICIENT_GPUS


def test_reason_eta_from_declared_runtimes():
    h = H(node("n1", gpus=8))
    h.job("run", 8, expected_runtime_seconds=600)
    h.feed(started("run", when=at(10)), now=at(10))
    (r,) = reasons(h.job("next", 4, when=at(20)))
    assert r.eta == at(610)


def test_gang_eta_is_when_enough_nodes_have_freed_up():
    h = H(node("n1", gpus=8), node("n2", gpus=8), node("n3", gpus=8))
    for job_id, runtime in (("a", 900), ("b", 600), ("c", 3000)):
        h.job(job_id, 8, expected_runtime_seconds=runtime)
        h.feed(started(job_id, when=at(10)), now=at(10))
    (r,) = reasons(h.job("gang", 8, gang_size=2, when=at(20)))
    assert r.eta == at(910)


def test_reasons_are_rate_limited_and_change_with_the_code():
    h = H(node("n1", gpus=8), node("n2", gpus=8))
    h.job("a", 7)
    h.job("b", 7)
    assert len(reasons(h.job("big", 8, when=at(1)))) == 1
    # same code, same message: nothing new when capacity changes elsewhere
    assert reasons(h.feed(node("n3", "h100", 8, when=at(2)), now=at(2))) == []


def test_heads_of_one_shape_share_one_explanation_each_with_its_own_ids():
    h = H(node("n1", gpus=4))
    h.job("fill", 4)
    holds = {j: reserved(j, gpus=2, attempt=attempt, when=at(1)) for j, attempt in (("a", 1), ("b", 2), ("c", 1))}
    out = h.feed(*[e for j, r in holds.items() for e in (submitted(j, spec(gpus=2)), admitted(j), r)], now=at(1))
    told = reasons(out)
    assert [r.aggregate_id for r in told] == ["a", "b", "c"]
    shared = {r.model_dump_json(exclude={"event_id", "aggregate_id", "attempt", "causation_id", "correlation_id"})
              for r in told}
    assert len(shared) == 1
    for r in told:
        hold = holds[r.aggregate_id]
        assert type(r).model_validate(r.model_dump()) == r  # a copy that validates as built
        assert r.event_id == derive_event_id(r.type, r.aggregate_id, f"{hold.attempt}/1")
        assert (r.attempt, r.causation_id, r.correlation_id) == (hold.attempt, hold.event_id, hold.event_id)


# -- fragmentation index -----------------------------------------------------------------------


def test_fragmentation_index():
    assert typical_request({}) == 1
    assert typical_request({1: 4, 8: 1}) == 8  # GPU-weighted: 8 GPUs of 8-GPU jobs vs 4 of 1-GPU jobs
    assert typical_request({1: 10, 8: 1}) == 1
    h = H(node("n1", gpus=8), node("n2", gpus=8), node("n3", gpus=8))
    h.job("a", 8)
    h.job("b", 3)
    h.job("c", 6)
    (f,) = h.core.fragmentation()
    # free: n2 5, n3 2; typical request 8 (GPU-weighted median of 8, 3, 6 -> 6): 5 and 2 both < 6
    assert (f.flavor, f.free, f.typical, f.largest_block) == ("a100", 7, 6, 5)
    assert f.ratio == 1.0
    assert f.largest_placeable_gang == 5  # max(1×2 nodes... 2×2=4, 5×1=5)


def test_cpu_aware_workload():
    from services.scheduler.placement import Workload

    w = Workload.of_requests({(1, 4000): 0.5, (1, 16000): 0.5})
    free = [1000, 1000]
    assert w.fragmentation(free) == 0  # GPU-only view: both GPUs usable
    assert w.fragmentation(free, cpu_free=8000) == 0.5 * 2000  # the 16-core half cannot run there
    assert w.fragmentation(free, cpu_free=2000) == 2000  # nothing can
    assert w.fragmentation(free, cpu_free=16000) == 0


def test_cpu_aware_fgd_keeps_cpu_beside_free_gpus():
    from services.scheduler.placement import Workload

    # Both nodes have 2 free GPUs; "a" has CPU to spare, "b" just enough. A CPU-light task goes to
    # "b", keeping "a"'s CPU for the CPU-heavy half of the workload.
    w = Workload.of_requests({(1, 2000): 0.5, (1, 30000): 0.5})
    core = SchedulerCore(Policy.FGD, workload=w)
    log = Log()
    drive(core, [node("a", gpus=2, cpu_millis=64000), node("b", gpus=2, cpu_millis=8000)], log=log)
    out = drive(core, [submitted("j", spec(gpus=1, cpu_millis=2000)), admitted("j"), reserved("j")], log=log)
    assert list(placements(out)["j"]) == ["b"]


@pytest.mark.parametrize("gpu_before, gpu_after, cpu_before, cpu_after, growth", [
    (4000, 3000, 12000, 8000, 1000),    # 3 GPUs left want 9 cores at 3/GPU, 8 remain: 1 core short
    (4000, 3000, 64000, 60000, 0),      # plenty of CPU before and after
    (2000, 1000, 2000, 1000, -2000),    # short 4 cores before, 2 after: the task eased it
    (1000, 1000, 9000, 1000, 2000),     # a CPU-only task taking the CPU a free GPU needs
    (0, 0, 8000, 0, 0),                 # no GPU left to serve: no deficit
])
def test_fgd_balance_cpu_deficit_growth(gpu_before, gpu_after, cpu_before, cpu_after, growth):
    """The CPU a node lacks to serve its free GPU thousandths at 3 CPU millicores each (3 cores
    per GPU), after minus before."""
    from services.scheduler.placement import cpu_deficit_growth

    assert cpu_deficit_growth(gpu_before, gpu_after, cpu_before, cpu_after, 3.0) == growth


def spread_and_balance_pick(workload, nodes, job_spec) -> tuple[list[str], list[str]]:
    """The nodes one job gets under fgd-spread and under fgd-balance, each on a fresh core."""
    picked = []
    for policy in (Policy.FGD_SPREAD, Policy.FGD_BALANCE):
        core = SchedulerCore(policy, workload=workload)
        log = Log()
        drive(core, nodes, log=log)
        out = drive(core, [submitted("j", job_spec), admitted("j"), reserved("j")], log=log)
        picked.append(list(placements(out)["j"]))
    return picked[0], picked[1]


def test_fgd_balance_keeps_cpu_in_step_with_free_gpus_where_fgd_ties():
    from services.scheduler.placement import Workload

    # The workload asks 3 cores per GPU. "a" (4 GPUs, 64 cores) and "b" (4 GPUs, 12 cores) both
    # stay usable to every typical task after a 1-GPU, 4-core task (FGD's growth 0 on both), but
    # "b" would keep 3 GPUs with 8 cores, one short of what they need. fgd-spread takes "b" (its
    # fixed order puts "b" first); fgd-balance takes "a".
    assert spread_rank("b") < spread_rank("a")
    w = Workload.of_requests({(1, 4000): 0.5, (1, 2000): 0.5})
    assert w.cpu_per_milli == 3.0
    nodes = [node("a", gpus=4, cpu_millis=64000), node("b", gpus=4, cpu_millis=12000)]
    assert spread_and_balance_pick(w, nodes, spec(gpus=1, cpu_millis=4000)) == (["b"], ["a"])


def test_fgd_balance_puts_a_cpu_only_task_where_the_fewest_gpus_are_free():
    from services.scheduler.placement import Workload

    # A CPU-only task blocks no task class on either node (FGD's growth 0 on both): fgd-spread
    # takes the first in its fixed order ("big", 8 free GPUs); fgd-balance takes "small" (1 free
    # GPU), where its CPU is least needed by GPU work.
    assert spread_rank("big") < spread_rank("small")
    w = Workload.of_requests({(1, 4000): 1.0})
    nodes = [node("big", gpus=8, cpu_millis=96000), node("small", gpus=1, cpu_millis=96000)]
    assert spread_and_balance_pick(w, nodes, spec(gpus=0, cpu_millis=8000)) == (["big"], ["small"])


def test_live_workload_is_cpu_aware_for_the_integer_scored_policies():
    h = H(node("a", gpus=8, cpu_millis=96000), policy=Policy.FGD_BALANCE)
    h.job("one", 1, cpu_millis=2000)
    h.job("two", 2, cpu_millis=10000, when=at(1))
    w = h.core.workload_distribution("a100", cpu=True)
    assert w.cpu_aware and w.cpu_per_milli == (2000 + 10000) / (1000 + 2000)
    assert not h.core.workload_distribution("a100").cpu_aware  # fgd's: sizes only


def test_model_aware_fragmentation_keeps_constrained_models_for_their_tasks():
    from services.scheduler.placement import Workload

    # Half the workload may run on T4 only. On a G2 node that half can use nothing, so a G2
    # node's free GPUs are half lost already; on a T4 node nothing is lost.
    w = Workload.of_requests({(1, 1000, frozenset({"T4"})): 0.5, (1, 1000): 0.5})
    assert w.fragmentation([1000, 1000], cpu_free=8000, model="G2") == 0.5 * 2000
    assert w.fragmentation([1000, 1000], cpu_free=8000, model="T4") == 0
    # so an unconstrained task takes the G2 node (its measure falls) and leaves the T4 node to
    # the tasks that need it, under every fragmentation-aware policy with this workload; blind to
    # models, each would take the T4 node (first by name, and first in the fixed order)
    assert spread_rank("a-t4") < spread_rank("b-g2")
    for policy in (Policy.FGD, Policy.FGD_SPREAD, Policy.FGD_BALANCE):
        core = SchedulerCore(policy, workload=w)
        log = Log()
        drive(core, [node("a-t4", gpus=2, cpu_millis=8000, gpu_product="T4"),
                     node("b-g2", gpus=2, cpu_millis=8000, gpu_product="G2")], log=log)
        out = drive(core, [submitted("j", spec(gpus=1, cpu_millis=1000)), admitted("j"), reserved("j")], log=log)
        assert list(placements(out)["j"]) == ["b-g2"], policy


def test_fgd_balance_leaves_the_gpus_of_a_restricted_model_to_its_tasks():
    from services.scheduler.placement import Workload

    # The workload asks 4 cores per GPU; 2 % of it may run on V100 only. "v100" (4 GPUs, 12 cores)
    # is 4 cores short, "g2" (4 GPUs, 64 cores) has CPU to spare; a 1-GPU, 1-core task ties on
    # FGD's integer score on both (its growth differs by 0.02 GPU). The CPU deficit would draw it
    # to "v100" (it eases the shortage there), onto a GPU the V100-only tasks need; on a node of a
    # model some class is restricted to, the deficit does not count, and the order decides.
    assert spread_rank("g2") < spread_rank("v100")
    nodes = [node("g2", gpus=4, cpu_millis=64000, gpu_product="G2"),
             node("v100", gpus=4, cpu_millis=12000, gpu_product="V100")]
    task = spec(gpus=1, cpu_millis=1000)
    restricted = Workload.of_requests({(1, 4000): 0.98, (1, 4000, frozenset({"V100"})): 0.02})
    assert restricted.restricted_models == {"V100"} and restricted.cpu_per_milli == 4.0
    assert spread_and_balance_pick(restricted, nodes, task) == (["g2"], ["g2"])
    # with no class restricted to a model, the deficit acts as before
    free = Workload.of_requests({(1, 4000): 0.98, (1, 4000, frozenset()): 0.02})
    assert free.restricted_models == frozenset()
    assert spread_and_balance_pick(free, nodes, task) == (["g2"], ["v100"])


# -- property: constraints and capacity under every policy ---------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from services.scheduler.inventory import tolerates  # noqa: E402


@st.composite
def clusters(draw):
    nodes = [node(f"n{i}", gpus=draw(st.sampled_from([1, 2, 4, 8])),
                  gpu_memory_mib=draw(st.sampled_from([16384, 40960, 81920])),
                  features=tuple(draw(st.sets(st.sampled_from(["rdma", "zone=a"])))),
                  taints=tuple(draw(st.sets(st.sampled_from(["gpu=res:NoSchedule", "x=y:PreferNoSchedule"])))),
                  gpu_sharable=draw(st.booleans()), cpu_millis=draw(st.sampled_from([0, 8000, 64000])),
                  rack=draw(st.sampled_from([None, "r1", "r2"])))
             for i in range(draw(st.integers(1, 6)))]
    jobs = []
    for _ in range(draw(st.integers(1, 15))):
        fraction = draw(st.sampled_from([None, None, 250, 500, 900]))
        jobs.append(dict(
            gpus=1 if fraction else draw(st.sampled_from([1, 2, 3, 4, 8])), gpu_milli=fraction,
            gang_size=1 if fraction else draw(st.sampled_from([1, 1, 2, 3])),
            min_gpu_memory_mib=draw(st.sampled_from([None, 40000])),
            node_features=tuple(draw(st.sets(st.sampled_from(["rdma", "zone=a"]), max_size=1))),
            tolerations=tuple(draw(st.sets(st.sampled_from(["gpu=res"]), max_size=1))),
            cpu_millis=draw(st.sampled_from([1000, 6000]))))
    return nodes, jobs


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.sampled_from(list(Policy)))
def test_property_constraints_and_capacity_always_hold(cluster, policy):
    nodes, jobs = cluster

    def play():
        h = H(*nodes, policy=policy)
        out = []
        for i, fields in enumerate(jobs):
            out += h.job(f"j{i}", when=at(i), **fields)
        return h, out

    h, out = play()
    infos = {n.node.name: n.node for n in nodes}
    used: dict[tuple[str, int], int] = {}
    cpu: dict[str, int] = {}
    for e in out:
        if not isinstance(e, JobScheduled):
            continue
        job = jobs[int(e.aggregate_id[1:])]
        assert len(e.placement) == job["gang_size"] and len({a.node for a in e.placement}) == job["gang_size"]
        for a in e.placement:
            info = infos[a.node]
            assert job["min_gpu_memory_mib"] is None or info.gpu_memory_mib >= job["min_gpu_memory_mib"]
            assert set(job["node_features"]) <= set(info.features)
            assert all(tolerates(job["tolerations"], t) for t in info.taints)
            assert len(a.gpu_indices) == job["gpus"] and all(0 <= i < info.gpu_count for i in a.gpu_indices)
            if job["gpu_milli"]:
                assert info.gpu_sharable and a.gpu_milli == job["gpu_milli"]
            for i in a.gpu_indices:
                used[(a.node, i)] = used.get((a.node, i), 0) + (job["gpu_milli"] or 1000)
            cpu[a.node] = cpu.get(a.node, 0) + job["cpu_millis"]
    assert all(v <= 1000 for v in used.values()), "a GPU given beyond its capacity"
    assert all(not infos[n].cpu_millis or c <= infos[n].cpu_millis for n, c in cpu.items())
    _, again = play()
    assert [e.model_dump() for e in again] == [e.model_dump() for e in out]  # deterministic


def test_the_example_clusters_topology_labels_are_the_ones_the_scheduler_reads():
    from pathlib import Path

    from services.executor.cluster import load_cluster
    from services.scheduler.inventory import TOPOLOGY_LABELS, topology_of

    nodes = load_cluster(Path(__file__).parents[2] / "gpusched" / "examples" / "cluster.yaml").nodes()
    used = {key for n in nodes for key in n.labels if key.startswith("topology.gpusched.io/")}
    assert used <= set(TOPOLOGY_LABELS.values()), used - set(TOPOLOGY_LABELS.values())
    assert {topology_of(n)[0] for n in nodes if n.gpu_flavor == "h100-80gb"} == {"h100-nvl"}
