"""What a JetStream cluster costs, and how fast the platform decides again when a server dies
(issue 46): in one run, on one nats-server (R1) and on a cluster of three on loopback (R3, every
stream, consumer and bucket on each):

* append rate: ``EventLog.append`` one at a time (what a service's append costs: each awaits its
  ack, which on R3 waits for a second server to store it), and acknowledged publishes with 1,000
  in flight (the broker's ceiling);
* submit → scheduled latency: one-GPU jobs at a steady rate through admission, quota, the
  scheduler and the sim executor as processes;
* on R3, the time without decisions when the GPUSCHED_EVENTS stream leader is killed with
  SIGKILL while jobs arrive at that rate: from the kill to the first job scheduled after it, and
  the longest interval between two jobs scheduled around it (beside the longest one without a
  kill), with the services as `make run` runs them and again with quota and the scheduler
  single-active on a lease (as the production overlay runs them).

    python -m bench.cluster [--appends N] [--jobs N] [--rate R] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil

from bench import command_line
from bench.__main__ import pct, raw_publish_pipelined
from gpusched.dev import stack as devstack
from runtime import eventlog
from runtime.settings import Settings
from schemas import JobSpec, SubmitJob, new_event, parse_event
from schemas.job import JobSubmitted
from schemas.queue import FlavorQuota, QueueConfigured

SERVICES = ("admission", "quota", "scheduler", "executor")
"""A job's path from submission to its end (accounting, notifier and serving only read the log)."""
CLUSTER = "groups:\n  - {prefix: n, count: 64, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 40960}\n"
LEASE_TTL_S = 4.0


async def connect(server, user: str):
    return await eventlog.connect(Settings(nats_url=server.url(), nats_user=user,
                                           nats_password=server.creds.users[user]), f"bench-{user}")


async def fresh_log(js, replicas: int) -> None:
    for stream in (eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM, "RAW"):
        try:
            await js.delete_stream(stream)
        except Exception:  # not there yet
            pass
    for bucket in ("lease-quota", "lease-scheduler"):
        try:
            await js.delete_key_value(bucket)
        except Exception:
            pass
    await eventlog.provision(js, eventlog.StreamLimits(replicas=replicas))
    await eventlog.EventLog(js).append(QueueConfigured(
        event_id="bench-q", aggregate_id="bench", occurred_at=datetime.now(UTC), producer="config", name="bench",
        allowed_teams=("team-a",), quotas=(FlavorQuota(flavor="a100", nominal=100_000),)))


async def append_rate(js, n: int, replicas: int) -> dict:
    """Sequential EventLog.append of job events, and pipelined acknowledged publishes on a scratch
    stream with the same replicas."""
    from nats.js.api import StorageType, StreamConfig

    log = eventlog.EventLog(js)
    spec = JobSpec(kind="batch", queue="bench", team="team-a", image="img", gpus=1, gpu_flavors=("a100",))
    now = datetime.now(UTC)
    events = [new_event(JobSubmitted, aggregate_id=f"bench-append-{replicas}-{i}", producer="admission",
                        occurred_at=now, key="1", spec=spec, submitter="bench", intake_sequence=i + 1)
              for i in range(n)]
    t = time.perf_counter()
    for event in events:
        await log.append(event)
    sequential = n / (time.perf_counter() - t)
    await js.add_stream(StreamConfig(name="RAW", subjects=["raw.>"], storage=StorageType.FILE, duplicate_window=120,
                                     num_replicas=replicas))
    piped = await raw_publish_pipelined(eventlog.client_of(js), 10 * n, f"raw.p{replicas}")
    await js.delete_stream("RAW")
    return {"append_per_s": sequential, "publish_pipelined_per_s": piped}


