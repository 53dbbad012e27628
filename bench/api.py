"""`make bench` (part): the front door, each figure beside its raw ceiling measured in the same run.

1. Submit -> admission's decision at a steady 50 requests/s: POST /v1/jobs (the response is the
   decision) beside the same path over raw NATS (the team's credential publishes the SubmitJob
   on its intake subject; a core subscription made before publishing waits for
   ``gpusched.job.<id>.admitted``), alternating in each round; the API's own timing (its
   metrics) and CPU per request say where its time goes.
2. Server-sent events to 200 clients of /v1/teams/team-a/stream, beside 200 core NATS
   subscriptions to the same subjects: copies of a real team-a job event published on the
   team's subjects (as the notifier does), paced for latency (publish -> every client has it)
   and in one burst for deliveries per second.
3. The jobs page with 10,000 jobs in the read models: GET /console/jobs and GET /v1/jobs (one
   page of 50), beside GET /healthz (the HTTP round trip alone); httpx's elapsed, loopback.
4. `gpusched submit`'s decision: the CLI's code paths in process, through the SDK and the API
   and over NATS as the operator (publish, then follow the job's subjects), beside the raw path
   one at a time; and the whole `gpusched submit` process, with Python's start beside it.

    python -m bench.api [--submissions N] [--rounds R] [--fanout-events N] [--page-jobs N] [--json PATH]
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
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import nats
import psutil

from bench import command_line
from bench.__main__ import pct
from gpusched.gateway import commands
from gpusched.dev import stack as devstack
from gpusched.api import tokens
from gpusched_sdk import AsyncClient
from runtime import eventlog
from schemas import JobSpec, SubmitJob
from schemas.auth import Role
from schemas.queue import FlavorQuota, QueueConfigured

TEAM = "team-a"
CLUSTER = "groups:\n  - {prefix: n, count: 64, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 40960}\n"
RATE = 50.0
CLIENTS = 200


def spec(queue: str = "bench", runtime_s: float = 0.05) -> dict:
    return {"kind": "batch", "queue": queue, "team": TEAM, "image": "img", "gpus": 1, "gpu_flavors": ["a100"],
            "expected_runtime_seconds": runtime_s}


class Platform:
    """nats-server, Postgres, every service and the API as processes, at time scale 1."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.server = devstack.NatsServer(work / "nats", teams=(TEAM,)).start()
        self.pg = devstack.Postgres(work / "pg").start()
        self.procs: devstack.ServiceProcesses | None = None
        self.url = ""
        self.tokens: dict[str, str] = {}

    async def start(self) -> None:
        self.nc = await nats.connect(self.server.url(), user="admin", password=self.server.creds.users["admin"])
        self.js = self.nc.jetstream()
        await eventlog.provision(self.js, teams=(TEAM,))
        log = eventlog.EventLog(self.js)
        for name, nominal in (("bench", 100_000), ("parked", 0)):  # parked: admitted jobs wait there
            await log.append(QueueConfigured(event_id=f"bench-q-{name}", aggregate_id=name, producer="config",
                                             occurred_at=datetime.now(UTC), name=name, allowed_teams=(TEAM,),
                                             quotas=(FlavorQuota(flavor="a100", nominal=nominal),)))
        cluster = self.work / "cluster.yaml"
        cluster.write_text(CLUSTER)
        port, self.metrics_port = devstack.free_ports(2)
        env = devstack.service_env(self.server.env, self.pg.dsn, cluster=cluster, time_scale=1.0, epoch=time.time(),
                                   api_port=port, extra={"GPUSCHED_TICK_S": "0.02", "GPUSCHED_LOG_LEVEL": "WARNING",
                                                         "GPUSCHED_API_STREAM_MAX_S": "600"})
        env["api"]["GPUSCHED_METRICS_PORT"] = str(self.metrics_port)
        self.procs = devstack.ServiceProcesses(self.work / "logs", env)
        self.procs.start_all()
        self.url = f"http://127.0.0.1:{port}"
        devstack.wait_for_port(port, timeout_s=60, proc=self.procs.procs["api"])
        for holder, role, team in (("bench", Role.MEMBER, TEAM), ("ops", Role.OPERATOR, None)):
            minted = tokens.mint()
            await log.append(tokens.issued(minted, name=holder, role=role, team=team, issued_by="admin",
                                           now=datetime.now(UTC)))
            self.tokens[holder] = minted.token
        async with httpx.AsyncClient(base_url=self.url) as client:
            while (await client.get("/v1/whoami", headers=self.auth("ops"))).status_code != 200:
                await asyncio.sleep(0.2)
        await asyncio.sleep(2)  # the executor registers its nodes

    async def api_sample(self) -> dict[str, float]:
        """The API process's CPU seconds, and its metrics' sums and counts of POST /v1/jobs's
        server time and of the submit decision wait."""
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{self.metrics_port}/metrics")).text
        out = {"cpu_s": sum(psutil.Process(self.procs.procs["api"].pid).cpu_times()[:2])}
        for line in text.splitlines():
            for key, prefix in (("server", 'gpusched_api_request_seconds_{}{{method="POST",route="/v1/jobs"}}'),
                                ("wait", 'gpusched_api_decision_wait_seconds_{}{{verb="submit"}}'),
                                ("publish", 'gpusched_api_publish_seconds_{}{{verb="submit"}}')):
                for part in ("sum", "count"):
                    if line.startswith(prefix.format(part) + " "):
                        out[f"{key}_{part}"] = float(line.split()[-1])
        return out

    def auth(self, holder: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[holder]}"}

    async def stop(self) -> None:
        await self.nc.close()
        if self.procs:
            self.procs.stop_all()
        self.pg.stop()
        self.server.stop()


