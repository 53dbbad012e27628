"""Trace replay: a GPU cluster trace (the Alibaba 2023 "openb" format) through the platform's own
decision cores — quota (:class:`QuotaCore`), scheduler (:class:`SchedulerCore`) and the sim
backend (:class:`SimExecutorCore`) — in one process on a virtual clock.

* nodes from a node list (``sn, cpu_milli, memory_mib, gpu, model``; by default
  ``openb_node_list_gpu_node.csv`` of a trace directory): one sharable GPU flavor ``gpu`` for the
  whole cluster, each node's ``model`` its ``gpu_product``;
* tasks from a pod list (by default ``openb_pod_list_default.csv``): requests (``num_gpu``,
  ``gpu_milli`` for a fraction of one GPU, ``cpu_milli``, ``memory_mib``), ``gpu_spec`` (GPU
  models separated by ``|``, any one of them: the job's ``gpu_models``), and for replay the
  arrival at ``creation_time`` and runtime ``deletion_time - scheduled_time``. CPU-only tasks
  (``num_gpu`` 0) are kept: they take CPU and memory on the GPU nodes. Tasks that never ran in
  the trace (no ``scheduled_time``) are left out of replay, and counted;
* one queue with quota for the whole cluster, so the scheduler's placement policy is what the
  replay measures.

Two modes:

* **replay**: tasks arrive and leave as traced; reports allocation rate, the share of GPU
  capacity left unallocated while tasks wait, fragmentation over time, wait percentiles and
  job completion times;
* **inflation** (Weng et al., ATC '23, section 6): tasks arrive one a second and never leave,
  until the requested GPUs reach ``ratio`` × capacity; reports the allocation rate and
  unallocated share against arrived demand. How the tasks are drawn and how the curve is read
  is the ``protocol`` (docs/scheduling.md, "Trace replay").
"""

from __future__ import annotations

import csv
import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from schemas import (
    Event,
    FlavorQuota,
    JobAdmitted,
    JobScheduled,
    JobSpec,
    JobSubmitted,
    JobSucceeded,
    QueueConfigured,
    new_event,
)
from schemas.node import NodeInfo
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import PreemptionLimits, SchedulerCore
from services.scheduler.fragmentation import measure
from services.scheduler.inventory import MILLI
from services.scheduler.placement import Policy, Workload

NODE_FILE = "openb_node_list_gpu_node.csv"
POD_FILE = "openb_pod_list_default.csv"
FLAVOR = "gpu"
QUEUE = "trace"
TEAM = "trace"
T0 = datetime(2023, 1, 1, tzinfo=UTC)
MAX_RUNTIME_S = 90 * 86_400  # JobSpec's limit; longer traced runtimes are cut to it
NEVER_S = 90 * 86_400


class TraceError(ValueError):
    """The trace is missing or malformed: which file, which row, what was wrong."""


@dataclass(frozen=True)
class Task:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    gpu_milli: int | None  # a fraction of one GPU
    models: tuple[str, ...]
    created: float  # seconds from the trace start
    runtime: float | None  # None: never ran in the trace
    scheduled: float | None = None  # seconds from the trace start; None: never ran
    qos: str = ""  # the trace's class of service (LS, BE, Burstable, Guaranteed), when it has one

    @property
    def milli(self) -> int:
        """GPU thousandths requested."""
        return self.gpu_milli if self.gpu_milli is not None else self.gpus * MILLI

    @property
    def demand(self) -> float:
        """GPUs requested (a fraction counts as its share)."""
        return self.milli / MILLI


@dataclass
class Trace:
    nodes: list[NodeInfo]
    tasks: list[Task]  # in the pod list's order (by arrival where it has creation times)
    timed: bool = True  # the pod list has the time columns (replay needs them)

    @property
    def capacity(self) -> int:
        return sum(n.gpu_count for n in self.nodes)

    @property
    def gpu_tasks(self) -> list[Task]:
        return [t for t in self.tasks if t.gpus > 0]

    @property
    def cpu_only(self) -> int:
        return sum(1 for t in self.tasks if t.gpus == 0)


def _int(row: dict, key: str, where: str, default: int | None = None) -> int:
    raw = (row.get(key) or "").strip()
    if raw == "" and default is not None:
        return default
    try:
        return int(float(raw))
    except ValueError:
        raise TraceError(f"{where}: column {key!r} is {raw!r}; accepted: an integer") from None


