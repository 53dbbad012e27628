"""Scale simulation: 100,000 GPUs in 10 clusters through the decision cores on a virtual clock.

    python -m bench.scale [--gpus 100000] [--clusters 10] [--runs 1] [--json PATH] (--help: every option)

The platform's cores in one process, no NATS (what the services fold and decide, not what the
pipeline between them costs): admission, quota, the scheduler and one sim executor per cluster,
each folding the whole log as each cluster's executor does. ``--clusters`` clusters of
``--gpus`` ÷ 8 ÷ clusters nodes of 8 GPUs (bench.scheduler's nodes: a quarter h100, half a100, a
quarter l4; racks of 20, blocks of 200), registered by their cluster's executor as
``<node>.<cluster>`` with the cluster set. Ten teams, a queue each, in one cohort; the queues'
nominal quota adds up to ``--quota`` (0.85) of each flavor's GPUs: the headroom a platform of ten
clusters keeps to lose one.

1. burst: jobs asking ``--backlog`` (1.2) × the GPUs are submitted at once through admission's
   intake (bench.scheduler's mix, with gangs of 2-16 nodes; every job may take 3 attempts, the
   retry 30 s after a failure); each core's first cycle over them is timed;
2. steady: steps of one platform second; jobs end (the sim executors: lognormal runtimes, median
   ``--runtime``) and arrive (Poisson, offering ``--load`` × the GPUs), until no job waits for
   quota and ``--steady`` seconds have passed;
3. loss: the first cluster's executor falls silent (no ClusterReported, nothing decided). The
   scheduler declares the cluster lost ``cluster_lost_after_s`` (90 s) after its last report, the
   other executors end its attempts (``node-lost``), quota retries them after their backoff and
   the scheduler places them in the other clusters; the run ends when all are placed again.

Prints, per core, the wall time it spent folding events and deciding, and the events, decisions
and placements per second of that time beside the rate at which the same process parses the
events (every service parses each event before it folds it); the first cycle over the burst; the
steady steps' p50 and p99 beside the platform second each one covers; the peak RSS (ru_maxrss of
the run's own process: all the cores, the workload and this bench's bookkeeping); the GPUs
allocated beside the quota's ceiling; how long re-placing the lost cluster's work took in platform
seconds, scheduler cycles, decisions and wall time. Every gang is checked to stay inside one
cluster, and nothing to be placed on the lost cluster once it is lost.

A run at the default size takes about 6 minutes on the 2-core development machine, so one run
is the default; ``--runs 3`` gives medians (the workload is the same each run: only the times
differ). ``--gpus 8000 --clusters 4`` takes seconds (tests/unit/test_bench_scale.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from bench.scheduler import (
    TARGET_FIRST_CYCLE_S,
    TARGET_RSS_MIB,
    TARGET_STEADY_P99_MS,
    CollectorTime,
    beside,
    draw,
    in_fresh_process,
    node_infos,
    pct,
    summary,
)
from gpusched.sim.trace import decide_until_quiet
from schemas import (
    ClusterLost,
    Event,
    FlavorQuota,
    JobCancelled,
    JobFailed,
    JobPreempted,
    JobScheduled,
    JobSucceeded,
    QueueConfigured,
    QuotaReserved,
    dumps,
    new_event,
    parse_event,
)
from schemas.commands import Principal
from schemas.node import NodeInfo
from schemas.queue import CohortConfigured
from services.admission.domain import AdmissionCore
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.__main__ import freeze_state
from services.scheduler.domain import SchedulerCore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STEP = timedelta(seconds=1)
TEAMS = 10
GANGS = (2, 4, 8, 16)
GPUS_PER_NODE = 8
LOST_AFTER_S = 90.0  # the scheduler's default cluster_lost_after_s
HEARTBEAT_S = 15.0  # the executor's default ClusterReported interval
RETRY = {"max_attempts": 3, "backoff_seconds": 30}
MAX_PLATFORM_S = 6 * 3600  # the loss comes by then even if jobs still wait for quota
SAMPLE_EVERY = 10  # every tenth event of the log is kept to measure the parse rate


@dataclass
class Meter:
    """One core, and the wall time it spent folding events and deciding."""

    name: str
    core: object
    fold_s: float = 0.0
    decide_s: float = 0.0
    folded: int = 0
    decided: int = 0
    busy_cycles: int = 0  # decide calls that decided something
    step_s: float = 0.0  # fold and decide time in the current step
    longest: tuple[float, list[Event]] = (0.0, [])  # the longest decide call since it was reset

    def fold(self, events: list[Event]) -> None:
        t = time.perf_counter()
        for e in events:
            self.core.evolve(e)
        dt = time.perf_counter() - t
        self.fold_s += dt
        self.step_s += dt
        self.folded += len(events)

    def decide(self, now: datetime) -> list[Event]:
        t = time.perf_counter()
        out = self.core.decide(now)
        dt = time.perf_counter() - t
        self.decide_s += dt
        self.step_s += dt
        self.decided += len(out)
        self.busy_cycles += bool(out)
        if dt > self.longest[0]:
            self.longest = (dt, out)
        return out

    def timed(self, fn, *args):
        """``fn(*args)``, its time counted as this core's (admission's intake commands)."""
        t = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t
        self.decide_s += dt
        self.step_s += dt
        return out

    @property
    def seconds(self) -> float:
        return self.fold_s + self.decide_s


@dataclass
class Loss:
    """The lost cluster and what became of its work."""

    cluster: str
    event: ClusterLost | None = None
    stranded: dict[str, int] = field(default_factory=dict)  # job -> its attempt the loss ended, until placed again
    attempts: int = 0
    gpus: int = 0
    replaced_at: list[datetime] = field(default_factory=list)
    mark: tuple[float, int, int] = (0.0, 0, 0)  # wall, events in the log, scheduler cycles at ClusterLost
    last: tuple[float, int, int] = (0.0, 0, 0)  # the same at the last re-placement


def cluster_executor(nodes: list[NodeInfo], cluster: str) -> SimExecutorCore:
    """The sim executor of one cluster."""
    return SimExecutorCore(nodes, cluster=cluster, heartbeat_s=HEARTBEAT_S)


class Platform:
    """The cores, the log between them (counted, not kept), and what the bench checks."""

    def __init__(self, clusters: list[str], nodes_per_cluster: int) -> None:
        infos = node_infos(nodes_per_cluster)
        self.admission = Meter("admission", AdmissionCore())
        self.quota = Meter("quota", QuotaCore())
        self.scheduler = Meter("scheduler", SchedulerCore(cluster_lost_after_s=LOST_AFTER_S))
        self.executors = [Meter(c, cluster_executor(infos, c)) for c in clusters]
        self.live = [self.admission, self.quota, self.scheduler, *self.executors]
        self.events = 0
        self.types: Counter[str] = Counter()  # events in the log by type
        self.sample: list[Event] = []
        self.held: dict[str, tuple[int, str, int]] = {}  # job -> (attempt, cluster, GPUs) placed and not ended
        self.allocated = 0
        self.placements = 0
        self.gangs = 0  # gangs placed (each checked to be in one cluster)
        self.loss: Loss | None = None

    def feed(self, events: list[Event]) -> None:
        for meter in self.live:
            meter.fold(events)
        for e in events:
            self.events += 1
            self.types[e.type] += 1
            if self.events % SAMPLE_EVERY == 0:
                self.sample.append(e)
            self._track(e)

    def _track(self, e: Event) -> None:
        job = e.aggregate_id
        if isinstance(e, JobScheduled):
            where = {a.node.partition(".")[2] for a in e.placement}  # nodes are <node>.<cluster>
            assert len(where) == 1, f"{job} placed across clusters {sorted(where)}"
            cluster = where.pop()
            gpus = sum(a.gpus for a in e.placement)
            self.held[job] = (e.attempt, cluster, gpus)
            self.allocated += gpus
            self.placements += 1
            self.gangs += len(e.placement) > 1
            loss = self.loss
            if loss is not None and loss.event is not None:
                assert cluster != loss.cluster, f"{job} placed on the lost cluster {cluster}"
                if loss.stranded.pop(job, None) is not None:
                    loss.replaced_at.append(e.occurred_at)
                    loss.last = (time.perf_counter(), self.events, self.scheduler.busy_cycles)
        elif isinstance(e, (JobSucceeded, JobFailed, JobPreempted, JobCancelled)):
            held = self.held.get(job)
            if held is not None and held[0] == e.attempt:
                del self.held[job]
                self.allocated -= held[2]
        elif isinstance(e, ClusterLost) and self.loss is not None and e.cluster == self.loss.cluster:
            loss = self.loss
            loss.event = e
            loss.stranded = {j: a for j, (a, c, _) in self.held.items() if c == e.cluster}
            loss.attempts = len(loss.stranded)
            loss.gpus = sum(g for _, c, g in self.held.values() if c == e.cluster)
            loss.mark = (time.perf_counter(), self.events, self.scheduler.busy_cycles)

    def step(self, now: datetime) -> float:
        """Every live core decides at ``now`` until none decides anything new; wall seconds."""
        t = time.perf_counter()
        if not decide_until_quiet(self.live, self.feed, now, 1000):
            raise RuntimeError(f"the cores still decide at {now}")
        return time.perf_counter() - t

    def lose(self, cluster: str) -> None:
        """The cluster's executor falls silent: it reports, folds and decides nothing more."""
        self.live = [m for m in self.live if m.name != cluster]
        self.loss = Loss(cluster)

    def waiting_for_quota(self) -> int:
        return sum(len(jobs) for jobs in self.quota.core.state.pending.values())


