"""`make bench` (admission partitions): the live admission service working off a backlog of N
submissions (default 20,000, over 8 teams) as 1 and 2 (``--partitions``) processes partitioned by
team (services/admission/__main__.py), beside the broker's pipelined publish ceiling measured on
the same server in the same run: a submission costs two appends (JobSubmitted, JobAdmitted), so
half that rate is the most submissions/s any admission could decide.

    python -m bench.admission_partitions [--commands N] [--repeats R] [--partitions 1,2] [--json PATH]

Each run starts a fresh nats-server, publishes the queue, a node and the N SubmitJob commands
(pipelined, as the teams' intake subjects), then starts the real service processes (``python -m
services.admission``, the admission credential, no snapshots) and times process start → every
submission decided (the log holds 2 events per command). Then the processes are stopped and the
ceiling measured on that server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import nats
import psutil

from bench import command_line
from bench.__main__ import raw_publish_pipelined
from gpusched.dev import stack as devstack
from runtime import eventlog
from runtime.teams import partition_of
from schemas import NodeRegistered, QueueConfigured, new_event
from schemas.node import NodeInfo
from schemas.queue import FlavorQuota

TEAMS = ("team-a", "team-b", "team-c", "team-d", "team-e", "team-f", "team-g", "team-j")
"""Four teams in each of two partitions (runtime.teams.partition_of), so that two partitions
share the backlog evenly: what is measured is what a partition costs, not how the hash fell."""
REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
CEILING_MESSAGES = 20_000


@contextlib.asynccontextmanager
async def server():
    with tempfile.TemporaryDirectory(prefix="gpusched-bench-admp-") as work:
        srv = devstack.NatsServer(Path(work) / "nats", teams=("team-a",)).start()
        try:
            nc = await nats.connect(srv.url(), user="admin", password=srv.creds.users["admin"],
                                    max_outstanding_pings=10, pending_size=64 * 2**20)
            await eventlog.provision(nc.jetstream())
            try:
                yield srv, nc
            finally:
                await nc.close()
        finally:
            srv.stop()


async def publish_backlog(nc, commands: int) -> int:
    """The configuration and ``commands`` submissions, team ``i % 8``; returns the log's length
    once every submission is decided."""
    js = nc.jetstream(publish_async_max_pending=2000)
    log = eventlog.EventLog(js)
    await log.append(new_event(QueueConfigured, aggregate_id="bench", producer="config", occurred_at=T0, key="q",
                               name="bench", allowed_teams=TEAMS, quotas=(FlavorQuota(flavor="a100", nominal=1000),)))
    await log.append(new_event(NodeRegistered, aggregate_id="n1", producer="executor", occurred_at=T0, key="n",
                               node=NodeInfo(name="n1", gpu_flavor="a100", gpu_count=8, gpu_memory_mib=81920)))
    acks = []
    for i in range(commands):
        team = TEAMS[i % len(TEAMS)]
        body = {"spec": {"kind": "training", "queue": "bench", "team": team, "image": "registry.example/train:1",
                         "gpus": 1 + i % 8, "gpu_flavors": ["a100"]}}
        acks.append(await js.publish_async(f"gpusched.intake.{team}.submit", json.dumps(body).encode()))
    await asyncio.gather(*acks)
    return 2 + 2 * commands


async def decide(srv, js, partitions: int, end: int) -> tuple[float, list[float], float]:
    """Seconds from starting ``partitions`` admission processes to the log holding ``end`` events;
    the CPU seconds each process used, and nats-server's, in that time."""
    server_cpu = psutil.Process(srv.proc.pid)
    server_before = sum(server_cpu.cpu_times()[:2])
    env = {**os.environ, **srv.env("admission"), "GPUSCHED_ADMISSION_PARTITIONS": str(partitions),
           "GPUSCHED_SNAPSHOT_EVERY": "0", "GPUSCHED_LOG_LEVEL": "ERROR", "GPUSCHED_METRICS_PORT": "0"}
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "services.admission"], cwd=REPO,
                              env={**env, "GPUSCHED_ADMISSION_PARTITION": str(k)}) for k in range(partitions)]
    try:
        while (got := await eventlog.last_sequence(js)) < end:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("an admission process ended early")
            await asyncio.sleep(0.05)
        wall = time.perf_counter() - t
        cpu = [sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs]
        if got != end:
            raise RuntimeError(f"the log holds {got} events, expected {end}")
        return wall, cpu, sum(server_cpu.cpu_times()[:2]) - server_before
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)