def _rows(path: Path, required: tuple[str, ...]) -> tuple[list[str], Iterable[tuple[int, dict]]]:
    try:
        handle = path.open(newline="")
    except OSError as err:
        raise TraceError(f"{path}: {err.strerror}; give a node list and a pod list (or a trace directory holding "
                         f"{NODE_FILE} and {POD_FILE})") from None
    with handle:
        reader = csv.DictReader(handle)
        header = list(reader.fieldnames or ())
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(f"{path}: missing column(s) {missing}; accepted header: {', '.join(required)}")
        return header, list(enumerate(reader, start=2))


NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
TIME_COLUMNS = ("creation_time", "deletion_time", "scheduled_time")


def load_trace(directory: Path | None = None, *, nodes: Path | None = None, pods: Path | None = None) -> Trace:
    """A trace from a directory in the openb layout, or from a node list and a pod list by path
    (each given path overrides the directory's file). A pod list without the time columns
    loads (inflation does not use them); replay refuses it."""
    if nodes is None or pods is None:
        if directory is None:
            raise TraceError("give a trace directory, or both a node list and a pod list")
        nodes, pods = nodes or directory / NODE_FILE, pods or directory / POD_FILE
    infos = []
    _, rows = _rows(nodes, NODE_COLUMNS)
    for line, row in rows:
        where = f"{nodes}:{line}"
        gpus = _int(row, "gpu", where)
        if gpus <= 0:
            continue
        infos.append(NodeInfo(
            name=row["sn"].strip().lower(), gpu_flavor=FLAVOR, gpu_product=row["model"].strip(), gpu_count=gpus,
            cpu_millis=_int(row, "cpu_milli", where), memory_mib=_int(row, "memory_mib", where), gpu_sharable=True,
        ))
    if not infos:
        raise TraceError(f"{nodes}: no GPU nodes")
    header, rows = _rows(pods, POD_COLUMNS)
    timed = all(c in header for c in TIME_COLUMNS)
    tasks = []
    for line, row in rows:
        where = f"{pods}:{line}"
        gpus = _int(row, "num_gpu", where)
        if gpus < 0:
            raise TraceError(f"{where}: column 'num_gpu' is {gpus}; accepted: 0 or more")
        milli = _int(row, "gpu_milli", where, default=MILLI)
        runtime, created, scheduled = None, 0.0, None
        if timed:
            created = float(_int(row, "creation_time", where))
            if (row.get("scheduled_time") or "").strip() and (row.get("deletion_time") or "").strip():
                scheduled = float(_int(row, "scheduled_time", where))
                runtime = float(max(1, _int(row, "deletion_time", where) - scheduled))
        tasks.append(Task(
            name=row["name"].strip(), cpu_milli=max(1, _int(row, "cpu_milli", where)),
            memory_mib=max(1, _int(row, "memory_mib", where)), gpus=gpus,
            gpu_milli=milli if gpus == 1 and 0 < milli < MILLI else None,
            models=tuple(m.strip() for m in (row.get("gpu_spec") or "").split("|") if m.strip()),
            created=created, runtime=runtime, scheduled=scheduled, qos=(row.get("qos") or "").strip(),
        ))
    if timed:
        tasks.sort(key=lambda t: (t.created, t.name))
    return Trace(nodes=infos, tasks=tasks, timed=timed)


def workload_of(tasks: Iterable[Task]) -> dict[int, float]:
    """The trace's workload distribution as FGD's size classes (GPUs, or -thousandths)."""
    counts: dict[int, int] = {}
    for t in tasks:
        c = -t.gpu_milli if t.gpu_milli is not None else t.gpus
        counts[c] = counts.get(c, 0) + 1
    total = sum(counts.values()) or 1
    return {c: n / total for c, n in sorted(counts.items())}


def cpu_workload_of(tasks: Iterable[Task]) -> Workload:
    """The trace's workload as (size class, CPU request, GPU models) keys: FGD's CPU- and
    model-aware measure."""
    counts: dict[tuple[int, int, frozenset[str]], int] = {}
    for t in tasks:
        key = (-t.gpu_milli if t.gpu_milli is not None else t.gpus, t.cpu_milli, frozenset(t.models))
        counts[key] = counts.get(key, 0) + 1
    total = sum(counts.values()) or 1
    return Workload.of_requests({k: n / total for k, n in sorted(counts.items())})


# -- the replay loop ---------------------------------------------------------------------------


