"""The notifier against a real nats-server and real HTTP receivers (started here): a team reads
its own jobs' events and notifications with its own credential, and nothing of another team's;
webhooks are signed, retried with backoff, dead-lettered after the last try, logged, and in order
per job; the preemption notice arrives before its grace deadline; a restart duplicates nothing."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_network

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from conftest import connect_as, eventually, running, service_settings

from runtime import eventlog
from schemas import NotifySpec, TeamConfigured, Webhook, new_event
from schemas.tenant import OTHER_TEAMS_JOB, OTHER_TEAMS_QUEUE, JobNotification, NotificationDelivery
from services.notifier.__main__ import Notifier
from services.notifier.settings import NotifierSettings
from tests.integration.test_telemetry import REPO
from tests.unit.builders import (admitted, preempted, preemption_requested, reclaim_requested, spec, started, submitted,
                                 succeeded)

SECRET = "a-secret-of-some-length"


class Receiver:
    """A real HTTP server: answers each POST with the next status of ``statuses`` (then 204) and
    keeps (wall time, headers, body)."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses, self.got = list(statuses or []), []
        receiver = self

        class Hook(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.got.append((time.time(), dict(self.headers), body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def bodies(self) -> list[dict]:
        return [json.loads(body) for _, _, body in self.got]


@pytest.fixture
def receivers():
    made: list[Receiver] = []
    yield lambda statuses=None: made.append(Receiver(statuses)) or made[-1]
    for r in made:
        r.server.shutdown()


# The receivers listen on loopback, which webhooks may reach only where the operator allows it.
LOOPBACK_ALLOWED = (ip_network("127.0.0.0/8"),)


def notifier(nats_server, **options) -> Notifier:
    return Notifier(service_settings(nats_server, "notifier"),
                    NotifierSettings(secrets={"team-a": SECRET}, backoff_cap_s=0.2, webhook_allow=LOOPBACK_ALLOWED,
                                     **options))


async def read_tenant(nats_server, team: str, subjects: str) -> list:
    """Everything on ``subjects`` of ``team``'s tenant stream, read with the team's own credential."""
    nc = await connect_as(nats_server, team)
    js = nc.jetstream()
    stream = eventlog.tenant_stream(team)
    info = await js.stream_info(stream)
    if info.state.messages == 0:
        await nc.close()
        return []
    sub = await js.pull_subscribe(subjects, stream=stream, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=5))
    out = []
    while batch := await eventlog.fetch(sub, 100, 0.5):  # nats-py may time out with either TimeoutError
        out += batch
    await nc.close()
    return out


async def test_a_team_reads_its_jobs_and_nothing_of_another_teams(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    for job_id, team in (("a1", "team-a"), ("b1", "team-b")):  # as services append: with expected sequences
        seq = await log.append(submitted(job_id, spec(team=team)), expected_last_seq=0)
        seq = await log.append(admitted(job_id), expected_last_seq=seq)
        await log.append(started(job_id), expected_last_seq=seq)
    async with running(notifier(nats_server)):
        def copies(team):
            return read_tenant(nats_server, team, f"gpusched.tenant.{team}.job.>")
        a = await eventually(lambda: _at_least(copies("team-a"), 3))
        b = await eventually(lambda: _at_least(copies("team-b"), 3))
    assert [m.subject for m in a] == ["gpusched.tenant.team-a.job.a1.submitted", "gpusched.tenant.team-a.job.a1.admitted",
                                      "gpusched.tenant.team-a.job.a1.started"]
    assert all(b"b1" not in m.data for m in a) and all(b"a1" not in m.data for m in b)
    notes = [JobNotification.model_validate_json(m.data)
             for m in await read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.notify.>")]
    assert [(n.job_id, n.kind.value) for n in notes] == [("a1", "submitted"), ("a1", "admitted"), ("a1", "started")]
    # team-b's credential may not look at team-a's stream at all: no info, no consumer, no subscription
    violations: list[str] = []

    async def denied(err: Exception) -> None:
        violations.append(str(err).lower())
    other = await connect_as(nats_server, "team-b", error_cb=denied)
    other_js = other.jetstream(timeout=1)
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await other_js.stream_info(eventlog.tenant_stream("team-a"))
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await other_js.add_consumer(eventlog.tenant_stream("team-a"), ConsumerConfig(
            name="peek", filter_subject="gpusched.tenant.team-a.>", ack_policy=AckPolicy.NONE))
    seen = []

    async def got(msg) -> None:
        seen.append(msg)
    await other.subscribe("gpusched.tenant.team-a.>", cb=got)
    await other.flush()
    await eventually(lambda: any('subscription to "gpusched.tenant.team-a.>"' in v for v in violations))
    await other.close()
    assert any('publish to "$js.api.consumer.create.gpusched_tenant_team-a.peek' in v for v in violations), violations
    assert seen == []


async def test_a_teams_services_reach_its_stream_only(nats_server, admin_js):
    """A service's events (docs/serving.md) go to its team's stream as its jobs' do: the
    ServiceDeployed names the team, the controller's later events are looked up by it."""
    from schemas.service import ReplicaReady, ScaledTo
    from tests.unit.builders import service_deployed, service_spec

    log = eventlog.EventLog(admin_js)
    seq = await log.append(service_deployed(service_spec(name="chat", team="team-b", queue_="q")), expected_last_seq=0)
    for cls, fields in ((ScaledTo, {"replicas": 3, "requested": 3}),
                        (ReplicaReady, {"job_id": "replica-chat-1-0", "attempt": 1})):
        seq = await log.append(new_event(cls, aggregate_id="chat", producer="serving", occurred_at=datetime.now(UTC),
                                         key=cls.__name__, **fields), expected_last_seq=seq)
    async with running(notifier(nats_server)):
        got = await eventually(lambda: _at_least(
            read_tenant(nats_server, "team-b", "gpusched.tenant.team-b.service.>"), 3))
    assert [m.subject for m in got] == ["gpusched.tenant.team-b.service.chat.deployed",
                                        "gpusched.tenant.team-b.service.chat.scaled",
                                        "gpusched.tenant.team-b.service.chat.replica_ready"]
    assert await read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.>") == []


async def test_a_services_deploy_scaling_lost_replica_and_deletion_reach_its_webhooks(nats_server, admin_js,
                                                                                      receivers):
    """The service's own notifications go to the team's webhooks and to its replica template's
    (the service's); its routine events (a replica asked for, ready) are only copied."""
    from schemas.service import ReplicaLost, ReplicaReady, ScaledTo, ServiceDeleted
    from tests.unit.builders import service_deployed, service_spec

    team_hook, service_hook = receivers(), receivers()
    log = eventlog.EventLog(admin_js)
    now = datetime.now(UTC)
    await log.append(new_event(TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=now, key="1",
                               name="team-a", notify=NotifySpec(webhooks=(Webhook(url=team_hook.url,
                                                                                  kinds=("replica-lost",)),))))
    hooks = NotifySpec(webhooks=(Webhook(url=service_hook.url),))
    seq = await log.append(service_deployed(service_spec(name="chat", notify=hooks), when=now), expected_last_seq=0)
    job = "replica-chat-1-0"
    for cls, producer, fields in (
            (ReplicaReady, "serving", {"job_id": job, "attempt": 1}),
            (ScaledTo, "serving", {"replicas": 3, "requested": 3, "by": "autoscaler", "message": "autoscaler: 3"}),
            (ReplicaLost, "serving", {"job_id": job, "attempt": 1, "reason": "JobPreempted: for urgent"}),
            (ServiceDeleted, "admission", {"deleted_by": "alice", "intake_sequence": 7})):
        seq = await log.append(new_event(cls, aggregate_id="chat", producer=producer, occurred_at=datetime.now(UTC),
                                         key=cls.__name__, **fields), expected_last_seq=seq)
    async with running(notifier(nats_server)):
        await eventually(lambda: len(service_hook.got) >= 4 and team_hook.got, timeout_s=20)
    assert [(b["kind"], b["service"], b["job_id"]) for b in service_hook.bodies()] == [
        ("service-deployed", "chat", None), ("service-scaled", "chat", None), ("replica-lost", "chat", job),
        ("service-deleted", "chat", None)]
    assert [b["kind"] for b in team_hook.bodies()] == ["replica-lost"]
    assert "scaled to 3 replica(s) by the autoscaler" in service_hook.bodies()[1]["summary"]
    notes = await read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.notify.>")
    assert [m.subject for m in notes] == [
        "gpusched.tenant.team-a.notify.chat.service-deployed", "gpusched.tenant.team-a.notify.chat.service-scaled",
        f"gpusched.tenant.team-a.notify.{job}.replica-lost", "gpusched.tenant.team-a.notify.chat.service-deleted"]


ACK_WAIT_RACE_S = 45.0
"""How long to wait for an event appended just after a notifier stopped: the server may still hold
that notifier's last pull request (1 s) and deliver the event to it; nobody acknowledges it, and
the durable redelivers it after its ack wait (30 s), before anything later (one message in
flight). Delayed, never lost, never out of order."""


async def _at_least(read, n: int):
    got = await read
    return got if len(got) >= n else None


async def test_webhooks_are_signed_retried_logged_and_in_order(nats_server, admin_js, receivers):
    flaky, dead = receivers([500, 503]), receivers([500] * 10)
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=datetime.now(UTC),
                               key="1", name="team-a", notify=NotifySpec(webhooks=(Webhook(url=flaky.url),))))
    job_hooks = NotifySpec(webhooks=(Webhook(url=dead.url, kinds=("succeeded",)),))
    await log.append(submitted("w1", spec(team="team-a", notify=job_hooks)))
    await log.append(admitted("w1"))
    await log.append(started("w1"))
    await log.append(succeeded("w1"))
    async with running(notifier(nats_server, max_attempts=3)):
        await eventually(lambda: len(flaky.got) >= 6 and len(dead.got) >= 3, timeout_s=30)
        deliveries = await eventually(lambda: _at_least(
            read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.delivery.>"), 9), timeout_s=15)
    # in order per job, each once delivered; the first one after two failures
    assert [b["kind"] for b in flaky.bodies()] == ["submitted"] * 3 + ["admitted", "started", "succeeded"]
    for _, headers, body in flaky.got:
        stamp, signature = (part.split("=", 1)[1] for part in headers["Gpusched-Signature"].split(","))
        assert hmac.compare_digest(signature, hmac.new(SECRET.encode(), f"{stamp}.".encode() + body,
                                                       hashlib.sha256).hexdigest())
        assert abs(int(stamp) - time.time()) < 60
    records = [NotificationDelivery.model_validate_json(m.data) for m in deliveries]
    by_url = {url: [(r.kind.value, r.outcome, r.attempt, r.status_code) for r in records if r.url == url]
              for url in (flaky.url, dead.url)}
    assert by_url[flaky.url][:3] == [("submitted", "failed-attempt", 1, 500), ("submitted", "failed-attempt", 2, 503),
                                     ("submitted", "delivered", 3, 204)]
    assert by_url[dead.url] == [("succeeded", "failed-attempt", 1, 500), ("succeeded", "failed-attempt", 2, 500),
                                ("succeeded", "dead-lettered", 3, 500)]
    dlq = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    assert [m.subject for m in dlq] == ["gpusched.deadletter.notifier.webhook"]
    assert "HTTP 500 after 3 tries" in dlq[0].headers["Gpusched-Reason"]


async def test_the_preemption_notice_reaches_the_webhook_before_the_grace_deadline(nats_server, admin_js, receivers):
    hook = receivers()
    log = eventlog.EventLog(admin_js)
    now = datetime.now(UTC)
    await log.append(new_event(TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=now, key="1",
                               name="team-a", notify=NotifySpec(webhooks=(Webhook(url=hook.url,
                                                                                  kinds=("preemption-notice",)),))))
    async with running(notifier(nats_server)):
        await log.append(submitted("p1", spec(team="team-a"), when=now))
        await log.append(submitted("urgent", spec(team="team-a"), when=now))  # the team's own: named
        await log.append(preemption_requested("p1", "urgent", grace_seconds=30, when=datetime.now(UTC)))
        await eventually(lambda: hook.got, timeout_s=15)
    at, _, body = hook.got[0]
    notice = json.loads(body)
    assert (notice["kind"], notice["by_job"], notice["grace_seconds"]) == ("preemption-notice", "urgent", 30.0)
    deadline = datetime.fromisoformat(notice["deadline"])
    assert deadline - datetime.fromisoformat(notice["occurred_at"]) == timedelta(seconds=30)
    assert at < deadline.timestamp()


async def test_a_preemption_for_another_teams_job_names_neither_that_job_nor_its_queue(nats_server, admin_js,
                                                                                       receivers):
    """team-b's job takes team-a's GPUs (the scheduler's preemption) and team-b's queue reclaims
    the quota team-a borrowed: team-a's copies, notifications and webhook say when and why, and
    never name team-b's job or queue. A job whose team the log does not name is unnamed too."""
    hook = receivers()
    log = eventlog.EventLog(admin_js)
    now = datetime.now(UTC)
    await log.append(new_event(TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=now, key="1",
                               name="team-a", notify=NotifySpec(webhooks=(Webhook(
                                   url=hook.url, kinds=("preemption-notice", "preempted")),))))
    await log.append(submitted("a-long", spec(team="team-a"), when=now))
    await log.append(submitted("b-secret-job", spec(team="team-b", queue="b-secret-queue"), when=now))
    async with running(notifier(nats_server)):
        await log.append(preemption_requested("a-long", "b-secret-job", grace_seconds=30, when=datetime.now(UTC)))
        await log.append(reclaim_requested("a-long", "b-secret-job", for_queue="b-secret-queue",
                                           when=datetime.now(UTC)))
        await log.append(preemption_requested("a-long", "never-submitted", when=datetime.now(UTC)))
        await log.append(preempted("a-long", by="b-secret-job", when=datetime.now(UTC)))
        await eventually(lambda: len(hook.got) >= 4, timeout_s=15)
        copies = await read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.>")
    everything = b"".join(m.data for m in copies) + b"".join(body for _, _, body in hook.got)
    for secret in (b"b-secret-job", b"b-secret-queue", b"never-submitted", b"team-b"):
        assert secret not in everything, f"{secret!r} reached team-a"
    notices = [json.loads(body) for _, _, body in hook.got]
    assert [(n["kind"], n["by_job"]) for n in notices] == [("preemption-notice", OTHER_TEAMS_JOB)] * 3 + [
        ("preempted", OTHER_TEAMS_JOB)]
    assert notices[0]["grace_seconds"] == 30.0 and notices[0]["deadline"]
    reclaim = next(json.loads(m.data) for m in copies if m.subject.endswith(".reclaim_requested"))
    assert (reclaim["for_job"], reclaim["for_queue"]) == (OTHER_TEAMS_JOB, OTHER_TEAMS_QUEUE)
    assert reclaim["message"] == f"queue {OTHER_TEAMS_QUEUE} needs its guaranteed a100 back for job {OTHER_TEAMS_JOB}"


async def test_a_restart_copies_nothing_twice_and_loses_nothing(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(submitted("r1", spec(team="team-a")))
    async with running(notifier(nats_server)):
        await eventually(lambda: _at_least(read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.job.>"), 1))
    await log.append(admitted("r1"))  # while it is down
    async with running(notifier(nats_server)):
        await log.append(started("r1"))
        copies = await eventually(lambda: _at_least(
            read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.job.>"), 3), timeout_s=ACK_WAIT_RACE_S)
        await asyncio.sleep(1)
    assert [m.subject.rsplit(".", 1)[1] for m in copies] == ["submitted", "admitted", "started"]
    assert len(await read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.>")) == 6  # 3 copies, 3 notifications


async def test_sigterm_stops_the_process_within_5_s_even_while_it_retries(nats_server, admin_js, receivers,
                                                                           tmp_path):
    dead = receivers([500] * 100)
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"team-a": SECRET}))
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=datetime.now(UTC),
                               key="1", name="team-a", notify=NotifySpec(webhooks=(Webhook(url=dead.url),))))
    await log.append(submitted("s1", spec(team="team-a")))
    env = {**os.environ, **nats_server.env("notifier"), "GPUSCHED_WEBHOOK_SECRETS_FILE": str(secrets),
           "GPUSCHED_WEBHOOK_ALLOW": "127.0.0.0/8"}
    with open(tmp_path / "notifier.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.notifier"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        await eventually(lambda: len(dead.got) >= 2, timeout_s=30)  # retrying, in its backoff
        start = time.monotonic()
        proc.terminate()
        assert proc.wait(10) == 0, (tmp_path / "notifier.log").read_text()
        assert time.monotonic() - start < 5
    finally:
        proc.kill()


async def test_two_partitions_share_the_teams_and_taking_one_on_repeats_nothing(nats_server, admin_js):
    """GPUSCHED_NOTIFIER_PARTITIONS=2: each team's events are copied by exactly one notifier, in
    log order; a second partition added to a running notifier starts where the first had
    acknowledged, so nothing is copied twice or lost."""
    from runtime.teams import partition_of

    teams = ("team-a", "team-b", "team-c")
    assert {partition_of(t, 2) for t in teams} == {0, 1}  # both partitions have work
    log = eventlog.EventLog(admin_js)
    for team in teams:
        await log.append(submitted(f"{team}-1", spec(team=team)))

    def partitioned(k: int) -> Notifier:
        return Notifier(service_settings(nats_server, "notifier"),
                        NotifierSettings(secrets={"team-a": SECRET}, backoff_cap_s=0.2, partitions=2, partition=k))

    def copies(team):
        return read_tenant(nats_server, team, f"gpusched.tenant.{team}.job.>")

    async with running(notifier(nats_server)):  # one notifier first: it copies everything
        for team in teams:
            await eventually(lambda: _at_least(copies(team), 1))
    for team in teams:
        await log.append(admitted(f"{team}-1"))  # while none runs
    async with running(partitioned(0)), running(partitioned(1)):
        for team in teams:
            await log.append(started(f"{team}-1"))
        for team in teams:  # (ACK_WAIT_RACE_S: an event may go to the stopped notifier's last pull)
            await eventually(lambda: _at_least(copies(team), 3), timeout_s=ACK_WAIT_RACE_S)
        await asyncio.sleep(1)
    for team in teams:
        got = await copies(team)
        assert [m.subject.rsplit(".", 1)[1] for m in got] == ["submitted", "admitted", "started"], team
        assert len(await read_tenant(nats_server, team, f"gpusched.tenant.{team}.>")) == 6  # 3 copies, 3 notifications
    # partition 1's durables exist and started after partition 0's acknowledged position
    info = await admin_js.consumer_info(eventlog.EVENTS_STREAM, "notifier-p1")
    assert info.config.opt_start_seq is not None and info.config.opt_start_seq > 1


async def test_partition_1_starting_after_partition_0_loses_nothing_and_is_remade_after_one_notifier(
        nats_server, admin_js):
    """Partition 0 of two runs alone and passes over partition 1's team's events: partition 1,
    started later, still copies them (partition 0 made its durable first). Then one notifier,
    then two again: partition 1's durable of the first time is made again where the single one
    stopped, not used from where it was (it would copy that time's events again)."""
    from runtime.teams import partition_of

    team = next(t for t in ("team-a", "team-b", "team-c") if partition_of(t, 2) == 1)
    log = eventlog.EventLog(admin_js)

    def partitioned(k: int) -> Notifier:
        return Notifier(service_settings(nats_server, "notifier"),
                        NotifierSettings(secrets={"team-a": SECRET}, backoff_cap_s=0.2, partitions=2, partition=k))

    async def passed_over(end: int) -> bool:
        try:
            return (await admin_js.consumer_info(eventlog.EVENTS_STREAM, "notifier")).ack_floor.stream_seq >= end
        except NotFoundError:  # not made yet
            return False

    def copies():
        return read_tenant(nats_server, team, f"gpusched.tenant.{team}.job.>")

    async with running(partitioned(0)):
        end = await log.append(submitted(f"{team}-1", spec(team=team)))
        await eventually(lambda: passed_over(end))
    async with running(partitioned(1)):
        await eventually(lambda: _at_least(copies(), 1))
    async with running(notifier(nats_server)):
        end = await log.append(admitted(f"{team}-1"))
        await eventually(lambda: _at_least(copies(), 2))
        await eventually(lambda: passed_over(end))
    async with running(partitioned(0)), running(partitioned(1)):
        await log.append(started(f"{team}-1"))
        await eventually(lambda: _at_least(copies(), 3), timeout_s=ACK_WAIT_RACE_S)
    info = await admin_js.consumer_info(eventlog.EVENTS_STREAM, "notifier-p1")
    assert info.config.description == "partition 1 of 2" and info.config.opt_start_seq == end + 1
    assert [m.subject.rsplit(".", 1)[1] for m in await copies()] == ["submitted", "admitted", "started"]


async def test_a_team_without_a_tenant_stream_is_skipped_and_holds_up_no_other(nats_server, admin_js):
    """Events of a team nobody provisioned (gpusched init --team) are counted and skipped: the
    fan-out, one message in flight, goes on to the next team's."""
    from services.notifier.__main__ import UNPROVISIONED

    log = eventlog.EventLog(admin_js)
    before = UNPROVISIONED.labels(team="team-z")._value.get()
    await log.append(submitted("z1", spec(team="team-z")))
    await log.append(submitted("a1", spec(team="team-a")))
    async with running(notifier(nats_server)):
        copies = await eventually(lambda: _at_least(
            read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.job.>"), 1), timeout_s=15)
    assert [m.subject for m in copies] == ["gpusched.tenant.team-a.job.a1.submitted"]
    assert UNPROVISIONED.labels(team="team-z")._value.get() == before + 1
