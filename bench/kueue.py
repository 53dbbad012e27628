"""Kueue's published scheduler baseline, run through the whole platform in real time.

    python -m bench.kueue [--scale 1.0] [--timeout 900]

5 cohorts × 6 queues; each queue nominal 20 GPUs with borrowingLimit 100; per queue 350 small
(1 GPU, 200 ms, every 100 ms), 100 medium (5 GPUs, 500 ms, every 500 ms) and 50 large (20 GPUs,
1 s, every 1.2 s) workloads: 15,000 in all, submitted on their schedule to the intake and run by
the sim executor at time scale 1. The cluster (30 nodes × 40 GPUs) is twice the quota, so
placement never constrains: the figures measure quota and the pipeline. Priorities 50/100/200
map to the classes batch-low / experiment / training (same order).

Reported beside Kueue's published averages (wall 351 s; time to admission large 6.7 s, medium
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
from pathlib import Path

import nats

from gpusched import client, devstack, eventlog
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
                    out.append((i * period, name, SubmitJob(job_id=f"{queue}-{name}-{i}", submitter="bench", spec=spec)))
    out.sort(key=lambda x: x[0])
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
        now = client.utcnow()
        for c in range(COHORTS):
            await log.append(new_event(CohortConfigured, aggregate_id=f"c{c}", producer="config", occurred_at=now,
                                       key="1", name=f"c{c}"))
            for q in range(QUEUES_PER_COHORT):
                name = f"c{c}-q{q}"
                await log.append(new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=now,
                                           key="1", name=name, cohort=f"c{c}", allowed_teams=("team-a",),
                                           quotas=(FlavorQuota(flavor="gpu", nominal=NOMINAL, borrowing_limit=100),),
                                           preemption=PreemptionPolicy(reclaim_within_cohort="any",
                                                                       within_queue="lower-priority")))
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
            await client.publish_command(js, "team-a", "submit", job)
        submit_s = time.time() - t0

        async def finished() -> int:
            info = await js.stream_info(eventlog.EVENTS_STREAM, subjects_filter="gpusched.job.*.succeeded")
            return len(info.state.subjects or {})
        done = 0
        while (done := await finished()) < len(jobs) and time.time() - t0 < timeout_s:
            await asyncio.sleep(0.5)
        reserved_at, succeeded_at = {}, {}
        usage: dict[str, list[tuple[float, int]]] = defaultdict(list)
        events = 0
        async for m in eventlog.read(js):
            events += 1
            e = parse_event(m.data)
            if e.type == "QuotaReserved" and e.attempt == 1:
                reserved_at[e.aggregate_id] = e.occurred_at.timestamp()
            if e.type in ("QuotaReserved", "QuotaReleased"):
                usage[e.queue].append((e.occurred_at.timestamp(), e.gpus if e.type == "QuotaReserved" else -e.gpus))
            elif e.type == "JobSucceeded":
                succeeded_at[e.aggregate_id] = e.occurred_at.timestamp()
        end = max(succeeded_at.values()) if succeeded_at else time.time()
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
            shares[queue] = area / (NOMINAL * wall)
        return {
            "jobs": len(jobs), "finished": done, "events": events, "submit_s": submit_s, "wall_s": wall,
            "physical_bound_s": sum(c * g * r for c, g, r, _, _ in CLASSES.values()) * scale
            * COHORTS * QUEUES_PER_COHORT / (COHORTS * QUEUES_PER_COHORT * NOMINAL),
            "admission_avg_s": {k: statistics.mean(v) for k, v in admission.items()},
            "min_queue_usage": min(shares.values()) if shares else 0.0,
            "mean_queue_usage": statistics.mean(shares.values()) if shares else 0.0,
        }
    finally:
        await nc.close()
        procs.stop_all()
        pg.stop()
        server.stop()


def report(r: dict, scale: float) -> None:
    print(f"\nKueue baseline through gpusched — {r['jobs']} workloads (scale {scale}), all five services, "
          f"time scale 1, this machine")
    print(f"  finished {r['finished']} of {r['jobs']}; {r['events']} events in the log")
    print(f"  {'':<28}{'gpusched':>12}{'Kueue':>10}")
    print(f"  {'wall time':<28}{r['wall_s']:>11.0f}s{KUEUE['wall_s']:>9}s   physical bound {r['physical_bound_s']:.0f} s")
    for k in ("large", "medium", "small"):
        got = r["admission_avg_s"].get(k)
        print(f"  {'time to admission, ' + k:<28}{(f'{got:.1f}s' if got is not None else '-'):>12}"
              f"{KUEUE['admission_s'][k]:>9}s")
    print(f"  {'minimum queue usage':<28}{r['min_queue_usage'] * 100:>11.1f}%{KUEUE['min_usage'] * 100:>9.1f}%"
          f"   (mean {r['mean_queue_usage'] * 100:.1f} %)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = asyncio.run(run(args.scale, args.timeout))
    report(result, args.scale)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
