"""The FGD paper's own simulator (hkust-adsl/kubernetes-scheduler-simulator), built from a local
checkout and run on the same node and pod lists as gpusched, for bench.placement.

    python -m bench.placement --peer DIR      # or GPUSCHED_PEER_SRC=DIR

DIR is a checkout of the peer's repository, or a bare clone of it (a fetched mirror), which is
checked out once into ~/.cache/gpusched (the peer vendors its Go modules, so the build needs no
network). The binary is built once per commit into ~/.cache/gpusched (about 2 minutes on a 2-core
machine). Each run gets its own directory under a temporary root: the node and pod lists as
Kubernetes objects (JSON documents in .yaml files, the layout of the peer's data/ folder and its
pod_csv_to_yaml.py), the two config files its scripts/generate_config_and_run.py writes for the
paper's BestFit and FGD runs, and the log. The log's "[Alloc]" lines (one per task) are read the way
the peer's experiments/analysis/merge_alloc_discrete.py reads them (gpusched.sim.trace.fgd_curve).

Go 1.24 and later ignore rand.Seed unless GODEBUG=randseednop=0, which the run sets: without it
every seed would give another workload than the paper's.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import gobuild
from gpusched.sim import trace as tracesim

POLICIES = {"BestFit": "BestFitScore", "FGD": "FGDScore"}
CHECKOUT = ("go.mod", "go.sum", "cmd", "pkg", "vendor", "example")  # the peer's paths a build and a run use
ALLOC = re.compile(r"\[Alloc\].*Used GPU Milli: (\d+); Total GPUs: (\d+); Arrived GPU Milli: (\d+)")


class PeerUnavailable(RuntimeError):
    pass


def source(given: Path | None) -> Path | None:
    """The peer checkout from --peer or GPUSCHED_PEER_SRC, or None when neither is set. A bare
    git repository (a fetched mirror) is checked out once into ~/.cache/gpusched first."""
    text = str(given) if given else os.environ.get("GPUSCHED_PEER_SRC", "")
    if not text:
        return None
    path = Path(text).expanduser()
    if (path / "HEAD").is_file() and (path / "objects").is_dir():  # bare: check it out
        rev = subprocess.run(["git", "--git-dir", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        if rev.returncode != 0:
            raise PeerUnavailable(f"{path}: not a readable git repository ({rev.stderr.strip()})")
        checkout = gobuild.cache() / f"peer-src-{rev.stdout.strip()[:12]}"
        if not checkout.exists():
            tmp = checkout.with_suffix(f".{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            # Only what the build and a run need: a mirror may lack the blobs of large result files.
            for cmd in (["git", "clone", "-q", "--no-checkout", str(path), str(tmp)],
                        ["git", "-C", str(tmp), "checkout", "HEAD", "--", *CHECKOUT]):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise PeerUnavailable(f"{' '.join(cmd[:3])} of {path} failed: {done.stderr.strip()[-500:]}")
            tmp.replace(checkout)
        path = checkout
    if not (path / "cmd" / "main.go").exists() or not (path / "vendor").is_dir():
        raise PeerUnavailable(f"{path} is not a checkout of hkust-adsl/kubernetes-scheduler-simulator "
                              "(no cmd/main.go or vendor/)")
    return path


def build(checkout: Path) -> Path:
    """bin/simon for the checkout's commit (or its go.sum when it is not a git work tree)."""
    rev = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    key = rev.stdout.strip()[:12] if rev.returncode == 0 else \
        hashlib.sha256((checkout / "go.sum").read_bytes()).hexdigest()[:12]
    out = gobuild.cache() / f"simon-{key}"
    if not out.exists():
        print(f"[peer] building {checkout} at {key} into {out} (about 2 minutes)", flush=True)
    return gobuild.build(checkout, "./cmd", out, "-mod=vendor")


def _node(row: dict) -> dict:
    gpus = int(row["gpu"])
    amounts = {"alibabacloud.com/gpu-count": str(gpus), "alibabacloud.com/gpu-milli": str(gpus * 1000),
               "cpu": f"{int(row['cpu_milli'])}m", "memory": f"{int(row['memory_mib'])}Mi", "pods": "1001"}
    name = row["sn"].strip()
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"alibabacloud.com/gpu-card-model": row["model"].strip(),
                                                  "beta.kubernetes.io/os": "linux",
                                                  "kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
            "status": {"allocatable": amounts, "capacity": amounts}}


def _pod(row: dict) -> dict:
    """As the peer's data/pod_csv_to_yaml.py writes a row (its times are not exported)."""
    annotations = {}
    gpus = int(row["num_gpu"])
    if gpus != 0:
        milli = int(float(row.get("gpu_milli") or 0))
        annotations["alibabacloud.com/gpu-milli"] = str(milli if 0 < milli <= 1000 else 1000 if milli > 1000 else 0)
        annotations["alibabacloud.com/gpu-count"] = str(gpus)
        spec = "|".join(x for x in (row.get("gpu_spec") or "").split("|") if x)
        if spec:
            annotations["alibabacloud.com/gpu-card-model"] = spec
    amounts = {"cpu": f"{int(row['cpu_milli'])}m", "memory": f"{int(row['memory_mib'])}Mi"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": row["name"].strip(), "namespace": "paib-gpu", "annotations": annotations},
            "spec": {"containers": [{"name": "main", "image": "tensorflow:latest", "imagePullPolicy": "Always",
                                     "resources": {"requests": amounts, "limits": amounts}}],
                     "dnsPolicy": "Default", "restartPolicy": "OnFailure"}}


