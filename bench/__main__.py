"""`make bench`: end-to-end throughput and latency through all five services, beside the raw
JetStream publish/consume rates measured in the same run. The ceiling is the pipelined publish
rate (1,000 acknowledged publishes in flight, the same message size and Nats-Msg-Id header as
an append); the sequential rate, one ack awaited per publish, is printed beside it. Each run's
burst also goes through the relay (bench/relay.py: the same topology with no logic) and its
filtered variant, on fresh streams: the services' jobs/s and CPU per event beside the relay's.

    python -m bench [--jobs N] [--repeats R] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
import psutil

from bench import command_line
from bench.relay import Relay
from gpusched.gateway import commands
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import JobSpec, SubmitJob, parse_event
from schemas.queue import FlavorQuota, QueueConfigured

PAYLOAD = b"x" * 700  # about the size of a lifecycle event
CLUSTER = "groups:\n  - {prefix: n, count: 64, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 40960}\n"
TEAMS = ("team-a",)
"""The benchmark's one team; its tenant stream is provisioned, so the notifier does its full work."""


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    k = max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))
    return values[k]


async def raw_publish(js, n: int, subject_prefix: str) -> float:
    """Sequential acknowledged publishes with a Nats-Msg-Id each: what one service append costs."""
    t = time.perf_counter()
    for i in range(n):
        await js.publish(f"{subject_prefix}.{i % 1000}.raw", PAYLOAD, headers={"Nats-Msg-Id": f"{subject_prefix}-{i}"})
    return n / (time.perf_counter() - t)


async def raw_publish_pipelined(nc, n: int, subject_prefix: str, in_flight: int = 1000) -> float:
    """Acknowledged publishes with a Nats-Msg-Id each, up to ``in_flight`` awaiting their ack at
    once (nats-py's publish_async): the broker's ceiling for a producer that does not wait for
    each ack before the next append."""
    js = nc.jetstream(publish_async_max_pending=in_flight)
    t = time.perf_counter()
    acks = [await js.publish_async(f"{subject_prefix}.{i % 1000}.raw", PAYLOAD,
                                   headers={"Nats-Msg-Id": f"{subject_prefix}-{i}"}) for i in range(n)]
    await asyncio.gather(*acks)
    return n / (time.perf_counter() - t)


async def raw_publish_windows(js, n: int, subject_prefix: str, window: int = 1000) -> float:
    """The same publishes as ``js.publish`` calls, ``window`` at a time with asyncio.gather (each
    its own request and reply): how issue 26 first measured the pipelined rate."""
    t = time.perf_counter()
    for start in range(0, n, window):
        await asyncio.gather(*(js.publish(f"{subject_prefix}.{i % 1000}.raw", PAYLOAD,
                                          headers={"Nats-Msg-Id": f"{subject_prefix}-{i}"})
                               for i in range(start, min(n, start + window))))
    return n / (time.perf_counter() - t)


async def raw_consume(js, n: int) -> float:
    t = time.perf_counter()
    count = 0
    async for _ in eventlog.read(js, batch=1000):
        count += 1
    return count / (time.perf_counter() - t)


