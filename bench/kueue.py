"""Kueue's published scheduler baseline, run through the whole platform in real time.

    python -m bench.kueue [--scale 1.0] [--runs 3] [--timeout 900]

5 cohorts × 6 queues; each queue nominal 20 GPUs with borrowingLimit 100; per queue 350 small
(1 GPU, 200 ms, every 100 ms), 100 medium (5 GPUs, 500 ms, every 500 ms) and 50 large (20 GPUs,
1 s, every 1.2 s) workloads: 15,000 in all, submitted on their schedule to the intake and run by
the sim executor at time scale 1. The cluster (30 nodes × 40 GPUs) is twice the quota, so
placement never constrains: the figures measure quota and the pipeline. Priorities 50/100/200
map to the classes batch-low / experiment / training (same order).

Also run: the same scenario through the quota, scheduler and sim-executor cores in one
process on a virtual clock (20 ms steps): what the policy achieves with no pipeline between
the services. Reported beside Kueue's published averages (wall 351 s; time to admission large 6.7 s, medium
76.8 s, small 215 s; minimum queue usage 58.7 %) and the physical bound (total work ÷ quota
capacity = 39,600 GPU-s ÷ 600 GPUs = 66 s). ``--scale`` shrinks the workload counts (e.g. 0.2
for a quick run); the figures are then not comparable to Kueue's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats

from gpusched.gateway import commands
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import CohortConfigured, FlavorQuota, JobSpec, QueueConfigured, SubmitJob, new_event, parse_event
from schemas.queue import PreemptionPolicy

CLASSES = {  # name: (count per queue, GPUs, runtime s, period s, priority class)
    "small": (350, 1, 0.2, 0.1, "batch-low"),
    "medium": (100, 5, 0.5, 0.5, "experiment"),
    "large": (50, 20, 1.0, 1.2, "training"),
}
KUEUE = {"wall_s": 351, "admission_s": {"large": 6.7, "medium": 76.8, "small": 215}, "min_usage": 0.587}
COHORTS, QUEUES_PER_COHORT, NOMINAL = 5, 6, 20


def workload(scale: float) -> list[tuple[float, str, SubmitJob]]:
    out = []
    for c in range(COHORTS):
        for q in range(QUEUES_PER_COHORT):
            queue = f"c{c}-q{q}"
            for name, (count, gpus, runtime, period, pclass) in CLASSES.items():
                for i in range(max(1, int(count * scale))):
                    spec = JobSpec(kind="batch", queue=queue, team="team-a", image="img", gpus=gpus,
                                   gpu_flavors=("gpu",), expected_runtime_seconds=runtime, priority_class=pclass)
                    out.append((i * period, name, SubmitJob(job_id=f"{queue}-{name}-{i}", spec=spec)))
    out.sort(key=lambda x: x[0])
    return out


def config_events(now: datetime) -> list:
    """5 cohorts × 6 queues: nominal 20, borrowingLimit 100, reclaim from any borrower in the
    cohort, preemption of lower priority within a queue (Kueue's configuration)."""
    out = []
    for c in range(COHORTS):
        out.append(new_event(CohortConfigured, aggregate_id=f"c{c}", producer="config", occurred_at=now,
                             key="1", name=f"c{c}"))
        for q in range(QUEUES_PER_COHORT):
            name = f"c{c}-q{q}"
            out.append(new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=now,
                                 key="1", name=name, cohort=f"c{c}", allowed_teams=("team-a",),
                                 quotas=(FlavorQuota(flavor="gpu", nominal=NOMINAL, borrowing_limit=100),),
                                 preemption=PreemptionPolicy(reclaim_within_cohort="any",
                                                             within_queue="lower-priority")))
    return out