class RawPath:
    """Submit → admitted over raw NATS, the ceiling of the API's submit: the team's credential
    publishes the SubmitJob on its intake subject, and a core subscription (made once, before
    any publish) waits for the job's JobAdmitted."""

    def __init__(self, team_nc: nats.NATS) -> None:
        self.team_nc, self.team_js = team_nc, team_nc.jetstream()
        self.admitted: dict[str, asyncio.Future] = {}
        self.sub = None

    @classmethod
    async def open(cls, p: Platform) -> "RawPath":
        raw = cls(await nats.connect(p.server.url(), user=TEAM, password=p.server.creds.users[TEAM],
                                     inbox_prefix=eventlog.inbox_prefix(TEAM)))
        raw.sub = await p.nc.subscribe("gpusched.job.*.admitted", cb=raw.on_admitted)
        return raw

    async def on_admitted(self, msg) -> None:
        future = self.admitted.get(msg.subject.split(".")[2])
        if future is not None and not future.done():
            future.set_result(None)

    async def submit(self, job_id: str) -> None:
        future = self.admitted[job_id] = asyncio.get_running_loop().create_future()
        doc = json.dumps({"job_id": job_id, "spec": spec()}).encode()
        try:
            await self.team_js.publish(f"gpusched.intake.{TEAM}.submit", doc, headers={"Nats-Msg-Id": job_id})
            await asyncio.wait_for(future, 10)
        finally:
            del self.admitted[job_id]

    async def close(self) -> None:
        await self.sub.unsubscribe()
        await self.team_nc.close()


async def steady(n: int, rate: float, one) -> list[float]:
    """``one(i)`` started at a steady ``rate``; each one's latency in ms."""
    t0 = time.perf_counter()

    async def timed(i: int) -> float:
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        start = time.perf_counter()
        await one(i)
        return (time.perf_counter() - start) * 1000
    return list(await asyncio.gather(*(timed(i) for i in range(n))))