def decide_until_quiet(cores, feed: Callable[[list[Event]], None], now: datetime, max_rounds: int) -> bool:
    """Let each core decide at ``now`` and ``feed`` its decisions to all of them, until none
    decides anything new (the log's duplicate window is not needed: each core decides only what
    is not yet in its state). False when they still decide after ``max_rounds`` rounds."""
    for _ in range(max_rounds):
        decided = False
        for core in cores:
            out = core.decide(now)
            if out:
                decided = True
                feed(out)
        if not decided:
            return True
    return False


@dataclass
class Platform:
    """The three cores and the log between them, on a virtual clock."""

    quota: QuotaCore
    scheduler: SchedulerCore
    executor: SimExecutorCore
    log_size: int = 0
    scheduled_at: dict[str, datetime] = field(default_factory=dict)
    finished_at: dict[str, datetime] = field(default_factory=dict)

    def cores(self):
        return (self.quota, self.scheduler, self.executor)

    def feed(self, events: Iterable[Event]) -> None:
        for event in events:
            self.log_size += 1
            for core in self.cores():
                core.evolve(event)
            if isinstance(event, JobScheduled):
                self.scheduled_at[event.aggregate_id] = event.occurred_at
            elif isinstance(event, JobSucceeded):
                self.finished_at[event.aggregate_id] = event.occurred_at

    def settle(self, now: datetime, max_rounds: int = 100) -> None:
        if not decide_until_quiet(self.cores(), self.feed, now, max_rounds):
            raise RuntimeError(f"the cores are still deciding at {now.isoformat()} after {max_rounds} rounds")

    def next_end(self) -> datetime | None:
        return self.executor.next_end()


def _spec(task: Task, runtime: float | None) -> JobSpec:
    return JobSpec(
        kind="batch", queue=QUEUE, team=TEAM, priority_class="batch-low", image="trace", gpus=task.gpus,
        gpu_milli=task.gpu_milli, cpu_millis=min(task.cpu_milli, 1_024_000), memory_mib=task.memory_mib,
        gpu_models=task.models,
        expected_runtime_seconds=min(runtime, MAX_RUNTIME_S) if runtime is not None else NEVER_S,
    )


def _arrive(job_id: str, task: Task, runtime: float | None, seq: int, now: datetime) -> list[Event]:
    sub = new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=now, key=str(seq),
                    spec=_spec(task, runtime), submitter="trace", intake_sequence=seq)
    adm = new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=now, key="decision",
                    cause=sub, queue=QUEUE, priority=100, preemptible=True)
    return [sub, adm]


def build_platform(trace: Trace, policy: Policy, cpu_aware: bool = True) -> Platform:
    workload = cpu_workload_of(trace.gpu_tasks) if cpu_aware else workload_of(trace.gpu_tasks)
    scheduler = SchedulerCore(policy, preemption=PreemptionLimits(enabled=False), workload=workload, explain=False)
    p = Platform(QuotaCore(), scheduler, SimExecutorCore(trace.nodes))
    p.feed([new_event(QueueConfigured, aggregate_id=QUEUE, producer="config", occurred_at=T0, key="replay",
                      name=QUEUE, allowed_teams=(TEAM,),
                      quotas=(FlavorQuota(flavor=FLAVOR, nominal=1_000_000),))])
    p.settle(T0)  # the sim backend registers the nodes
    return p


@dataclass
class Sample:
    t: float  # seconds from the start
    allocated: float  # GPUs allocated (fractions as their share)
    waiting: int  # tasks arrived and not placed
    fragmentation: float  # the fragmentation ratio of the flavor
    arrived_demand: float = 0.0  # GPUs requested by the tasks arrived so far
    fgd_fragmentation: float | None = None  # FGD's measure (computed at sampled steps only)


def _allocated(p: Platform) -> float:
    return sum(MILLI * len(n.free) - sum(n.free) for n in p.scheduler.state.inventory.nodes.values()) / MILLI


def _sample(p: Platform, t: float, waiting: int, demand: float = 0.0, fgd: bool = False) -> Sample:
    index = p.scheduler.state.inventory.flavor(FLAVOR)
    frag = measure(FLAVOR, index, p.scheduler.state.sizes.get(FLAVOR, {})).ratio
    return Sample(t=t, allocated=_allocated(p), waiting=waiting, fragmentation=frag, arrived_demand=demand,
                  fgd_fragmentation=fgd_fragmentation(p) if fgd else None)


