"""The notifier POSTs only to addresses outside the platform (services.notifier.egress): a
webhook whose address is refused is never contacted, is tried once, logged as dead-lettered with
the refusal, and dead-lettered at once (no retries); the allow-list lets a receiver through."""

from __future__ import annotations

from datetime import UTC, datetime

from conftest import eventually, running, service_settings

from runtime import eventlog
from schemas import NotifySpec, TeamConfigured, Webhook, new_event
from schemas.tenant import NotificationDelivery
from services.notifier.__main__ import Notifier
from services.notifier.settings import NotifierSettings
from tests.integration.test_notifier import SECRET, _at_least, read_tenant, receivers  # noqa: F401 (a fixture)
from tests.unit.builders import spec, submitted


async def test_a_refused_webhook_is_never_contacted_and_dead_lettered_at_once(nats_server, admin_js, receivers):
    team_hook, job_hook = receivers(), receivers()
    spelled = f"http://2130706433:{job_hook.server.server_port}/hook"  # 127.0.0.1, spelled as one integer
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=datetime.now(UTC),
                               key="1", name="team-a", notify=NotifySpec(webhooks=(Webhook(url=team_hook.url),))))
    await log.append(submitted("e1", spec(team="team-a", notify=NotifySpec(webhooks=(Webhook(url=spelled),)))))
    notifier = Notifier(service_settings(nats_server, "notifier"),
                        NotifierSettings(secrets={"team-a": SECRET}, backoff_cap_s=0.2, max_attempts=5))
    async with running(notifier):
        deliveries = await eventually(lambda: _at_least(
            read_tenant(nats_server, "team-a", "gpusched.tenant.team-a.delivery.>"), 2), timeout_s=15)
    records = [NotificationDelivery.model_validate_json(m.data) for m in deliveries]
    assert sorted((r.url, r.outcome, r.attempt) for r in records) == sorted(
        [(team_hook.url, "dead-lettered", 1), (spelled, "dead-lettered", 1)])
    by_url = {r.url: r.error for r in records}
    assert by_url[spelled] == (f"webhook url {spelled} refused: 127.0.0.1 is a loopback address; webhooks reach "
                               "public addresses only (an operator may allow a network with GPUSCHED_WEBHOOK_ALLOW)")
    assert team_hook.got == [] and job_hook.got == []
    dlq = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    # one dead letter per notification (runtime.eventlog.dead_letter's id): the first refused URL's
    (dead,) = dlq
    assert dead.subject == "gpusched.deadletter.notifier.webhook"
    assert "refused: 127.0.0.1 is a loopback address" in dead.headers["Gpusched-Reason"]