async def submit_latency(p: Platform, n: int, rounds: int) -> dict[str, float]:
    """(1) API and raw NATS, submit -> admitted, at RATE per second, alternating in each round;
    with the API process's CPU per request and its own timing of the request and of the wait."""
    raw_path = await RawPath.open(p)

    async def raw(i: int, prefix: str) -> None:
        await raw_path.submit(f"{prefix}-{i}")

    lats: dict[str, list[float]] = {"raw": [], "api": [], "api_new_id": []}
    ratios: list[float] = []
    idle_cpu = 0.0  # the API's CPU while the raw path runs: its subscriptions to those jobs' events
    totals = {"cpu_s": 0.0, "server_sum": 0.0, "server_count": 0.0, "wait_sum": 0.0, "wait_count": 0.0,
              "publish_sum": 0.0, "publish_count": 0.0}
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=p.url, headers=p.auth("bench"), limits=limits, timeout=30) as client:
        async def api(i: int, prefix: str | None) -> None:
            doc = {"job_id": f"{prefix}-{i}", "spec": spec()} if prefix else {"spec": spec()}
            r = await client.post("/v1/jobs", json=doc)
            assert r.status_code == 201 and r.json()["decision"] == "admitted", r.text
        await steady(20, RATE, lambda i: api(i, "warm"))
        await steady(20, RATE, lambda i: raw(i, "rwarm"))
        for _ in range(rounds):  # short rounds, alternating: the box's speed drifts within a minute
            tag = uuid.uuid4().hex[:6]
            start = await p.api_sample()
            raw_lat = await steady(n, RATE, lambda i: raw(i, f"r{tag}"))
            before = await p.api_sample()
            idle_cpu += before["cpu_s"] - start["cpu_s"]
            api_lat = await steady(n, RATE, lambda i: api(i, f"a{tag}"))
            after = await p.api_sample()
            for key in totals:
                totals[key] += after.get(key, 0.0) - before.get(key, 0.0)
            lats["raw"] += raw_lat
            lats["api"] += api_lat
            lats["api_new_id"] += await steady(n, RATE, lambda i: api(i, None))
            ratios.append(pct(api_lat, 50) / pct(raw_lat, 50))
    out: dict[str, float] = {f"{k}_{q}": pct(v, q) for k, v in lats.items() for q in (50, 99)}
    out["submissions_each"] = len(lats["raw"])
    out["ratio_p50_by_round"] = ratios
    out["ratio_p50_median"] = statistics.median(ratios)
    await raw_path.close()
    requests = rounds * n
    out["api_cpu_ms_per_request"] = totals["cpu_s"] * 1000 / requests
    out["api_cpu_ms_per_raw_job"] = idle_cpu * 1000 / requests
    out["api_server_mean_ms"] = totals["server_sum"] * 1000 / max(1.0, totals["server_count"])
    out["api_wait_mean_ms"] = totals["wait_sum"] * 1000 / max(1.0, totals["wait_count"])
    out["api_publish_mean_ms"] = totals["publish_sum"] * 1000 / max(1.0, totals["publish_count"])
    return out


async def fanout(p: Platform, template: dict, events: int, rate: float | None, sse: bool) -> dict[str, float]:
    """``events`` copies of a team-a job event published on the team's subjects (at ``rate``
    per second, or in one burst) to CLIENTS streams of /v1/teams/team-a/stream (``sse``) or
    CLIENTS core subscriptions of the same subjects: each event's latency until every client
    has it, and the deliveries per second from the first publish to the last receipt."""
    sent: dict[str, float] = {}
    got: dict[str, list[float]] = {}
    everyone = asyncio.Event()
    opened = asyncio.Event()
    ready = [0]

    def receipt(event_id: str) -> None:
        times = got.setdefault(event_id, [])
        times.append(time.perf_counter())
        if len(got) == events and all(len(t) == CLIENTS for t in got.values()):
            everyone.set()

    async def client(http: httpx.AsyncClient) -> None:
        async with http.stream("GET", f"/v1/teams/{TEAM}/stream") as response:
            async for line in response.aiter_lines():
                if line.startswith("event: open"):
                    ready[0] += 1
                    if ready[0] == CLIENTS:
                        opened.set()
                elif line.startswith("id: "):
                    receipt(line[4:])

    async def on_copy(msg) -> None:
        receipt(msg.headers["Nats-Msg-Id"])

    job = template["aggregate_id"]
    subject = f"gpusched.tenant.{TEAM}.job.{job}.{template['_token']}"
    tag = uuid.uuid4().hex[:6]
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
    async with httpx.AsyncClient(base_url=p.url, headers=p.auth("bench"), limits=limits,
                                 timeout=httpx.Timeout(30, read=None)) as http:
        if sse:
            tasks = [asyncio.create_task(client(http)) for _ in range(CLIENTS)]
            await asyncio.wait_for(opened.wait(), 60)
        else:
            tasks = []
            subs = [await p.nc.subscribe(f"gpusched.tenant.{TEAM}.job.>", cb=on_copy) for _ in range(CLIENTS)]
            await p.nc.flush()
        t0 = time.perf_counter()
        for i in range(events):
            if rate is not None:
                await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            event_id = f"fan-{tag}-{i}"
            data = json.dumps({k: v for k, v in template.items() if k != "_token"} | {"event_id": event_id}).encode()
            sent[event_id] = time.perf_counter()
            await p.nc.publish(subject, data, headers={"Nats-Msg-Id": event_id, "Gpusched-Type": template["type"]})
        try:
            await asyncio.wait_for(everyone.wait(), 60)
        except TimeoutError:
            pass
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not sse:
            for sub in subs:
                await sub.unsubscribe()
    delivered = sum(len(t) for e, t in got.items() if e in sent)
    all_in = [(max(t) - sent[e]) * 1000 for e, t in got.items() if e in sent and len(t) == CLIENTS]
    each = [(x - sent[e]) * 1000 for e, t in got.items() if e in sent for x in t]
    last = max((max(t) for e, t in got.items() if e in sent), default=t0)
    return {"deliveries": delivered, "expected": events * CLIENTS, "all_p50_ms": pct(all_in, 50) if all_in else -1,
            "all_p99_ms": pct(all_in, 99) if all_in else -1, "each_p50_ms": pct(each, 50) if each else -1,
            "deliveries_per_s": delivered / (last - t0) if last > t0 else 0.0}