class Stack:
    """The job-path services as processes on ``server``, started again when they exit (as `make
    run`'s supervisor does: a single-active service that lost its lease exits to come back as a
    standby)."""

    def __init__(self, server, workdir: Path, lease_ttl_s: float = 0.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        spec = workdir / "cluster.yaml"
        spec.write_text(CLUSTER)
        env = devstack.service_env(server.env, "", cluster=spec, time_scale=1.0, epoch=time.time(),
                                   extra={"GPUSCHED_TICK_S": "0.02", "GPUSCHED_LOG_LEVEL": "WARNING",
                                          "GPUSCHED_LEASE_TTL_S": str(lease_ttl_s)})
        self.procs = devstack.ServiceProcesses(workdir / "logs", {name: env[name] for name in SERVICES})
        self.restarted: list[str] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Stack":
        self.procs.start_all()
        self._task = asyncio.create_task(self._supervise())
        await asyncio.sleep(3)  # the services rebuild and the executor registers its nodes
        return self

    async def _supervise(self) -> None:
        while True:
            self.restarted.extend(self.procs.restart_dead())
            await asyncio.sleep(0.1)

    async def __aexit__(self, *exc) -> None:
        if self._task:
            self._task.cancel()
        self.procs.stop_all()


async def latency(server, admin_js, workdir: Path, jobs: int, rate: float) -> dict:
    operator = await connect(server, "operator")
    try:
        async with Stack(server, workdir):
            await scheduled_after(admin_js, operator.jetstream(), f"{workdir.name}-warm", 20, rate)
            latency_ms = await scheduled_after(admin_js, operator.jetstream(), f"{workdir.name}-lat", jobs, rate)
    finally:
        await operator.close()
    return {"submit_to_scheduled_ms_p50": pct(latency_ms, 50), "submit_to_scheduled_ms_p99": pct(latency_ms, 99)}


def bench_job(job_id: str) -> SubmitJob:
    return SubmitJob(job_id=job_id, on_behalf_of="bench", spec=JobSpec(
        kind="batch", queue="bench", team="team-a", image="img", gpus=1, gpu_flavors=("a100",),
        expected_runtime_seconds=0.05))


async def scheduled_after(admin_js, ojs, prefix: str, n: int, rate: float) -> list[float]:
    """Submit ``n`` one-GPU jobs of 50 ms at ``rate`` per second; milliseconds from each one's
    submission to its JobScheduled (the scheduler's decision time), once all are scheduled."""
    start_seq = await eventlog.last_sequence(admin_js) + 1
    submitted_at: dict[str, float] = {}
    t0 = time.time()
    for i in range(n):
        job = bench_job(f"{prefix}-{i}")
        await asyncio.sleep(max(0.0, t0 + i / rate - time.time()))
        submitted_at[job.job_id] = time.time()
        await commands_publish(ojs, job)
    scheduled: dict[str, float] = {}
    while len(scheduled) < n:
        if time.time() - t0 > 300:
            raise TimeoutError(f"{prefix}: {len(scheduled)} of {n} jobs scheduled in 5 minutes")
        await asyncio.sleep(0.5)
        async for m in eventlog.read(admin_js, from_seq=start_seq, subjects=["gpusched.job.*.scheduled"]):
            event = parse_event(m.data)
            if event.aggregate_id in submitted_at:
                scheduled[event.aggregate_id] = event.occurred_at.timestamp()
    return [(scheduled[j] - submitted_at[j]) * 1000 for j in submitted_at]


async def leader_loss(cluster: devstack.NatsCluster, admin_js, workdir: Path, rate: float, lease_ttl_s: float,
                      before_s: float = 8.0, after_s: float = 20.0) -> dict:
    """Jobs at ``rate`` for ``before_s``, the GPUSCHED_EVENTS stream leader killed, jobs for
    ``after_s`` more; the decisions (JobScheduled, by the time the stream stored them) around it."""
    operator = await connect(cluster, "operator")
    ojs = operator.jetstream()
    start_seq = await eventlog.last_sequence(admin_js) + 1
    prefix = f"{workdir.name}-loss"
    killed_at = 0.0
    try:
        async with Stack(cluster, workdir, lease_ttl_s) as stack:
            t0 = time.time()
            leader = cluster.index((await admin_js.stream_info(eventlog.EVENTS_STREAM)).cluster.leader)
            i = 0
            while time.time() - t0 < before_s + after_s:
                if not killed_at and time.time() - t0 >= before_s:
                    leader = cluster.index((await admin_js.stream_info(eventlog.EVENTS_STREAM)).cluster.leader)
                    cluster.kill(leader)
                    killed_at = time.time()
                    election = asyncio.create_task(_new_leader(admin_js, cluster.name(leader)))
                job = bench_job(f"{prefix}-{i}")
                while True:  # the intake may be electing its leader too: again (the message id de-duplicates)
                    try:
                        await commands_publish(ojs, job)
                        break
                    except eventlog.BROKER_ERRORS:
                        await asyncio.sleep(0.05)
                i += 1
                await asyncio.sleep(max(0.0, t0 + i / rate - time.time()))
            await asyncio.sleep(5)
            restarted = list(stack.restarted)
        elected_at = await asyncio.wait_for(election, 30)
        cluster.start()  # the killed server back (it catches up as a follower)
        stored: list[float] = []
        async for m in eventlog.read(admin_js, from_seq=start_seq, subjects=["gpusched.job.*.scheduled"]):
            if parse_event(m.data).aggregate_id.startswith(prefix):
                stored.append(m.metadata.timestamp.timestamp())
    finally:
        await operator.close()
    stored.sort()
    gaps = [(b - a, a) for a, b in zip(stored, stored[1:])]
    calm = [g for g, at in gaps if at < killed_at - 1]
    around = [g for g, at in gaps if killed_at - 1 <= at <= killed_at + after_s]
    after = [s for s in stored if s > killed_at]
    return {"lease_ttl_s": lease_ttl_s, "killed": cluster.name(leader), "jobs_submitted": i,
            "jobs_scheduled": len(stored), "services_restarted": restarted,
            "new_stream_leader_after_s": elected_at - killed_at,
            "first_decision_after_kill_s": (after[0] - killed_at) if after else None,
            "longest_gap_around_kill_s": max(around) if around else None,
            "longest_gap_without_kill_s": max(calm) if calm else None}


async def _new_leader(js, old: str) -> float:
    """When a server other than ``old`` is first seen leading GPUSCHED_EVENTS (asked every 0.1 s)."""
    nc = eventlog.client_of(js)
    while True:
        try:
            reply = await nc.request(f"$JS.API.STREAM.INFO.{eventlog.EVENTS_STREAM}", b"", timeout=0.5)
            leader = (json.loads(reply.data).get("cluster") or {}).get("leader")
            if leader not in (None, old):
                return time.time()
        except eventlog.BROKER_ERRORS:
            pass
        await asyncio.sleep(0.1)


async def commands_publish(ojs, job: SubmitJob) -> None:
    from gpusched.gateway import commands

    await commands.publish_command(ojs, "team-a", "submit", job, headers={"Nats-Msg-Id": f"submit:{job.job_id}"})


async def measure(server, replicas: int, work: Path, args) -> dict:
    admin = await connect(server, "admin")
    js = admin.jetstream()
    try:
        await fresh_log(js, replicas)
        rates = await append_rate(js, args.appends, replicas)
        await fresh_log(js, replicas)
        figures = {**rates, **await latency(server, js, work / f"r{replicas}-latency", args.jobs, args.rate)}
        if isinstance(server, devstack.NatsCluster):
            figures["leader_loss"] = []
            for ttl in (0.0, LEASE_TTL_S):
                await fresh_log(js, replicas)
                figures["leader_loss"].append(await leader_loss(server, js, work / f"r{replicas}-loss-{ttl:g}",
                                                                args.rate, ttl))
    finally:
        await admin.close()
    return figures


async def main(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpusched-bench-cluster-"))
    result: dict = {"machine": f"{platform.node()} {os.cpu_count()} CPUs "
                               f"{round(psutil.virtual_memory().total / 2**30)} GiB",
                    "appends": args.appends, "jobs": args.jobs, "rate_per_s": args.rate}
    single = devstack.NatsServer(work / "r1", teams=("team-a",)).start()
    try:
        result["r1"] = await measure(single, 1, work, args)
    finally:
        single.stop()
    cluster = devstack.NatsCluster(work / "r3", size=3, teams=("team-a",)).start()
    try:
        result["r3"] = await measure(cluster, 3, work, args)
    finally:
        cluster.stop()
    return result


def report(r: dict) -> None:
    print(f"\ngpusched bench.cluster — {r['machine']} (R3: three nats-servers on the same cores)")
    r1, r3 = r["r1"], r["r3"]
    rows = [
        ("EventLog.append, one at a time", "append_per_s", "/s"),
        ("acked publish, 1,000 in flight", "publish_pipelined_per_s", "/s"),
        (f"submit → scheduled p50 at {r['rate_per_s']:g} jobs/s", "submit_to_scheduled_ms_p50", " ms"),
        (f"submit → scheduled p99 at {r['rate_per_s']:g} jobs/s", "submit_to_scheduled_ms_p99", " ms"),
    ]
    print(f"  {'':46} {'R1':>12} {'R3':>12} {'R3/R1':>7}")
    for label, key, unit in rows:
        print(f"  {label:46} {r1[key]:>10.1f}{unit:2} {r3[key]:>10.1f}{unit:2} {r3[key] / r1[key]:>7.2f}")
    for loss in r3["leader_loss"]:
        how = f"leases of {loss['lease_ttl_s']:g} s" if loss["lease_ttl_s"] else "no leases (make run)"
        first = loss["first_decision_after_kill_s"]
        print(f"  GPUSCHED_EVENTS leader ({loss['killed']}) killed -9, {how}: new leader seen after "
              f"{loss['new_stream_leader_after_s']:.2f} s; first job scheduled "
              f"{'never' if first is None else f'{first:.2f} s'} after the kill; longest gap between two jobs "
              f"scheduled {loss['longest_gap_around_kill_s'] or 0:.2f} s (without a kill "
              f"{loss['longest_gap_without_kill_s'] or 0:.2f} s); {loss['jobs_scheduled']}/{loss['jobs_submitted']} "
              f"scheduled; services started again: {', '.join(loss['services_restarted']) or 'none'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=2000, help="sequential appends per topology")
    parser.add_argument("--jobs", type=int, default=300, help="jobs of the latency phase")
    parser.add_argument("--rate", type=float, default=20.0, help="jobs per second submitted")
    command_line(parser, main, report)
