"""The local backend beyond the contract: NVML inventory and telemetry (with a stand-in NVML:
this machine has no GPU), CUDA_VISIBLE_DEVICES, the CPU-only message, max runtime, bad input."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from schemas import FailureReason, JobFailed, JobSucceeded, NodeRegistered
from services.executor.lifecycle import BackendCore
from services.executor.local import GpuSample, LocalBackend, Nvml
from tests.executor.harness import Backend, Driver, work
from tests.unit import builders as b


class FakeNvml:
    available = True
    why = ""

    def sample(self):
        return [GpuSample(i, "NVIDIA H100 80GB HBM3", 81559, 1024 * (i + 1), 0.25 * (i + 1)) for i in range(2)]


def local(root, nvml=None) -> Backend:
    return Backend(name="local", make_core=BackendCore,
                   make_backend=lambda: LocalBackend(root, node_name="gpu-host", telemetry_s=0.1, nvml=nvml),
                   node="gpu-host", gpus=1, honours_grace=True, count_runs=lambda d, j: 0,
                   close=lambda backend: backend.close())


def test_inventory_and_telemetry_from_nvml_and_the_gpus_of_the_placement(tmp_path):
    d = Driver(local(tmp_path, FakeNvml()))
    reg = d.until(lambda: [e for e in d.log if isinstance(e, NodeRegistered)])[0].node
    assert (reg.gpu_count, reg.gpu_product, reg.gpu_flavor, reg.gpu_memory_mib) == (
        2, "NVIDIA-H100-80GB-HBM3", "h100-80gb-hbm3", 81559)
    assert REGISTRY.get_sample_value("gpusched_gpu_utilization_ratio", {"node": "gpu-host", "gpu": "1"}) == 0.5
    assert REGISTRY.get_sample_value("gpusched_gpu_memory_used_bytes", {"node": "gpu-host", "gpu": "0"}) == 2 ** 30
    spec = b.spec(gpus=1, command=("sh", "-c", "echo cuda=$CUDA_VISIBLE_DEVICES resume=$GPUSCHED_RESUME"))
    d.feed(b.submitted("g", spec), b.scheduled("g", {"gpu-host": (1,)}))
    d.until(lambda: d.first("g", JobSucceeded))
    assert (tmp_path / "runs/g-a1-m0/log").read_text() == "cuda=1 resume=0\n"


def test_cpu_only_mode_says_so(tmp_path, caplog):
    nvml = Nvml()
    if nvml.available:
        pytest.skip("NVML finds a GPU here: this is the CPU-only case")
    assert "NVML" in nvml.why
    with caplog.at_level(logging.WARNING):
        d = Driver(local(tmp_path, nvml))
    assert any("CPU-only mode" in r.getMessage() for r in caplog.records)
    reg = d.until(lambda: [e for e in d.log if isinstance(e, NodeRegistered)])[0].node
    assert (reg.gpu_count, reg.gpu_flavor) == (0, None)


def test_max_runtime_is_a_deadline_failure(tmp_path):
    d = Driver(local(tmp_path))
    d.submit_and_schedule("slow", work(None, gpus=0, max_runtime_seconds=1))
    failed = d.until(lambda: d.first("slow", JobFailed), timeout=30)
    assert failed.reason == FailureReason.DEADLINE_EXCEEDED and not failed.retryable


def test_a_job_without_a_command_fails_with_a_clear_message(tmp_path):
    d = Driver(local(tmp_path))
    d.feed(b.submitted("nocmd", b.spec(gpus=0)), b.scheduled("nocmd", {"gpu-host": ()}))
    failed = d.until(lambda: d.first("nocmd", JobFailed))
    assert failed.reason == FailureReason.BACKEND_ERROR
    assert "spec.command" in failed.message


def test_a_command_that_does_not_exist(tmp_path):
    d = Driver(local(tmp_path))
    d.feed(b.submitted("enoent", b.spec(gpus=0, command=("/no/such/binary",))), b.scheduled("enoent", {"gpu-host": ()}))
    failed = d.until(lambda: d.first("enoent", JobFailed))
    assert failed.reason == FailureReason.BACKEND_ERROR and "/no/such/binary" in failed.message
