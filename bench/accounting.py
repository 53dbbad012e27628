"""`make bench` (accounting): replay N events (default 1,000,000) from JetStream into the read
models, beside the two ceilings measured in the same run on the same servers: the raw JetStream
ordered-consumer read rate (messages counted, nothing parsed) and the raw Postgres COPY rate
(ledger-shaped rows). Target: replay within 2× of the slower ceiling (ratio ≥ 0.5).

    python -m bench.accounting [--events N] [--repeats R] [--batch B] [--json PATH]

The log is a realistic mix: per job JobSubmitted, JobAdmitted, QuotaReserved, JobScheduled,
JobStarted, JobCheckpointed, JobSucceeded, QuotaReleased (8 events), built once and stamped with
a job id per copy; a queue and a price book first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import nats
import psutil

from bench import command_line
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import (
    JobAdmitted, JobCheckpointed, JobScheduled, JobSpec, JobStarted, JobSubmitted, JobSucceeded, NodeAssignment,
    QuotaReleased, QuotaReserved, dumps, event_subject, new_event,
)
from schemas.accounting import PriceBookUpdated
from schemas.node import NodeInfo, NodeRegistered
from schemas.queue import FlavorQuota, QueueConfigured
from services.accounting import replay, sink

T0 = datetime(2026, 11, 2, tzinfo=UTC)
JOB = "jobxxxxxxxxx"  # the placeholder replaced by each copy's id (same length keeps sizes equal)


def template() -> list[tuple[str, bytes]]:
    """One job's lifecycle as (subject, payload) with JOB as the job id placeholder."""
    spec = JobSpec(kind="training", queue="bench", team="team-a", project="vision", image="img", gpus=2)
    t = lambda s: T0 + timedelta(seconds=s)  # noqa: E731
    ev = [
        new_event(JobSubmitted, aggregate_id=JOB, producer="admission", occurred_at=t(0), key="s", spec=spec,
                  submitter="bench", intake_sequence=1),
        new_event(JobAdmitted, aggregate_id=JOB, producer="admission", occurred_at=t(0), key="a", queue="bench",
                  priority=500, preemptible=True),
        new_event(QuotaReserved, aggregate_id=JOB, producer="quota", occurred_at=t(5), key="1", attempt=1,
                  queue="bench", flavor="a100", gpus=2, borrowed=1),
        new_event(JobScheduled, aggregate_id=JOB, producer="scheduler", occurred_at=t(6), key="1", attempt=1,
                  flavor="a100", placement=(NodeAssignment(node="n1", gpus=2, gpu_indices=(0, 1)),)),
        new_event(JobStarted, aggregate_id=JOB, producer="executor", occurred_at=t(8), key="1", attempt=1,
                  nodes=("n1",)),
        new_event(JobCheckpointed, aggregate_id=JOB, producer="admission", occurred_at=t(600), key="c", attempt=1,
                  checkpointed_at=t(599), step=100, intake_sequence=2),
        new_event(JobSucceeded, aggregate_id=JOB, producer="executor", occurred_at=t(1800), key="1", attempt=1,
                  started_at=t(8)),
        new_event(QuotaReleased, aggregate_id=JOB, producer="quota", occurred_at=t(1800), key="1", attempt=1,
                  queue="bench", flavor="a100", gpus=2, reason="JobSucceeded"),
    ]
    return [(event_subject(e), dumps(e)) for e in ev]