async def one_run(partitions: int, commands: int) -> dict[str, float]:
    """Submissions decided per second, the pipelined publish ceiling in messages/s, and CPU
    milliseconds per submission: of the busiest admission process, of all of them, of nats-server."""
    async with server() as (srv, nc):
        js = nc.jetstream()
        end = await publish_backlog(nc, commands)
        wall, cpu, server_cpu = await decide(srv, js, partitions, end)
        ceiling = await raw_publish_pipelined(nc, CEILING_MESSAGES, "gpusched.job.ceiling")
    return {"rate": commands / wall, "ceiling": ceiling, "cpu_ms_max": 1000 * max(cpu) / commands,
            "cpu_ms_all": 1000 * sum(cpu) / commands, "server_cpu_ms": 1000 * server_cpu / commands}


async def main(args) -> dict:
    counts = sorted({int(p) for p in args.partitions.split(",")})
    for n in counts:
        if n > 1 and len({partition_of(t, n) for t in TEAMS}) < n:
            raise SystemExit(f"--partitions {n}: the bench's 8 teams leave a partition empty")
    runs = []
    for r in range(args.repeats):
        run = {str(n): await one_run(n, args.commands) for n in counts}
        runs.append(run)
        print(f"  run {r + 1}: " + ", ".join(f"{n} partition(s) {run[str(n)]['rate']:,.0f} submissions/s (ceiling "
                                            f"{run[str(n)]['ceiling']:,.0f} msg/s)" for n in counts), flush=True)

    def median(n: int, key: str) -> float:
        return statistics.median(r[str(n)][key] for r in runs)
    return {"machine": f"{platform.node()} {os.cpu_count()} CPUs {round(psutil.virtual_memory().total / 2**30)} GiB",
            "commands": args.commands,
            "publish_ceiling_msgs_per_s": statistics.median(r[str(n)]["ceiling"] for r in runs for n in counts),
            "submissions_per_s": {str(n): median(n, "rate") for n in counts},
            "cpu_ms_per_submission": {str(n): {k: median(n, k) for k in ("cpu_ms_max", "cpu_ms_all", "server_cpu_ms")}
                                      for n in counts},
            "runs": runs}


def report(r: dict) -> None:
    print(f"\ngpusched bench.admission_partitions — {r['machine']}; a backlog of {r['commands']:,} submissions over "
          f"8 teams (medians of {len(r['runs'])} runs)")
    ceiling = r["publish_ceiling_msgs_per_s"]
    print(f"  {'raw JetStream pipelined publish':<40} {ceiling:>10,.0f} msg/s   / 2 appends a submission = "
          f"{ceiling / 2:,.0f} submissions/s ceiling")
    one = r["submissions_per_s"].get("1")
    for n, v in r["submissions_per_s"].items():
        beside = f"{v / (ceiling / 2):.2f} of the ceiling" + (f", {v / one:.2f}× one process" if one and n != "1" else "")
        print(f"  {'live admission, ' + n + ' partition(s)':<40} {v:>10,.0f} sub/s   {beside}")
    print("  CPU per submission (ms): the busiest admission process / all of them / nats-server")
    for n, c in r["cpu_ms_per_submission"].items():
        print(f"    {n} partition(s): {c['cpu_ms_max']:.3f} / {c['cpu_ms_all']:.3f} / {c['server_cpu_ms']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commands", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--partitions", default="1,2", help="comma-separated numbers of partitions to run")
    command_line(parser, main, report)
