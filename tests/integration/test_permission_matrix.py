"""Trying to break in: every role (a tenant, another tenant, a service, the operator, the admin)
against a real nats-server, first with the configuration the dev stack generates, then with
deploy/nats-server.conf. Each role tries what it may do (it must work) and a list of what it may
not (each must be denied by the server); the test counts both and allows no forbidden action.

Authorization is the server's: a publish or subscribe it refuses comes back as a permissions
violation on the connection, and the message goes nowhere. JetStream management is a publish on
``$JS.API...``, so it is checked the same way."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest

from conftest import connect_as, eventually, running, service_settings
from gpusched import permissions
from gpusched.dev import natsconf
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import JobRejected, JobSubmitted, parse_event
from schemas.job import rejection_id
from services.admission.__main__ import AdmissionService
from services.admission.domain import AdmissionCore
from tests.unit.builders import queue

ROOT = Path(__file__).resolve().parents[2]
EV, INTAKE, DLQ = eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM
SNAP = "OBJ_snapshots"  # + "-<service>": a service's snapshot bucket (runtime/snapshot.py)
LEASE = "KV_lease"  # + "-<service>": a service's lease bucket (runtime/lease.py)


@dataclass(frozen=True)
class Try:
    verb: str  # "pub" (a publish, JetStream API calls included) or "sub"
    subject: str


def pub(*subjects: str) -> list[Try]:
    return [Try("pub", s) for s in subjects]


def sub(*subjects: str) -> list[Try]:
    return [Try("sub", s) for s in subjects]


def matrix(team: str, other: str) -> dict[str, tuple[list[Try], list[Try]]]:
    """user -> (what it may do, what it may not), for a tenant ``team`` and another tenant ``other``."""
    mine, theirs = eventlog.tenant_stream(team), eventlog.tenant_stream(other)
    never = [  # no role but the admin may do these
        *pub(f"$JS.API.STREAM.CREATE.X", f"$JS.API.STREAM.UPDATE.{EV}", f"$JS.API.STREAM.DELETE.{EV}",
             f"$JS.API.STREAM.PURGE.{EV}", f"$JS.API.STREAM.MSG.DELETE.{EV}", f"$JS.API.STREAM.DELETE.{mine}",
             f"$JS.API.STREAM.PURGE.{mine}", f"$JS.API.STREAM.MSG.DELETE.{INTAKE}", f"$JS.API.STREAM.PURGE.{DLQ}",
             f"$JS.API.CONSUMER.DELETE.{INTAKE}.admission-intake", f"$JS.API.CONSUMER.DELETE.{mine}.notifier",
             f"$JS.API.CONSUMER.MSG.NEXT.{EV}.scheduler", f"$JS.ACK.{EV}.scheduler.1.2.3.4.0"),
        *sub("_INBOX.>", ">", "gpusched.>", "$JS.API.>", f"_INBOX.{other}.>", "_INBOX.scheduler.>"),
    ]
    return {
        team: (
            pub(f"gpusched.intake.{team}.submit", f"gpusched.intake.{team}.deploy", f"gpusched.intake.{team}.scale",
                f"gpusched.intake.{team}.delete", f"$JS.API.STREAM.INFO.{mine}", f"$JS.API.CONSUMER.CREATE.{mine}.mine",
                f"$JS.API.CONSUMER.CREATE.{mine}.mine.gpusched.tenant.{team}.notify.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{mine}.mine", f"$JS.API.CONSUMER.DELETE.{mine}.mine")
            + sub(f"_INBOX.{team}.>", f"gpusched.tenant.{team}.>"),
            never + pub(
                f"gpusched.intake.{other}.submit", f"gpusched.intake.{team}.operator.submit",
                f"gpusched.intake.{other}.deploy", f"gpusched.intake.{other}.scale",
                "gpusched.service.chat.deployed", "gpusched.service.chat.replica_requested",
                f"gpusched.intake.{team}.user.mallory.submit", f"gpusched.job.x.admitted", "gpusched.queue.q.configured",
                "gpusched.policy.cluster.configured",
                f"gpusched.tenant.{team}.job.x.admitted", f"gpusched.tenant.{other}.notify.x.admitted",
                f"_INBOX.{other}.reply", f"$JS.API.STREAM.INFO.{EV}", f"$JS.API.DIRECT.GET.{EV}",
                f"$JS.API.STREAM.MSG.GET.{INTAKE}", f"$JS.API.STREAM.INFO.{theirs}",
                f"$JS.API.CONSUMER.CREATE.{theirs}", f"$JS.API.CONSUMER.CREATE.{theirs}.spy",
                f"$JS.API.CONSUMER.LIST.{theirs}", f"$JS.API.CONSUMER.CREATE.{EV}.spy",
                f"$JS.API.CONSUMER.MSG.NEXT.{mine}.notifier", f"$JS.ACK.{mine}.notifier.1.2.3.4.0",
                f"$JS.API.CONSUMER.DURABLE.CREATE.{mine}.notifier", f"$JS.API.CONSUMER.CREATE.{mine}.notifier.x",
                "$O.snapshots-scheduler.M.x", f"$JS.API.STREAM.CREATE.{SNAP}-quota", f"$JS.API.DIRECT.GET.{SNAP}-quota",
                f"$JS.API.CONSUMER.CREATE.{SNAP}-admission", "$KV.lease-scheduler.active",
                f"$JS.API.STREAM.CREATE.{LEASE}-quota",
            ) + sub(f"gpusched.tenant.{other}.>", "gpusched.job.>", f"_INBOX.{team}x.>"),
        ),
        "quota": (
            pub(f"$JS.API.STREAM.INFO.{EV}", f"$JS.API.CONSUMER.INFO.{EV}.quota", f"$JS.API.CONSUMER.INFO.{EV}.quota-r0",
                "gpusched.deadletter.quota", f"$JS.API.DIRECT.GET.{EV}",
                # its own snapshot bucket (runtime/snapshot.py)
                "$O.snapshots-quota.C.x", "$O.snapshots-quota.M.x", f"$JS.API.STREAM.CREATE.{SNAP}-quota",
                f"$JS.API.STREAM.PURGE.{SNAP}-quota", f"$JS.API.DIRECT.GET.{SNAP}-quota",
                f"$JS.API.CONSUMER.CREATE.{SNAP}-quota", f"$JS.FC.{SNAP}-quota.x",
                # its own lease bucket (runtime/lease.py)
                "$KV.lease-quota.active", f"$JS.API.STREAM.CREATE.{LEASE}-quota", f"$JS.API.STREAM.INFO.{LEASE}-quota",
                f"$JS.API.DIRECT.GET.{LEASE}-quota.$KV.lease-quota.active")
            + sub("_INBOX.quota.>"),
            never + pub(
                "gpusched.job.x.scheduled", "gpusched.job.x.admitted", "gpusched.policy.cluster.configured",
                f"gpusched.intake.{team}.submit",
                f"gpusched.intake.{team}.operator.submit", "gpusched.deadletter.admission", f"gpusched.tenant.{team}.x",
                f"$JS.API.CONSUMER.DELETE.{EV}.admission", f"$JS.API.CONSUMER.CREATE.{EV}.admission",
                f"$JS.API.CONSUMER.INFO.{INTAKE}.admission-intake", f"$JS.API.CONSUMER.CREATE.{EV}.admission-r0",
                f"$JS.API.CONSUMER.CREATE.{EV}", f"$JS.API.STREAM.INFO.{INTAKE}", f"$JS.API.CONSUMER.DELETE.{DLQ}.x",
                f"$JS.API.CONSUMER.CREATE.{mine}.spy", f"$JS.ACK.{EV}.admission.1.2.3.4.0", "_INBOX.admission.reply",
                # another service's snapshots, and changing or deleting its own bucket
                "$O.snapshots-scheduler.M.x", "$O.snapshots-scheduler.C.x", f"$JS.API.STREAM.INFO.{SNAP}-scheduler",
                f"$JS.API.DIRECT.GET.{SNAP}-scheduler", f"$JS.API.CONSUMER.CREATE.{SNAP}-scheduler",
                f"$JS.API.STREAM.PURGE.{SNAP}-scheduler", f"$JS.API.STREAM.DELETE.{SNAP}-quota",
                f"$JS.API.STREAM.UPDATE.{SNAP}-quota",
                # another service's lease (taking it would stop that service deciding), and
                # changing or deleting its own bucket
                "$KV.lease-scheduler.active", f"$JS.API.STREAM.CREATE.{LEASE}-scheduler",
                f"$JS.API.DIRECT.GET.{LEASE}-scheduler", f"$JS.API.STREAM.UPDATE.{LEASE}-quota",
                f"$JS.API.STREAM.DELETE.{LEASE}-quota", f"$JS.API.STREAM.PURGE.{LEASE}-quota",
            ) + sub(f"gpusched.tenant.{team}.>"),
        ),
        "executor": (
            pub(f"$JS.API.CONSUMER.INFO.{EV}.executor", "gpusched.node.n1.telemetry") + sub("_INBOX.executor.>"),
            never + pub(f"$JS.API.CONSUMER.DELETE.{DLQ}.dlq-reader", f"$JS.API.CONSUMER.CREATE.{DLQ}.x",
                        f"$JS.API.CONSUMER.DELETE.{EV}.quota", "gpusched.job.x.quota_reserved",
                        # the executor keeps no snapshot
                        "$O.snapshots-executor.C.x", f"$JS.API.STREAM.CREATE.{SNAP}-executor",
                        f"$JS.API.DIRECT.GET.{SNAP}-scheduler"),
        ),
        "executor-east": (  # one cluster's executor (docs/executor.md, "Many clusters"): its own durable and lease
            pub(f"$JS.API.CONSUMER.INFO.{EV}.executor-east", f"$JS.API.CONSUMER.MSG.NEXT.{EV}.executor-east",
                "gpusched.cluster.east.reported", "gpusched.node.gpu-0_east.registered", "gpusched.job.x.started",
                "gpusched.deadletter.executor-east", "$KV.lease-executor-east.active",
                f"$JS.API.STREAM.CREATE.{LEASE}-executor-east")
            + sub("_INBOX.executor-east.>"),
            never + pub(
                # the other clusters' executors, and the single-cluster one
                f"$JS.API.CONSUMER.INFO.{EV}.executor", f"$JS.API.CONSUMER.MSG.NEXT.{EV}.executor-west",
                f"$JS.ACK.{EV}.executor.1.2.3.4.0", "$KV.lease-executor-west.active", "$KV.lease-executor.active",
                "gpusched.deadletter.executor", "gpusched.deadletter.executor-west",
                # declaring a cluster lost is the scheduler's; quota's and admission's events
                "gpusched.cluster.west.lost", "gpusched.job.x.quota_reserved", "gpusched.job.x.admitted",
                f"$JS.API.STREAM.UPDATE.{LEASE}-executor-east")
            + sub("_INBOX.executor-west.>", "_INBOX.executor.>"),
        ),
        "serving": (  # the serving controller: its service events, its durable; never a job or a command
            pub("gpusched.service.chat.replica_requested", "gpusched.service.chat.scaled",
                "gpusched.service.chat.replica_ready", f"$JS.API.CONSUMER.INFO.{EV}.serving")
            + sub("_INBOX.serving.>"),
            never + pub("gpusched.job.x.submitted", "gpusched.job.x.cancel_requested", "gpusched.service.chat.deployed",
                        "gpusched.service.chat.scale_requested", f"gpusched.intake.{team}.submit",
                        f"gpusched.intake.{team}.operator.deploy", f"$JS.API.CONSUMER.DELETE.{EV}.quota",
                        "$O.snapshots-serving.C.x", f"$JS.API.STREAM.CREATE.{SNAP}-serving")
            + sub(f"gpusched.tenant.{team}.>"),
        ),
        "operator": (
            pub(f"gpusched.intake.{team}.operator.submit", f"$JS.API.STREAM.INFO.{EV}", "gpusched.policy.cluster.configured",
                f"$JS.API.CONSUMER.INFO.{DLQ}.operator-r0", f"$JS.API.CONSUMER.INFO.{mine}.operator-r1")
            + sub("_INBOX.operator.>"),
            never + pub(
                f"gpusched.intake.{team}.submit", f"gpusched.intake.{team}.user.alice.submit", "gpusched.job.x.admitted",
                f"gpusched.tenant.{team}.x", f"$JS.API.CONSUMER.DELETE.{EV}.admission",
                f"$JS.API.CONSUMER.CREATE.{EV}.admission", f"$JS.API.CONSUMER.MSG.NEXT.{INTAKE}.admission-intake",
                f"$JS.API.CONSUMER.CREATE.{mine}.spy", "gpusched.token.x.issued", "gpusched.token.x.revoked",
            ) + sub(f"gpusched.tenant.{team}.>"),
        ),
        "api": (  # the HTTP API: commands as its callers, direct gets, core subscriptions; no consumer
            pub(f"gpusched.intake.{team}.user.alice.submit", f"gpusched.intake.{other}.operator.cancel",
                f"gpusched.intake.{team}.user.bob.checkpoint", f"$JS.API.DIRECT.GET.{EV}",
                f"$JS.API.DIRECT.GET.{EV}.gpusched.job.x.admitted", f"$JS.API.STREAM.INFO.{DLQ}",
                f"$JS.API.DIRECT.GET.{DLQ}")
            + sub("_INBOX.api.>", "gpusched.job.*.admitted", "gpusched.job.*.rejected",
                  "gpusched.deadletter.admission.intake", "gpusched.tenant.*.job.>"),
            never + pub(
                f"gpusched.intake.{team}.submit", "gpusched.job.x.admitted", "gpusched.token.x.issued",
                "gpusched.queue.q.configured", "gpusched.policy.cluster.configured", f"gpusched.tenant.{team}.job.x.admitted",
                f"$JS.API.CONSUMER.CREATE.{EV}", f"$JS.API.CONSUMER.CREATE.{EV}.api-r0",
                f"$JS.API.CONSUMER.CREATE.{mine}.spy", f"$JS.API.STREAM.INFO.{INTAKE}",
                f"$JS.API.DIRECT.GET.{INTAKE}", f"$JS.API.STREAM.MSG.GET.{mine}", "gpusched.deadletter.api",
            ) + sub("gpusched.job.>", "gpusched.job.x.scheduled", f"gpusched.tenant.{team}.notify.>",
                    "gpusched.intake.>", "gpusched.deadletter.>"),
        ),
        "admin": (pub(f"$JS.API.STREAM.INFO.{EV}", f"gpusched.intake.{team}.submit", "gpusched.token.x.issued")
                  + sub(">", "_INBOX.>"), []),
    }


@dataclass
class Outcome:
    allowed: list[Try] = field(default_factory=list)
    denied: list[Try] = field(default_factory=list)


async def attempt(url: str, user: str, password: str, tries: list[Try]) -> Outcome:
    """Run ``tries`` as ``user`` on one connection and sort them by the server's verdict."""
    violations: list[str] = []

    async def on_error(err: Exception) -> None:
        violations.append(str(err).lower())

    nc = await nats.connect(url, user=user, password=password, inbox_prefix=eventlog.inbox_prefix(user),
                            error_cb=on_error, connect_timeout=5)
    out = Outcome()
    try:
        for t in tries:
            violations.clear()
            if t.verb == "pub":
                await nc.publish(t.subject, b"{}")
            else:
                await nc.subscribe(t.subject)
            await nc.flush()
            await asyncio.sleep(0.05)  # the -ERR comes right after the flush's PONG at the latest
            what = "publish to" if t.verb == "pub" else "subscription to"
            denied = any(f'permissions violation for {what} "{t.subject.lower()}"' in v for v in violations)
            (out.denied if denied else out.allowed).append(t)
    finally:
        await nc.close()
    return out


