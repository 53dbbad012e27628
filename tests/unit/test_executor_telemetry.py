"""GPU telemetry in the executor, without NATS: the averaging of NVML samples into a window
(TelemetryWindow, and the local backend's windows with a stand-in sampler: this machine has no
GPU), reading pynvml (a stand-in module), the core turning a closed window into
NodeTelemetryReported until the log has it, and the GPUSCHED_TELEMETRY_INTERVAL_S setting.

The publish path itself (executor -> NATS -> accounting -> metrics) is tested against a real
nats-server and Postgres in tests/integration/test_telemetry.py."""

from __future__ import annotations

import sys
import types
from datetime import timedelta

import pytest

from runtime.settings import ConfigError
from schemas import NodeRegistered, NodeTelemetryReported
from services.executor.config import ExecutorConfig
from services.executor.lifecycle import MAX_PENDING_REPORTS, BackendCore, Plan, TelemetryReport, Workload, reconcile
from services.executor.local import GpuSample, LocalBackend, Nvml, TelemetryWindow
from tests.unit.builders import T0, at, gpu, scheduled, spec

H100 = "NVIDIA H100 80GB HBM3"


def sample(index: int, utilization: float, used: int = 1000, power: float | None = 300.0) -> GpuSample:
    return GpuSample(index, H100, 81559, used, utilization, power)


# -- TelemetryWindow: the averaging -------------------------------------------------------------


def test_a_window_averages_utilization_and_power_and_keeps_peak_memory():
    w = TelemetryWindow(start=T0)
    w.add([sample(0, 0.2, used=1000, power=100.0), sample(1, 0.0, power=None)], allocated=frozenset({0}))
    w.add([sample(0, 0.4, used=5000, power=200.0), sample(1, 0.1, power=None)], allocated=frozenset({0, 1}))
    w.add([sample(0, 0.9, used=2000, power=None), sample(1, 0.2, power=None)], allocated=frozenset())
    g0, g1 = w.gpus(gpu_count=2)
    assert (g0.index, g0.samples, g0.memory_used_mib, g0.memory_total_mib) == (0, 3, 5000, 81559)
    assert g0.utilization == pytest.approx(0.5)
    assert g0.power_w == pytest.approx(150.0)  # the samples that had a reading
    assert (g0.allocated_samples, g0.allocated_utilization) == (2, pytest.approx(0.3))
    assert g1.utilization == pytest.approx(0.1) and g1.power_w is None
    assert (g1.allocated_samples, g1.allocated_utilization) == (1, pytest.approx(0.1))


def test_a_gpu_never_allocated_has_no_allocated_utilization():
    w = TelemetryWindow(start=T0)
    w.add([sample(0, 0.7)])
    (g,) = w.gpus(gpu_count=1)
    assert (g.allocated_samples, g.allocated_utilization) == (0, None)


def test_a_gpu_the_node_no_longer_has_is_left_out():
    w = TelemetryWindow(start=T0)
    w.add([sample(0, 0.1), sample(1, 0.2)])
    assert [g.index for g in w.gpus(gpu_count=1)] == [0]
    assert TelemetryWindow(start=T0).gpus(gpu_count=8) == ()


def test_means_stay_within_zero_and_one_despite_float_sums():
    w = TelemetryWindow(start=T0)
    for _ in range(10):
        w.add([sample(0, 1.0)], allocated=frozenset({0}))
    (g,) = w.gpus(1)
    assert g.utilization == 1.0 and g.allocated_utilization == 1.0


# -- the local backend's windows (a stand-in sampler, an injected clock) ------------------------


class ScriptedNvml:
    """Stands in for services.executor.local.Nvml: returns the next scripted sample each call."""

    available = True
    why = ""

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    def sample(self):
        self.calls += 1
        return self.script[min(self.calls, len(self.script)) - 1]


def backend(tmp_path, nvml, interval=60.0) -> LocalBackend:
    # telemetry_s=0: sample on every pass, so the test's clock alone decides the windows
    return LocalBackend(tmp_path, node_name="gpu-host", telemetry_s=0, telemetry_interval_s=interval, nvml=nvml)