async def e2e(server: devstack.NatsServer, pg: devstack.Postgres, admin_js, n_jobs: int, workdir: Path,
              latency_jobs: int = 300, rate: float = 25.0) -> dict:
    """All five services as processes at time scale 1 on a 512-GPU sim cluster."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = workdir / "cluster.yaml"
    cluster.write_text(CLUSTER)
    conn = await asyncpg.connect(pg.dsn)
    await conn.execute(f'CREATE DATABASE "{workdir.name}"')  # fresh read models for fresh streams
    await conn.close()
    dsn = pg.dsn.rsplit("/", 1)[0] + f"/{workdir.name}"
    env = devstack.service_env(server.env, dsn, cluster=cluster, time_scale=1.0, epoch=time.time(),
                               extra={"GPUSCHED_TICK_S": "0.02", "GPUSCHED_LOG_LEVEL": "WARNING"})
    log = eventlog.EventLog(admin_js)
    await log.append(QueueConfigured(event_id="bench-q", aggregate_id="bench", occurred_at=datetime.now(UTC),
                                     producer="config", name="bench", allowed_teams=("team-a",),
                                     quotas=(FlavorQuota(flavor="a100", nominal=100_000),)))
    procs = devstack.ServiceProcesses(workdir / "logs", env)
    procs.start_all()
    nc = await nats.connect(server.url(), user="operator", password=server.creds.users["operator"],
                            inbox_prefix=eventlog.inbox_prefix("operator"))
    try:
        await asyncio.sleep(3)  # services rebuild and register nodes
        ojs = nc.jetstream()
        # 1. latency: jobs arrive at a steady rate below capacity
        latency = await _phase(admin_js, ojs, f"{workdir.name}-lat", latency_jobs, rate)
        # 2. throughput: one burst, as fast as the client can publish; the CPU each process
        # spends on it (where a 2-core machine's time goes)
        cpu = {name: psutil.Process(p.pid) for name, p in procs.procs.items()}
        cpu["nats-server"], cpu["bench client"] = psutil.Process(server.proc.pid), psutil.Process()
        before = {name: sum(p.cpu_times()[:2]) for name, p in cpu.items()}
        cpu_s: dict[str, float] = {}
        burst = await _phase(admin_js, ojs, f"{workdir.name}-tp", n_jobs, None, on_done=lambda: cpu_s.update(
            {name: sum(p.cpu_times()[:2]) - before[name] for name, p in cpu.items()}))
        # 3. accounting: how far behind the log the read models are when the burst ends
        last = await eventlog.last_sequence(admin_js)
        t = time.time()
        pg_conn = await asyncpg.connect(dsn)
        while ((await pg_conn.fetchval("SELECT max(last_sequence) FROM projection_position")) or 0) < last:
            await asyncio.sleep(0.05)
        await pg_conn.close()
        rss = {name: psutil.Process(p.pid).memory_info().rss / 2**20 for name, p in procs.procs.items()}
        return {"jobs": n_jobs, "wall_s": burst["wall_s"], "jobs_per_s": n_jobs / burst["wall_s"],
                "events": burst["events"], "events_per_job": burst["events"] / n_jobs,
                "events_per_s": burst["events"] / burst["wall_s"],
                "latency_jobs": latency_jobs, "latency_rate_per_s": rate,
                "submit_to_scheduled_ms_p50": pct(latency["latency_ms"], 50),
                "submit_to_scheduled_ms_p99": pct(latency["latency_ms"], 99),
                "accounting_lag_s": time.time() - t, "rss_mib": rss,
                # CPU microseconds each process spent per event appended during the burst
                "cpu_us_per_event": {k: v * 1e6 / burst["events"] for k, v in cpu_s.items()}}
    finally:
        await nc.close()
        procs.stop_all()


async def relay(server: devstack.NatsServer, admin_js, n_jobs: int, prefix: str, filtered: bool) -> dict:
    """The same burst through the relay's processes (bench/relay.py), with the CPU of every
    process (the relay's, nats-server, the benchmark's client) per event appended."""
    nc = await nats.connect(server.url(), user="operator", password=server.creds.users["operator"],
                            inbox_prefix=eventlog.inbox_prefix("operator"))
    load = os.getloadavg()[0]
    r = Relay(server.env("admin"), filtered=filtered, team=TEAMS[0])
    await asyncio.to_thread(r.start)
    try:
        cpu = {name: psutil.Process(p.pid) for name, p in r.procs.items()}
        cpu["nats-server"], cpu["bench client"] = psutil.Process(server.proc.pid), psutil.Process()
        before = {name: sum(p.cpu_times()[:2]) for name, p in cpu.items()}
        cpu_s: dict[str, float] = {}
        burst = await _phase(admin_js, nc.jetstream(), prefix, n_jobs, None, on_done=lambda: cpu_s.update(
            {name: sum(p.cpu_times()[:2]) - before[name] for name, p in cpu.items()}))
    finally:
        r.stop()
        await nc.close()
    return {"jobs": n_jobs, "wall_s": burst["wall_s"], "jobs_per_s": n_jobs / burst["wall_s"], "events": burst["events"],
            "events_per_s": burst["events"] / burst["wall_s"], "load_avg_1m": load,
            "cpu_us_per_event": {k: v * 1e6 / burst["events"] for k, v in cpu_s.items()}}


async def fresh_streams(js) -> None:
    """New streams (their consumers and duplicate windows go with them). Never purge a live log:
    the services' deterministic ids would be de-duplicated against events that are no longer there."""
    for stream in (eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM):
        await js.delete_stream(stream)
    for team in TEAMS:  # in the team's own account
        await eventlog.tenant_js(js, team).delete_stream(eventlog.tenant_stream(team))
    await eventlog.provision(js, teams=TEAMS)  # the notifier copies the team's events: its real work


