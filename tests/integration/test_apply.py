"""`gpusched apply` against a real nats-server: declarative diff, dry run, prune, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime import eventlog
from schemas import parse_event

CLI = [sys.executable, "-m", "gpusched.cli.main"]
V1 = """
cohorts: [{name: shared}]
queues:
  - {name: research, cohort: shared, allowed_teams: [team-a], quotas: [{flavor: a100, nominal: 8}]}
  - {name: product, cohort: shared, allowed_teams: [team-b], quotas: [{flavor: l4, nominal: 4}]}
"""
V2 = """
cohorts: [{name: shared}]
queues:
  - name: research
    cohort: shared
    allowed_teams: [team-a]
    quotas: [{flavor: a100, nominal: 16, borrowing_limit: 4}, {flavor: h100, nominal: 2}]
"""


def apply(nats_server, path, *flags):
    env = {**os.environ, **nats_server.env("operator")}
    r = subprocess.run(CLI + ["apply", "-f", str(path), "-o", "json", *flags], env=env, capture_output=True, text=True)
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else r.stderr)


async def config_events(js) -> list[str]:
    return [parse_event(m.data).type async for m in eventlog.read(js, subjects=["gpusched.queue.>", "gpusched.cohort.>"])]


async def test_apply_diff_dry_run_and_prune(nats_server, admin_js, tmp_path):
    v1, v2 = tmp_path / "v1.yaml", tmp_path / "v2.yaml"
    v1.write_text(V1)
    v2.write_text(V2)
    rc, changes = apply(nats_server, v1)
    assert rc == 0
    assert [(c["event"], c["name"], c["change"]) for c in changes] == [
        ("CohortConfigured", "shared", "new"), ("QueueConfigured", "research", "new"),
        ("QueueConfigured", "product", "new")]
    assert apply(nats_server, v1) == (0, [])  # unchanged: nothing published
    rc, planned = apply(nats_server, v2, "--dry-run", "--prune")
    assert [(c["event"], c["name"], c["change"]) for c in planned] == [
        ("QueueConfigured", "research", "quotas[a100].borrowing_limit: None → 4; quotas[a100].nominal: 8 → 16; "
                                        "quotas[h100]: added {'flavor': 'h100', 'nominal': 2, 'borrowing_limit': "
                                        "None, 'lending_limit': None, 'weight': 1.0}"),
        ("QueueDeleted", "product", "deleted")]
    assert len(await config_events(admin_js)) == 3  # the dry run published nothing
    rc, _ = apply(nats_server, v2, "--prune")
    assert rc == 0
    assert await config_events(admin_js) == ["CohortConfigured", "QueueConfigured", "QueueConfigured",
                                             "QueueConfigured", "QueueDeleted"]


@pytest.mark.parametrize("text, message", [
    ("queues: [{name: Research}]", "queues[0] (Research): name: String should match pattern '^[a-z0-9]"),
    ("queues: [{name: a, quotas: [{flavor: l4, nominal: -1}]}]", "quotas.0.nominal: Input should be greater than or equal to 0"),
    ("queues: [{name: a}, {name: a}]", "name(s) ['a'] appear more than once"),
    ("queues: [{name: a, colour: red}]", "colour: Extra inputs are not permitted"),
    ("queues: [{name: a, preemption: {within_queue: always}}]",
     "preemption.within_queue: Input should be 'never' or 'lower-priority'"),
    ("queues: []\nteams: [{name: team-a, notify: {webhooks: [{url: 'ftp://x.example/'}]}}]",
     "teams[0] (team-a): notify.webhooks.0.url: String should match pattern"),
    ("queues: []\nteams: [{name: team-a, notify: {webhooks: [{url: 'https://x.example/', kinds: [finished]}]}}]",
     "notify.webhooks.0.kinds.0: Input should be 'submitted', 'admitted'"),
    ("queues: []\nteams: [{name: team-a}, {name: team-a}]", "teams: name(s) ['team-a'] appear more than once"),
])
async def test_invalid_config_names_the_field(nats_server, admin_js, tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    rc, err = apply(nats_server, bad)
    assert rc == 2
    assert message in err
    assert await config_events(admin_js) == []


async def test_apply_configures_a_teams_webhooks(nats_server, admin_js, tmp_path):
    path = tmp_path / "teams.yaml"
    path.write_text("queues: []\nteams:\n  - name: team-a\n    notify: {webhooks: [{url: 'https://hooks.example/a'}]}\n")
    rc, changes = apply(nats_server, path)
    assert (rc, [(c["event"], c["name"], c["change"]) for c in changes]) == (0, [("TeamConfigured", "team-a", "new")])
    assert apply(nats_server, path) == (0, [])  # unchanged: nothing published
    path.write_text("queues: []\nteams:\n  - name: team-a\n    notify: {webhooks: [{url: 'https://hooks.example/b', "
                    "kinds: [preemption-notice, failed]}]}\n")
    rc, changes = apply(nats_server, path)
    assert rc == 0 and "https://hooks.example/b" in changes[0]["change"]
    events = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.team.>"])]
    assert [e.notify.webhooks[0].url for e in events] == ["https://hooks.example/a", "https://hooks.example/b"]
    assert events[1].notify.webhooks[0].kinds == ("preemption-notice", "failed")


POLICY = """
priority_classes:
  - {name: inference-sla, value: 1000, preemptible: false}
  - {name: training, value: 600, preemptible: true, protection_seconds: 900, max_preemptions: 3}
  - {name: experiment, value: 250, preemptible: true, protection_seconds: 120}
