"""The platform on a JetStream cluster (issue 46): three nats-servers on loopback with routes,
every stream, durable consumer and bucket replicated on all three, every process connected with
all three URLs. Jobs run end to end through the services as processes while the meta leader and
then the GPUSCHED_EVENTS stream leader are killed with SIGKILL and started again: every job ends
in exactly one terminal state, each attempt started once, and no service without a lease exits. A
single-active service whose lease is in doubt exits to start again as a standby (runtime/loop.py):
it is started again here, as the dev supervisor and a Deployment do."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from datetime import UTC, datetime

import pytest

from conftest import TEST_TEAMS, eventually, reset_log
from gpusched.dev import stack as devstack
from gpusched.errors import UserError
from gpusched.gateway import connection
from gpusched.gateway import commands
from runtime import eventlog, lease
from runtime.settings import ConfigError, Settings
from schemas import JobSpec, SubmitJob, parse_event
from schemas.queue import FlavorQuota, QueueConfigured
from tests.unit.builders import admitted, submitted

REPLICAS = 3
JOBS = 60
TIME_SCALE = 60.0
RUN = ("admission", "quota", "scheduler", "executor")
"""The services a job passes through from submission to its end (accounting, notifier and serving
read the same log and add nothing to a job's life)."""
LEASED = {"quota", "scheduler"}  # single-active with a lease, as the production overlay runs them
TERMINAL = {"JobSucceeded", "JobRejected", "JobCancelled"}
CLUSTER = """
groups:
  - {prefix: big, count: 3, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 40960}
  - {prefix: small, count: 4, gpu_flavor: l4, gpu_count: 4, gpu_memory_mib: 23034}
"""


def workload(n: int) -> list[SubmitJob]:
    jobs = []
    for i in range(n):
        team = TEST_TEAMS[i % 3]
        flavor, gpus = [("a100", 1), ("a100", 2), ("l4", 1), ("a100", 4), ("l4", 2)][i % 5]
        spec = JobSpec(kind="training", queue=f"q-{team}" if i % 20 != 9 else "q-missing", team=team, image="img",
                       gpus=gpus, gpu_flavors=(flavor,), expected_runtime_seconds=30 + (i % 4) * 15,
                       retry={"max_attempts": 2, "backoff_seconds": 5})
        jobs.append(SubmitJob(job_id=f"r3-{i:03d}", on_behalf_of=f"{team}-ci", spec=spec))
    return jobs


async def connect(cluster: devstack.NatsCluster, user: str):
    """A client that rides out the loss of a server (runtime.eventlog.connect: every URL, reconnects)."""
    return await eventlog.connect(Settings(nats_url=cluster.url(), nats_user=user,
                                           nats_password=cluster.creds.users[user]), f"test-{user}")


@pytest.fixture
async def cluster_stack(nats_cluster, tmp_path):
    admin = await connect(nats_cluster, "admin")
    js = admin.jetstream()
    await reset_log(js, replicas=REPLICAS)
    for service in LEASED:  # a lease bucket of an earlier run in this session
        try:
            await js.delete_key_value(lease.bucket(service))
        except Exception:
            pass
    for i, team in enumerate(TEST_TEAMS):
        await eventlog.EventLog(js).append(QueueConfigured(
            event_id=f"q-{team}", aggregate_id=f"q-{team}", occurred_at=datetime.now(UTC), producer="config",
            name=f"q-{team}", allowed_teams=(team,),
            quotas=(FlavorQuota(flavor="a100", nominal=8), FlavorQuota(flavor="l4", nominal=6))))
    spec = tmp_path / "cluster.yaml"
    spec.write_text(CLUSTER)
    env = devstack.service_env(nats_cluster.env, "", cluster=spec, time_scale=TIME_SCALE, epoch=time.time(),
                               extra={"GPUSCHED_TICK_S": "0.1", "GPUSCHED_LOG_FORMAT": "text"})
    env = {name: {**env[name], **({"GPUSCHED_LEASE_TTL_S": "4"} if name in LEASED else {})} for name in RUN}
    procs = devstack.ServiceProcesses(tmp_path / "logs", env)
    procs.start_all()
    try:
        yield nats_cluster, procs, js
    finally:
        procs.stop_all()
        await admin.close()
        nats_cluster.start()  # every server running for the next test, whatever happened here
    for name in RUN:
        text = procs.log(name).read_text()
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"


async def replicas_of(js, stream: str) -> int:
    """The servers holding ``stream`` once it has a leader (a stream just created elects one)."""
    async def led():
        info = await js.stream_info(stream)
        return info if info.cluster is not None and info.cluster.leader else None
    info = await eventually(led, timeout_s=10)
    assert info.config.num_replicas == REPLICAS, (stream, info.config.num_replicas)
    return 1 + len(info.cluster.replicas or [])


async def events_leader(js) -> int:
    info = await js.stream_info(eventlog.EVENTS_STREAM)
    return info.cluster.leader


async def terminal_count(js) -> int:
    try:
        return len([m async for m in eventlog.read(js, subjects=["gpusched.job.*.succeeded",
                                                                  "gpusched.job.*.rejected"])])
    except eventlog.BROKER_ERRORS:
        return 0


async def test_jobs_run_on_a_3_server_cluster_through_kills_of_the_meta_and_stream_leaders(cluster_stack):
    cluster, procs, js = cluster_stack
    pids = {name: p.pid for name, p in procs.procs.items()}
    # Every stream, the tenant streams too, every durable consumer and bucket: on all three servers.
    for stream in (eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM):
        assert await replicas_of(js, stream) == REPLICAS, stream
    for team in TEST_TEAMS:
        assert await replicas_of(eventlog.tenant_js(js, team), eventlog.tenant_stream(team)) == REPLICAS, team
    for service in LEASED:
        await eventually(lambda: _exists(js, lease.stream(service)), timeout_s=30)
        assert await replicas_of(js, lease.stream(service)) == REPLICAS, service

    jobs = workload(JOBS)
    operator = await connect(cluster, "operator")
    ojs = operator.jetstream()

    async def submit_all():
        for i, job in enumerate(jobs):
            while True:  # a server may be away: publish again (the message id de-duplicates)
                try:
                    await commands.publish_command(ojs, job.spec.team, "submit", job,
                                                   headers={"Nats-Msg-Id": f"submit:{job.job_id}"})
                    break
                except eventlog.BROKER_ERRORS:
                    await asyncio.sleep(0.2)
            await asyncio.sleep(0.1)

    restarted: list[str] = []

    async def supervise():  # as `make run`'s supervisor and Kubernetes do
        while True:
            restarted.extend(procs.restart_dead())
            await asyncio.sleep(0.2)

    supervisor = asyncio.create_task(supervise())
    submitting = asyncio.create_task(submit_all())
    kills = []
    try:
        await eventually(lambda: _at_least(terminal_count(js), 8), timeout_s=45, interval_s=0.5)
        leader = cluster.meta_leader()
        assert leader is not None
        kills.append(f"meta leader {cluster.name(leader)}")
        cluster.kill(leader)
        await asyncio.sleep(1.0)
        cluster.start()  # same port, same store
        print(f"killed -9 and restarted the meta leader {cluster.name(leader)}")

        await eventually(lambda: _at_least(terminal_count(js), 20), timeout_s=45, interval_s=0.5)
        stream_leader = cluster.index(await events_leader(js))
        kills.append(f"{eventlog.EVENTS_STREAM} leader {cluster.name(stream_leader)}")
        cluster.kill(stream_leader)
        await asyncio.sleep(1.0)
        cluster.start()
        print(f"killed -9 and restarted the {eventlog.EVENTS_STREAM} stream leader {cluster.name(stream_leader)}")
        await submitting
    finally:
        submitting.cancel()
        await operator.close()

    async def all_ended():
        history = await _histories(js)
        return history if all(TERMINAL & {e.type for e in history.get(j.job_id, [])} for j in jobs) else None

    try:
        history = await eventually(all_ended, timeout_s=60, interval_s=1.0)
    except AssertionError:
        history = await _histories(js)
        open_jobs = {j.job_id: [e.type for e in history.get(j.job_id, [])][-4:] for j in jobs
                     if not TERMINAL & {e.type for e in history.get(j.job_id, [])}}
        raise AssertionError(f"{len(open_jobs)} jobs never ended (kills: {kills}, restarted: {restarted}): "
                             f"{open_jobs}") from None
    finally:
        supervisor.cancel()
    print(f"kills: {kills}; services started again: {restarted or 'none'}")
    for job in jobs:
        types = Counter(e.type for e in history[job.job_id])
        ends = {t: n for t, n in types.items() if t in TERMINAL}
        assert sum(ends.values()) == 1, f"{job.job_id} ended {ends}"
        starts = Counter(e.attempt for e in history[job.job_id] if e.type == "JobStarted")
        assert all(n == 1 for n in starts.values()), f"{job.job_id} started an attempt twice: {starts}"
    rejected = {j.job_id for j in jobs if j.spec.queue == "q-missing"}
    assert {j for j, events in history.items() if events[-1].type == "JobRejected" or
            any(e.type == "JobRejected" for e in events)} == rejected
    exited = {name: p.returncode for name, p in procs.procs.items()
              if name not in LEASED and (p.poll() is not None or p.pid != pids[name])}
    assert exited == {}, f"services exited: {exited}"
    assert set(restarted) <= LEASED, restarted
    assert len(kills) == 2, kills


async def _exists(js, stream: str) -> bool:
    try:
        await js.stream_info(stream)
    except Exception:
        return False
    return True


async def _at_least(count, n: int) -> bool:
    return await count >= n


async def _histories(js) -> dict[str, list]:
    history: dict[str, list] = {}
    try:
        async for m in eventlog.read(js, subjects=["gpusched.job.>"]):
            event = parse_event(m.data)
            history.setdefault(event.aggregate_id, []).append(event)
    except eventlog.BROKER_ERRORS:
        return {}
    return history


async def test_a_concurrent_writer_on_a_replicated_stream_is_a_concurrency_conflict(nats_cluster):
    """On an R3 stream the leader refuses an append that expects the aggregate's last sequence
    while another append to it is still being replicated, with another error code (10164) than
    the one server's (10071): it is the same conflict, so the loser re-decides after catching up
    (runtime.loop) instead of retrying the append as a broker error."""
    admin = await connect(nats_cluster, "admin")
    try:
        js = admin.jetstream()
        await reset_log(js, replicas=REPLICAS)
        log = eventlog.EventLog(js)
        outcomes: Counter = Counter()
        for k in range(10):
            seq = await log.append(submitted(f"c{k}"), expected_last_seq=0)

            async def write(i: int) -> str:
                try:
                    await log.append(admitted(f"c{k}").model_copy(update={"event_id": f"c{k}-{i}"}),
                                     expected_last_seq=seq)
                except eventlog.ConcurrencyConflict:
                    return "conflict"
                return "appended"
            outcomes.update(await asyncio.gather(*(write(i) for i in range(3))))
        assert outcomes == {"appended": 10, "conflict": 20}
    finally:
        await admin.close()


async def test_every_url_of_the_cluster_reaches_a_service_and_the_cli(nats_cluster, monkeypatch):
    """GPUSCHED_NATS_URL (and the connection file's nats_url) takes every server, comma-separated:
    a client reaches the cluster through any that answers; a wrong entry is refused by name."""
    monkeypatch.setenv("GPUSCHED_NATS_URL", nats_cluster.url())
    settings = Settings.from_env()
    assert settings.nats_servers == nats_cluster.urls() and len(settings.nats_servers) == REPLICAS
    down = f"nats://127.0.0.1:{devstack.free_port()}"  # nothing listens there: the client goes on to the next
    nc = await eventlog.connect(Settings(nats_url=f"{down},{nats_cluster.url()}", nats_user="admin",
                                         nats_password=nats_cluster.creds.users["admin"]), "test-urls")
    try:
        assert nc.connected_url.geturl() in nats_cluster.urls()
        await nc.jetstream().stream_info(eventlog.EVENTS_STREAM)
    finally:
        await nc.close()
    cli = connection.Connection(f"{down},{nats_cluster.url()}", "operator", nats_cluster.creds.users["operator"],
                                None)
    monkeypatch.delenv("GPUSCHED_NATS_URL")
    nc = await cli.nats()
    await nc.close()

    monkeypatch.setenv("GPUSCHED_NATS_URL", f"{nats_cluster.urls()[0]},127.0.0.1:4222")
    with pytest.raises(ConfigError, match=r"GPUSCHED_NATS_URL=.*'127.0.0.1:4222' is not a NATS server URL; "
                                          r"accepted: nats://HOST:PORT"):
        Settings.from_env()
    with pytest.raises(UserError, match="GPUSCHED_NATS_URL=.*is not a NATS server URL"):
        await connection.Connection(os.environ["GPUSCHED_NATS_URL"], "operator", "x", None).nats()


def test_dev_up_keeps_a_data_directory_on_the_broker_it_ran_with(tmp_path, monkeypatch):
    """`gpusched dev up --nats-cluster 3` over a data directory whose log is one server's (or the
    reverse, or another size) would start an empty log under read models of another: refused, as
    is the option beside external NATS."""
    from gpusched.dev import run as devrun

    monkeypatch.delenv("GPUSCHED_NATS_URL", raising=False)
    devrun._check_nats_layout(3, tmp_path)  # a new directory: either
    devrun._check_nats_layout(1, tmp_path)
    (tmp_path / "nats" / "jetstream").mkdir(parents=True)
    with pytest.raises(UserError, match="--nats-cluster 3: .* ran on one nats-server .* accepted: another data"):
        devrun._check_nats_layout(3, tmp_path)
    (tmp_path / "nats" / "jetstream").rmdir()
    for i in range(3):
        (tmp_path / devrun.NATS_CLUSTER_DIR / f"n{i}" / "jetstream").mkdir(parents=True)
    with pytest.raises(UserError, match="ran on a cluster of 3 nats-servers .* accepted: --nats-cluster 3"):
        devrun._check_nats_layout(1, tmp_path)
    with pytest.raises(UserError, match="--nats-cluster 5: .* a cluster of 3 nats-servers"):
        devrun._check_nats_layout(5, tmp_path)
    devrun._check_nats_layout(3, tmp_path)
    monkeypatch.setenv("GPUSCHED_NATS_URL", "nats://10.0.0.1:4222")
    with pytest.raises(UserError, match="GPUSCHED_NATS_URL names external ones"):
        devrun._check_nats_layout(3, tmp_path)