def plan_holding(node: str, indices: tuple[int, ...]) -> Plan:
    ev = scheduled("j", {node: indices})
    w = Workload(job_id="j", attempt=1, spec=spec(gpus=len(indices), command=("true",)), flavor="a100",
                 placement=ev.placement)
    return Plan(run=(w,), stop=(), keep=frozenset({("j", 1)}))


IDLE = Plan(run=(), stop=(), keep=frozenset())


def sync_at(b: LocalBackend, seconds: float, plan: Plan = IDLE):
    return reconcile(b, plan, at(seconds))


def test_the_local_backend_reports_one_window_per_interval(tmp_path):
    nvml = ScriptedNvml([[sample(0, u), sample(1, 0.0)] for u in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)])
    b = backend(tmp_path, nvml)
    reports = []
    for t in (0, 20, 40, 59):  # 4 samples in [0, 60)
        reports += sync_at(b, t).telemetry
    assert reports == []
    (r,) = sync_at(b, 60).telemetry  # closes [0, 60), then samples into [60, 120)
    assert (r.node, r.window_start, r.window_end, r.gpu_count) == ("gpu-host", at(0), at(60), 2)
    assert [g.samples for g in r.gpus] == [4, 4]
    assert r.gpus[0].utilization == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4)
    assert sync_at(b, 100).telemetry == []
    (r2,) = sync_at(b, 121).telemetry
    assert (r2.window_start, r2.window_end) == (at(60), at(121))  # windows follow each other without a gap
    assert r2.gpus[0].utilization == pytest.approx((0.5 + 0.6) / 2)


def test_samples_count_as_allocated_while_a_placement_on_this_host_holds_the_gpu(tmp_path):
    nvml = ScriptedNvml([[sample(0, 0.9), sample(1, 0.01)]])
    b = backend(tmp_path, nvml)
    holding = plan_holding("gpu-host", (1,))  # a job using GPU 1 of this host
    sync_at(b, 0, holding)
    sync_at(b, 30, holding)
    sync_at(b, 45)  # the attempt is gone from the plan
    (r,) = sync_at(b, 60, holding).telemetry
    g0, g1 = r.gpus
    assert (g0.allocated_samples, g0.allocated_utilization) == (0, None)
    assert (g1.samples, g1.allocated_samples, g1.allocated_utilization) == (3, 2, pytest.approx(0.01))


def test_a_window_the_loop_did_not_close_in_time_is_dropped(tmp_path):
    b = backend(tmp_path, ScriptedNvml([[sample(0, 0.5)]]))
    sync_at(b, 0)
    assert sync_at(b, 500).telemetry == []  # [0, 500) is not a 60 s window of samples
    (r,) = sync_at(b, 560).telemetry
    assert (r.window_start, r.window_end) == (at(500), at(560))


def test_no_reports_in_cpu_only_mode_or_with_interval_zero(tmp_path):
    class NoGpu:
        available, why = False, "NVML is not available (test)"

        def sample(self):
            return []

    for b in (backend(tmp_path / "cpu", NoGpu()), backend(tmp_path / "off", ScriptedNvml([[sample(0, 0.5)]]), 0)):
        b.start()
        assert all(not sync_at(b, t).telemetry for t in range(0, 400, 30))


# -- reading pynvml (a stand-in module) ---------------------------------------------------------


class _NvmlError(Exception):
    pass


def fake_pynvml(power_mw: dict[int, int | None]) -> types.ModuleType:
    """The handful of pynvml calls Nvml makes, for two GPUs; GPU i's power is power_mw[i] (None: unsupported)."""
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=143771 * 2 ** 20, used=(h + 1) * 512 * 2 ** 20)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37 if h == 0 else 0, memory=5)

    def power(h):
        if power_mw[h] is None:
            raise _NvmlError("Not Supported")
        return power_mw[h]
    m.nvmlDeviceGetPowerUsage = power
    return m


def test_nvml_reads_utilization_memory_and_power(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({0: 412_345, 1: None}))
    nvml = Nvml()
    assert nvml.available, nvml.why
    s0, s1 = nvml.sample()
    assert (s0.index, s0.name, s0.memory_total_mib, s0.memory_used_mib) == (0, "NVIDIA H200", 143771, 512)
    assert s0.utilization == pytest.approx(0.37) and s0.power_w == pytest.approx(412.345)
    assert s1.utilization == 0.0 and s1.power_w is None  # a device without a power reading