async def _phase(admin_js, ojs, prefix: str, n: int, rate: float | None, on_done=None) -> dict:
    """Submit n one-GPU jobs of 50 ms (at ``rate`` per second, or in one burst) and wait until
    every one has succeeded and released its quota."""
    start_seq = await eventlog.last_sequence(admin_js) + 1
    submitted_at: dict[str, float] = {}
    t0 = time.time()
    for i in range(n):
        job = SubmitJob(job_id=f"{prefix}-{i}", on_behalf_of="bench", spec=JobSpec(
            kind="batch", queue="bench", team="team-a", image="img", gpus=1, gpu_flavors=("a100",),
            expected_runtime_seconds=0.05))
        if rate is not None:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.time()))
        submitted_at[job.job_id] = time.time()
        await commands.publish_command(ojs, "team-a", "submit", job)

    async def released() -> int:
        info = await admin_js.stream_info(eventlog.EVENTS_STREAM, subjects_filter="gpusched.job.*.quota_released")
        return sum(1 for subject in (info.state.subjects or {}) if subject.split(".")[2].startswith(prefix))
    while (done := await released()) < n:
        if time.time() - t0 > 300:
            raise TimeoutError(f"{prefix}: {done} of {n} jobs finished in 5 minutes")
        await asyncio.sleep(0.1)
    if on_done is not None:  # the jobs are through: before the figures are read back from the log
        on_done()
    scheduled, succeeded, events = {}, {}, 0
    async for m in eventlog.read(admin_js, from_seq=start_seq):
        e = parse_event(m.data)
        if not e.aggregate_id.startswith(prefix):
            continue
        events += 1
        if e.type == "JobScheduled":
            scheduled[e.aggregate_id] = e.occurred_at.timestamp()
        elif e.type == "JobSucceeded":
            succeeded[e.aggregate_id] = e.occurred_at.timestamp()
    return {"wall_s": max(succeeded.values()) - t0, "events": events,
            "latency_ms": [(scheduled[j] - submitted_at[j]) * 1000 for j in submitted_at]}


async def main(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpusched-bench-"))
    server = devstack.NatsServer(work / "nats", teams=TEAMS).start()
    pg = devstack.Postgres(work / "pg").start()
    try:
        nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"])
        js = nc.jetstream()
        await eventlog.provision(js, teams=TEAMS)
        # the raw ceiling, in the same run, on the same server: a scratch stream
        from nats.js.api import StorageType, StreamConfig
        await js.add_stream(StreamConfig(name="RAW", subjects=["raw.>"], storage=StorageType.FILE, duplicate_window=120))
        pub = [await raw_publish(js, args.raw, f"raw.r{r}") for r in range(args.repeats)]
        piped = [await raw_publish_pipelined(nc, args.raw, f"raw.p{r}") for r in range(args.repeats)]
        windows = [await raw_publish_windows(js, args.raw, f"raw.w{r}") for r in range(args.repeats)]
        runs, relays, filtered = [], [], []
        for r in range(args.repeats):  # each run, the relay's and the filtered relay's on new streams
            await fresh_streams(js)
            load = os.getloadavg()[0]
            runs.append({**await e2e(server, pg, js, args.jobs, work / f"run{r}"), "load_avg_1m": load})
            await fresh_streams(js)
            relays.append(await relay(server, js, args.jobs, f"relay{r}", filtered=False))
            await fresh_streams(js)
            filtered.append(await relay(server, js, args.jobs, f"filtered{r}", filtered=True))
        consume = [await raw_consume(js, 0) for _ in range(args.repeats)]
        await nc.close()
    finally:
        pg.stop()
        server.stop()
    shutil.rmtree(work, ignore_errors=True)  # 150-260 MB a run; a failed run keeps its logs there
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    raw_pub = statistics.median(pub)
    raw_piped = statistics.median(piped)
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs {round(psutil.virtual_memory().total / 2**30)} GiB",
        "raw_publish_msgs_per_s": raw_pub,
        "raw_publish_pipelined_msgs_per_s": raw_piped,
        "raw_publish_windows_msgs_per_s": statistics.median(windows),
        "raw_consume_msgs_per_s": statistics.median(consume),
        "jobs_per_s": med("jobs_per_s"),
        "events_per_s": med("events_per_s"),
        "events_per_job": med("events_per_job"),
        "submit_to_scheduled_ms_p50": med("submit_to_scheduled_ms_p50"),
        "submit_to_scheduled_ms_p99": med("submit_to_scheduled_ms_p99"),
        "accounting_lag_s": med("accounting_lag_s"),
        "latency_rate_per_s": runs[0]["latency_rate_per_s"],
        "ratio_events_per_s_to_raw_publish": med("events_per_s") / raw_pub,
        "ratio_events_per_s_to_pipelined": med("events_per_s") / raw_piped,
        # jobs/s the pipelined ceiling allows at this run's events per job
        "jobs_per_s_ceiling": raw_piped / med("events_per_job"),
        "relay_jobs_per_s": statistics.median(r["jobs_per_s"] for r in relays),
        "relay_filtered_jobs_per_s": statistics.median(r["jobs_per_s"] for r in filtered),
        "ratio_jobs_per_s_to_relay": med("jobs_per_s") / statistics.median(r["jobs_per_s"] for r in relays),
        "runs": runs,
        "relay_runs": relays,
        "relay_filtered_runs": filtered,
    }
    return result


