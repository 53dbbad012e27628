"""Restart time of the decision services against the length of the log (snapshots,
runtime/snapshot.py).

    python -m bench.restart [--events N ...] [--service S ...] [--tail T]

For each log length N: the log is the events of a synthetic openb-shaped trace replayed through
the platform's cores (gpusched.sim.trace: every job submitted, admitted, reserved, scheduled,
started, succeeded and released), published by the admin on a real nats-server. Then, for each
service, as its own process with its own credential (deploy/Procfile):

1. **without a snapshot** (N - T events in the log): process start → its first decision, on a
   probe job appended after the log. It folds the whole log. It is stopped cleanly: that saves
   its snapshot;
2. **with the snapshot**, three times: the next T events of the trace and a new probe are
   appended (a tail like the one a crash between two periodic snapshots leaves), and the process
   starts again: process start → its decision on the new probe (median of the three).

The target: under 5 s at 1,000,000 events, and flat as the log grows. The full fold is one run
(it takes most of a minute per service at a million events on this machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import nats
import psutil

from gpusched.dev import stack as devstack
from gpusched.sim import trace as tracesim
from runtime import eventlog, snapshot
from schemas import JobAdmitted, JobSpec, JobSubmitted, QuotaReserved, new_event
from schemas.registry import event_subject, subject_suffix
from services.scheduler.placement import Policy

TARGET_S = 5.0
FIRST_DECISION = {"admission": "JobAdmitted", "quota": "QuotaReserved", "scheduler": "JobScheduled"}
TASKS_PER_EVENT = 1 / 7  # a finished trace job is 7 events
RESTARTS = 3


def trace_log(events: int, workdir: Path) -> tuple[list[tuple[str, bytes, str]], object]:
    """(subject, payload, event id) of a replay of about ``events`` events, and its last event."""
    trace = tracesim.load_trace(tracesim.write_synthetic_trace(workdir / f"trace-{events}", nodes=40,
                                                               tasks=round(events * TASKS_PER_EVENT)))
    out: list[tuple[str, bytes, str]] = []
    last: list = [None]
    fold = tracesim.Platform.feed

    def recording(p, batch):
        batch = list(batch)
        out.extend((event_subject(e), e.model_dump_json().encode(), e.event_id) for e in batch)
        last[0] = batch[-1] if batch else last[0]
        fold(p, batch)

    tracesim.Platform.feed = recording
    try:
        tracesim.replay(trace, Policy.BEST_FIT)
    finally:
        tracesim.Platform.feed = fold
    return out, last[0]


async def publish(nc, messages: list[tuple[str, bytes, str]]) -> float:
    js = nc.jetstream(publish_async_max_pending=1000)
    t = time.perf_counter()
    for subject, data, event_id in messages:
        await js.publish_async(subject, data, headers={"Nats-Msg-Id": event_id})
    await js.publish_async_completed()
    return time.perf_counter() - t


def probe(service: str, job_id: str, when) -> list:
    """The events after which ``service`` has exactly one thing to decide: this job."""
    from gpusched.sim.trace import FLAVOR, QUEUE, TEAM

    spec = JobSpec(kind="batch", queue=QUEUE, team=TEAM, priority_class="batch-low", image="probe", gpus=1,
                   cpu_millis=1000, memory_mib=1024, expected_runtime_seconds=60)
    sub = new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=when, key="probe",
                    spec=spec, submitter="bench",
                    intake_sequence=10**9)
    if service == "admission":
        return [sub]
    adm = new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=when, key="decision",
                    cause=sub, queue=QUEUE, priority=100, preemptible=True)
    if service == "quota":
        return [sub, adm]
    res = new_event(QuotaReserved, aggregate_id=job_id, producer="quota", occurred_at=when, key="1", cause=adm,
                    attempt=1, queue=QUEUE, flavor=FLAVOR, gpus=1)
    return [sub, adm, res]


async def first_decision(server, nc, service: str, job_id: str, env: dict[str, str], log_dir: Path) -> float:
    """Start the service's process; seconds until its decision on ``job_id`` is in the log."""
    subject = f"gpusched.job.{job_id}.{subject_suffix(FIRST_DECISION[service])}"
    got = asyncio.get_running_loop().create_future()

    async def decided(msg) -> None:
        if not got.done():
            got.set_result(None)

    sub = await nc.subscribe(subject, cb=decided)
    procs = devstack.ServiceProcesses(log_dir, {service: env})
    t = time.perf_counter()
    procs.start(service)
    try:
        await asyncio.wait_for(got, timeout=1800)
        return time.perf_counter() - t
    finally:
        await sub.unsubscribe()
        procs.stop_all()  # SIGTERM: a clean stop, which saves the snapshot