def queues(nodes_per_cluster: int, clusters: int, quota: float) -> list[Event]:
    """One cohort; a queue per team with ``quota`` ÷ TEAMS of each flavor's GPUs, borrowing the
    rest of the cohort's unused quota."""
    per_flavor: dict[str, int] = {}
    for info in node_infos(nodes_per_cluster):
        per_flavor[info.gpu_flavor] = per_flavor.get(info.gpu_flavor, 0) + info.gpu_count * clusters
    out: list[Event] = [new_event(CohortConfigured, aggregate_id="platform", producer="config", occurred_at=T0,
                                  key="1", name="platform")]
    for t in range(TEAMS):
        quotas = tuple(FlavorQuota(flavor=f, nominal=math.floor(quota * n / TEAMS)) for f, n in per_flavor.items())
        out.append(new_event(QueueConfigured, aggregate_id=f"q-{t}", producer="config", occurred_at=T0, key="1",
                             name=f"q-{t}", cohort="platform", allowed_teams=(f"team-{t}",), quotas=quotas))
    return out


class Workload:
    """Jobs of bench.scheduler's mix (gangs of 2-16 nodes), as the teams' SubmitJob commands."""

    def __init__(self, seed: int, median_runtime_s: float) -> None:
        self.rng = random.Random(seed)
        self.median_runtime_s = median_runtime_s
        self.submitted = 0

    def next(self) -> tuple[Principal, bytes, int, float]:
        """(the sender, the command, its GPUs, its GPU-seconds) of the next job."""
        rng = self.rng
        flavor, gpus, gang, klass = draw(rng, GANGS)
        runtime = round(min(4 * 3600, rng.lognormvariate(math.log(self.median_runtime_s), 1.0)), 1)
        t = rng.randrange(TEAMS)
        self.submitted += 1
        spec = {"kind": "training", "queue": f"q-{t}", "team": f"team-{t}", "image": "registry.example/train:1",
                "gpus": gpus, "gang_size": gang, "gpu_flavors": [flavor], "priority_class": klass,
                "node_features": ["rdma"] if gang > 1 and flavor != "l4" else [], "expected_runtime_seconds": runtime,
                "retry": RETRY}
        raw = json.dumps({"job_id": f"j{self.submitted:07d}", "spec": spec}).encode()
        return Principal(team=f"team-{t}", user=f"team-{t}", verb="submit"), raw, gpus * gang, gpus * gang * runtime


