"""The tenant wall (docs/events.md, "The tenant wall"): nothing a team's credential can make the
server publish lands outside the team's own account. A hostile team-a, with only its own
credential, points every server-side publisher it can create or trigger at the platform's
subjects: a push consumer's deliver subject, the reply subject of a fetch, of a direct get, of a
stream info, and of a publish to its own intake (JetStream's ack). Each target is a subject one
of the platform's streams captures (the event log, the intake on another team's subject, the dead
letters, another team's tenant stream) and that a platform component listens to. No stream may
change but by the team's own intake publishes, and no platform subscriber may hear anything.

Within one NATS account, subject permissions cannot hold this: they check the subject a client
publishes on, not a consumer's deliver subject nor a request's reply subject, which the server
answers on with its own rights. Every vector here stored a message on the one-account
configuration; the team accounts (gpusched.permissions.accounts) leave the team only its own
account to write in."""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import connect_as
from runtime import eventlog

TEAM, OTHER = "team-a", "team-b"
MINE = eventlog.tenant_stream(TEAM)

TARGETS = {
    "event log": "gpusched.job.wall-1.submitted",
    "intake, another team's submit": f"gpusched.intake.{OTHER}.submit",
    "intake, another team's user": f"gpusched.intake.{OTHER}.user.bob.cancel",
    "intake, the operator's on the team's behalf": f"gpusched.intake.{TEAM}.operator.cancel",
    "dead letters": "gpusched.deadletter.admission.intake",
    "another team's tenant stream": f"gpusched.tenant.{OTHER}.job.wall-1.admitted",
}
"""What the attack aims at: a subject of each platform stream (and of the API's answer feeds)."""


async def positions(admin_js) -> dict[str, int]:
    """The last sequence of each stream the attack must not change."""
    out = {s: (await admin_js.stream_info(s)).state.last_seq
           for s in (eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM)}
    other = eventlog.tenant_js(admin_js, OTHER)
    out[eventlog.tenant_stream(OTHER)] = (await other.stream_info(eventlog.tenant_stream(OTHER))).state.last_seq
    return out


async def create_consumer(tenant, name: str, **config) -> None:
    reply = await tenant.request(f"$JS.API.CONSUMER.CREATE.{MINE}.{name}", json.dumps(
        {"stream_name": MINE, "config": {"name": name, "ack_policy": "none", "deliver_policy": "all", **config}}).encode(),
        timeout=5)
    assert "error" not in json.loads(reply.data), reply.data  # the team may make consumers on its stream


@pytest.mark.parametrize("target", list(TARGETS.values()), ids=list(TARGETS))
async def test_nothing_a_team_makes_the_server_publish_leaves_its_account(nats_server, admin_js, target):
    # the team's stream holds something to deliver (written as the notifier writes it)
    for n in range(3):
        await admin_js.publish(f"gpusched.tenant.{TEAM}.job.j{n}.admitted", json.dumps({"n": n}).encode())
    heard: list = []

    async def listen(msg) -> None:
        heard.append(msg)
    admin = eventlog.client_of(admin_js)
    await admin.subscribe(target, cb=listen)  # a platform component's interest (a push needs one)
    await admin.flush()
    before = await positions(admin_js)

    tenant = await connect_as(nats_server, TEAM)
    await create_consumer(tenant, "push", deliver_subject=target)
    await create_consumer(tenant, "pull")
    await tenant.publish(f"$JS.API.CONSUMER.MSG.NEXT.{MINE}.pull", json.dumps({"batch": 3, "no_wait": True}).encode(),
                         reply=target)
    await tenant.publish(f"$JS.API.DIRECT.GET.{MINE}", json.dumps({"seq": 1}).encode(), reply=target)
    await tenant.publish(f"$JS.API.STREAM.INFO.{MINE}", b"", reply=target)
    own = f"gpusched.intake.{TEAM}.submit"
    await tenant.publish(own, b'{"not": "a command"}', reply=target)  # JetStream's ack goes to the reply
    await tenant.flush()
    await asyncio.sleep(1.0)
    after = await positions(admin_js)
    await tenant.close()

    # the one message stored is the team's own publish, on its own intake subject
    assert after[eventlog.INTAKE_STREAM] == before[eventlog.INTAKE_STREAM] + 1
    stored = await admin_js.get_msg(eventlog.INTAKE_STREAM, after[eventlog.INTAKE_STREAM])
    assert stored.subject == own
    assert {s: after[s] - before[s] for s in before if s != eventlog.INTAKE_STREAM} == {
        eventlog.EVENTS_STREAM: 0, eventlog.DLQ_STREAM: 0, eventlog.tenant_stream(OTHER): 0}
    assert heard == []


async def test_the_team_still_reads_its_own_stream_and_gets_its_acks(nats_server, admin_js):
    """The wall takes nothing from the team: its consumers deliver to it, its publishes are acked."""
    await admin_js.publish(f"gpusched.tenant.{TEAM}.notify.j1.admitted", b'{"kind": "admitted"}')
    tenant = await connect_as(nats_server, TEAM)
    js = tenant.jetstream()
    ack = await js.publish(f"gpusched.intake.{TEAM}.submit", b"{}")
    assert ack.stream == eventlog.INTAKE_STREAM
    sub = await js.pull_subscribe(f"gpusched.tenant.{TEAM}.notify.>", durable="mine", stream=MINE)
    assert [m.data for m in await eventlog.fetch(sub, 10, 2.0)] == [b'{"kind": "admitted"}']
    pushed = await js.subscribe(f"gpusched.tenant.{TEAM}.notify.>", stream=MINE, ordered_consumer=True)
    assert (await pushed.next_msg(timeout=5)).data == b'{"kind": "admitted"}'
    await tenant.close()
