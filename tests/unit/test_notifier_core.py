"""The notifier's pure core: which notification each event makes, where it goes, the signature."""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

import pytest

from schemas import ALL_EVENT_TYPES, FailureReason, JobRejected, NotificationKind, NotifySpec, RejectReason, Webhook
from schemas.envelope import new_event
from runtime import eventlog, teams
from runtime.settings import ConfigError
from services.notifier import core
from services.notifier.settings import NotifierSettings
from tests.unit.builders import (T0, admitted, cancel_requested, checkpointed, failed, node, preempted,
                                 preemption_requested, ready, reclaim_requested, retry_scheduled, scheduled,
                                 service_samples, spec, started, submitted, succeeded)

K = NotificationKind


@pytest.mark.parametrize("event, kind, fields", [
    (submitted("j1", spec(team="team-a")), K.SUBMITTED, {}),
    (admitted("j1"), K.ADMITTED, {}),
    (scheduled("j1"), K.SCHEDULED, {"attempt": 1}),
    (started("j1", ("n1", "n2")), K.STARTED, {"attempt": 1}),
    (checkpointed("j1", at_=T0, step=7), K.CHECKPOINTED, {"attempt": 1}),
    (preemption_requested("j1", "urgent", grace_seconds=30), K.PREEMPTION_NOTICE,
     {"by_job": "urgent", "grace_seconds": 30.0, "deadline": T0 + timedelta(seconds=30)}),
    (reclaim_requested("j1", "owner"), K.PREEMPTION_NOTICE, {"by_job": "owner"}),
    (preempted("j1", by="urgent"), K.PREEMPTED, {"by_job": "urgent", "reason": "preempted"}),
    (retry_scheduled("j1", 1, not_before=T0), K.RETRY_SCHEDULED, {"next_attempt": 2, "not_before": T0}),
    (succeeded("j1"), K.SUCCEEDED, {}),
    (failed("j1", FailureReason.OOM_KILLED, exit_code=137), K.FAILED,
     {"reason": "oom-killed", "exit_code": 137, "retryable": False}),
    (cancel_requested("j1", by="team-a"), K.CANCEL_REQUESTED, {}),
])
def test_each_job_event_a_team_cares_about_makes_one_notification(event, kind, fields):
    n = core.notification(event, "team-a")
    assert (n.kind, n.team, n.job_id, n.event_id, n.event_type) == (kind, "team-a", "j1", event.event_id, event.type)
    assert {k: getattr(n, k) for k in fields} == fields
    assert n.summary
    assert core.notify_subject(n) == f"gpusched.tenant.team-a.notify.j1.{kind.value}"
    assert core.notification(event, "team-a").notification_id == n.notification_id  # deterministic


def test_the_preemption_notice_names_the_deadline_to_checkpoint_before():
    n = core.notification(preemption_requested("j1", "urgent", grace_seconds=120), "team-a")
    assert "checkpoint before 2026" in n.summary and "(120 s)" in n.summary


def test_every_job_event_type_is_copied_and_the_ones_without_a_notification_are_known():
    job_types = {t for t in ALL_EVENT_TYPES if t.aggregate == "job"}
    assert set(core.KINDS) <= job_types
    assert {t.__name__ for t in job_types - set(core.KINDS)} == {"QuotaReserved", "QuotaReleased", "JobReady"}
    assert core.notification(node("n1"), "team-a") is None
    assert core.notification(ready("replica-chat-1-0"), "team-a") is None


def test_a_services_deploys_updates_scalings_lost_replicas_and_deletion_make_notifications():
    by_type = {e.type: e for e in service_samples()}
    expected = {
        "ServiceDeployed": (K.SERVICE_DEPLOYED, None, {"replicas": 2}, "deployed by alice: 2 replica(s) (1 to 4)"),
        "ServiceUpdated": (K.SERVICE_UPDATED, None, {"replicas": 2}, "generation 2"),
        "ScaledTo": (K.SERVICE_SCALED, None, {"replicas": 4},
                     "scaled to 4 replica(s) by the operator (9 asked): 9 replicas asked"),
        "ReplicaLost": (K.REPLICA_LOST, "replica-chat-2-0", {"replaced": True, "attempt": 2},
                        "lost (attempt 2): JobFailed: node-lost; another replica replaces it"),
        "ServiceDeleted": (K.SERVICE_DELETED, None, {}, "deleted by bob"),
    }
    for type_, (kind, job_id, fields, said) in expected.items():
        n = core.notification(by_type[type_], "team-a")
        assert (n.kind, n.service, n.job_id, n.event_type) == (kind, "chat", job_id, type_)
        assert {k: getattr(n, k) for k in fields} == fields and said in n.summary, n.summary
        assert core.notify_subject(n) == f"gpusched.tenant.team-a.notify.{job_id or 'chat'}.{kind.value}"
    quiet = set(by_type) - set(expected)
    assert quiet == {"ScaleRequested", "ServiceLoadReported", "ReplicaRequested", "ReplicaRetired",
                     "ReplicaScheduled", "ReplicaReady"}
    assert all(core.notification(by_type[t], "team-a") is None for t in quiet)


def test_a_rejection_names_its_team_and_field():
    rejected = new_event(JobRejected, aggregate_id="rejected-9", producer="admission", occurred_at=T0, key="9",
                         reason=RejectReason.SCHEMA_INVALID, message="spec.gpus: bad", field="spec.gpus",
                         intake_sequence=9, team="team-b")
    assert teams.named_team(rejected) == "team-b"
    n = core.notification(rejected, "team-b")
    assert (n.kind, n.reason, n.field) == (K.REJECTED, "schema-invalid", "spec.gpus")
    assert core.copy_subject("team-b", rejected) == "gpusched.tenant.team-b.job.rejected-9.rejected"