async def check_matrix(url: str, passwords: dict[str, str], team: str, other: str) -> dict[str, tuple[int, int]]:
    """Every role's may and may-not lists; returns role -> (forbidden tried, forbidden denied)."""
    counts, broken = {}, []
    for user, (may, may_not) in matrix(team, other).items():
        if user not in passwords and permissions.cluster_executor(user):
            continue  # deploy/nats-server.conf names no cluster: `gpusched dev nats-config --cluster` adds one
        ok = await attempt(url, user, passwords[user], may)
        bad = await attempt(url, user, passwords[user], may_not)
        broken += [f"{user} was refused {t.verb} {t.subject}" for t in ok.denied]
        broken += [f"{user} was ALLOWED {t.verb} {t.subject}" for t in bad.allowed]
        counts[user] = (len(may_not), len(bad.denied))
    print("forbidden actions tried / denied by role:", counts)
    assert not broken, "\n".join(broken)
    return counts


@pytest.mark.parametrize("team, other", [("team-a", "team-b"), ("team-b", "team-a")])
async def test_each_role_may_do_what_it_needs_and_nothing_else(nats_server, admin_js, team, other):
    counts = await check_matrix(nats_server.url(), nats_server.creds.users, team, other)
    assert all(tried == denied for tried, denied in counts.values())
    assert sum(tried for tried, _ in counts.values()) > 100