def parse_rate(events: list[Event]) -> float:
    """Events per second this process parses (``parse_event``, as every consumer does before it
    folds an event): the best of 3 passes over ``events``."""
    raw = [dumps(e) for e in events]
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        for r in raw:
            parse_event(r)
        best = min(best, time.perf_counter() - t)
    return len(raw) / best


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(gpus: int, clusters: int, quota: float, backlog: float, load: float, runtime: float, steady: float,
        seed: int) -> dict:
    """One run; meant for a fresh process (the peak RSS is the process's)."""
    rss_start = rss_mib()
    names = [f"c{i}" for i in range(clusters)]
    per_cluster = gpus // GPUS_PER_NODE // clusters
    capacity = per_cluster * GPUS_PER_NODE * clusters
    p = Platform(names, per_cluster)
    t = time.perf_counter()
    p.feed(queues(per_cluster, clusters, quota))
    p.step(T0)  # the executors register their clusters' nodes
    setup_s = time.perf_counter() - t
    freeze_state()  # as the scheduler service does after its rebuild

    work = Workload(seed, runtime)
    arrivals = random.Random(seed + 1)

    def submit(now: datetime) -> tuple[int, float]:
        sender, raw, asked, gpu_s = work.next()
        p.feed(p.admission.timed(p.admission.core.handle_submit, raw, sender, work.submitted, now))
        return asked, gpu_s

    with CollectorTime() as collector:
        # 1. the burst: every job submitted at once, then one step (each core's first cycle over it)
        now = T0 + STEP
        for m in p.live:
            m.longest = (0.0, [])
        t = time.perf_counter()
        asked = gpu_s = 0.0
        while asked < backlog * capacity:
            g, s = submit(now)
            asked, gpu_s = asked + g, gpu_s + s
        burst_jobs = work.submitted
        p.step(now)
        burst_s = time.perf_counter() - t
        first = {m.name: m.longest for m in (p.admission, p.quota, p.scheduler)}
        allocated_first = p.allocated

        # 2. steady steps, arrivals offering ``load`` × the GPUs, until the burst has drained
        rate = load * capacity / (gpu_s / burst_jobs)  # jobs per platform second
        next_arrival = now + timedelta(seconds=arrivals.expovariate(rate))

        def step() -> float:
            nonlocal now, next_arrival
            now += STEP
            for m in p.live:
                m.step_s = 0.0
            while next_arrival <= now:
                submit(now)
                next_arrival += timedelta(seconds=arrivals.expovariate(rate))
            return p.step(now)

        steady_from = now
        steps: list[float] = []
        cores: dict[str, list[float]] = {"admission": [], "quota": [], "scheduler": [], "executor": []}
        peak = allocated_first
        while (now - steady_from).total_seconds() < steady or (
                p.waiting_for_quota() and now - T0 < timedelta(seconds=MAX_PLATFORM_S)):
            steps.append(step())
            for m in (p.admission, p.quota, p.scheduler):
                cores[m.name].append(m.step_s)
            cores["executor"].append(sum(m.step_s for m in p.executors))
            peak = max(peak, p.allocated)
        waiting_at_loss, allocated_at_loss = p.waiting_for_quota(), p.allocated

        # 3. the first cluster's executor falls silent
        p.lose(names[0])
        loss = p.loss
        give_up = now + timedelta(seconds=LOST_AFTER_S + HEARTBEAT_S + 600)
        while now < give_up and (loss.event is None or loss.stranded):
            step()

    lost = loss.event
    assert lost is not None, f"{loss.cluster} was never declared lost"
    first_s, first_out = first["scheduler"]
    first_placed = sum(isinstance(e, JobScheduled) for e in first_out)
    last = max(loss.replaced_at, default=None)
    out = {
        "gpus": capacity, "clusters": clusters, "nodes": per_cluster * clusters, "quota": quota, "backlog": backlog,
        "load": load, "runtime_s": runtime, "jobs_submitted": work.submitted, "burst_jobs": burst_jobs,
        "platform_s": (now - T0).total_seconds(), "events": p.events, "types": dict(p.types.most_common()),
        "placements": p.placements, "gangs_placed": p.gangs,
        "setup_s": round(setup_s, 2), "burst_s": round(burst_s, 2),
        "first_cycle_s": round(first_s, 3), "first_cycle_placed": first_placed,
        "first_cycle_reasons": len(first_out) - first_placed,
        "first_cycle_placements_per_s": round(first_placed / first_s) if first_s else None,
        "first_quota_cycle_s": round(first["quota"][0], 3), "first_quota_decisions": len(first["quota"][1]),
        "first_quota_reserved": sum(isinstance(e, QuotaReserved) for e in first["quota"][1]),
        "first_admission_cycle_s": round(first["admission"][0], 3),
        "first_admission_decisions": len(first["admission"][1]),
        "allocated_first": allocated_first, "allocated_peak": peak,
        "steady_steps": len(steps), "steady_p50_ms": round(statistics.median(steps) * 1000, 1),
        "steady_p99_ms": round(pct(steps, 99) * 1000, 1),
        "waiting_at_loss": waiting_at_loss, "allocated_at_loss": allocated_at_loss,
        "lost_cluster": loss.cluster, "lost_attempts": loss.attempts, "lost_gpus": loss.gpus,
        "not_replaced": len(loss.stranded),
        "lost_after_report_s": (lost.occurred_at - lost.last_report).total_seconds(),
        "replaced_after_lost_s": (last - lost.occurred_at).total_seconds() if last else None,
        "replaced_p50_after_lost_s": statistics.median((t - lost.occurred_at).total_seconds()
                                                       for t in loss.replaced_at) if last else None,
        "replacing_cycles": len(set(loss.replaced_at)),  # one scheduler cycle a step at most places them
        "replace_floor_s": RETRY["backoff_seconds"],
        "replace_wall_s": round(loss.last[0] - loss.mark[0], 3), "replace_events": loss.last[1] - loss.mark[1],
        "replace_scheduler_cycles": loss.last[2] - loss.mark[2],
        "parse_events_per_s": round(parse_rate(p.sample)),
        "gc_s": round(collector.seconds, 2), "start_rss_mib": round(rss_start), "max_rss_mib": round(rss_mib()),
    }
    for name, meters in (("admission", [p.admission]), ("quota", [p.quota]), ("scheduler", [p.scheduler]),
                         ("executor", p.executors)):
        seconds = sum(m.seconds for m in meters)
        out |= {f"{name}_cores": len(meters), f"{name}_s": round(seconds, 2),
                f"{name}_fold_s": round(sum(m.fold_s for m in meters), 2),
                f"{name}_folded": sum(m.folded for m in meters), f"{name}_decided": sum(m.decided for m in meters),
                f"{name}_step_p50_ms": round(statistics.median(cores[name]) * 1000, 2),
                f"{name}_step_p99_ms": round(pct(cores[name], 99) * 1000, 2)}
    return out


