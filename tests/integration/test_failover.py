"""Single-active quota and scheduler, each with a standby (runtime/lease.py), as real processes
against a real nats-server. kill -9 of the active one mid-load: the standby takes the lease and
decides on within seconds; no decision is appended twice; a deposed active's late append is
refused by the log, and its repeat of a decision the new one took is dropped as a duplicate; an
active paused past its lease (SIGSTOP) neither fetches nor appends when it wakes, and exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime

import pytest

from conftest import connect_as, eventually, service_settings
from gpusched.dev import stack as devstack
from runtime import eventlog, lease
from runtime.teams import partition_of
from schemas import JobScheduled, NodeAssignment, new_event, parse_event
from tests.integration.test_telemetry import REPO
from tests.unit.builders import admitted, node, queue, spec, submitted

TTL_S = 2.0
JOBS = 300
NODES = 40  # × 8 GPUs: room for every job


def start(nats_server, service: str, log_path, metrics_port: int, **extra: str) -> subprocess.Popen:
    env = {**os.environ, **nats_server.env(service), "GPUSCHED_TICK_S": "0.05", "GPUSCHED_LEASE_TTL_S": str(TTL_S),
           "GPUSCHED_SNAPSHOT_EVERY": "0", "GPUSCHED_LOG_FORMAT": "text", "GPUSCHED_METRICS_PORT": str(metrics_port),
           **extra}
    return subprocess.Popen([sys.executable, "-m", f"services.{service}"], cwd=REPO, env=env,
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


async def holder_pid(js, service: str) -> int | None:
    """The pid of the process holding the service's lease, as its bucket says."""
    try:
        kv = await js.key_value(lease.bucket(service))
        entry = await kv.get(lease.KEY)
    except Exception:  # no bucket yet, no key (aged out, released)
        return None
    return int(entry.value.decode().split(":")[1]) if entry.value else None


async def appended(js, token: str) -> list:
    """Every message of the job subjects ending in ``token``, in log order."""
    return [m async for m in eventlog.read(js, subjects=[f"gpusched.job.*.{token}"])]


async def feed(log: eventlog.EventLog, count: int, per_s: float) -> None:
    for i in range(count):
        now = datetime.now(UTC)
        await log.append(submitted(f"j{i}", spec(gpus=1), when=now))
        await log.append(admitted(f"j{i}", when=now))
        await asyncio.sleep(1 / per_s)