async def test_no_one_deletes_or_purges_history_not_even_the_admin(admin_js):
    await admin_js.publish("gpusched.intake.team-a.submit", b"{}")
    with pytest.raises(nats.js.errors.ServerError, match="message delete not permitted"):
        await admin_js.delete_msg(INTAKE, 1)
    for js, stream in ((admin_js, EV), (admin_js, INTAKE), (admin_js, DLQ),
                       (eventlog.tenant_js(admin_js, "team-a"), eventlog.tenant_stream("team-a"))):
        with pytest.raises(nats.js.errors.ServerError, match="stream purge not permitted"):
            await js.purge_stream(stream)
    assert (await admin_js.stream_info(INTAKE)).state.messages == 1


async def test_a_tenant_cannot_read_the_replies_services_get(nats_server, admin_js):
    """The _INBOX leak: pull deliveries to a service travel on its inbox. A tenant may not
    subscribe to ``_INBOX.>`` nor to a service's inbox, and gets nothing while a service reads."""
    tenant = await connect_as(nats_server, "team-a", error_cb=_ignore)
    got: list = []

    async def keep(msg):
        got.append(msg)
    for subject in ("_INBOX.>", "_INBOX.admission.>"):
        await tenant.subscribe(subject, cb=keep)
    await admin_js.publish("gpusched.intake.team-b.submit", b'{"spec": {"env": {"API_KEY": "secret"}}}')
    service = await connect_as(nats_server, "admission")
    sub = await eventlog.durable_consumer(service.jetstream(), stream=INTAKE, durable="admission-intake")
    assert [m.data for m in await eventlog.fetch(sub, 10, 2.0)] == [b'{"spec": {"env": {"API_KEY": "secret"}}}']
    await asyncio.sleep(0.3)
    assert got == []
    await service.close()
    await tenant.close()