async def publish_log(nc, n_events: int) -> int:
    """Fill the events stream with exactly n_events (acknowledged, pipelined publishes)."""
    js = nc.jetstream()
    log = eventlog.EventLog(js)
    await log.append(QueueConfigured(event_id="bench-q", aggregate_id="bench", occurred_at=T0 - timedelta(days=1),
                                     producer="config", name="bench", allowed_teams=("team-a",),
                                     quotas=(FlavorQuota(flavor="a100", nominal=1000),)))
    await log.append(new_event(PriceBookUpdated, aggregate_id="default", producer="config", occurred_at=T0, key="b",
                               effective_from=T0 - timedelta(days=30), gpu_prices=({"flavor": "a100", "gpu_hour": 2.0},)))
    tpl = template()
    jobs = (n_events - 2) // len(tpl)
    pending: list = []
    for i in range(jobs):
        jid = f"j{i:011d}"
        for k, (subject, payload) in enumerate(tpl):
            data = payload.replace(JOB.encode(), jid.encode())
            # unique event ids: the template's ids are per placeholder job
            data = data.replace(b'"event_id":"', f'"event_id":"{i}-'.encode(), 1)
            pending.append(await js.publish_async(subject.replace(JOB, jid), data,
                                                  headers={"Nats-Msg-Id": f"{i}-{k}"}))
        if len(pending) >= 4000:
            await asyncio.gather(*pending)  # raises if any publish was refused
            pending.clear()
    # pad to exactly n_events with node inventory events
    for k in range(n_events - 2 - jobs * len(tpl)):
        node = new_event(NodeRegistered, aggregate_id=f"pad{k}", producer="executor", occurred_at=T0, key="1",
                         node=NodeInfo(name=f"pad{k}", gpu_flavor="a100", gpu_count=8))
        pending.append(await js.publish_async(event_subject(node), dumps(node), headers={"Nats-Msg-Id": node.event_id}))
    await asyncio.gather(*pending)
    want = n_events
    deadline = time.monotonic() + 60
    while (got := (await js.stream_info(eventlog.EVENTS_STREAM)).state.messages) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"stream has {got} of {want} messages")
        await asyncio.sleep(0.2)
    return want


async def raw_ordered_read(js, n: int) -> float:
    """Messages/s through a push ordered consumer over the whole stream, nothing parsed."""
    done = asyncio.Event()
    count = 0

    async def cb(msg):
        nonlocal count
        count += 1
        if count >= n:
            done.set()

    t = time.perf_counter()
    sub = await js.subscribe("gpusched.>", stream=eventlog.EVENTS_STREAM, ordered_consumer=True, cb=cb,
                             pending_msgs_limit=-1, pending_bytes_limit=-1)
    await asyncio.wait_for(done.wait(), timeout=600)
    rate = n / (time.perf_counter() - t)
    await sub.unsubscribe()
    return rate


async def raw_copy(dsn: str, n: int) -> float:
    """Rows/s of COPY into a ledger-shaped table with a primary key, in one transaction."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DROP TABLE IF EXISTS copy_ceiling; CREATE TABLE copy_ceiling (job_id text, attempt int, "
                           "team text, queue text, flavor text, gpus int, started_at timestamptz, "
                           "ended_at timestamptz, gpu_seconds float8, sequence bigint, PRIMARY KEY (job_id, attempt))")
        t1 = T0 + timedelta(hours=1)
        records = [(f"j{i:011d}", 1, "team-a", "bench", "a100", 2, T0, t1, 7200.0, i) for i in range(n)]
        t = time.perf_counter()
        async with conn.transaction():
            await conn.copy_records_to_table("copy_ceiling", records=records)
        rate = n / (time.perf_counter() - t)
        await conn.execute("DROP TABLE copy_ceiling")
        return rate
    finally:
        await conn.close()


async def replay_run(nc, dsn: str, schema: str, batch: int) -> dict:
    t = time.perf_counter()
    progress = await replay.rebuild(nc, dsn, schema, batch=batch)  # what `gpusched replay --into` runs
    wall = time.perf_counter() - t
    conn = await replay.connect(dsn, schema)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM usage_ledger")
        position = await sink.position(conn)
    finally:
        await conn.close()
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA {schema} CASCADE")
    await admin.execute("CHECKPOINT")  # this run's dirty pages are not flushed during the next one's ceilings
    await admin.close()
    return {"events": progress.applied, "wall_s": wall, "events_per_s": progress.applied / wall,
            "read_s": progress.read_s, "apply_s": progress.apply_s, "turn_wait_s": progress.wait_s,
            "writer_cpu_s": progress.writer_cpu_s,
            "ledger_rows": rows, "position": position}


@contextlib.asynccontextmanager
async def servers(prefix: str):
    """A nats-server with the streams provisioned and a Postgres, in a temporary directory, for
    one bench run: (the server, Postgres, the admin's NATS client); all stopped after."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    server = devstack.NatsServer(work / "nats", teams=("team-a",)).start()
    pg = devstack.Postgres(work / "pg").start()
    try:
        nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"],
                                max_outstanding_pings=10, pending_size=64 * 2**20)
        await eventlog.provision(nc.jetstream())
        try:
            yield server, pg, nc
        finally:
            await nc.close()
    finally:
        pg.stop()
        server.stop()