def report(r: dict) -> None:
    print(f"\ngpusched bench — {r['machine']} (medians of {len(r['runs'])} runs; noisy 2-core box: read the ratios)")
    rows = [
        ("raw JetStream publish (acked, 1,000 in flight)", f"{r['raw_publish_pipelined_msgs_per_s']:.0f} msg/s",
         "1.00 (ceiling)"),
        ("raw JetStream publish (acked, gather × 1,000)", f"{r['raw_publish_windows_msgs_per_s']:.0f} msg/s",
         f"{r['raw_publish_windows_msgs_per_s'] / r['raw_publish_pipelined_msgs_per_s']:.2f} of the ceiling"),
        ("raw JetStream publish (acked, sequential)", f"{r['raw_publish_msgs_per_s']:.0f} msg/s",
         f"{r['raw_publish_msgs_per_s'] / r['raw_publish_pipelined_msgs_per_s']:.2f} of the ceiling"),
        ("raw JetStream consume (pull, batch 1000)", f"{r['raw_consume_msgs_per_s']:.0f} msg/s", ""),
        (f"e2e jobs submit → succeeded (burst of {r['runs'][0]['jobs']})", f"{r['jobs_per_s']:.1f} jobs/s",
         f"{r['jobs_per_s'] / r['jobs_per_s_ceiling']:.2f} of the ceiling / events per job "
         f"({r['jobs_per_s_ceiling']:.0f} jobs/s)"),
        ("e2e events appended by the services", f"{r['events_per_s']:.0f} events/s",
         f"{r['ratio_events_per_s_to_pipelined']:.2f} of the ceiling "
         f"({r['ratio_events_per_s_to_raw_publish']:.2f} of sequential)"),
        ("events per job", f"{r['events_per_job']:.2f}", ""),
        (f"submit → scheduled p50 at {r['latency_rate_per_s']:.0f} jobs/s", f"{r['submit_to_scheduled_ms_p50']:.1f} ms", ""),
        (f"submit → scheduled p99 at {r['latency_rate_per_s']:.0f} jobs/s", f"{r['submit_to_scheduled_ms_p99']:.1f} ms", ""),
        ("accounting behind the log after the burst", f"{r['accounting_lag_s']:.2f} s", ""),
    ]
    for name, value, ratio in rows:
        print(f"  {name:<44} {value:>18}   {ratio}")
    rss = r["runs"][-1]["rss_mib"]
    print("  service RSS (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))
    cpu = {k: statistics.median(run["cpu_us_per_event"][k] for run in r["runs"]) for k in r["runs"][0]["cpu_us_per_event"]}
    total = sum(cpu.values())
    print(f"  CPU per event appended in the burst: {total:.0f} µs in all = at most {2e6 / total:.0f} events/s on 2 "
          "cores; " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    print(f"\n  the relay (bench/relay.py: the same topology, no logic), the same burst; 1-minute load average "
          "before each run in brackets")
    for name, runs in (("services", r["runs"]), ("relay", r["relay_runs"]), ("relay, filtered", r["relay_filtered_runs"])):
        cpu = {k: statistics.median(run["cpu_us_per_event"][k] for run in runs) for k in runs[0]["cpu_us_per_event"]}
        print(f"  {name:<16} {statistics.median(run['jobs_per_s'] for run in runs):7.1f} jobs/s "
              "(" + ", ".join(f"{run['jobs_per_s']:.0f} [{run['load_avg_1m']:.1f}]" for run in runs) + "); "
              f"{sum(cpu.values()):.0f} µs CPU per event in all: "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    print(f"  services / relay: {r['ratio_jobs_per_s_to_relay']:.2f} (jobs/s, medians); services / filtered relay: "
          f"{r['jobs_per_s'] / r['relay_filtered_jobs_per_s']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--raw", type=int, default=5000, help="messages per raw publish run")
    command_line(parser, main, report)