async def tenant_template(p: Platform) -> dict:
    """A real copy the notifier wrote to team-a's subjects (a JobAdmitted), to publish again
    under new event ids."""
    team_js = eventlog.tenant_js(p.js, TEAM)  # the team's stream is in its own account
    msg = await team_js.get_msg(eventlog.tenant_stream(TEAM), subject=f"gpusched.tenant.{TEAM}.job.warm-0.admitted",
                             direct=True)
    doc = json.loads(msg.data)
    doc["_token"] = msg.subject.split(".")[-1]
    return doc


async def quiet(p: Platform, still_s: float = 1.0) -> None:
    """Until the notifier has copied the earlier phases' events (the team's stream stands still)."""
    last = -1
    team_js = eventlog.tenant_js(p.js, TEAM)
    while (now := (await team_js.stream_info(eventlog.tenant_stream(TEAM))).state.last_seq) != last:
        last = now
        await asyncio.sleep(still_s)


async def sse_fanout(p: Platform, events: int) -> dict[str, dict[str, float]]:
    """(2) paced (10 events/s) for latency, then one burst for deliveries per second; SSE and raw."""
    template = await tenant_template(p)
    await quiet(p)
    out = {}
    for name, rate in (("paced", 10.0), ("burst", None)):
        for kind in ("raw", "sse"):
            out[f"{kind}_{name}"] = await fanout(p, template, events, rate, sse=kind == "sse")
    return out


async def page_load(p: Platform, jobs: int) -> dict[str, float]:
    """(3) jobs parked in a zero-quota queue (admitted, waiting), then the pages, median of 20."""
    for start in range(0, jobs, 500):
        acks = [p.js.publish(f"gpusched.intake.{TEAM}.submit",
                             json.dumps({"job_id": f"page-{i}", "spec": spec("parked")}).encode(),
                             headers={"Nats-Msg-Id": f"page-{i}"}) for i in range(start, min(jobs, start + 500))]
        await asyncio.gather(*acks)
    conn = await asyncpg.connect(p.pg.dsn)
    try:
        while (count := await conn.fetchval("SELECT count(*) FROM jobs WHERE job_id LIKE 'page-%'")) < jobs:
            await asyncio.sleep(1)
        total = await conn.fetchval("SELECT count(*) FROM jobs")
    finally:
        await conn.close()
    out: dict[str, float] = {"jobs_in_read_models": total}
    async with httpx.AsyncClient(base_url=p.url, timeout=30) as http:
        for name, path, headers in (("healthz", "/healthz", {}), ("api_jobs", "/v1/jobs?limit=50", p.auth("ops")),
                                    ("console_jobs", "/console/jobs", {"Cookie": f"gpusched_token={p.tokens['ops']}"}),
                                    ("console_jobs_member", "/console/jobs",
                                     {"Cookie": f"gpusched_token={p.tokens['bench']}"})):
            times = []
            for _ in range(21):
                r = await http.get(path, headers=headers)
                assert r.status_code == 200, (path, r.status_code)
                times.append(r.elapsed.total_seconds() * 1000)
            out[f"{name}_ms"] = statistics.median(times[1:])
    return out