def report(r: dict) -> None:
    gpus, clusters = r["gpus"], r["clusters"]
    parse = r["parse_events_per_s"]
    print(f"scale simulation — {gpus:,} GPUs: {clusters} clusters × {r['nodes'] // clusters:,} nodes × "
          f"{GPUS_PER_NODE} GPUs (h100/a100/l4); the decision cores on a virtual clock, no NATS; this machine; "
          f"{r['runs']} run(s), each in a fresh process: medians (peak RSS: the largest)")
    print(f"  workload: {r['burst_jobs']:,} jobs at once asking {r['backlog']:g} × the GPUs, then arrivals offering "
          f"{r['load']:g} × the GPUs; {r['jobs_submitted']:,} jobs in all (1 GPU 40 %, 2: 20 %, 4: 15 %, 8: 15 %, "
          f"gangs of 2-16 × 8 GPUs: 10 %; lognormal runtimes, median {r['runtime_s']:g} s); quota {r['quota']:g} "
          f"of the GPUs, {TEAMS} queues in one cohort")
    print(f"  log: {r['events']:,} events over {r['platform_s']:,.0f} platform seconds ("
          + ", ".join(f"{kind} {n:,}" for kind, n in list(r["types"].items())[:6]) + f", ...); {r['placements']:,} "
          f"placements, {r['gangs_placed']:,} of them gangs, every one inside one cluster (checked)")
    print(f"  per core, over the whole run (wall time folding and deciding; events/s beside this process parsing "
          f"the same events, {parse:,} events/s):")
    for name in ("admission", "quota", "scheduler", "executor"):
        n = r[f"{name}_cores"]
        seconds = r[f"{name}_s"] / n
        events_s, decisions_s = r[f"{name}_folded"] / n / seconds, r[f"{name}_decided"] / n / seconds
        label = f"executor ×{n} (each)" if name == "executor" else name
        extra = f"; {r['placements'] / seconds:,.0f} placements/s" if name == "scheduler" else ""
        print(f"    {label:<19} {r[f'{name}_folded'] // n:>9,} folded, {r[f'{name}_decided'] // n:>7,} decided in "
              f"{seconds:7.2f} s (folding {r[f'{name}_fold_s'] / n:.2f} s): {events_s:>9,.0f} events/s = "
              f"{events_s / parse:5.2f} × parsing; {decisions_s:,.0f} decisions/s{extra}")
    print(f"  first cycle over the burst of {r['burst_jobs']:,} jobs (the step took {r['burst_s']:.1f} s in all):")
    print(f"    admission: {r['first_admission_cycle_s']:.2f} s for {r['first_admission_decisions']:,} decisions "
          f"({r['first_admission_decisions'] / r['first_admission_cycle_s']:,.0f}/s)")
    print(f"    quota: {r['first_quota_cycle_s']:.2f} s for {r['first_quota_decisions']:,} decisions "
          f"({r['first_quota_reserved']:,} reserved, the rest explained)")
    print(f"    scheduler: {beside(r['first_cycle_s'], TARGET_FIRST_CYCLE_S, 's')} (bench.scheduler's, for 50,000 "
          f"heads); {r['first_cycle_placed']:,} placed + {r['first_cycle_reasons']:,} reasons = "
          f"{r['first_cycle_placements_per_s']:,} placements/s")
    ceiling = r["quota"] * gpus
    print(f"  GPUs allocated: {r['allocated_first']:,} after the first cycle = {r['allocated_first'] / gpus:.2f} "
          f"of the GPUs = {r['allocated_first'] / ceiling:.2f} × the quota's ceiling ({ceiling:,.0f}); peak "
          f"{r['allocated_peak']:,}")
    print(f"  steady steps ({r['steady_steps']:,}, one platform second each): p50 {r['steady_p50_ms']:g} ms, p99 "
          f"{r['steady_p99_ms']:g} ms = {r['steady_p99_ms'] / 1000:.3f} × the second it covers; p50 / p99 per core: "
          + ", ".join(f"{name} {r[f'{name}_step_p50_ms']:g} / {r[f'{name}_step_p99_ms']:g} ms"
                      for name in ("admission", "quota", "scheduler", "executor"))
          + f" (all {r['executor_cores']} executors)")
    print(f"    scheduler steady p99: {beside(r['scheduler_step_p99_ms'], TARGET_STEADY_P99_MS, 'ms')} "
          f"(bench.scheduler's)")
    print(f"  peak RSS: {beside(r['max_rss_mib'], TARGET_RSS_MIB, 'MiB')} (ru_maxrss of the run's own process: "
          f"every core, the workload and the bench; {r['start_rss_mib']} MiB at its start); garbage collector "
          f"{r['gc_s']:.2f} s")
    replaced = r["lost_attempts"] - r["not_replaced"]
    after = r["replaced_after_lost_s"]
    print(f"  lost cluster {r['lost_cluster']}: {r['waiting_at_loss']} jobs waiting for quota and "
          f"{r['allocated_at_loss']:,} GPUs allocated when its executor fell silent; ClusterLost "
          f"{r['lost_after_report_s']:g} s after its last report (cluster_lost_after_s {LOST_AFTER_S:g}); "
          f"{r['lost_attempts']:,} attempts on it ({r['lost_gpus']:,} GPUs)")
    floor = r["replace_floor_s"]
    print(f"    re-placed in the other clusters: {replaced:,} of {r['lost_attempts']:,}"
          + (f"; after ClusterLost p50 {r['replaced_p50_after_lost_s']:g} s = "
             f"{r['replaced_p50_after_lost_s'] / floor:.2f} × the {floor:g} s retry backoff, the last {after:g} s = "
             f"{after / floor:.2f} ×, in {r['replacing_cycles']:,} scheduler cycle(s); until the last: "
             f"{r['replace_scheduler_cycles']:,} scheduler cycles that decided anything, {r['replace_events']:,} "
             f"events in the log, {r['replace_wall_s']:.2f} s of wall time" if after is not None else ""))


OPTIONS = {  # name: (default, meaning); run() takes them in this order
    "gpus": (100_000, "GPUs in all, 8 a node"),
    "clusters": (10, "clusters, an executor each"),
    "quota": (0.85, "the queues' nominal quota, a share of the GPUs"),
    "backlog": (1.2, "GPUs the burst asks for, a share of the GPUs"),
    "load": (0.5, "GPU-seconds arriving per platform second after the burst, a share of the GPUs"),
    "runtime": (900.0, "median runtime of a job, seconds (lognormal)"),
    "steady": (300.0, "platform seconds of steady steps, at least"),
    "seed": (7, "the workload's random seed"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (default, meaning) in OPTIONS.items():
        p.add_argument(f"--{name}", type=type(default), default=default, help=f"{meaning} (default {default})")
    p.add_argument("--runs", type=int, default=1, help="runs, each in a fresh process: medians (default 1)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    runs = [in_fresh_process(run, *(getattr(args, name) for name in OPTIONS)) for _ in range(args.runs)]
    result = summary(runs)
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": result, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