def _documents(path: Path, out: Path, convert, keep=lambda row: True) -> None:
    with path.open(newline="") as f, out.open("w") as w:
        w.write("\n---\n".join(json.dumps(convert(row)) for row in csv.DictReader(f) if keep(row)))


def _configs(run_dir: Path, policy: str, ratio: float, seed: int) -> tuple[Path, Path]:
    cc = {"apiVersion": "simon/v1alpha1", "kind": "Config", "metadata": {"name": "gpusched-bench"},
          "spec": {"cluster": {"customConfig": str(run_dir / "input")}, "appList": None,
                   "newNode": "example/newnode/gpushare",
                   "customConfig": {"shufflePod": True, "descheduleConfig": {"ratio": 0.0},
                                    "exportConfig": {"nodeSnapshotCSVFilePrefix": None,
                                                     "podSnapshotYamlFilePrefix": None},
                                    "newWorkloadConfig": None,
                                    "typicalPodsConfig": {"isInvolvedCpuPods": True, "podPopularityThreshold": 95,
                                                          "podIncreaseStep": 1, "gpuResWeight": 0},
                                    "workloadInflationConfig": {"ratio": 1, "seed": 233},
                                    "workloadTuningConfig": {"ratio": ratio, "seed": seed}}}}
    plugin = POLICIES[policy]
    every_score = ["RandomScore", "DotProductScore", "GpuClusteringScore", "GpuPackingScore", "BestFitScore",
                   "FGDScore", "ImageLocality", "NodeAffinity", "PodTopologySpread", "TaintToleration",
                   "NodeResourcesBalancedAllocation", "InterPodAffinity", "NodeResourcesLeastAllocated",
                   "NodePreferAvoidPods"]
    share = {"dimExtMethod": "share", "normMethod": "max"}
    plugin_config = ([{"name": "FGDScore", "args": share},
                      {"name": "Open-Gpu-Share", "args": {**share, "gpuSelMethod": "FGDScore"}}]
                     if policy == "FGD" else [{"name": "Open-Gpu-Share", "args": {"gpuSelMethod": "best"}}])
    sc = {"apiVersion": "kubescheduler.config.k8s.io/v1beta1", "kind": "KubeSchedulerConfiguration",
          "percentageOfNodesToScore": 100,
          "profiles": [{"schedulerName": "simon-scheduler", "pluginConfig": plugin_config, "plugins": {
              "bind": {"disabled": [{"name": "DefaultBinder"}], "enabled": [{"name": "Simon"}]},
              "filter": {"enabled": [{"name": "Open-Gpu-Share"}]},
              "preScore": {"disabled": [{"name": "RandomScore"}], "enabled": None},
              "reserve": {"enabled": [{"name": "Open-Gpu-Share"}]},
              "score": {"disabled": [{"name": n} for n in every_score],
                        "enabled": [{"name": plugin, "weight": 1000}]}}}]}
    (run_dir / "cc.yaml").write_text(json.dumps(cc))
    (run_dir / "sc.yaml").write_text(json.dumps(sc))
    return run_dir / "cc.yaml", run_dir / "sc.yaml"


@dataclass
class PeerRun:
    policy: str
    seed: int
    curve: dict[int, float]
    failed: int | None
    wall_s: float
    peak_rss_mib: float


def run(binary: Path, checkout: Path, nodes: Path, pods: Path, policy: str, seed: int, ratio: float,
        root: Path) -> PeerRun:
    """One run of the peer's `simon apply` (cwd: the checkout, for its example/ files)."""
    run_dir = root / f"{policy}-{seed}"
    (run_dir / "input").mkdir(parents=True)
    _documents(nodes, run_dir / "input" / "nodes.yaml", _node, keep=lambda row: int(row["gpu"]) > 0)
    _documents(pods, run_dir / "input" / "pods.yaml", _pod)
    cc, sc = _configs(run_dir, policy, ratio, seed)
    log = run_dir / "simon.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([str(binary), "apply", "--extended-resources", "gpu", "-f", str(cc),
                                 "--default-scheduler-config", str(sc)], cwd=checkout, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "GODEBUG": "randseednop=0"})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    rows, capacity, failed = [], 0, None
    with log.open(errors="replace") as f:
        for line in f:
            if m := ALLOC.search(line):
                used, total, arrived = (int(x) for x in m.groups())
                rows.append((arrived, used))
                capacity = total
            elif m := re.match(r"there are (\d+) unscheduled pods", line):
                failed = int(m.group(1))
    if not rows:
        raise PeerUnavailable(f"the peer's {policy} run (seed {seed}) logged no [Alloc] line; "
                              f"exit {proc.returncode}, log {log}")
    return PeerRun(policy=policy, seed=seed, curve=tracesim.fgd_curve(rows, capacity), failed=failed,
                   wall_s=wall, peak_rss_mib=usage.ru_maxrss / 1024)


def run_all(checkout: Path, nodes: Path, pods: Path, seeds: list[int], ratio: float, workers: int) -> list[PeerRun]:
    from concurrent.futures import ThreadPoolExecutor

    binary = build(checkout)
    with tempfile.TemporaryDirectory(prefix="gpusched-peer-") as tmp, ThreadPoolExecutor(workers) as pool:
        jobs = [(p, s) for s in seeds for p in POLICIES]
        return list(pool.map(lambda j: run(binary, checkout, nodes, pods, j[0], j[1], ratio, Path(tmp)), jobs))