def test_webhooks_are_the_teams_and_the_jobs_that_want_the_kind_each_once():
    team = NotifySpec(webhooks=(Webhook(url="https://a.example/"),
                                Webhook(url="https://b.example/", kinds=(K.FAILED,))))
    job = NotifySpec(webhooks=(Webhook(url="https://a.example/"), Webhook(url="https://c.example/x")))
    assert core.webhooks_for(K.STARTED, team, job) == ["https://a.example/", "https://c.example/x"]
    assert core.webhooks_for(K.FAILED, team, None) == ["https://a.example/", "https://b.example/"]
    assert core.webhooks_for(K.FAILED, None, None) == []


def test_signature_is_hmac_sha256_of_timestamp_dot_body():
    body = b'{"kind":"failed"}'
    expected = hmac.new(b"s3cret-s3cret-s3cret", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert core.sign("s3cret-s3cret-s3cret", 1700000000, body) == f"t=1700000000,v1={expected}"
    # a known answer, so a change to the recipe shows here and not only at a receiver
    assert expected == "c6bc6acc19b65a976947bd64779535411b25d6eb8eb30c0c8a01745cbc8916cf"


def test_backoff_doubles_up_to_the_cap():
    assert [core.backoff_s(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert core.backoff_s(3, cap_s=1.5) == 1.5


def test_settings_read_the_secrets_file_and_refuse_a_bad_one(tmp_path, monkeypatch):
    good = tmp_path / "secrets.json"
    good.write_text('{"team-a": "0123456789abcdef"}')
    monkeypatch.setenv("GPUSCHED_WEBHOOK_SECRETS_FILE", str(good))
    monkeypatch.setenv("GPUSCHED_WEBHOOK_MAX_ATTEMPTS", "3")
    options = NotifierSettings.from_env()
    assert (options.secrets, options.max_attempts, options.timeout_s) == ({"team-a": "0123456789abcdef"}, 3, 5.0)
    for text in ('{"team-a": "short"}', '["team-a"]', "not json"):
        good.write_text(text)
        with pytest.raises(ConfigError, match="GPUSCHED_WEBHOOK_SECRETS_FILE"):
            NotifierSettings.from_env()
    monkeypatch.setenv("GPUSCHED_WEBHOOK_SECRETS_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot be read"):
        NotifierSettings.from_env()
    monkeypatch.delenv("GPUSCHED_WEBHOOK_SECRETS_FILE")
    assert NotifierSettings.from_env().secrets == {}


def test_teams_are_partitioned_stably_and_partition_0_keeps_the_unpartitioned_durables():
    from gpusched import permissions
    from runtime.teams import MAX_PARTITIONS, partition_of
    from services.notifier.core import durable_names

    teams = [f"team-{i}" for i in range(200)]
    assert [partition_of(t, 4) for t in teams] == [partition_of(t, 4) for t in teams]  # no salted hash()
    assert set(partition_of(t, 4) for t in teams) == {0, 1, 2, 3}
    assert all(partition_of(t, 1) == 0 for t in teams)
    assert durable_names(0) == ("notifier", "notifier-services", "notifier-refused")
    assert durable_names(3) == ("notifier-p3", "notifier-services-p3", "notifier-refused-p3")
    owned = permissions.DURABLES["notifier"]
    assert owned[eventlog.EVENTS_STREAM] == [n for k in range(MAX_PARTITIONS) for n in durable_names(k)[:2]]
    assert owned[eventlog.DLQ_STREAM] == [durable_names(k)[2] for k in range(MAX_PARTITIONS)]


def test_a_partition_outside_the_partitions_is_refused():
    from runtime.settings import ConfigError
    from services.notifier.settings import NotifierSettings

    with pytest.raises(ConfigError, match="GPUSCHED_NOTIFIER_PARTITION=2 is out of range; accepted: 0..1"):
        NotifierSettings(partitions=2, partition=2)


def test_a_refused_command_is_told_to_the_team_its_subject_names():
    from datetime import UTC, datetime

    from services.notifier.core import notify_subject, refused_command, refused_notification, refused_subject

    at = datetime(2026, 12, 7, tzinfo=UTC)
    headers = {"Gpusched-Original-Subject": "gpusched.intake.team-a.user.alice.cancel",
               "Gpusched-Original-Sequence": "42", "Gpusched-Reason": "cancel: field 'why' is not accepted"}
    refused = refused_command(headers, at)
    assert (refused.team, refused.intake_sequence) == ("team-a", 42)
    assert refused_subject(refused) == "gpusched.tenant.team-a.refused.42"
    note = refused_notification(refused, b'{"job_id": "j-1", "why": 1}')
    assert (note.kind.value, note.job_id, note.intake_sequence, note.team) == ("command-refused", "j-1", 42, "team-a")
    assert note.summary == ("cancel command refused (intake sequence 42, subject "
                            "gpusched.intake.team-a.user.alice.cancel): cancel: field 'why' is not accepted")
    assert notify_subject(note) == "gpusched.tenant.team-a.notify.command-42.command-refused"
    assert refused_notification(refused, b"not json").job_id is None
    assert refused_notification(refused, b'{"job_id": "Not A Name!"}').job_id is None
    # a subject that names no team: nobody to tell
    assert refused_command({**headers, "Gpusched-Original-Subject": "gpusched.intake.x"}, at) is None
    assert refused_command({}, at) is None
