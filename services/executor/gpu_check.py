"""A short check of the local backend on a machine with an NVIDIA GPU (docs/executor.md):
NVML inventory, the NodeInfo the executor would register, three telemetry samples and the
NodeTelemetryReported they average into, and one job run through the local backend with
CUDA_VISIBLE_DEVICES set to GPU 0.

    python -m services.executor.gpu_check
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from services.executor.lifecycle import BackendCore, TelemetryReport
from services.executor.local import LocalBackend, Nvml, TelemetryWindow, host_node
from services.executor.service import reconcile_once


def main() -> int:
    nvml = Nvml()
    print(json.dumps({"nvml_available": nvml.available, "why": nvml.why}))
    samples = []
    window = TelemetryWindow(start=datetime.now(UTC))
    for _ in range(3):
        taken = nvml.sample()
        window.add(taken, allocated=frozenset({0}))  # as if a job held GPU 0
        samples.append([s.__dict__ for s in taken])
        time.sleep(1)
    print(json.dumps({"samples": samples}, indent=1))
    gpus = nvml.sample()
    print("node:", host_node("gpu-check", gpus).model_dump_json())
    if not gpus:
        print("no GPU: CPU-only mode (nothing more to check)")
        return 1
    core = BackendCore()
    core.observe_telemetry(TelemetryReport("gpu-check", window.start, datetime.now(UTC), len(gpus),
                                           window.gpus(len(gpus))))
    print("telemetry:", core.decide(datetime.now(UTC))[0].model_dump_json())
    from tests.unit import builders as b  # noqa: PLC0415 (a dev check, run from the repository)

    root = Path(tempfile.mkdtemp(prefix="gpusched-gpu-check-"))
    try:
        backend = LocalBackend(root, node_name="gpu-check", telemetry_s=1, nvml=nvml)
        backend.start()
        core = BackendCore()
        script = "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; nvidia-smi -L || true"
        core.evolve(b.submitted("gpu-check", b.spec(gpus=1, command=("sh", "-c", script))))
        core.evolve(b.scheduled("gpu-check", {"gpu-check": (0,)}, when=datetime.now(UTC)))
        seen = set()
        for _ in range(100):
            reconcile_once(core, backend)
            for e in core.decide(datetime.now(UTC)):
                if e.event_id not in seen:
                    seen.add(e.event_id)
                    core.evolve(e)
                    print("event:", e.type)
            if (root / "runs/gpu-check-a1-m0/exit.json").exists() and not core.plan().keep:
                break
            time.sleep(0.1)
        print("log:", (root / "runs/gpu-check-a1-m0/log").read_text())
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