# -- the core: a closed window becomes NodeTelemetryReported until the log has it -------------


def report(start=T0, node="gpu-host") -> TelemetryReport:
    return TelemetryReport(node=node, window_start=start, window_end=start + timedelta(seconds=60), gpu_count=2,
                           gpus=(gpu(0, 0.8), gpu(1, 0.0, allocated=0)))


def test_the_core_reports_a_window_after_the_nodes_inventory_and_until_the_log_has_it():
    from tests.unit.builders import node_info

    c = BackendCore()
    c.observe_inventory([node_info("gpu-host", "h100-80gb-hbm3", 2)])
    c.observe_telemetry(report())
    decided = c.decide(at(61))
    assert [type(e) for e in decided] == [NodeRegistered, NodeTelemetryReported]
    t = decided[1]
    assert (t.aggregate_id, t.node, t.window_start, t.window_end, t.occurred_at) == (
        "gpu-host", "gpu-host", T0, at(60), at(60))
    assert t.producer == "executor" and [g.index for g in t.gpus] == [0, 1]
    assert c.decide(at(62))[1] == t  # not in the log yet (refused, or not appended): decided again, same id
    for e in decided:
        c.evolve(e)
    assert c.decide(at(63)) == []
    c.observe_telemetry(report())  # the same window again (a restart re-sampling it): the same event id
    assert [e.event_id for e in c.decide(at(64))] == [t.event_id]


def test_a_report_the_contract_refuses_raises_and_pending_reports_are_bounded():
    c = BackendCore()
    with pytest.raises(ValueError, match="gpus has 2 entries but the node has gpu_count 1"):
        c.observe_telemetry(TelemetryReport("n1", T0, at(60), 1, (gpu(0), gpu(1))))
    for i in range(MAX_PENDING_REPORTS + 5):
        c.observe_telemetry(report(start=at(60 * i), node="n1"))
    pending = c.decide(at(0))
    assert len(pending) == MAX_PENDING_REPORTS and pending[0].window_start == at(60 * 5)  # the oldest dropped


# -- GPUSCHED_TELEMETRY_INTERVAL_S ---------------------------------------------------------------


def test_telemetry_interval_default_and_off(monkeypatch):
    monkeypatch.delenv("GPUSCHED_TELEMETRY_INTERVAL_S", raising=False)
    monkeypatch.delenv("GPUSCHED_LOCAL_TELEMETRY_S", raising=False)
    assert ExecutorConfig.from_env().telemetry_interval_s == 60.0
    monkeypatch.setenv("GPUSCHED_TELEMETRY_INTERVAL_S", "0")
    assert ExecutorConfig.from_env().telemetry_interval_s == 0.0
    monkeypatch.setenv("GPUSCHED_TELEMETRY_INTERVAL_S", "300")
    assert ExecutorConfig.from_env().telemetry_interval_s == 300.0


@pytest.mark.parametrize("value, sample_s, needle", [
    ("soon", None, "GPUSCHED_TELEMETRY_INTERVAL_S='soon' is not a number; accepted: 0 (no telemetry reports) "
                   "or a number of seconds 10..3600"),
    ("0.5", None, "GPUSCHED_TELEMETRY_INTERVAL_S='0.5' is out of range; accepted: 0 (no telemetry reports)"),
    ("7200", None, "GPUSCHED_TELEMETRY_INTERVAL_S='7200' is out of range"),
    ("-1", None, "is out of range"),
    ("5", None, "GPUSCHED_TELEMETRY_INTERVAL_S='5' is shorter than GPUSCHED_LOCAL_TELEMETRY_S=10 (the NVML sampling "
                "period)"),
    ("30", "60", "accepted: 0 (no telemetry reports) or a number of seconds 60..3600"),
])
def test_bad_telemetry_interval_is_explained(monkeypatch, value, sample_s, needle):
    monkeypatch.setenv("GPUSCHED_TELEMETRY_INTERVAL_S", value)
    if sample_s is None:
        monkeypatch.delenv("GPUSCHED_LOCAL_TELEMETRY_S", raising=False)
    else:
        monkeypatch.setenv("GPUSCHED_LOCAL_TELEMETRY_S", sample_s)
    with pytest.raises(ConfigError) as err:
        ExecutorConfig.from_env()
    assert needle in str(err.value)