async def main(args) -> dict:
    async with servers("gpusched-bench-acct-") as (_, pg, nc):
        js = nc.jetstream()
        t = time.perf_counter()
        n = await publish_log(nc, args.events)
        publish_s = time.perf_counter() - t
        conn = await asyncpg.connect(pg.dsn)
        await conn.execute('CREATE DATABASE "bench"')
        await conn.close()
        dsn = pg.dsn.rsplit("/", 1)[0] + "/bench"
        runs = []
        for r in range(args.repeats):
            read = await raw_ordered_read(js, n)
            copy = await raw_copy(dsn, n)
            rep = await replay_run(nc, dsn, f"bench_{r}", args.batch)
            if rep["position"] != n or rep["ledger_rows"] != (n - 2) // 8:
                raise RuntimeError(f"replay incomplete: {rep}")
            runs.append({"read_msgs_per_s": read, "copy_rows_per_s": copy, **rep,
                         "ratio": rep["events_per_s"] / min(read, copy)})
            print(f"  run {r + 1}: replay {rep['events_per_s']:,.0f} ev/s, ordered read {read:,.0f} msg/s, "
                  f"COPY {copy:,.0f} rows/s, ratio {runs[-1]['ratio']:.2f} ({rep['wall_s']:.1f} s; the writers together: "
                  f"waiting for reads {rep['read_s']:.0f} s, parsing and writing {rep['apply_s']:.0f} s, waiting for the turn "
                  f"{rep['turn_wait_s']:.0f} s, CPU {rep['writer_cpu_s']:.0f} s)", flush=True)
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    slower = min(med("read_msgs_per_s"), med("copy_rows_per_s"))
    return {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs {round(psutil.virtual_memory().total / 2**30)} GiB",
        "events": n, "batch": args.batch, "publish_s": publish_s,
        "replay_events_per_s": med("events_per_s"), "raw_ordered_read_msgs_per_s": med("read_msgs_per_s"),
        "raw_copy_rows_per_s": med("copy_rows_per_s"),
        "ratio_to_slower_ceiling": med("events_per_s") / slower,
        "ratio_to_read": med("events_per_s") / med("read_msgs_per_s"),
        "ratio_to_copy": med("events_per_s") / med("copy_rows_per_s"),
        "target_met": med("events_per_s") / slower >= 0.5,
        "runs": runs,
    }


def report(r: dict) -> None:
    print(f"\ngpusched bench.accounting — {r['machine']}; {r['events']:,} events, batch {r['batch']} "
          f"(medians of {len(r['runs'])} runs)")
    rows = [
        ("raw JetStream ordered-consumer read", f"{r['raw_ordered_read_msgs_per_s']:,.0f} msg/s", "ceiling"),
        ("raw Postgres COPY (ledger-shaped rows)", f"{r['raw_copy_rows_per_s']:,.0f} rows/s", "ceiling"),
        ("replay into the read models", f"{r['replay_events_per_s']:,.0f} events/s",
         f"{r['ratio_to_slower_ceiling']:.2f} of the slower ceiling (target ≥ 0.50: "
         f"{'met' if r['target_met'] else 'NOT met'})"),
    ]
    for name, value, ratio in rows:
        print(f"  {name:<40} {value:>20}   {ratio}")
    print(f"  ratios: replay/read {r['ratio_to_read']:.2f}, replay/COPY {r['ratio_to_copy']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=20_000, help="events per replay transaction")
    command_line(parser, main, report)