async def _ignore(err: Exception) -> None:
    """The permission violations this test provokes."""


async def test_identity_comes_from_the_credential_not_the_document(nats_server, admin_js):
    await eventlog.EventLog(admin_js).append(queue("research", ("team-a",), allowed_users=("carol",)))
    service = AdmissionService("admission", AdmissionCore(), service_settings(nats_server, "admission"))
    async with running(service):
        tenant = (await connect_as(nats_server, "team-a")).jetstream()
        operator = (await connect_as(nats_server, "operator", error_cb=_ignore)).jetstream()
        spec = {"kind": "training", "queue": "research", "team": "team-a", "image": "i", "gpus": 1}
        claim = await tenant.publish("gpusched.intake.team-a.submit",
                                     json.dumps({"job_id": "claims-carol", "submitter": "carol", "spec": spec}).encode())
        # The operator cannot pose as the team on its subject; on its own it must say for whom.
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await operator.publish("gpusched.intake.team-a.submit", json.dumps({"spec": spec}).encode(), timeout=1)
        await operator.publish("gpusched.intake.team-a.operator.submit",
                               json.dumps({"job_id": "for-carol", "on_behalf_of": "carol", "spec": spec}).encode())

        async def decided():
            events = {}
            async for m in eventlog.read(admin_js, subjects=["gpusched.job.>"]):
                e = parse_event(m.data)
                events[e.aggregate_id, e.type] = e
            return events if {(rejection_id(claim.seq), "JobRejected"), ("for-carol", "JobAdmitted")} <= set(events) \
                else None
        events = await eventually(decided)
    rejected: JobRejected = events[rejection_id(claim.seq), "JobRejected"]
    assert (rejected.field, rejected.team) == ("submitter", "team-a")
    assert "submitter 'carol' is not the sender" in rejected.message
    submitted: JobSubmitted = events["for-carol", "JobSubmitted"]
    assert (submitted.submitter, submitted.on_behalf_of) == ("operator", "carol")


