"""The sim executor's simulated GPU telemetry (services/executor/sim.py, docs/executor.md
"Simulated telemetry"): windows on the platform clock, a GPU's utilization from the attempts
holding it (a hint in the spec, a service's load, or the kind's mean with seeded jitter), marked
``source: simulated``; none unless asked for (the trace simulator and the what-if run without)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from runtime.settings import ConfigError
from schemas import JobKind, JobScheduled, NodeTelemetryReported, ServiceLoadReported, new_event
from schemas.job import NodeAssignment
from schemas.node import GpuTelemetry
from schemas.service import SERVICE_ANNOTATION, replica_job_id
from services.executor.config import SIM_TELEMETRY_S, sim_telemetry_interval
from services.executor.sim import (
    ANN_REPLICA_RPS,
    ANN_UTILIZATION,
    ATTEMPT_JITTER,
    KIND_UTILIZATION,
    TELEMETRY_SAMPLES,
    WINDOW_JITTER,
    SimExecutorCore,
    attempt_utilization,
)
from tests.unit.builders import T0, Log, at, drive, node_info, scheduled, spec, submitted

WINDOW = 60.0
CLUSTER = [node_info("n1", "a100", 2, gpu_memory_mib=40_000), node_info("cpu-0", None, 0),
           node_info("l4-0", "l4", 1, gpu_memory_mib=20_000, gpu_sharable=True)]


class Sim:
    def __init__(self, telemetry_s: float = WINDOW, cluster=CLUSTER):
        self.core = SimExecutorCore(cluster, telemetry_s=telemetry_s)
        self.log = Log()
        self.feed()

    def feed(self, *events, now=T0):
        return drive(self.core, events, now, log=self.log)

    def job(self, job_id, gpus=(0,), node="n1", when=T0, **fields):
        fields.setdefault("expected_runtime_seconds", 3600)
        return self.feed(submitted(job_id, spec(**fields), when=when),
                         scheduled(job_id, {node: gpus}, when=when), now=when)

    def reports(self, now) -> dict[tuple[str, float], NodeTelemetryReported]:
        """(node, window start as seconds after T0) -> its report, of what is decided by ``now``."""
        return {(e.node, (e.window_start - T0).total_seconds()): e for e in self.feed(now=now)
                if isinstance(e, NodeTelemetryReported)}


def gpu(report: NodeTelemetryReported, index: int) -> GpuTelemetry:
    return next(g for g in report.gpus if g.index == index)


def test_none_without_a_window():
    """The trace simulator's and the what-if's sim executor: no telemetry, as before."""
    sim = Sim(telemetry_s=0)
    sim.job("j1", **{"annotations": {ANN_UTILIZATION: "0.7"}})
    assert not [e for e in sim.feed(now=at(3 * WINDOW)) if isinstance(e, NodeTelemetryReported)]
    assert sim.core.next_wake() == at(3600)  # the job's end: no window to wake for


def test_a_hinted_job_in_whole_windows():
    sim = Sim()
    assert sim.core.next_wake() == at(WINDOW)  # T0 is a boundary: the first window is [T0, T0 + 60 s)
    sim.job("j1", gpus=(1,), **{"annotations": {ANN_UTILIZATION: "0.7"}})
    assert sim.reports(at(WINDOW - 1)) == {}
    reports = sim.reports(at(WINDOW))
    assert set(reports) == {("n1", 0), ("l4-0", 0)}  # every node with GPUs; the CPU-only node reports nothing
    n1 = reports[("n1", 0)]
    assert n1.source == "simulated" and n1.producer == "executor" and n1.aggregate_id == "n1"
    assert (n1.window_start, n1.window_end, n1.occurred_at, n1.gpu_count) == (T0, at(WINDOW), at(WINDOW), 2)
    assert gpu(n1, 1) == GpuTelemetry(index=1, samples=TELEMETRY_SAMPLES, utilization=0.7, memory_used_mib=32_000,
                                      memory_total_mib=40_000, allocated_samples=TELEMETRY_SAMPLES,
                                      allocated_utilization=0.7)
    assert gpu(n1, 0) == GpuTelemetry(index=0, samples=TELEMETRY_SAMPLES, utilization=0.0, memory_used_mib=0,
                                      memory_total_mib=40_000)  # idle: 0, not allocated
    assert [g.utilization for g in reports[("l4-0", 0)].gpus] == [0.0]
    assert sim.reports(at(WINDOW + 30)) == {}  # each window once
    later = sim.reports(at(3 * WINDOW + 5))  # a late pass: both windows that ended
    assert sorted(later) == [("l4-0", 60), ("l4-0", 120), ("n1", 60), ("n1", 120)]


def test_a_start_and_an_end_inside_a_window_count_for_their_share_of_it():
    sim = Sim()
    sim.feed(now=at(30))
    sim.job("j1", when=at(30), expected_runtime_seconds=60, annotations={ANN_UTILIZATION: "0.8"})  # 30 s .. 90 s
    first = gpu(sim.reports(at(WINDOW))[("n1", 0)], 0)
    assert (first.utilization, first.allocated_samples, first.allocated_utilization) == (0.4, 30, 0.8)
    second = gpu(sim.reports(at(2 * WINDOW))[("n1", 60)], 0)  # it succeeded at 90 s
    assert (second.utilization, second.allocated_samples, second.allocated_utilization) == (0.4, 30, 0.8)
    third = gpu(sim.reports(at(3 * WINDOW))[("n1", 120)], 0)
    assert (third.utilization, third.allocated_samples, third.allocated_utilization) == (0.0, 0, None)


def test_a_shared_gpu_sums_the_shares():
    sim = Sim()
    for job_id, hint in (("a", "0.6"), ("b", "1")):
        s = spec(gpu_milli=500, expected_runtime_seconds=3600, annotations={ANN_UTILIZATION: hint})
        place = new_event(JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=T0, key="1", attempt=1,
                          flavor="l4", placement=(NodeAssignment(node="l4-0", gpus=1, gpu_indices=(0,), gpu_milli=500),))
        sim.feed(submitted(job_id, s), place)
    l4 = gpu(sim.reports(at(WINDOW))[("l4-0", 0)], 0)
    assert (l4.utilization, l4.allocated_utilization) == (pytest.approx(0.5 * 0.6 + 0.5 * 1), pytest.approx(0.8))
    assert l4.memory_used_mib == 2 * int(0.5 * 20_000 * 0.8)


@pytest.mark.parametrize("kind", list(JobKind))
def test_without_a_hint_the_kind_mean_with_seeded_jitter(kind):
    values = [attempt_utilization("job-1", spec(kind=kind.value), 1, at(w * WINDOW)) for w in range(20)]
    mean = KIND_UTILIZATION[kind]
    assert all(abs(v - mean) <= ATTEMPT_JITTER + WINDOW_JITTER for v in values)
    assert len(set(values)) > 10  # it moves from window to window
    again = [attempt_utilization("job-1", spec(kind=kind.value), 1, at(w * WINDOW)) for w in range(20)]
    assert values == again  # seeded by job, attempt and window: no randomness
    other = [attempt_utilization("job-1", spec(kind=kind.value), 2, at(w * WINDOW)) for w in range(20)]
    assert other != values


@pytest.mark.parametrize("hint", ["1.5", "-0.1", "busy", ""])
def test_a_malformed_hint_counts_as_absent(hint):
    s = spec(kind="batch", annotations={ANN_UTILIZATION: hint})
    assert attempt_utilization("j", s, 1, T0) == attempt_utilization("j", spec(kind="batch"), 1, T0)


def test_the_same_log_and_clock_give_the_same_reports():
    """Deterministic on the platform clock: a second executor (or a restarted one) names the same
    windows with the same ids and figures."""
    def run():
        sim = Sim()
        sim.job("train", kind="training")
        sim.job("eval", gpus=(1,), kind="evaluation", expected_runtime_seconds=150)
        return [e for e in sim.feed(now=at(5 * WINDOW)) if isinstance(e, NodeTelemetryReported)]

    first, second = run(), run()
    assert len(first) == 10
    assert [e.model_dump() for e in first] == [e.model_dump() for e in second]
    busy = [gpu(e, 0).utilization for e in first if e.node == "n1"]
    assert len(set(busy)) == 5 and all(0.6 <= u <= 1 for u in busy)


def load(service, rps, when):
    return new_event(ServiceLoadReported, aggregate_id=service, producer="admission", occurred_at=when,
                     key=f"load/{when.isoformat()}", requests_per_second=rps, reported_by="ingress", intake_sequence=1)


def test_a_replica_follows_its_services_load():
    sim = Sim()
    replica = {"kind": "inference", "expected_runtime_seconds": None,
               "annotations": {SERVICE_ANNOTATION: "web", ANN_REPLICA_RPS: "20"}}
    sim.job(replica_job_id("web", 1, 0), gpus=(0,), **replica)
    no_load = gpu(sim.reports(at(WINDOW))[("n1", 0)], 0).utilization
    assert abs(no_load - KIND_UTILIZATION[JobKind.INFERENCE]) <= ATTEMPT_JITTER + WINDOW_JITTER  # no load reported yet
    sim.feed(load("web", 10.0, at(WINDOW)), now=at(WINDOW))
    assert gpu(sim.reports(at(2 * WINDOW))[("n1", 60)], 0).utilization == 0.5  # 10 rps / 20 rps at full
    sim.job(replica_job_id("web", 1, 1), gpus=(1,), when=at(2 * WINDOW), **replica)
    shared = sim.reports(at(3 * WINDOW))[("n1", 120)]
    assert [g.utilization for g in shared.gpus] == [0.25, 0.25]  # the same load over two replicas
    sim.feed(load("web", 100.0, at(3 * WINDOW + 30)), now=at(3 * WINDOW + 30))
    saturated = sim.reports(at(4 * WINDOW))[("n1", 180)]
    assert [g.utilization for g in saturated.gpus] == [pytest.approx((0.25 + 1) / 2)] * 2  # capped at 1


def test_the_report_passes_the_contract_and_nvml_stays_the_default():
    sim = Sim()
    sim.job("j1")
    report = sim.reports(at(WINDOW))[("n1", 0)]
    again = NodeTelemetryReported.model_validate(report.model_dump(mode="json"))
    assert again.source == "simulated"
    nvml = report.model_dump(mode="json")
    del nvml["source"]
    assert NodeTelemetryReported.model_validate(nvml).source == "nvml"  # what the local backend writes
    with pytest.raises(ValidationError, match="source") as err:
        NodeTelemetryReported.model_validate({**nvml, "source": "dcgm"})
    assert "'nvml' or 'simulated'" in str(err.value)


def test_a_late_pass_reports_a_bounded_number_of_windows():
    sim = Sim()
    reports = sim.reports(at(1000 * WINDOW))
    starts = sorted({start for _, start in reports})
    assert len(starts) == 60 and starts[-1] == 999 * WINDOW


def test_the_window_setting(monkeypatch):
    monkeypatch.delenv("GPUSCHED_TELEMETRY_INTERVAL_S", raising=False)
    assert sim_telemetry_interval() == SIM_TELEMETRY_S == 300
    for value, expected in (("0", 0.0), ("1", 1.0), ("3600", 3600.0)):
        monkeypatch.setenv("GPUSCHED_TELEMETRY_INTERVAL_S", value)
        assert sim_telemetry_interval() == expected
    for value, needle in (("0.5", "out of range"), ("7200", "out of range"), ("often", "not a number")):
        monkeypatch.setenv("GPUSCHED_TELEMETRY_INTERVAL_S", value)
        with pytest.raises(ConfigError, match=f"GPUSCHED_TELEMETRY_INTERVAL_S='{value}' is {needle}; accepted: 0"):
            sim_telemetry_interval()
    assert timedelta(seconds=SIM_TELEMETRY_S) <= timedelta(hours=1)


def test_a_cluster_executor_names_its_nodes_with_the_cluster():
    core = SimExecutorCore([node_info("n1", "a100", 1)], telemetry_s=WINDOW, cluster="east")
    drive(core, (), T0)
    reports = [e for e in drive(core, (), at(WINDOW)) if isinstance(e, NodeTelemetryReported)]
    assert [(e.node, e.aggregate_id, e.source) for e in reports] == [("n1.east", "n1.east", "simulated")]


def test_simulated_utilization_drives_a_gpu_utilization_autoscaling_rule():
    """The pure cores of the platform with the sim executor's telemetry on: a service whose rule
    reads GPU utilization (target 0.5) scales to its load: 40 requests/s over replicas serving 10
    at utilization 1 need 40 / (10 × 0.5) = 8 replicas, then 20 requests/s need 4."""
    import json

    from gpusched.sim.trace import decide_until_quiet
    from schemas import QueueConfigured
    from schemas.commands import Principal
    from schemas.queue import FlavorQuota
    from services.admission.domain import AdmissionCore
    from services.quota.domain import QuotaCore
    from services.scheduler.domain import SchedulerCore
    from services.serving.domain import ServingCore

    cluster = [node_info(f"n{i}", "a100", 8) for i in range(2)]
    admission, serving = AdmissionCore(), ServingCore()
    cores = (admission, QuotaCore(), SchedulerCore(), SimExecutorCore(cluster, telemetry_s=WINDOW), serving)

    def feed(events):
        for e in events:
            for core in cores:
                core.evolve(e)

    def command(verb):
        return Principal(team="team-a", user="alice", verb=verb)

    feed([new_event(QueueConfigured, aggregate_id="prod", producer="config", occurred_at=T0, key="1", name="prod",
                    allowed_teams=("team-a",), quotas=(FlavorQuota(flavor="a100", nominal=16),))])
    assert decide_until_quiet(cores, feed, T0, 1000)
    doc = {"spec": {"name": "chat", "team": "team-a", "queue": "prod", "replicas": {"min": 1, "max": 12, "desired": 1},
                    "replica": {"kind": "inference", "queue": "prod", "team": "team-a", "image": "srv", "gpus": 1,
                                "priority_class": "inference-sla", "annotations": {ANN_REPLICA_RPS: "10"}},
                    "autoscaling": {"metric": "gpu_utilization", "target": 0.5, "scale_up_stabilization_seconds": 0,
                                    "scale_down_stabilization_seconds": 0}}}
    feed(admission.handle_deploy(json.dumps(doc).encode(), command("deploy"), 1, T0))
    seq = iter(range(2, 1000))

    def run_until(minutes, rps):
        feed(admission.handle_load(json.dumps({"service": "chat", "requests_per_second": rps}).encode(),
                                   command("load"), next(seq), now[0]))
        while now[0] < T0 + timedelta(minutes=minutes):
            now[0] += timedelta(seconds=10)
            assert decide_until_quiet(cores, feed, now[0], 1000)
        return serving.services["chat"].desired

    now = [T0]
    assert decide_until_quiet(cores, feed, T0, 1000)
    assert run_until(30, 40.0) == 8
    assert run_until(60, 20.0) == 4
