"""The local backend: the :class:`~services.executor.lifecycle.Backend` port over processes on
this host, one per gang member.

* Each gang member is one process (``spec.command + spec.args``; the image is not used), started
  through :mod:`services.executor.local_shim` in its own session, with
  ``CUDA_VISIBLE_DEVICES`` set to the member's ``gpu_indices`` (empty: no GPU), the job's env and
  ``GPUSCHED_JOB_ID`` / ``GPUSCHED_ATTEMPT`` / ``GPUSCHED_CHECKPOINT_DIR`` / ``GPUSCHED_RESUME``.
* Everything about a run lives in ``<root>/runs/<job>-a<attempt>-m<member>/``: ``log`` (stdout
  and stderr, read by ``gpusched logs ID``), ``started`` (pid and start time, written by the
  shim), ``exit.json`` (exit code or signal, finish time), ``stop.json`` (when the stop was
  asked and its grace). The directory's name is deterministic, so a restarted executor finds
  runs that are still going (adopts them; processes outlive it) and the outcomes of runs that
  ended while it was down, and never starts a run twice.
* Stop: SIGTERM to the process group, SIGKILL once the grace period (the checkpoint window) is
  over; max runtime: SIGTERM at the deadline, SIGKILL 10 s later, reported as deadline-exceeded.
* Inventory, utilization and memory telemetry from NVML (pynvml) every
  ``GPUSCHED_LOCAL_TELEMETRY_S``; with no NVIDIA driver or GPU it says so once and runs
  CPU-only (the node reports 0 GPUs; jobs that ask for none still run).
* Every ``GPUSCHED_TELEMETRY_INTERVAL_S`` (0: never) the samples taken in that window are
  averaged (:class:`TelemetryWindow`) into a :class:`~services.executor.lifecycle.TelemetryReport`,
  which the core publishes as NodeTelemetryReported. CPU-only mode reports nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import Gauge

from schemas import FailureReason
from schemas.node import GpuTelemetry, NodeInfo
from services.executor.gang import MemberStatus, attempt_observation
from services.executor.lifecycle import (
    Observation,
    Phase,
    Plan,
    TelemetryReport,
    Workload,
    flavor_of,
    workload_name,
)

log = logging.getLogger(__name__)

GPU_UTIL = Gauge("gpusched_gpu_utilization_ratio", "GPU utilization (NVML), 0..1", ["node", "gpu"])
GPU_MEM_USED = Gauge("gpusched_gpu_memory_used_bytes", "GPU memory in use (NVML)", ["node", "gpu"])
GPU_MEM_TOTAL = Gauge("gpusched_gpu_memory_total_bytes", "GPU memory (NVML)", ["node", "gpu"])
DEADLINE_KILL_AFTER_S = 10.0


def _now() -> datetime:
    return datetime.now(UTC)


def default_node_name() -> str:
    name = re.sub(r"[^a-z0-9.-]", "-", socket.gethostname().lower()).strip("-.")
    return name or "localhost"


# -- NVML ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    memory_total_mib: int
    memory_used_mib: int
    utilization: float  # 0..1
    power_w: float | None = None  # None: the device does not report it


class Nvml:
    """Inventory and telemetry through pynvml; ``available`` is False (with ``why``) without GPUs."""

    def __init__(self) -> None:
        self.available = False
        self.why = ""
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                import pynvml
            self._nvml = pynvml
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                self.why = "NVML reports no GPU"
            else:
                self.available = True
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.why = f"NVML is not available ({type(err).__name__}: {err})"

    def sample(self) -> list[GpuSample]:
        if not self.available:
            return []
        n = self._nvml
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            name = n.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = n.nvmlDeviceGetMemoryInfo(h)
            try:
                util = n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            except Exception:  # not supported on some (e.g. MIG) devices
                util = 0.0
            try:
                power = n.nvmlDeviceGetPowerUsage(h) / 1000.0  # milliwatts
            except Exception:  # not supported on some devices
                power = None
            out.append(GpuSample(i, name, mem.total // 2 ** 20, mem.used // 2 ** 20, util, power))
        return out


@dataclass
class _GpuSums:
    samples: int = 0
    utilization: float = 0.0
    memory_used_max: int = 0
    memory_total: int = 0
    power: float = 0.0
    power_samples: int = 0
    allocated: int = 0
    allocated_utilization: float = 0.0


@dataclass
class TelemetryWindow:
    """The samples of one report window, ``[start, end)``: per GPU the mean utilization (of all
    samples, and of those taken while the GPU was allocated), the peak memory in use and the mean
    power. Pure: no NVML, no clock."""

    start: datetime
    _gpus: dict[int, _GpuSums] = field(default_factory=dict)

    def add(self, samples: list[GpuSample], allocated: frozenset[int] = frozenset()) -> None:
        """One sampling pass; ``allocated``: GPU indices a live attempt's placement holds now."""
        for g in samples:
            t = self._gpus.setdefault(g.index, _GpuSums())
            t.samples += 1
            t.utilization += g.utilization
            t.memory_used_max = max(t.memory_used_max, g.memory_used_mib)
            t.memory_total = g.memory_total_mib
            if g.power_w is not None:
                t.power += g.power_w
                t.power_samples += 1
            if g.index in allocated:
                t.allocated += 1
                t.allocated_utilization += g.utilization

    def gpus(self, gpu_count: int) -> tuple[GpuTelemetry, ...]:
        """The window's figures, for the GPUs the node still has (index below ``gpu_count``)."""
        out = []
        for index in sorted(self._gpus):
            t = self._gpus[index]
            if index >= gpu_count or t.memory_total < 1:
                continue
            out.append(GpuTelemetry(
                index=index, samples=t.samples, utilization=_ratio(t.utilization / t.samples),
                memory_used_mib=min(t.memory_used_max, t.memory_total), memory_total_mib=t.memory_total,
                power_w=t.power / t.power_samples if t.power_samples else None,
                allocated_samples=t.allocated,
                allocated_utilization=_ratio(t.allocated_utilization / t.allocated) if t.allocated else None))
        return tuple(out)