# -- the same matrix against the committed deployment configuration ----------------------------


@pytest.fixture
def deployed_nats(tmp_path):
    """nats-server running deploy/nats-server.conf as committed (port and store moved here)."""
    text = (ROOT / "deploy" / "nats-server.conf").read_text()
    port = devstack.free_port()
    text = text.replace('"listen": "0.0.0.0:4222"', f'"listen": "127.0.0.1:{port}"')
    text = text.replace('"/data/jetstream"', json.dumps(str(tmp_path / "js")))
    conf = tmp_path / "nats.conf"
    conf.write_text(text)
    users = re.findall(r'"user": "([^"]+)"', text)
    passwords = {user: f"pw-{user}" for user in users}
    env = {**os.environ, **{natsconf.password_variable(u): p for u, p in passwords.items()}}
    proc = subprocess.Popen([devstack._bin("nats-server"), "-c", str(conf)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    devstack.wait_for_port(port, proc=proc)
    yield f"nats://127.0.0.1:{port}", passwords
    proc.terminate()
    proc.wait(10)


async def test_the_deployment_config_holds_the_same_matrix(deployed_nats):
    url, passwords = deployed_nats
    admin = await nats.connect(url, user="admin", password=passwords["admin"])
    await eventlog.provision(admin.jetstream(), teams=("team-research", "team-product"))
    await admin.close()
    counts = await check_matrix(url, passwords, "team-research", "team-product")
    assert all(tried == denied for tried, denied in counts.values())