async def cli_submit(p: Platform, n: int) -> dict[str, float]:
    """(4) the CLI's code paths, in process, sequentially: the SDK over the API, and NATS as the
    operator (publish, then follow the job's subjects until the decision); then the process."""
    sdk, over_nats, raw = [], [], []
    raw_path = await RawPath.open(p)
    for i in range(n):
        t = time.perf_counter()
        await raw_path.submit(f"seq-{uuid.uuid4().hex[:8]}")
        raw.append((time.perf_counter() - t) * 1000)
    await raw_path.close()
    async with AsyncClient(p.url, p.tokens["bench"]) as gs:
        for i in range(n):
            t = time.perf_counter()
            done = await gs.submit({"job_id": f"sdk-{uuid.uuid4().hex[:8]}", "spec": spec()})
            sdk.append((time.perf_counter() - t) * 1000)
            assert done.decision == "admitted"
    onc = await nats.connect(p.server.url(), user="operator", password=p.server.creds.users["operator"],
                             inbox_prefix=eventlog.inbox_prefix("operator"))
    ojs = onc.jetstream()
    for i in range(n):
        job = SubmitJob(job_id=f"cli-{uuid.uuid4().hex[:8]}", spec=JobSpec(**spec()))
        t = time.perf_counter()
        seq = await commands.publish_command(ojs, TEAM, "submit", job, on_behalf_of="bench")
        answer = await commands.wait_for_decision(ojs, job.job_id, seq)
        over_nats.append((time.perf_counter() - t) * 1000)
        assert answer is not None and answer.event.type == "JobAdmitted"
    await onc.close()
    job_file = p.work / "job.json"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")},
           "GPUSCHED_API_URL": p.url, "GPUSCHED_API_TOKEN": p.tokens["bench"],
           "GPUSCHED_CONNECTION_FILE": str(p.work / "none.json")}
    process = []
    for i in range(10):
        job_file.write_text(json.dumps({"job_id": f"proc-{uuid.uuid4().hex[:8]}", "spec": spec()}))
        t = time.perf_counter()
        done = subprocess.run([str(Path(sys.executable).parent / "gpusched"), "submit", "-f", str(job_file)],
                              env=env, capture_output=True, text=True)
        process.append((time.perf_counter() - t) * 1000)
        assert done.returncode == 0, done.stderr
    bare_python, imports = [], []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare_python.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import gpusched.cli.main"], check=True)
        imports.append((time.perf_counter() - t) * 1000)
    return {"raw_p50_ms": pct(raw, 50), "sdk_p50_ms": pct(sdk, 50), "nats_cli_path_p50_ms": pct(over_nats, 50),
            "process_p50_ms": statistics.median(process),
            "bare_python_ms": statistics.median(bare_python), "import_cli_ms": statistics.median(imports)}