def readiness(port: int) -> dict | None:
    """The process's /readyz answer (runtime/health.py), whatever its status; None: no answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())
    except OSError:
        return None


@pytest.fixture
def processes(nats_server, tmp_path):
    procs: dict[str, list[subprocess.Popen]] = {}
    ports = iter(devstack.free_ports(10))

    def spawn(service: str, **env: str) -> subprocess.Popen:
        port = next(ports)
        proc = start(nats_server, service, tmp_path / f"{service}.log", port, **env)
        proc.metrics_port = port  # type: ignore[attr-defined]
        procs.setdefault(service, []).append(proc)
        return proc
    yield spawn
    for proc in (p for ps in procs.values() for p in ps):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in (p for ps in procs.values() for p in ps):
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


async def test_kill_9_of_the_active_quota_and_scheduler_mid_load(nats_server, admin_js, processes, tmp_path):
    log = eventlog.EventLog(admin_js)
    await log.append(queue(quotas={"a100": NODES * 8}))
    for i in range(NODES):
        await log.append(node(f"n{i}"))
    procs = {s: [processes(s), processes(s)] for s in ("quota", "scheduler")}
    for service in procs:
        await eventually(lambda: holder_pid(admin_js, service), timeout_s=30)
        # both ready (connected, caught up); one active, the other standing by
        answers = await eventually(lambda: _all_ready([readiness(p.metrics_port) for p in procs[service]]),
                                   timeout_s=30)
        assert sorted(a["role"] for a in answers) == ["active", "standby"], answers

    loader = asyncio.create_task(feed(log, JOBS, per_s=60))
    await eventually(lambda: _at_least(appended(admin_js, "scheduled"), JOBS // 4), timeout_s=60)
    killed: dict[str, tuple[int, float]] = {}
    for service in ("scheduler", "quota"):
        pid = await holder_pid(admin_js, service)
        os.kill(pid, signal.SIGKILL)
        killed[service] = (pid, time.time())
        await eventually(lambda: _at_least(appended(admin_js, "scheduled"), JOBS // 2), timeout_s=60)
    await loader
    scheduled = await eventually(lambda: _at_least(appended(admin_js, "scheduled"), JOBS), timeout_s=60)

    # the standbys hold the leases now
    for service, (pid, _) in killed.items():
        now = await eventually(lambda: holder_pid(admin_js, service), timeout_s=10)
        others = {p.pid for p in procs[service]} - {pid}
        assert now in others, (service, now, pid)
    # every attempt reserved and placed exactly once
    reserved = await appended(admin_js, "quota_reserved")
    for kind, msgs in (("QuotaReserved", reserved), ("JobScheduled", scheduled)):
        per_job = [m.subject.split(".")[2] for m in msgs]
        assert len(per_job) == len(set(per_job)) == JOBS, kind
    # how long each service decided nothing: from its kill to the next decision it appended
    gaps = {}
    for service, token in (("scheduler", "scheduled"), ("quota", "quota_reserved")):
        at = killed[service][1]
        after = [m.metadata.timestamp.timestamp() for m in await appended(admin_js, token)
                 if m.metadata.timestamp.timestamp() > at]
        gaps[service] = min(after) - at
    print(f"\nfailover, lease ttl {TTL_S:g} s: no decisions for {gaps['scheduler']:.2f} s (scheduler), "
          f"{gaps['quota']:.2f} s (quota)")
    assert all(gap < 3 * TTL_S for gap in gaps.values()), gaps

    # A deposed active that wakes up late and appends what it had decided before the takeover:
    last = scheduled[-1]
    decided = parse_event(last.data)
    stale = new_event(JobScheduled, aggregate_id=decided.aggregate_id, producer="scheduler",
                      occurred_at=datetime.now(UTC), key="deposed", attempt=decided.attempt, flavor=decided.flavor,
                      placement=(NodeAssignment(node="n0", gpus=1, gpu_indices=(7,)),))
    # ... a different decision, against the job as it saw it (before the new active's): refused
    with pytest.raises(eventlog.ConcurrencyConflict):
        await log.append(stale, expected_last_seq=last.metadata.sequence.stream - 1)
    # ... the same decision (its id derives from what it decides): a duplicate, dropped
    before = (await admin_js.stream_info(eventlog.EVENTS_STREAM)).state.last_seq
    await admin_js.publish(last.subject, last.data, headers={"Nats-Msg-Id": decided.event_id})
    assert (await admin_js.stream_info(eventlog.EVENTS_STREAM)).state.last_seq == before


async def test_a_lease_is_held_by_one_process_and_taken_over_after_its_ttl(nats_server, admin_js):
    """The lease alone, with the scheduler's credential: one holder at a time; a holder that
    stops renewing loses it after the ttl; a release frees it at once."""
    nc = await eventlog.connect(service_settings(nats_server, "scheduler"), "lease-test")
    js = nc.jetstream()
    try:
        a, b = lease.Lease(js, "scheduler", TTL_S, holder="a"), lease.Lease(js, "scheduler", TTL_S, holder="b")
        assert await a.try_acquire() and not await b.try_acquire()
        assert await a.renew() and await a.holder_now() == "a"
        await asyncio.sleep(TTL_S + 1.5)  # a stops renewing (paused, partitioned, killed)
        assert await eventually(b.try_acquire, timeout_s=5)
        assert not await a.renew()  # a finds out it is deposed
        await b.release()
        assert await a.try_acquire()
        await a.release()
        # a write of ours whose answer was lost (a timeout): the key holds our id, and it is ours
        kv = await js.key_value(lease.bucket("scheduler"))
        await kv.create(lease.KEY, b"c")
        c = lease.Lease(js, "scheduler", TTL_S, holder="c")
        assert await c.try_acquire() and await c.renew() and not await b.try_acquire()
        await c.release()
    finally:
        await eventlog.close(nc)


def _all_ready(answers: list[dict | None]) -> list[dict] | None:
    return answers if all(a is not None and a["ok"] and "role" in a for a in answers) else None


async def _at_least(read, n: int):
    got = await read
    return got if len(got) >= n else None


async def test_kill_9_of_the_active_admission_mid_load(nats_server, admin_js, processes):
    """Admission single-active with a standby: commands keep being answered across a kill -9 of
    the active one; every submission becomes exactly one JobSubmitted and one JobAdmitted, a
    resubmission with the same idempotency key none, and no intake message is lost."""
    log = eventlog.EventLog(admin_js)
    await log.append(queue(quotas={"a100": 64}))
    await log.append(node("n0"))
    procs = [processes("admission"), processes("admission")]
    await eventually(lambda: holder_pid(admin_js, "admission"), timeout_s=30)
    tenant = await connect_as(nats_server, "team-a")
    js = tenant.jetstream()

    async def send(i: int) -> None:
        payload = {"job_id": f"a{i}", "spec": {"kind": "training", "queue": "research", "team": "team-a",
                                               "image": "img", "gpus": 1, "idempotency_key": f"k{i}"}}
        await js.publish("gpusched.intake.team-a.submit", json.dumps(payload).encode())

    count = 120
    killed_at = None
    for i in range(count):
        await send(i)
        if i == count // 3:
            await eventually(lambda: _at_least(appended(admin_js, "admitted"), count // 4), timeout_s=30)
            pid = await holder_pid(admin_js, "admission")
            os.kill(pid, signal.SIGKILL)
            killed_at = time.time()
        await asyncio.sleep(1 / 40)
    for i in range(0, count, 10):  # the same commands again: answered by their idempotency keys
        await send(i)
    admitted = await eventually(lambda: _at_least(appended(admin_js, "admitted"), count), timeout_s=60)
    await asyncio.sleep(2 * TTL_S)  # anything decided twice would be in by now
    submitted = await appended(admin_js, "submitted")
    admitted = await appended(admin_js, "admitted")
    for kind, msgs in (("JobSubmitted", submitted), ("JobAdmitted", admitted)):
        per_job = [m.subject.split(".")[2] for m in msgs]
        assert sorted(per_job) == sorted(f"a{i}" for i in range(count)), kind
    survivor = await holder_pid(admin_js, "admission")
    assert survivor in {p.pid for p in procs} and survivor != pid
    gap = min(m.metadata.timestamp.timestamp() for m in admitted if m.metadata.timestamp.timestamp() > killed_at) - killed_at
    print(f"\nadmission failover, lease ttl {TTL_S:g} s: no decisions for {gap:.2f} s")
    assert gap < 3 * TTL_S
    await tenant.close()


async def test_kill_9_of_one_admission_partitions_active_mid_load(nats_server, admin_js, processes):
    """Two admission partitions, each an active and a standby (four processes): a kill -9 of
    partition 1's active one stalls only partition 1's teams, for about the lease ttl; every
    submission of both becomes exactly one JobSubmitted and one JobAdmitted."""
    teams = {partition_of(t, 2): t for t in ("team-a", "team-b", "team-c", "team-d")}
    assert set(teams) == {0, 1}
    log = eventlog.EventLog(admin_js)
    await log.append(queue(teams=tuple(teams.values()), quotas={"a100": 64}))
    await log.append(node("n0"))
    for k in (0, 1, 0, 1):
        processes("admission", GPUSCHED_ADMISSION_PARTITIONS="2", GPUSCHED_ADMISSION_PARTITION=str(k))
    for name in ("admission", "admission-p1"):
        await eventually(lambda: holder_pid(admin_js, name), timeout_s=30)

    async def send(k: int, i: int) -> None:
        payload = {"job_id": f"p{k}-{i}", "spec": {"kind": "training", "queue": "research", "team": teams[k],
                                                   "image": "img", "gpus": 1}}
        await admin_js.publish(f"gpusched.intake.{teams[k]}.submit", json.dumps(payload).encode())

    count = 90
    for i in range(count):
        await send(0, i)
        await send(1, i)
        if i == count // 3:
            await eventually(lambda: _at_least(appended(admin_js, "admitted"), count // 2), timeout_s=30)
            pid = await holder_pid(admin_js, "admission-p1")
            os.kill(pid, signal.SIGKILL)
            killed_at = time.time()
        await asyncio.sleep(1 / 30)
    await eventually(lambda: _at_least(appended(admin_js, "admitted"), 2 * count), timeout_s=60)
    await asyncio.sleep(2 * TTL_S)  # anything decided twice would be in by now
    for kind in ("submitted", "admitted"):
        per_job = [m.subject.split(".")[2] for m in await appended(admin_js, kind)]
        assert sorted(per_job) == sorted(f"p{k}-{i}" for k in (0, 1) for i in range(count)), kind
    assert await holder_pid(admin_js, "admission-p1") not in (None, pid)
    admitted = [m for m in await appended(admin_js, "admitted") if m.metadata.timestamp.timestamp() > killed_at]

    def gap(k: int) -> float:
        return min(m.metadata.timestamp.timestamp() for m in admitted if m.subject.split(".")[2].startswith(f"p{k}-")) - killed_at
    print(f"\nadmission partition 1 failover, lease ttl {TTL_S:g} s: no decisions for its teams for {gap(1):.2f} s; "
          f"partition 0's next decision after {gap(0):.2f} s")
    assert gap(1) < 3 * TTL_S and gap(0) < TTL_S


async def _feed_until(log: eventlog.EventLog, per_s: float, woke: asyncio.Event, after: int) -> int:
    """Like ``feed``, until ``after`` jobs past the moment ``woke`` is set; returns how many in all."""
    count, left = 0, after
    while left:
        now = datetime.now(UTC)
        await log.append(submitted(f"j{count}", spec(gpus=1), when=now))
        await log.append(admitted(f"j{count}", when=now))
        count += 1
        left -= woke.is_set()
        await asyncio.sleep(1 / per_s)
    return count


async def _holds(js, service: str, pid: int) -> bool:
    return await holder_pid(js, service) == pid


async def test_a_paused_scheduler_that_wakes_after_losing_its_lease_appends_nothing_twice(
        nats_server, admin_js, processes, tmp_path):
    """SIGSTOP of the active scheduler mid-load (a GC pause, a frozen VM): the standby takes the
    lease after the ttl and schedules on; SIGCONT while jobs still come in. The woken process
    finds its lease no longer current, so it neither fetches nor appends, and exits when its
    renewal fails; what the shared durable consumer delivered to it, the new active reads from
    the log. Every job is reserved and scheduled exactly once, and no GPU is given twice (before
    runtime/loop.py checked the lease before each fetch and append, about half the runs lost jobs
    or gave a GPU twice)."""
    log = eventlog.EventLog(admin_js)
    await log.append(queue(quotas={"a100": NODES * 8}))
    for i in range(NODES):
        await log.append(node(f"n{i}"))
    processes("quota")
    schedulers: list[subprocess.Popen] = []
    loader = None
    try:
        for k, port in enumerate(devstack.free_ports(2)):  # a log file each: what the woken one said
            proc = start(nats_server, "scheduler", tmp_path / f"scheduler-{k}.log", port, GPUSCHED_LOG_FORMAT="json")
            proc.metrics_port = port  # type: ignore[attr-defined]
            schedulers.append(proc)
        for service in ("quota", "scheduler"):
            await eventually(lambda: holder_pid(admin_js, service), timeout_s=30)
        answers = await eventually(lambda: _all_ready([readiness(p.metrics_port) for p in schedulers]), timeout_s=30)
        assert sorted(a["role"] for a in answers) == ["active", "standby"], answers

        woke = asyncio.Event()
        loader = asyncio.create_task(_feed_until(log, 40, woke, after=60))
        await eventually(lambda: _at_least(appended(admin_js, "scheduled"), 30), timeout_s=60)
        paused_pid = await holder_pid(admin_js, "scheduler")
        paused = next(p for p in schedulers if p.pid == paused_pid)
        other = next(p for p in schedulers if p.pid != paused_pid)
        os.kill(paused.pid, signal.SIGSTOP)
        paused_at = time.time()
        try:
            await eventually(lambda: _holds(admin_js, "scheduler", other.pid), timeout_s=30)
            taken_over = len(await appended(admin_js, "scheduled"))
            await eventually(lambda: _at_least(appended(admin_js, "scheduled"), taken_over + 20), timeout_s=30)
        finally:
            os.kill(paused.pid, signal.SIGCONT)
            resumed_at = time.time()
            woke.set()
        assert not loader.done()  # jobs still come in while the woken one finds out
        jobs = await loader
        scheduled = await eventually(lambda: _at_least(appended(admin_js, "scheduled"), jobs), timeout_s=60)
        await asyncio.sleep(2 * TTL_S)  # a late append of the woken one would be in by now

        scheduled = await appended(admin_js, "scheduled")
        reserved = await appended(admin_js, "quota_reserved")
        for kind, msgs in (("QuotaReserved", reserved), ("JobScheduled", scheduled)):
            per_job = [m.subject.split(".")[2] for m in msgs]
            assert len(per_job) == len(set(per_job)) == jobs, kind
        # nor was a GPU given twice: a decision the woken one took on its stale view of the nodes
        # (another job's aggregate, so no concurrency check of that job's refuses it) would show here
        gpus = [(a.node, i) for m in scheduled for a in parse_event(m.data).placement for i in a.gpu_indices]
        assert len(gpus) == len(set(gpus)) == jobs, sorted(g for g in gpus if gpus.count(g) > 1)
        assert await holder_pid(admin_js, "scheduler") == other.pid
        # the woken one stops deciding: it exits as a lost lease says (3, no traceback), or stands by
        said = (tmp_path / f"scheduler-{schedulers.index(paused)}.log").read_text()
        assert "Traceback" not in said, said
        if paused.poll() is None:
            assert (await eventually(lambda: readiness(paused.metrics_port), timeout_s=10))["role"] == "standby"
        else:
            assert paused.returncode == 3 and "lease lost" in said, (paused.returncode, said)
        gap = min(m.metadata.timestamp.timestamp() for m in scheduled
                  if m.metadata.timestamp.timestamp() > paused_at) - paused_at
        print(f"\nscheduler paused {resumed_at - paused_at:.2f} s, lease ttl {TTL_S:g} s: no decisions for "
              f"{gap:.2f} s; {jobs} jobs; the woken one: exit {paused.poll()}, "
              f"{said.count('decision refused')} decisions refused")
        assert gap < 3 * TTL_S, gap
    finally:
        if loader is not None and not loader.done():
            loader.cancel()
        for proc in schedulers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in schedulers:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