def fgd_fragmentation(p: Platform) -> float:
    """FGD's measure over the cluster: the expected share of free GPU capacity that a task drawn
    from the trace's workload could not use where it lies (CPU-aware)."""
    workload = p.scheduler.workload_distribution(FLAVOR)
    free = frag = 0.0
    for n in p.scheduler.state.inventory.nodes.values():
        f = sum(n.free)
        if not f:
            continue
        free += f
        cpu = n.info.cpu_millis - n.used_cpu if n.info.cpu_millis else None
        frag += workload.fragmentation(n.free, cpu, n.info.gpu_product)
    return round(frag / free, 4) if free else 0.0


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = sorted(values)

    def q(x: float) -> float:
        return v[min(len(v) - 1, int(x * (len(v) - 1) + 0.5))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(v) / len(v)}


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _series(samples: list[Sample], capacity: int, points: int = 40) -> list[dict]:
    if not samples:
        return []
    step = max(1, len(samples) // points)
    picked = [s for s in samples if s.fgd_fragmentation is not None] or samples[::step]
    return [{"t": s.t, "allocation": round(s.allocated / capacity, 4), "fragmentation": round(s.fragmentation, 4),
             "fgd_fragmentation": s.fgd_fragmentation, "waiting": s.waiting} for s in picked]


def replay(trace: Trace, policy: Policy, *, limit: int | None = None,
           progress: Callable[[int], None] | None = None) -> dict:
    """Tasks arrive and leave as traced."""
    if not trace.timed:
        raise TraceError(f"replay needs the pod list's time columns ({', '.join(TIME_COLUMNS)}); "
                         "without them, run inflation (--inflation RATIO)")
    p = build_platform(trace, policy)
    tasks = [t for t in trace.tasks if t.runtime is not None][:limit]
    never_ran = sum(1 for t in trace.tasks if t.runtime is None)
    capacity = trace.capacity
    arrivals = [(t.created, i) for i, t in enumerate(tasks)]
    heapq.heapify(arrivals)
    created: dict[str, float] = {}
    runtimes: dict[str, float] = {}
    samples: list[Sample] = []
    busy_area = idle_while_waiting = waiting_time = 0.0
    last: Sample | None = None
    steps, every = 0, max(1, 2 * len(tasks) // 40)  # FGD's measure at about 40 steps
    while arrivals or p.next_end() is not None:
        next_arrival = arrivals[0][0] if arrivals else None
        end = p.next_end()
        end_s = (end - T0).total_seconds() if end is not None else None
        t = min(x for x in (next_arrival, end_s) if x is not None)
        now = T0 + timedelta(seconds=t)
        batch = []
        while arrivals and arrivals[0][0] <= t:
            _, i = heapq.heappop(arrivals)
            task = tasks[i]
            job_id = f"t{i}"
            created[job_id] = task.created
            runtimes[job_id] = min(task.runtime, MAX_RUNTIME_S)  # type: ignore[arg-type]
            batch += _arrive(job_id, task, task.runtime, i + 1, now)
        p.feed(batch)
        p.settle(now)
        if progress is not None and batch:
            progress(len(batch) // 2)
        if last is not None:
            dt = t - last.t
            busy_area += last.allocated * dt
            if last.waiting:
                idle_while_waiting += (capacity - last.allocated) * dt
                waiting_time += dt
        waiting = len(created) - len(p.scheduled_at)
        steps += 1
        last = _sample(p, t, waiting, fgd=steps % every == 1 or not (arrivals or p.next_end()))
        samples.append(last)
    span = samples[-1].t - samples[0].t if len(samples) > 1 else 0.0
    waits = [(p.scheduled_at[j] - T0).total_seconds() - created[j] for j in p.scheduled_at if j in created]
    jct = [(p.finished_at[j] - T0).total_seconds() - created[j] for j in p.finished_at if j in created]
    return {
        "policy": policy.value, "mode": "replay", "tasks": len(tasks), "capacity_gpus": capacity,
        "cpu_only": sum(1 for t in tasks if t.gpus == 0), "skipped": {"never_ran": never_ran},
        "placed": len(p.scheduled_at), "finished": len(p.finished_at),
        "allocation_rate": round(busy_area / (capacity * span), 4) if span else None,
        "unallocated_share_while_waiting": round(idle_while_waiting / (capacity * waiting_time), 4) if waiting_time else None,
        "time_with_waiting_share": round(waiting_time / span, 4) if span else None,
        "fragmentation_mean": round(sum(s.fragmentation for s in samples) / len(samples), 4) if samples else None,
        "fgd_fragmentation_mean": _mean([s.fgd_fragmentation for s in samples if s.fgd_fragmentation is not None]),
        "wait_s": {k: (round(v, 1) if v is not None else None) for k, v in _percentiles(waits).items()},
        "jct_s": {k: (round(v, 1) if v is not None else None) for k, v in _percentiles(jct).items()},
        "series": _series(samples, capacity),
        "events": p.log_size,
    }


PROTOCOLS = ("gpusched", "fgd")
"""How inflation draws its tasks and reads its curve (docs/scheduling.md, "Trace replay")."""


class Draws(Protocol):
    """A source of the two random choices the FGD protocol makes (``random.Random`` is one)."""

    def shuffle(self, x: list, /) -> None: ...

    def randrange(self, n: int, /) -> int: ...


def fgd_tasks(trace: Trace, *, ratio: float, seed: int, draws: Draws | None = None) -> list[Task]:
    """The FGD simulator's workload ("workload tuning", Weng et al., ATC '23): every task of the
    pod list, CPU-only ones included, sorted by name and shuffled with the seed; then tasks drawn
    uniformly with replacement from the whole list and appended (``<name>-tuned-<i>``) until the
    next draw would take the requested GPU thousandths past ``ratio`` × capacity. As in the peer,
    that test adds the drawn task's per-GPU share while the total adds all its GPUs. Below the
    list's own demand, tasks are removed from the end of the shuffled list instead. ``draws``
    defaults to Python's RNG seeded with ``seed``: the same construction as the peer, not its
    sequence; bench.placement passes Go's draws (bench/gorand) to get the peer's very tasks."""
    rng = draws if draws is not None else random.Random(seed)
    base = sorted(trace.tasks, key=lambda t: t.name)
    order = list(base)
    rng.shuffle(order)
    target = ratio * trace.capacity * MILLI
    total = sum(t.milli for t in base)
    while total > target and order:
        total -= order.pop().milli
    i = 0
    while total < target:
        task = base[rng.randrange(len(base))]
        per_gpu = (task.gpu_milli or MILLI) if task.gpus else 0
        if total + per_gpu > target:
            break
        total += task.milli
        order.append(replace(task, name=f"{task.name}-tuned-{i}"))
        i += 1
    return order


def fgd_curve(rows: list[tuple[int, int]], capacity: int, top: int = 130) -> dict[int, float]:
    """The FGD simulator's reading of a run (its experiments/analysis/merge_alloc_discrete.py):
    one row per task tried, (arrived GPU thousandths, failed tasks included; allocated GPU
    thousandths after it). Each row's arrived percentage is rounded to an integer (half to even,
    Python's round), its allocation percentage to two decimals; each integer percentage gets the
    mean allocation of its rows, or of the rows within ±1 when it has none."""
    buckets: dict[int, list[float]] = {}
    for arrived, used in rows:
        buckets.setdefault(round(arrived / capacity / 10), []).append(round(used / capacity / 10, 2))
    out = {}
    for pct in range(top + 1):
        values = buckets.get(pct) or [v for k in (pct - 1, pct, pct + 1) for v in buckets.get(k, ())]
        if values:
            out[pct] = round(sum(values) / len(values), 2)
    return out


def inflation(trace: Trace, policy: Policy, *, ratio: float, seed: int, steps: int = 13, protocol: str = "gpusched",
              progress: Callable[[int], None] | None = None, draws: Draws | None = None) -> dict:
    """Tasks arrive one a second and never leave, until the requested GPUs reach ``ratio`` ×
    capacity. ``protocol`` "gpusched": tasks with GPUs sampled independently (with replacement,
    seeded) from the trace; the allocation rate and unallocated share read at each 1/``steps``
    of the target. "fgd": the FGD simulator's workload (:func:`fgd_tasks`) and its reading of the
    curve (:func:`fgd_curve`), in percent of GPU capacity per integer percent of arrived demand."""
    if not 0 < ratio <= 10:
        raise ValueError(f"--inflation {ratio} is out of range; accepted: 0 < RATIO <= 10 (the paper uses 1.3)")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not known; accepted: {', '.join(PROTOCOLS)}")
    if protocol == "fgd":
        return _inflation_fgd(trace, policy, ratio=ratio, seed=seed, progress=progress, draws=draws)
    rng = random.Random(seed)
    p = build_platform(trace, policy)
    capacity = trace.capacity
    target = ratio * capacity
    demand = 0.0
    i = 0
    marks = [target * (k + 1) / steps for k in range(steps)]
    curve = []
    gpu_tasks = trace.gpu_tasks
    while demand < target:
        task = rng.choice(gpu_tasks)
        i += 1
        now = T0 + timedelta(seconds=i)
        p.feed(_arrive(f"s{i}", task, None, i, now))
        p.settle(now)
        demand += task.demand
        if progress is not None:
            progress(1)
        while marks and demand >= marks[0]:
            marks.pop(0)
            allocated = _allocated(p)
            frag = measure(FLAVOR, p.scheduler.state.inventory.flavor(FLAVOR), p.scheduler.state.sizes.get(FLAVOR, {}))
            curve.append({"arrived_demand": round(demand / capacity, 4), "allocation": round(allocated / capacity, 4),
                          "unallocated": round(1 - allocated / capacity, 4), "fragmentation": round(frag.ratio, 4),
                          "fgd_fragmentation": fgd_fragmentation(p), "waiting": i - len(p.scheduled_at)})
    allocated = _allocated(p)
    return {
        "policy": policy.value, "mode": "inflation", "protocol": "gpusched", "ratio": ratio, "seed": seed,
        "arrived_tasks": i,
        "capacity_gpus": capacity, "arrived_demand": round(demand / capacity, 4),
        "allocation_rate": round(allocated / capacity, 4), "unallocated_share": round(1 - allocated / capacity, 4),
        "placed": len(p.scheduled_at), "curve": curve, "events": p.log_size,
    }


def _inflation_fgd(trace: Trace, policy: Policy, *, ratio: float, seed: int,
                   progress: Callable[[int], None] | None = None, draws: Draws | None = None) -> dict:
    p = build_platform(trace, policy)
    capacity = trace.capacity
    rows: list[tuple[int, int]] = []
    arrived = 0
    tasks = fgd_tasks(trace, ratio=ratio, seed=seed, draws=draws)
    for i, task in enumerate(tasks, start=1):
        now = T0 + timedelta(seconds=i)
        arrived += task.milli  # before it is tried: a task that fits nowhere has arrived too
        p.feed(_arrive(f"s{i}", task, None, i, now))
        p.settle(now)
        rows.append((arrived, round(_allocated(p) * MILLI)))
        if progress is not None:
            progress(1)
    curve = fgd_curve(rows, capacity)
    at = {pct: curve.get(pct) for pct in (80, 90, 100, 110, 120, 130)}
    return {
        "policy": policy.value, "mode": "inflation", "protocol": "fgd", "ratio": ratio, "seed": seed,
        "arrived_tasks": len(tasks), "capacity_gpus": capacity, "arrived_demand": round(arrived / capacity / MILLI, 4),
        "allocation_rate": round(rows[-1][1] / capacity / MILLI, 4) if rows else 0.0,
        "unallocated_share": round(1 - rows[-1][1] / capacity / MILLI, 4) if rows else 1.0,
        "allocation_at_100": at[100], "placed": len(p.scheduled_at), "failed": len(tasks) - len(p.scheduled_at),
        "allocation_pct_by_arrived_pct": curve, "curve": [
            {"arrived_demand": pct / 100, "allocation": None if v is None else round(v / 100, 4)} for pct, v in at.items()],
        "events": p.log_size,
    }


# -- a small trace in the same format, for tests and for machines without the real one -------


def write_synthetic_trace(directory: Path, *, nodes: int = 40, tasks: int = 400, seed: int = 7) -> Path:
    """A trace shaped like openb (mixed models, mostly 1-GPU and fractional tasks, a few
    multi-GPU ones), generated here so that nothing is copied from the real one."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    models = [("T4", 2), ("G2", 8), ("V100M16", 8), ("P100", 2)]
    with (directory / NODE_FILE).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        for i in range(nodes):
            model, gpus = models[i % len(models)]
            w.writerow([f"synth-node-{i:04d}", 96000, 393216, gpus, model])
    with (directory / POD_FILE).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
                    "creation_time", "deletion_time", "scheduled_time"])
        t = 0
        for i in range(tasks):
            t += rng.randint(0, 120)
            gpus = rng.choices([0, 1, 1, 1, 2, 4, 8], weights=[10, 40, 20, 10, 5, 3, 2])[0]
            milli = rng.choice([1000, 1000, 500, 250, 460]) if gpus == 1 else (1000 if gpus else 0)
            runtime = rng.randint(60, 7200)
            w.writerow([f"synth-pod-{i:04d}", rng.choice([2000, 4000, 8000]), rng.choice([8192, 16384]), gpus, milli,
                        "", "BE", "Succeeded", t, t + runtime, t])
    return directory