preemption_limits: {max_per_window: 10, window_seconds: 600}
queues:
  - {name: research, allowed_teams: [team-a], allowed_priority_classes: [training, experiment],
     quotas: [{flavor: a100, nominal: 8}]}
"""


async def policies(js) -> list:
    return [parse_event(m.data) async for m in eventlog.read(js, subjects=["gpusched.policy.>"])]


async def test_apply_publishes_a_policy_that_admission_uses_from_then_on(nats_server, admin_js, tmp_path):
    from conftest import connect_as, running, service_settings
    from services.admission.__main__ import AdmissionService
    from services.admission.domain import AdmissionCore
    from tests.integration.test_admission import outcome, submit

    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    rc, planned = apply(nats_server, path, "--dry-run")
    assert rc == 0 and planned[0]["event"] == "PolicyConfigured" and planned[0]["name"] == "cluster"
    assert "priority_classes[deadline-training]: retired" in planned[0]["change"]
    assert "priority_classes[training].value: 500 → 600" in planned[0]["change"]
    assert await policies(admin_js) == []
    rc, changes = apply(nats_server, path)
    assert rc == 0 and [c["event"] for c in changes] == ["PolicyConfigured", "QueueConfigured"]
    assert apply(nats_server, path) == (0, [])  # the same policy again: nothing published
    # a file with only the rate limit keeps the classes the log has
    limits = tmp_path / "limits.yaml"
    limits.write_text("preemption_limits: {enabled: false}\n")
    rc, changes = apply(nats_server, limits)
    assert rc == 0 and changes[0]["change"] == ("preemption_limits.enabled: True → False; "
                                                "preemption_limits.max_per_window: 10 → 20; "
                                                "preemption_limits.window_seconds: 600.0 → 300.0")
    (first, second) = await policies(admin_js)
    assert second.priority_classes == first.priority_classes and not second.preemption.enabled
    # a class the log's queue admits cannot be retired while the queue admits it
    retire = tmp_path / "retire.yaml"
    retire.write_text("priority_classes: [{name: training, value: 600, preemptible: true}]\n")
    rc, err = apply(nats_server, retire)
    assert rc == 2 and "queue 'research' allowed_priority_classes names ['experiment']" in err
    assert len(await policies(admin_js)) == 2

    service = AdmissionService("admission", AdmissionCore(), service_settings(nats_server, "admission"))
    async with running(service):
        tenant_nc = await connect_as(nats_server, "team-a")
        tenant = tenant_nc.jetstream()
        job = {"kind": "training", "queue": "research", "team": "team-a", "image": "img", "gpus": 1}
        await submit(tenant, {"job_id": "e1", "spec": {**job, "priority_class": "experiment"}})
        await submit(tenant, {"job_id": "d1", "spec": {**job, "priority_class": "deadline-training"}})
        admitted, rejected = await outcome(admin_js, "e1"), await outcome(admin_js, "d1")
        await tenant_nc.close()
    assert (admitted.type, admitted.priority) == ("JobAdmitted", 250)
    assert rejected.type == "JobRejected" and rejected.field == "spec.priority_class"
    assert "accepted: experiment, training" in rejected.message


async def test_a_change_is_stamped_no_earlier_than_the_log_time(nats_server, admin_js, tmp_path):
    # The platform clock ahead of the wall (a fast dev clock, or `dev up --clock-start`): a change
    # applied now takes effect at the log's time, never in the platform's past.
    from datetime import UTC, datetime, timedelta

    from tests.unit.builders import queue

    ahead = datetime.now(UTC) + timedelta(days=20)
    await eventlog.EventLog(admin_js).append(
        queue("elsewhere", ("team-z",), {"a100": 1}).model_copy(update={"occurred_at": ahead}))
    v1 = tmp_path / "v1.yaml"
    v1.write_text(V1.replace("research", "research-2").replace("product", "product-2"))
    rc, changes = apply(nats_server, v1)
    assert rc == 0 and changes
    stamped = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.queue.research-2.>"])]
    assert stamped and all(e.occurred_at >= ahead for e in stamped)
