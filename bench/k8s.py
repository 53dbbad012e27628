"""`make bench-k8s`: the kubernetes backend against the test control plane of `make test-k8s`.

* raw API create rate: sequential creates of a ConfigMap and of a batch/v1 Job of the
  executor's shape, straight through the client (the API server's ceiling for one caller);
* executor create rate: N scheduled attempts, one reconcile pass creating their Jobs (the
  executor's path: plan, manifests, create, cache write-through), and its ratio to the raw Job
  create rate;
* watch-to-event latency: for each Pod, the time from an independent watch seeing it Running to
  the executor's loop (reconcile every 0.1 s) deciding JobStarted; and Job Succeeded to
  JobSucceeded.

    python -m bench.k8s [--jobs N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from datetime import UTC, datetime

from schemas import JobStarted, JobSucceeded
from services.executor.k8s_model import L_JOB, SELECTOR, JobOptions, job_manifests
from services.executor.kubernetes import KubernetesBackend
from services.executor.lifecycle import BackendCore, Workload, reconcile
from services.executor.service import reconcile_once
from schemas.job import NodeAssignment
from tests.executor.controlplane import cluster
from tests.unit import builders as b


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kubernetes import client

    plane = cluster.start()
    try:
        cluster.prepare(plane)
        api = plane.api_client()
        core_api, batch = client.CoreV1Api(api), client.BatchV1Api(api)
        ns = cluster.NAMESPACE
        n = args.jobs
        # -- raw create rates ------------------------------------------------------------------
        t = time.perf_counter()
        for i in range(n):
            core_api.create_namespaced_config_map(ns, {"metadata": {"name": f"raw-{i}"}, "data": {"k": "v" * 200}})
        raw_cm = n / (time.perf_counter() - t)
        spec = b.spec(gpus=1, command=("sh", "-c", "true"), cpu_millis=10, memory_mib=16)
        opts = JobOptions(namespace=ns)
        raw_jobs = []
        for i in range(n):
            w = Workload(job_id=f"raw-{i}", attempt=1, spec=spec, flavor="a100",
                         placement=(NodeAssignment(node=f"kwok-gpu-{i % 2}", gpus=1, gpu_indices=(0,)),))
            m = job_manifests(w, opts)[0]
            m["metadata"]["labels"] = {"bench": "raw"}  # not the executor's: it must not adopt these
            m["spec"]["template"]["metadata"]["labels"] = {"bench": "raw"}
            m["spec"]["suspend"] = True  # no Pods: only the create is measured
            raw_jobs.append(m)
        t = time.perf_counter()
        for m in raw_jobs:
            batch.create_namespaced_job(ns, m)
        raw_job = n / (time.perf_counter() - t)
        batch.delete_collection_namespaced_job(ns, label_selector="bench=raw", propagation_policy="Background")

        # -- the executor's create path and latencies --------------------------------------------
        seen_running: dict[str, float] = {}
        seen_done: dict[str, float] = {}
        stop = threading.Event()

        def record(ev) -> None:
            pod = ev["object"]
            job = pod.metadata.labels.get(L_JOB)
            if pod.status.phase == "Running":
                seen_running.setdefault(job, time.time())
            if pod.status.phase == "Succeeded":
                seen_done.setdefault(job, time.time())

        def watch_pods() -> None:
            from kubernetes import watch
            from urllib3.exceptions import ProtocolError

            w = watch.Watch()
            try:
                for ev in w.stream(core_api.list_namespaced_pod, ns, label_selector=SELECTOR, timeout_seconds=600):
                    record(ev)
                    if stop.is_set():
                        w.stop()
                        return
            except ProtocolError:
                return  # the plane is going away at the end of the run

        watcher = threading.Thread(target=watch_pods, daemon=True)
        watcher.start()
        backend = KubernetesBackend(opts, api_client=plane.api_client(), resync_s=300)
        backend.start()
        backend.wait_synced(30)
        core = BackendCore()
        now = datetime.now(UTC)
        jspec = b.spec(gpus=1, command=("sh", "-c", "true"), cpu_millis=10, memory_mib=16,
                       annotations={"kwok.gpusched.io/run-for": "3s", "kwok.gpusched.io/exit-code": "0"})
        ids = [f"bench-{i}" for i in range(n)]
        for i, j in enumerate(ids):
            core.evolve(b.submitted(j, jspec, when=now))
            core.evolve(b.scheduled(j, {f"kwok-gpu-{i % 2}": (0,)}, when=now))
        t = time.perf_counter()
        result = reconcile(backend, core.plan(), datetime.now(UTC))
        exec_rate = result.created / (time.perf_counter() - t)
        started_at: dict[str, float] = {}
        done_at: dict[str, float] = {}
        seen_ids: set[str] = set()
        deadline = time.monotonic() + 300
        while len(done_at) < n and time.monotonic() < deadline:
            reconcile_once(core, backend)
            for e in core.decide(datetime.now(UTC)):
                if e.event_id in seen_ids:
                    continue
                seen_ids.add(e.event_id)
                core.evolve(e)
                if isinstance(e, JobStarted):
                    started_at[e.aggregate_id] = time.time()
                if isinstance(e, JobSucceeded):
                    done_at[e.aggregate_id] = time.time()
            time.sleep(0.1)
        stop.set()
        backend.close()
        start_lat = [started_at[j] - seen_running[j] for j in ids if j in started_at and j in seen_running]
        done_lat = [done_at[j] - seen_done[j] for j in ids if j in done_at and j in seen_done]
        out = {
            "jobs": n, "raw_configmap_creates_per_s": round(raw_cm, 1), "raw_job_creates_per_s": round(raw_job, 1),
            "executor_job_creates_per_s": round(exec_rate, 1),
            "executor_vs_raw_job_ratio": round(exec_rate / raw_job, 3),
            "running_to_JobStarted_s": {"p50": round(pct(start_lat, 50), 3), "p95": round(pct(start_lat, 95), 3),
                                        "n": len(start_lat)},
            "succeeded_to_JobSucceeded_s": {"p50": round(pct(done_lat, 50), 3), "p95": round(pct(done_lat, 95), 3),
                                            "n": len(done_lat)},
            "completed": len(done_at), "control_plane": plane.timings,
        }
        print(json.dumps(out, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    finally:
        plane.stop()


if __name__ == "__main__":
    main()