def _ratio(x: float) -> float:
    return min(1.0, max(0.0, x))  # float sums may land a hair outside 0..1


def host_node(name: str, gpus: list[GpuSample]) -> NodeInfo:
    mem_mib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_mib = int(line.split()[1]) // 1024
    except OSError:
        pass
    product = re.sub(r"\s+", "-", gpus[0].name.strip()) if gpus else None
    return NodeInfo(
        name=name, gpu_flavor=flavor_of(product) if gpus else None, gpu_product=product, gpu_count=len(gpus),
        gpu_memory_mib=min(g.memory_total_mib for g in gpus) if gpus else None,
        cpu_millis=(os.cpu_count() or 1) * 1000, memory_mib=mem_mib, labels={"kubernetes.io/hostname": name},
    )


# -- runs ----------------------------------------------------------------------------------------

class LocalBackend:
    def __init__(self, root: Path, *, node_name: str | None = None, telemetry_s: float = 10.0,
                 telemetry_interval_s: float = 60.0, checkpoint_root: Path | None = None,
                 nvml: Nvml | None = None) -> None:
        self.root = Path(root)
        self.runs = self.root / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = checkpoint_root or self.root / "checkpoints"
        self.node_name = node_name or default_node_name()
        self.telemetry_s = telemetry_s
        self.telemetry_interval_s = telemetry_interval_s  # 0: no NodeTelemetryReported
        self.nvml = nvml or Nvml()
        self._last_sample = 0.0
        self._gpus: list[GpuSample] = []
        self._window: TelemetryWindow | None = None
        self._procs: dict[str, subprocess.Popen] = {}  # runs this process started (reaped here)
        if not self.nvml.available:
            log.warning("no GPU on this host: CPU-only mode; the node reports 0 GPUs and only jobs asking "
                        "for none can be placed here", extra={"why": self.nvml.why, "node": self.node_name})

    def start(self) -> None:
        # Inventory only: which GPUs live attempts hold is known from the first plan on.
        self._telemetry(_now(), force=True, into_window=False)

    def close(self) -> None:
        pass

    def _telemetry(self, now: datetime, allocated: frozenset[int] = frozenset(), force: bool = False,
                   into_window: bool = True) -> None:
        if not force and time.monotonic() - self._last_sample < self.telemetry_s:
            return
        self._last_sample = time.monotonic()
        try:
            self._gpus = self.nvml.sample()
        except Exception as err:
            log.warning("NVML sample failed", extra={"error": repr(err)})
            return
        if self._gpus and self.telemetry_interval_s > 0 and into_window:
            if self._window is None:
                self._window = TelemetryWindow(start=now)
            self._window.add(self._gpus, allocated)
        for g in self._gpus:
            GPU_UTIL.labels(self.node_name, str(g.index)).set(g.utilization)
            GPU_MEM_USED.labels(self.node_name, str(g.index)).set(g.memory_used_mib * 2 ** 20)
            GPU_MEM_TOTAL.labels(self.node_name, str(g.index)).set(g.memory_total_mib * 2 ** 20)

    def _allocated(self, plan: Plan) -> frozenset[int]:
        """GPU indices of this host that live attempts' placements hold (what CUDA_VISIBLE_DEVICES gets)."""
        return frozenset(i for w in plan.workloads for p in w.placement
                         if p.node == self.node_name for i in p.gpu_indices[: p.gpus])

    def _close_window(self, now: datetime) -> TelemetryReport | None:
        """The report of the window that ``now`` ends, if it is due; the next window starts at ``now``."""
        w = self._window
        if w is None or self.telemetry_interval_s <= 0:
            return None
        span = (now - w.start).total_seconds()
        if span < self.telemetry_interval_s:
            if span < 0:  # the clock stepped back: start again from here
                self._window = TelemetryWindow(start=now)
            return None
        self._window = TelemetryWindow(start=now)  # windows follow each other without a gap
        if span > 2 * self.telemetry_interval_s:
            # The loop stalled (or the clock jumped): the samples do not cover the window.
            log.warning("telemetry window dropped: it was not closed in time",
                        extra={"node": self.node_name, "window_s": span})
            return None
        gpus = w.gpus(len(self._gpus))
        if not gpus:
            return None
        return TelemetryReport(node=self.node_name, window_start=w.start, window_end=now,
                               gpu_count=len(self._gpus), gpus=gpus)

    def run_dir(self, job_id: str, attempt: int, member: int) -> Path:
        return self.runs / workload_name(job_id, attempt, member)

    # -- the Backend port -----------------------------------------------------------------------
    def reachable(self) -> bool:
        """This host: always."""
        return True

    def inventory(self) -> list[NodeInfo]:
        return [host_node(self.node_name, self._gpus)]

    def create(self, plan: Plan, now: datetime) -> int:
        for pid_run, proc in list(self._procs.items()):
            if proc.poll() is not None:
                del self._procs[pid_run]
        created = 0
        for w in plan.run:
            for i in range(len(w.placement)):
                d = self.run_dir(w.job_id, w.attempt, i)
                if not d.exists():
                    self._launch(w, i, d)
                    created += 1
                else:
                    self._enforce_deadline(w, d)
        return created

    def stop(self, plan: Plan, now: datetime) -> int:
        stopped = 0
        for s in plan.stop:
            for i in range(len(s.workload.placement)):
                d = self.run_dir(s.workload.job_id, s.workload.attempt, i)
                if d.exists():
                    stopped += self._stop(d, s.grace_seconds)
        if not plan.complete:
            return stopped
        keep_names = {workload_name(w.job_id, w.attempt, i) for w in plan.workloads for i in range(len(w.placement))}
        for d in self.runs.iterdir():
            if d.name not in keep_names and self._alive(d):
                log.info("stopping orphan run", extra={"run": d.name})
                stopped += self._stop(d, 30.0)
        return stopped

    def observe(self, plan: Plan, now: datetime) -> tuple[list[Observation], list[TelemetryReport]]:
        """Every attempt of the plan from its run directories, and the telemetry window that
        ``now`` closes (then a new sample, into the next window)."""
        report = self._close_window(now)
        self._telemetry(now, self._allocated(plan))
        stopping = {(s.workload.job_id, s.workload.attempt) for s in plan.stop}
        observations = []
        for w in plan.workloads:
            obs = self._observe(w, now, started_in_log=w.started_at is not None,
                                stopping=(w.job_id, w.attempt) in stopping)
            if obs is not None:
                observations.append(obs)
        return observations, [report] if report is not None else []

    def _launch(self, w: Workload, member: int, d: Path) -> None:
        d.mkdir(parents=True)
        p = w.placement[member]
        spec = w.spec
        argv = [*spec.command, *spec.args]
        ckpt = self.checkpoint_root / spec.team / w.job_id
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
        env.update(spec.env)
        env.update({
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in p.gpu_indices[: p.gpus]) if p.gpus else "",
            "GPUSCHED_JOB_ID": w.job_id, "GPUSCHED_ATTEMPT": str(w.attempt),
            "GPUSCHED_CHECKPOINT_DIR": str(ckpt), "GPUSCHED_RESUME": "1" if w.resume else "0",
            "GPUSCHED_GANG_SIZE": str(len(w.placement)), "GPUSCHED_GANG_INDEX": str(member),
        })
        meta = {"job_id": w.job_id, "attempt": w.attempt, "member": member, "argv": argv,
                "max_runtime_seconds": spec.max_runtime_seconds, "gpus": list(p.gpu_indices)}
        (d / "run.json").write_text(json.dumps(meta))
        if not argv:
            _write_json(d / "exit.json", {"error": "the local backend runs spec.command (+ args); this job has "
                                                   "none", "finished_at": _now().isoformat()})
            return
        ckpt.mkdir(parents=True, exist_ok=True)
        logf = open(d / "log", "ab")
        try:
            proc = subprocess.Popen([sys.executable, "-m", "services.executor.local_shim", str(d), "--", *argv],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    cwd=str(ckpt), start_new_session=True)
        finally:
            logf.close()
        self._procs[d.name] = proc
        (d / "pgid").write_text(str(proc.pid))

    def _pgid(self, d: Path) -> int | None:
        try:
            return int((d / "pgid").read_text())
        except (OSError, ValueError):
            return None

    def _alive(self, d: Path) -> bool:
        if (d / "exit.json").exists():
            return False
        pgid = self._pgid(d)
        if pgid is None:
            return False
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        proc = self._procs.get(d.name)
        if proc is not None and proc.poll() is not None:
            return False
        return True

    def _signal(self, d: Path, sig: int) -> None:
        pgid = self._pgid(d)
        if pgid is not None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass

    def _stop(self, d: Path, grace: float) -> int:
        """SIGTERM now, SIGKILL after ``grace``; the request is recorded, so a restart keeps the deadline."""
        if not self._alive(d):
            return 0
        stop_file = d / "stop.json"
        if stop_file.exists():
            req = json.loads(stop_file.read_text())
            deadline = req["at"] + req["grace"]
            if req["grace"] > grace:  # a later, shorter stop (cancel after preempt) wins
                deadline = min(deadline, time.time() + grace)
                _write_json(stop_file, {"at": time.time(), "grace": grace})
        else:
            _write_json(stop_file, {"at": time.time(), "grace": grace})
            self._signal(d, signal.SIGTERM)
            deadline = time.time() + grace
        if time.time() >= deadline:
            self._signal(d, signal.SIGKILL)
            self._reap(d)
            if not (d / "exit.json").exists():
                _write_json(d / "exit.json", {"signal": int(signal.SIGKILL), "killed_after_grace": True,
                                              "finished_at": _now().isoformat()})
        return 1

    def _enforce_deadline(self, w: Workload, d: Path) -> None:
        limit = w.spec.max_runtime_seconds
        if limit is None or not self._alive(d):
            return
        started = _read_json(d / "started")
        if started is None:
            return
        elapsed = time.time() - datetime.fromisoformat(started["at"]).timestamp()
        if elapsed < limit:
            return
        if not (d / "deadline.json").exists():
            _write_json(d / "deadline.json", {"at": time.time()})
            self._signal(d, signal.SIGTERM)
        elif time.time() - _read_json(d / "deadline.json")["at"] >= DEADLINE_KILL_AFTER_S:
            self._signal(d, signal.SIGKILL)
            self._reap(d)

    def _reap(self, d: Path) -> None:
        proc = self._procs.get(d.name)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _observe(self, w: Workload, now: datetime, started_in_log: bool, stopping: bool) -> Observation | None:
        members = []
        for i in range(len(w.placement)):
            d = self.run_dir(w.job_id, w.attempt, i)
            if not d.exists():
                members.append(None)
                continue
            members.append(self._member(d, now))
        return attempt_observation(w.job_id, w.attempt, members, seen=[False] * len(members),
                                   started_in_log=started_in_log, stopping=stopping, now=now)

    def _member(self, d: Path, now: datetime) -> MemberStatus:
        started = _read_json(d / "started")
        started_at = datetime.fromisoformat(started["at"]) if started else None
        ex = _read_json(d / "exit.json")
        if ex is None and not self._alive(d) and (d / "pgid").exists():
            # The shim is gone without writing its exit (killed with the executor's host?).
            _write_json(d / "exit.json", {"error": "the process vanished without an exit status",
                                          "finished_at": now.isoformat()})
            ex = _read_json(d / "exit.json")
        if ex is None:
            if not started:
                return MemberStatus(Phase.PENDING)
            # no readiness probe here: a running process is ready (after the service's delay)
            return MemberStatus(Phase.RUNNING, started_at, started_at, ready_at=started_at)
        at = datetime.fromisoformat(ex["finished_at"])
        if "error" in ex:
            return MemberStatus(Phase.FAILED, at, started_at, FailureReason.BACKEND_ERROR, None, ex["error"])
        code = ex.get("exit_code")
        sig = ex.get("signal")
        if (d / "deadline.json").exists():
            return MemberStatus(Phase.FAILED, at, started_at, FailureReason.DEADLINE_EXCEEDED,
                                code if code is not None else 128 + (sig or 9), "ran past its max runtime")
        if code == 0:
            return MemberStatus(Phase.SUCCEEDED, at, started_at, exit_code=0)
        if sig is not None:
            return MemberStatus(Phase.FAILED, at, started_at, FailureReason.EXIT_CODE, 128 + sig,
                                f"killed by signal {sig}" + (" after the grace period" if ex.get("killed_after_grace")
                                                             else ""))
        return MemberStatus(Phase.FAILED, at, started_at, FailureReason.EXIT_CODE, code, f"exited with code {code}")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_log(root: Path, job_id: str, attempt: int | None = None) -> list[tuple[str, str]]:
    """(run name, log text) of a job's runs, attempt by attempt (``gpusched logs ID``)."""
    runs = Path(root) / "runs"
    out = []
    for d in sorted(runs.glob("*"), key=lambda p: p.name):
        meta = _read_json(d / "run.json")
        if not meta or meta["job_id"] != job_id or (attempt is not None and meta["attempt"] != attempt):
            continue
        try:
            text = (d / "log").read_text(errors="replace")
        except OSError:
            text = ""
        out.append((d.name, text))
    return out