async def run_length(server, nc, events: int, services: list[str], tail: int, workdir: Path) -> dict:
    js = nc.jetstream()
    for stream in (eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM):
        try:
            await js.delete_stream(stream)
        except Exception:
            pass
    await eventlog.provision(js)
    for service in services:
        try:
            await js.delete_object_store(snapshot.bucket(service))
        except Exception:
            pass
    t = time.perf_counter()
    messages, last = trace_log(events, workdir)
    generate_s = time.perf_counter() - t
    head = messages[:-RESTARTS * tail]
    tails = [messages[len(head) + r * tail:len(head) + (r + 1) * tail] for r in range(RESTARTS)]
    publish_s = await publish(nc, head)
    when = last.occurred_at + timedelta(seconds=1)
    env = devstack.service_env(server.env, "", cluster=workdir / "unused.yaml", time_scale=1.0,
                               epoch=time.time(), extra={"GPUSCHED_LOG_LEVEL": "INFO"})
    out: dict = {"events": len(messages), "tail": tail, "generate_s": round(generate_s, 1),
                 "publish_msgs_per_s": round(len(head) / publish_s), "services": {}}
    for service in services:
        await publish(nc, [(event_subject(e), e.model_dump_json().encode(), e.event_id)
                           for e in probe(service, f"probe-{service}-cold", when)])
        cold = await first_decision(server, nc, service, f"probe-{service}-cold", env[service],
                                    workdir / f"logs-{events}")
        out["services"][service] = {"without_snapshot_s": round(cold, 2)}
    for r, rest in enumerate(tails):
        await publish(nc, rest)
        for service in services:
            await publish(nc, [(event_subject(e), e.model_dump_json().encode(), e.event_id)
                               for e in probe(service, f"probe-{service}-warm{r}", when)])
            warm = await first_decision(server, nc, service, f"probe-{service}-warm{r}", env[service],
                                        workdir / f"logs-{events}")
            out["services"][service].setdefault("with_snapshot_runs_s", []).append(round(warm, 2))
    for service in services:
        info = await (await js.object_store(snapshot.bucket(service))).get_info(snapshot.OBJECT)
        runs = out["services"][service]["with_snapshot_runs_s"]
        out["services"][service].update(with_snapshot_s=statistics.median(runs), snapshot_bytes=info.size)
    out["log_events"] = await eventlog.last_sequence(js)
    return out


async def main(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpusched-restart-"))
    server = devstack.NatsServer(work / "nats").start()
    try:
        nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"])
        runs = [await run_length(server, nc, n, args.service, args.tail, work) for n in args.events]
        await nc.close()
    finally:
        server.stop()
    return {"machine": f"{platform.node()} {os.cpu_count()} CPUs {round(psutil.virtual_memory().total / 2**30)} GiB",
            "target_s": TARGET_S, "runs": runs}


def report(r: dict) -> None:
    print(f"restart: process start → first decision, log of N events; target < {TARGET_S:.0f} s and flat in N "
          f"({r['machine']})")
    for run in r["runs"]:
        print(f"  N = {run['log_events']:,} (each restart: a tail of {run['tail']:,} events after the snapshot)")
        for name, s in run["services"].items():
            runs = ", ".join(f"{x:.2f}" for x in s["with_snapshot_runs_s"])
            print(f"    {name:<10} with snapshot {s['with_snapshot_s']:6.2f} s = {s['with_snapshot_s'] / TARGET_S:.2f} of "
                  f"the target (median of {runs}); without {s['without_snapshot_s']:7.2f} s (full fold); "
                  f"snapshot {s['snapshot_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, action="append", help="log lengths (default 100,000 and 1,000,000)")
    p.add_argument("--service", action="append", choices=sorted(FIRST_DECISION))
    p.add_argument("--tail", type=int, default=10_000, help="events appended after the snapshot")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    args.events = args.events or [100_000, 1_000_000]
    args.service = args.service or ["quota", "scheduler", "admission"]
    result = asyncio.run(main(args))
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
