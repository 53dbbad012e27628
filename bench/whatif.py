"""What-if over a long recorded history: ``gpusched whatif`` (a separate process, as an operator
runs it) over a log of ``--jobs`` recorded jobs (default 100,000) in a real nats-server, with no
change and with a changed priority class and quota. Reports its wall time and peak memory beside
the time the live platform took to decide the same jobs (the recorded history's span of event
time: the target is at least 50× faster than that), and beside the raw ceiling measured in the
same run: reading and parsing the events the what-if reads, with no replay.

The history comes from bench/history.py (the platform's cores on a virtual clock, no service
lag), so the no-change replay must reproduce every decision; the bench checks it.

    python -m bench.whatif [--jobs 100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nats
import psutil

from bench import history
from gpusched.dev import stack as devstack
from gpusched.api import whatif as whatif_run
from runtime import eventlog
from schemas import parse_event

TARGET = 50.0  # × faster than the platform took
CHANGES = """
priority_classes:
  - {name: inference-sla, value: 1000, preemptible: false}
  - {name: deadline-training, value: 800, preemptible: true, protection_seconds: 1800, max_preemptions: 2,
     preemption_grace_seconds: 120}
  - {name: training, value: 500, preemptible: true, protection_seconds: 600, max_preemptions: 5,
     preemption_grace_seconds: 60}
  - {name: experiment, value: 600, preemptible: true, protection_seconds: 300}
  - {name: batch-low, value: 100, preemptible: true, preemption_grace_seconds: 10}
queues:
  - name: research
    cohort: shared
    allowed_teams: [team-research]
    quotas:
      - {flavor: h100-80gb, nominal: 40, borrowing_limit: 8}
      - {flavor: a100-40gb, nominal: 32}
"""


def timed_cli(server: devstack.NatsServer, *args: str) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB, stdout) of one `gpusched` process; its resident memory is
    sampled every 0.2 s while it runs (its own, not the largest of this process's children)."""
    env = {**os.environ, **server.env("operator")}
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gpusched.cli.main", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = 0
    watched = psutil.Process(proc.pid)
    out_parts: list[str] = []
    reader = threading.Thread(target=lambda: out_parts.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, watched.memory_info().rss)
        time.sleep(0.2)
    wall = time.perf_counter() - began
    reader.join()
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"gpusched {' '.join(args)} failed: {err}")
    return wall, peak / 2**20, "".join(out_parts)


async def read_only(server: devstack.NatsServer) -> tuple[float, int]:
    """The ceiling: the what-if's read of the log and parse of each event, nothing else."""
    nc = await nats.connect(server.url(), user="operator", password=server.creds.users["operator"],
                            inbox_prefix=eventlog.inbox_prefix("operator"))
    js = nc.jetstream()
    began, n = time.perf_counter(), 0
    async for batch in eventlog.read_batches(js, client=nc, payloads=True, batch=4096):
        for _, payload in batch:
            if whatif_run.recorded_type(payload):
                parse_event(payload)
                n += 1
    wall = time.perf_counter() - began
    await nc.close()
    return wall, n


async def main(args) -> dict:
    began = time.perf_counter()
    log = history.record(args.jobs, seed=args.seed, scale=args.scale)
    recorded_s = time.perf_counter() - began
    span_s = (log[-1].occurred_at - log[0].occurred_at).total_seconds()
    work = Path(tempfile.mkdtemp(prefix="gpusched-whatif-"))
    server = devstack.NatsServer(work / "nats").start()
    try:
        nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"])
        js = nc.jetstream()
        await eventlog.provision(js)
        t = time.perf_counter()
        await history.store(js, log)
        stored_s = time.perf_counter() - t
        await nc.close()
        del log
        ceiling_s, read_events = await read_only(server)
        changes = work / "changes.yaml"
        changes.write_text(CHANGES)
        runs = {}
        for name, extra in (("no change", []), ("changed", ["--apply", str(changes)])):
            wall, rss, out = timed_cli(server, "whatif", "-o", "json", *extra)
            runs[name] = {"wall_s": round(wall, 1), "peak_rss_mib": round(rss), "report": json.loads(out)}
    finally:
        server.stop()
    return {"machine": f"{platform.node()} {os.cpu_count()} CPUs {round(psutil.virtual_memory().total / 2**30)} GiB",
            "jobs": args.jobs, "events": read_events, "span_s": span_s, "recorded_s": round(recorded_s, 1),
            "stored_s": round(stored_s, 1), "ceiling_s": round(ceiling_s, 1), "runs": runs}


def report(r: dict) -> None:
    print(f"whatif: {r['jobs']:,} recorded jobs ({r['events']:,} events read of the log; the history spans "
          f"{r['span_s'] / 3600:,.0f} h of platform time), `gpusched whatif` as a separate process ({r['machine']})")
    print(f"  ceiling: reading and parsing those events, no replay: {r['ceiling_s']:.1f} s")
    for name, run in r["runs"].items():
        d = run["report"]["decisions"]
        speed = r["span_s"] / run["wall_s"]
        print(f"  {name:<9}: wall {run['wall_s']:7.1f} s ({r['ceiling_s'] / run['wall_s']:.2f} of the read ceiling), "
              f"{speed:,.0f}× faster than the platform took = {speed / TARGET:,.0f}× the {TARGET:.0f}× target; "
              f"peak RSS {run['peak_rss_mib']:,} MiB; decisions the same as the log: {d['same']:,} of {d['jobs']:,}; "
              f"changed from the baseline: {run['report']['changed']['different']:,}")
    same = r["runs"]["no change"]["report"]["fidelity"]["decisions"]
    if same["same"] != same["jobs"]:
        print(f"  NOT REPRODUCED: the no-change replay differs for {same['jobs'] - same['same']} jobs, e.g. "
              f"{same['first_different']}")
    print(f"  (recording the history through the cores took {r['recorded_s']:.0f} s, storing it {r['stored_s']:.0f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--scale", type=int, default=4, help="the example cluster and quotas, this many times")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    result = asyncio.run(main(args))
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
