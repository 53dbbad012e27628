"""Every team hears why (docs/publishing.md, "When a command is refused unread"): a command that
admission cannot read or take is dead-lettered, and the notifier copies the dead letter, with its
reason, to the team's own stream on ``gpusched.tenant.<team>.refused.<intake sequence>`` (the
sequence the publisher's JetStream ack gave) and sends a ``command-refused`` notification to the
team's webhooks. Another team hears nothing of it. Real nats-server, admission, notifier and an
HTTP receiver."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

from nats.js.errors import NotFoundError

from conftest import connect_as, eventually, running, service_settings
from runtime import eventlog
from schemas import NotifySpec, TeamConfigured, Webhook, new_event
from schemas.tenant import CommandRefused, JobNotification
from services.admission.__main__ import AdmissionService
from services.admission.domain import AdmissionCore
from tests.integration.test_notifier import Receiver, notifier, read_tenant


async def test_a_team_reads_why_its_unreadable_commands_were_refused(nats_server, admin_js):
    hook = Receiver()
    await eventlog.EventLog(admin_js).append(new_event(
        TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=datetime.now(UTC), key="1",
        name="team-a", notify=NotifySpec(webhooks=(Webhook(url=hook.url),))))
    old = await admin_js.publish("gpusched.deadletter.admission.intake", b"{", headers={
        "Gpusched-Original-Subject": "gpusched.intake.team-a.submit", "Gpusched-Original-Sequence": "999",
        "Gpusched-Reason": "refused before the notifier told teams"})
    tenant = (await connect_as(nats_server, "team-a")).jetstream()
    not_json = await tenant.publish("gpusched.intake.team-a.submit", b"this is not JSON")
    bad_cancel = await tenant.publish("gpusched.intake.team-a.cancel", json.dumps({"job_id": "j-1", "why": 1}).encode())
    other = (await connect_as(nats_server, "team-b")).jetstream()
    theirs = await other.publish("gpusched.intake.team-b.submit", b"[1, 2")
    admission = AdmissionService("admission", AdmissionCore(), service_settings(nats_server, "admission"))
    try:
        async with running(notifier(nats_server)):
            # a first start tells of what is refused from now on, not of older dead letters
            durable = await eventually(lambda: _consumer(admin_js, "notifier-refused"))
            assert durable.config.opt_start_seq == old.seq + 1
            async with running(admission):
                refused = await eventually(lambda: _at_least(
                    read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.refused.>"), 2), timeout_s=30)
                notes = await eventually(lambda: _at_least(
                    read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.notify.>"), 2), timeout_s=30)
                posted = await eventually(lambda: hook.got if len(hook.got) >= 2 else None, timeout_s=30)
                b_refused = await eventually(lambda: _at_least(
                    read_tenant(nats_server, "team-b", "gpusched.tenant.team-b.refused.>"), 1), timeout_s=30)
    finally:
        hook.server.shutdown()

    # the refusal, on the subject the ack's sequence names, with its reason and the command's bytes
    # (base64: the team's stream never holds a document a command parser would take)
    assert [m.subject for m in refused] == [f"gpusched.tenant.team-a.refused.{not_json.seq}",
                                            f"gpusched.tenant.team-a.refused.{bad_cancel.seq}"]
    first, second = (CommandRefused.model_validate_json(m.data) for m in refused)
    assert base64.b64decode(first.document_base64) == b"this is not JSON"
    assert "JSON" in first.reason and first.reason == refused[0].headers["Gpusched-Reason"]
    assert (first.subject, first.intake_sequence) == ("gpusched.intake.team-a.submit", not_json.seq)
    assert "why" in second.reason  # the field it could not take
    assert b'{"job_id": "j-1", "why": 1}' not in refused[1].data  # only base64-encoded
    # the notification names the command, the sequence and the reason; the webhook got the same
    kinds = [JobNotification.model_validate_json(m.data) for m in notes]
    assert [(n.kind.value, n.intake_sequence) for n in kinds] == [("command-refused", not_json.seq),
                                                                  ("command-refused", bad_cancel.seq)]
    assert f"intake sequence {not_json.seq}" in kinds[0].summary and "JSON" in kinds[0].summary
    assert kinds[1].job_id == "j-1"
    assert [json.loads(body)["intake_sequence"] for _, _, body in posted] == [not_json.seq, bad_cancel.seq]
    # team-b hears of its own refused command and of nothing of team-a's
    assert [m.subject for m in b_refused] == [f"gpusched.tenant.team-b.refused.{theirs.seq}"]
    assert not any(b"team-a" in m.data for m in b_refused)


async def _consumer(js, name: str):
    try:
        return await js.consumer_info(eventlog.DLQ_STREAM, name)
    except NotFoundError:
        return None


async def _at_least(read, n: int):
    got = await read
    return got if len(got) >= n else None
