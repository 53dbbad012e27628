"""`make bench` (accounting partitions): the live accounting service catching up on a log of N
events (default 200,000) as 1, 2 (and more: ``--partitions``) processes partitioned by team
(services/accounting/partition.py), beside the raw JetStream ordered-consumer read rate measured
in the same run: every partition reads the whole log, so that read is each one's ceiling.

    python -m bench.accounting_partitions [--events N] [--repeats R] [--partitions 1,2] [--json PATH]

Each run starts the real service (``python -m services.accounting``, the accounting NATS
credential, statements off) into a fresh database and times process start → the read models
complete to the log's end (the lowest partition's position). The log: bench.accounting's job
lifecycle (8 events a job) spread over 8 teams, so that partitions share the work evenly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import psutil

from bench import command_line
from bench.accounting import JOB, T0, raw_ordered_read, servers, template
from runtime import eventlog
from runtime.teams import partition_of
from schemas.accounting import PriceBookUpdated
from schemas import new_event
from schemas.queue import FlavorQuota, QueueConfigured
from services.accounting import sink

TEAMS = tuple(f"team-{c}" for c in "abcdefgh")  # as long as the template's team-a: sizes stay equal
REPO = Path(__file__).resolve().parents[1]


async def publish_log(js, n_events: int) -> int:
    """A queue, a price book, then job lifecycles, job ``i`` of team ``i % 8``; exactly n_events
    rounded down to whole jobs."""
    log = eventlog.EventLog(js)
    await log.append(QueueConfigured(event_id="bench-q", aggregate_id="bench", occurred_at=T0, producer="config",
                                     name="bench", allowed_teams=TEAMS, quotas=(FlavorQuota(flavor="a100", nominal=1000),)))
    await log.append(new_event(PriceBookUpdated, aggregate_id="default", producer="config", occurred_at=T0, key="b",
                               effective_from=T0, gpu_prices=({"flavor": "a100", "gpu_hour": 2.0},)))
    tpl = template()
    pending: list = []
    for i in range((n_events - 2) // len(tpl)):
        jid, team = f"j{i:011d}".encode(), TEAMS[i % len(TEAMS)].encode()
        for k, (subject, payload) in enumerate(tpl):
            data = payload.replace(JOB.encode(), jid).replace(b'"team":"team-a"', b'"team":"' + team + b'"')
            data = data.replace(b'"event_id":"', f'"event_id":"{i}-'.encode(), 1)
            pending.append(await js.publish_async(subject.replace(JOB, jid.decode()), data,
                                                  headers={"Nats-Msg-Id": f"{i}-{k}"}))
        if len(pending) >= 4000:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    return await eventlog.last_sequence(js)


async def catch_up(server, admin_dsn: str, db: str, partitions: int, end: int) -> float:
    """Seconds from starting ``partitions`` accounting processes on a fresh database to the read
    models complete up to ``end``."""
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'DROP DATABASE IF EXISTS "{db}"')
    await admin.execute(f'CREATE DATABASE "{db}"')
    await admin.close()
    dsn = admin_dsn.rsplit("/", 1)[0] + f"/{db}"
    conn = await asyncpg.connect(dsn)
    await sink.migrate(conn)  # before the clock starts, as a running platform's database is
    env = {**os.environ, **server.env("accounting"), "GPUSCHED_PG_DSN": dsn, "GPUSCHED_STATEMENT_BY": "",
           "GPUSCHED_ACCOUNTING_PARTITIONS": str(partitions), "GPUSCHED_LOG_LEVEL": "WARNING"}
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "services.accounting"], cwd=REPO,
                              env={**env, "GPUSCHED_ACCOUNTING_PARTITION": str(k)}) for k in range(partitions)]
    try:
        while True:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("an accounting process ended early")
            rows = await sink.partition_rows(conn)
            if len(rows) == partitions and await sink.complete_position(conn) >= end:
                return time.perf_counter() - t
            await asyncio.sleep(0.1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
        ledger = await conn.fetchval("SELECT count(*) FROM usage_ledger")
        await conn.close()
        if ledger != (end - 2) // len(template()):
            raise RuntimeError(f"{ledger} ledger rows, expected {(end - 2) // len(template())}")


async def main(args) -> dict:
    counts = sorted({int(p) for p in args.partitions.split(",")})
    for n in counts:
        if n > 1 and len({partition_of(t, n) for t in TEAMS}) < n:
            raise SystemExit(f"--partitions {n}: the bench's 8 teams leave a partition empty")
    async with servers("gpusched-bench-acctp-") as (server, pg, nc):
        js = nc.jetstream()
        end = await publish_log(js, args.events)
        runs = []
        for r in range(args.repeats):
            run = {"read_msgs_per_s": await raw_ordered_read(js, end)}
            for n in counts:
                wall = await catch_up(server, pg.dsn, f"bench_p{n}_{r}", n, end)
                run[n] = end / wall
            runs.append(run)
            print(f"  run {r + 1}: ordered read {run['read_msgs_per_s']:,.0f} msg/s; "
                  + ", ".join(f"{n} partition(s) {run[n]:,.0f} events/s" for n in counts), flush=True)
    med = {n: statistics.median(r[n] for r in runs) for n in counts}
    read = statistics.median(r["read_msgs_per_s"] for r in runs)
    return {"machine": f"{platform.node()} {os.cpu_count()} CPUs {round(psutil.virtual_memory().total / 2**30)} GiB",
            "events": end, "read_msgs_per_s": read, "events_per_s": {str(n): v for n, v in med.items()},
            "runs": [{str(k): v for k, v in r.items()} for r in runs]}


def report(r: dict) -> None:
    print(f"\ngpusched bench.accounting_partitions — {r['machine']}; {r['events']:,} events over 8 teams "
          f"(medians of {len(r['runs'])} runs)")
    print(f"  {'raw JetStream ordered-consumer read':<44} {r['read_msgs_per_s']:>12,.0f} msg/s   ceiling of each partition")
    one = r["events_per_s"].get("1")
    for n, v in r["events_per_s"].items():
        beside = f"{v / r['read_msgs_per_s']:.2f} of the read" + (f", {v / one:.2f}× one process" if one and n != "1" else "")
        print(f"  {'live accounting, ' + n + ' partition(s)':<44} {v:>12,.0f} ev/s    {beside}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--partitions", default="1,2", help="comma-separated numbers of partitions to run")
    command_line(parser, main, report)