async def main(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpusched-bench-api-"))
    p = Platform(work)
    try:
        await p.start()
        latency = await submit_latency(p, args.submissions, args.rounds)
        fan = await sse_fanout(p, args.fanout_events)
        cli = await cli_submit(p, 30)
        pages = await page_load(p, args.page_jobs)
    finally:
        await p.stop()
    return {"latency": latency, "fanout": fan, "pages": pages, "cli": cli,
            "machine": f"{platform.node()} {os.cpu_count()} CPUs", "when": datetime.now(UTC).isoformat(timespec="seconds")}


def report(r: dict) -> None:
    lat, fan, pages, cli = r["latency"], r["fanout"], r["pages"], r["cli"]
    raw50, api50, new50 = lat["raw_50"], lat["api_50"], lat["api_new_id_50"]
    sp, rp, sb, rb = fan["sse_paced"], fan["raw_paced"], fan["sse_burst"], fan["raw_burst"]
    print(f"\ngpusched bench — the front door ({r['machine']}; {r['when']}; submissions: "
          f"{lat['submissions_each']:.0f} per path in {len(lat['ratio_p50_by_round'])} alternating rounds; "
          "noisy 2-core box: read the ratios)")
    rows = [
        (f"submit → admitted p50 at {RATE:.0f}/s, raw NATS", f"{raw50:.1f} ms", "1.00 (ceiling)"),
        (f"submit → decision p50 at {RATE:.0f}/s, POST /v1/jobs", f"{api50:.1f} ms",
         f"{api50 / raw50:.2f}× raw (median of the rounds' ratios {lat['ratio_p50_median']:.2f})"),
        ("  the same, job id chosen by the API", f"{new50:.1f} ms", f"{new50 / raw50:.2f}× raw"),
        ("  floor: raw + one HTTP round trip (GET /healthz)", f"{raw50 + pages['healthz_ms']:.1f} ms",
         f"{(raw50 + pages['healthz_ms']) / raw50:.2f}× raw (no HTTP API can be faster on this box)"),
        ("submit p99, raw NATS / API", f"{lat['raw_99']:.1f} / {lat['api_99']:.1f} ms",
         f"{lat['api_99'] / lat['raw_99']:.2f}× raw"),
        ("  API server time, mean (its metrics)", f"{lat['api_server_mean_ms']:.1f} ms",
         f"of which publishing {lat['api_publish_mean_ms']:.1f} ms, then waiting for admission "
         f"{lat['api_wait_mean_ms']:.1f} ms"),
        ("  API process CPU per request", f"{lat['api_cpu_ms_per_request']:.1f} ms",
         f"{lat['api_cpu_ms_per_request'] * RATE / 10:.0f} % of a core at {RATE:.0f}/s"),
        ("  API process CPU per raw-path job (its subscriptions)", f"{lat['api_cpu_ms_per_raw_job']:.1f} ms",
         "answers and team copies of jobs it did not submit"),
        (f"fan-out to {CLIENTS}, event → all have it p50, raw NATS", f"{rp['all_p50_ms']:.1f} ms", "1.00 (ceiling)"),
        (f"fan-out to {CLIENTS}, event → all have it p50, SSE", f"{sp['all_p50_ms']:.1f} ms",
         f"{sp['all_p50_ms'] / rp['all_p50_ms']:.1f}× raw"),
        ("fan-out p99, raw NATS / SSE", f"{rp['all_p99_ms']:.0f} / {sp['all_p99_ms']:.0f} ms",
         f"{sp['all_p99_ms'] / rp['all_p99_ms']:.1f}× raw"),
        ("fan-out burst, deliveries/s, raw NATS", f"{rb['deliveries_per_s']:.0f} /s",
         f"{rb['deliveries']} of {rb['expected']}"),
        ("fan-out burst, deliveries/s, SSE", f"{sb['deliveries_per_s']:.0f} /s",
         f"{sb['deliveries_per_s'] / rb['deliveries_per_s']:.2f} of raw; {sb['deliveries']} of {sb['expected']}"),
        ("GET /healthz (HTTP round trip)", f"{pages['healthz_ms']:.2f} ms", "1.00 (ceiling)"),
        (f"GET /v1/jobs?limit=50, {pages['jobs_in_read_models']:,} jobs", f"{pages['api_jobs_ms']:.1f} ms",
         f"{pages['api_jobs_ms'] / pages['healthz_ms']:.1f}× /healthz"),
        ("GET /console/jobs (operator)", f"{pages['console_jobs_ms']:.1f} ms",
         f"{pages['console_jobs_ms'] / pages['healthz_ms']:.1f}× /healthz"),
        ("GET /console/jobs (member)", f"{pages['console_jobs_member_ms']:.1f} ms",
         f"{pages['console_jobs_member_ms'] / pages['healthz_ms']:.1f}× /healthz"),
        ("submit → admitted p50, one at a time, raw NATS", f"{cli['raw_p50_ms']:.1f} ms", "1.00 (ceiling)"),
        ("gpusched submit's path: SDK over the API", f"{cli['sdk_p50_ms']:.1f} ms",
         f"{cli['sdk_p50_ms'] / cli['raw_p50_ms']:.2f}× raw"),
        ("gpusched submit's path: NATS as the operator", f"{cli['nats_cli_path_p50_ms']:.1f} ms",
         f"{cli['nats_cli_path_p50_ms'] / cli['raw_p50_ms']:.2f}× raw"),
        ("`gpusched submit` whole process (median of 10)", f"{cli['process_p50_ms']:.0f} ms",
         f"python start {cli['bare_python_ms']:.0f} ms; `import gpusched.cli.main` {cli['import_cli_ms']:.0f} ms"),
    ]
    for name, value, ratio in rows:
        print(f"  {name:<52} {value:>16}   {ratio}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--submissions", type=int, default=150, help="per round and path")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--fanout-events", type=int, default=50)
    parser.add_argument("--page-jobs", type=int, default=10_000)
    command_line(parser, main, report)