async def run(scale: float, timeout_s: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpusched-kueue-"))
    server = devstack.NatsServer(work / "nats", teams=("team-a",)).start()
    pg = devstack.Postgres(work / "pg", fsync=False).start()
    cluster = work / "cluster.yaml"
    cluster.write_text("groups:\n  - {prefix: n, count: 30, gpu_flavor: gpu, gpu_count: 40}\n")
    env = devstack.service_env(server.env, pg.dsn, cluster=cluster, time_scale=1.0, epoch=time.time(),
                               extra={"GPUSCHED_TICK_S": "0.02", "GPUSCHED_LOG_LEVEL": "WARNING"})
    procs = devstack.ServiceProcesses(work / "logs", env)
    nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"])
    try:
        js = nc.jetstream()
        await eventlog.provision(js)
        log = eventlog.EventLog(js)
        for event in config_events(datetime.now(UTC)):
            await log.append(event)
        procs.start_all()
        await asyncio.sleep(4)  # rebuild, register nodes
        jobs = workload(scale)
        submitted_at: dict[str, float] = {}
        klass = {job.job_id: name for _, name, job in jobs}
        t0 = time.time()
        for offset, _, job in jobs:
            delay = t0 + offset - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            submitted_at[job.job_id] = time.time()
            await commands.publish_command(js, "team-a", "submit", job)
        submit_s = time.time() - t0

        async def finished() -> int:
            info = await js.stream_info(eventlog.EVENTS_STREAM, subjects_filter="gpusched.job.*.succeeded")
            return len(info.state.subjects or {})
        done = 0
        while (done := await finished()) < len(jobs) and time.time() - t0 < timeout_s:
            await asyncio.sleep(0.5)
        events = [parse_event(m.data) async for m in eventlog.read(js)]
        return {"jobs": len(jobs), "finished": done, "submit_s": submit_s,
                **figures(events, klass, submitted_at, t0, scale)}
    finally:
        await nc.close()
        procs.stop_all()
        pg.stop()
        server.stop()


def figures(events: list, klass: dict[str, str], submitted_at: dict[str, float], t0: float, scale: float) -> dict:
    """Wall time, time to admission per class (publish to the first QuotaReserved) and each
    queue's time-averaged reserved GPUs over its nominal, from the log."""
    reserved_at, succeeded_at = {}, {}
    usage: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        if e.type == "QuotaReserved" and e.attempt == 1:
            reserved_at[e.aggregate_id] = e.occurred_at.timestamp()
        if e.type in ("QuotaReserved", "QuotaReleased"):
            usage[e.queue].append((e.occurred_at.timestamp(), e.gpus if e.type == "QuotaReserved" else -e.gpus))
        elif e.type == "JobSucceeded":
            succeeded_at[e.aggregate_id] = e.occurred_at.timestamp()
    end = max(succeeded_at.values()) if succeeded_at else t0
    wall = end - t0
    admission = defaultdict(list)
    for job_id, t in reserved_at.items():
        admission[klass[job_id]].append(t - submitted_at[job_id])
    shares = {}
    for queue, changes in usage.items():
        changes.sort()
        area, level, last = 0.0, 0, t0
        for t, delta in changes:
            area += level * (min(t, end) - last)
            level, last = level + delta, min(t, end)
        shares[queue] = area / (NOMINAL * wall) if wall > 0 else 0.0
    return {
        "events": len(events), "wall_s": wall,
        "physical_bound_s": sum(c * g * r for c, g, r, _, _ in CLASSES.values()) * scale / NOMINAL,
        "admission_avg_s": {k: statistics.mean(v) for k, v in admission.items()},
        "min_queue_usage": min(shares.values()) if shares else 0.0,
        "mean_queue_usage": statistics.mean(shares.values()) if shares else 0.0,
    }


def run_cores(scale: float, tick_s: float = 0.02) -> dict:
    """The same scenario through the quota, scheduler and sim-executor cores in one process on
    a virtual clock stepped every ``tick_s``: the policy alone, with no pipeline between them."""
    from gpusched.sim.trace import Platform
    from schemas import JobAdmitted, JobSubmitted
    from schemas.node import NodeInfo
    from schemas.priority import DEFAULT_PRIORITY_CLASSES
    from services.executor.sim import SimExecutorCore
    from services.quota.domain import QuotaCore
    from services.scheduler.domain import SchedulerCore

    start = datetime(2026, 1, 1, tzinfo=UTC)
    nodes = [NodeInfo(name=f"n-{i}", gpu_flavor="gpu", gpu_count=40) for i in range(30)]
    p = Platform(QuotaCore(), SchedulerCore(explain=False), SimExecutorCore(nodes))
    log: list = []
    feed = p.feed
    p.feed = lambda events: (log.extend(events), feed(events))  # keep the log for the figures
    p.feed(config_events(start))
    p.settle(start)
    jobs = workload(scale)
    klass = {job.job_id: name for _, name, job in jobs}
    submitted_at: dict[str, float] = {}
    i, now, tick = 0, start, timedelta(seconds=tick_s)
    while (i < len(jobs) or len(p.finished_at) < len(jobs)) and now - start < timedelta(hours=1):
        while i < len(jobs) and start + timedelta(seconds=jobs[i][0]) <= now:
            _, _, cmd = jobs[i]
            pc = DEFAULT_PRIORITY_CLASSES[cmd.spec.priority_class]
            sub = new_event(JobSubmitted, aggregate_id=cmd.job_id, producer="admission", occurred_at=now, key="1",
                            spec=cmd.spec, submitter="bench", intake_sequence=i + 1)
            p.feed([sub, new_event(JobAdmitted, aggregate_id=cmd.job_id, producer="admission", occurred_at=now,
                                   key="d", cause=sub, queue=cmd.spec.queue, priority=pc.value,
                                   preemptible=pc.preemptible)])
            submitted_at[cmd.job_id] = now.timestamp()
            i += 1
        p.settle(now)
        now += tick
    return {"jobs": len(jobs), "finished": len(p.finished_at), "tick_s": tick_s,
            **figures(log, klass, submitted_at, start.timestamp(), scale)}


def report(r: dict, scale: float, cores: dict | None = None) -> None:
    """The whole platform beside the decision cores alone (if run) and Kueue's published figures."""
    c = cores or {}
    print(f"\nKueue baseline through gpusched — {r['jobs']} workloads (scale {scale}), time scale 1, this machine")
    print(f"  platform: all five services over NATS and Postgres; finished {r['finished']} of {r['jobs']}, "
          f"{r['events']} events in the log")
    if cores:
        print(f"  cores: quota, scheduler and sim executor in one process, virtual clock in "
              f"{cores['tick_s'] * 1000:.0f} ms steps (the policy with no pipeline); finished {cores['finished']}")
    print(f"  {'':<28}{'platform':>10}{'cores':>10}{'Kueue':>10}")

    def row(label: str, key: str, unit: str, kueue, fmt: str = ".1f", scale_by: float = 1.0) -> None:
        def val(d: dict) -> str:
            v = d.get(key) if not isinstance(key, tuple) else d.get(key[0], {}).get(key[1])
            return "-" if v is None else f"{v * scale_by:{fmt}}{unit}"
        print(f"  {label:<28}{val(r):>10}{val(c):>10}{kueue:>10}")

    row("wall time", "wall_s", "s", f"{KUEUE['wall_s']}s", ".0f")
    for k in ("large", "medium", "small"):
        row(f"time to admission, {k}", ("admission_avg_s", k), "s", f"{KUEUE['admission_s'][k]}s")
    row("minimum queue usage", "min_queue_usage", "%", f"{KUEUE['min_usage'] * 100:.1f}%", ".1f", 100)
    row("mean queue usage", "mean_queue_usage", "%", "-", ".1f", 100)
    print(f"  physical bound (work ÷ quota): {r['physical_bound_s']:.0f} s")


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the platform runs (the rest from the first run)."""
    out = dict(runs[0])
    for key in ("wall_s", "min_queue_usage", "mean_queue_usage"):
        out[key] = statistics.median(r[key] for r in runs)
    out["admission_avg_s"] = {k: statistics.median(r["admission_avg_s"][k] for r in runs)
                              for k in runs[0]["admission_avg_s"]}
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=3, help="platform runs; each figure is their median")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", type=Path)
    p.add_argument("--no-cores", action="store_true", help="skip the in-process run of the decision cores")
    args = p.parse_args()
    cores = None if args.no_cores else run_cores(args.scale)
    runs = [asyncio.run(run(args.scale, args.timeout)) for _ in range(args.runs)]
    result = medians(runs)
    report(result, args.scale, cores)
    print(f"  platform figures: medians of {len(runs)} runs; wall times "
          + ", ".join(f"{r['wall_s']:.0f} s" for r in runs))
    if args.json:
        args.json.write_text(json.dumps({"platform": result, "runs": runs, "cores": cores}, indent=2))
