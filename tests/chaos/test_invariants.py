"""The chaos run's checks (tests/chaos/invariants.py) on small logs: each finds the violation it is
for, and a clean history passes. Fast; runs in `make test`. Also the seeded plans: the same seed
gives the same load, faults and fuzz, and the schedule kills what the run promises."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from schemas import FailureReason, JobRejected, new_event
from tests.chaos import faults, fuzz, invariants, workload
from tests.unit import builders as b


def logged(*events):
    return list(enumerate(events, start=1))


def clean_job(job="j1", node="n1", indices=(0,)):
    return [b.submitted(job), b.admitted(job), b.reserved(job), b.scheduled(job, {node: indices}),
            b.started(job, (node,)), b.succeeded(job), b.released(job)]


def retried_job(job="j1"):
    """A clean job whose spec allows three attempts."""
    return [b.submitted(job, b.spec(retry={"max_attempts": 3})), *clean_job(job)[1:]]


def other_id(event):
    """The same decision derived with another id (a key that changed between two derivations)."""
    return event.model_copy(update={"event_id": "another-id"})


def rejected(job_id: str, key: str = "decision") -> JobRejected:
    return new_event(JobRejected, aggregate_id=job_id, producer="admission", occurred_at=b.T0, key=key,
                     reason="unknown-queue", message="no such queue")


@pytest.mark.parametrize("events, expected", [
    (clean_job(), {"j1": "succeeded"}),
    ([b.submitted("j1"), b.admitted("j1"), b.cancelled("j1")], {"j1": "cancelled"}),
    ([*clean_job()[:5], b.failed("j1", FailureReason.NODE_LOST), b.retry_scheduled("j1"),
      b.scheduled("j1", attempt=2), b.started("j1", attempt=2), b.succeeded("j1", attempt=2)], {"j1": "succeeded"}),
    ([*clean_job()[:5], b.failed("j1")], {"j1": "failed"}),
    # retryable, but a cancel was asked before it failed: quota does not retry, the cancel ends it
    ([*retried_job()[:5], b.cancel_requested("j1"), b.failed("j1", FailureReason.NODE_LOST), b.cancelled("j1")],
     {"j1": "cancelled"}),
    # the last of its attempts failed (max_attempts 2)
    ([b.submitted("j1", b.spec(retry={"max_attempts": 2})), b.admitted("j1"),
      b.failed("j1", FailureReason.NODE_LOST), b.retry_scheduled("j1"),
      b.failed("j1", FailureReason.NODE_LOST, attempt=2)], {"j1": "failed"}),
    ([b.submitted("j1"), rejected("j1")], {}),  # not admitted: nothing to end
])
def test_terminal_once_finds_the_one_end(events, expected):
    states, violations = invariants.terminal_once(invariants.job_histories(logged(*events)))
    assert (states, violations) == (expected, [])


@pytest.mark.parametrize("events, message", [
    (clean_job()[:5], "job j1 never ended; its last event is JobStarted (seq 5)"),
    ([*clean_job()[:5], b.failed("j1"), b.cancelled("j1")], "job j1 ended 2 times: failed (seq 6), cancelled (seq 7)"),
    ([*clean_job(), b.cancelled("j1")], "job j1 ended 2 times: succeeded (seq 6), cancelled (seq 8)"),
    # retryable, no cancel, and quota never retried it
    ([*retried_job()[:5], b.failed("j1", FailureReason.NODE_LOST)],
     "job j1 never ended; its last event is JobFailed (seq 6)"),
])
def test_terminal_once_reports_open_and_twice_ended_jobs(events, message):
    assert invariants.terminal_once(invariants.job_histories(logged(*events)))[1] == [message]


def test_started_once():
    assert invariants.started_once(logged(*clean_job())) == []
    assert invariants.started_once(logged(*clean_job(), b.started("j1", ("n2",)))) == [
        "job j1 attempt 1 started twice (seq 5 and 8)"]


@pytest.mark.parametrize("extra, expected", [
    (b.retry_scheduled("j1"), []),
    (other_id(b.reserved("j1", gpus=2)), ["decision QuotaReserved j1 1 appended twice (seq 3 and 8)"]),
    (other_id(b.scheduled("j1", {"n2": (1,)})), ["decision JobScheduled j1 1 appended twice (seq 4 and 8)"]),
    (rejected("j1"), ["decision JobAdmitted or JobRejected j1 appended twice (seq 2 and 8)"]),
    (b.admitted("j1"), [f"event id {b.admitted('j1').event_id} (JobAdmitted) appended twice (seq 2 and 8)",
                        "decision JobAdmitted or JobRejected j1 appended twice (seq 2 and 8)"]),
])
def test_decisions_once(extra, expected):
    assert invariants.decisions_once(logged(*clean_job(), extra)) == expected


NODES = [b.node("n1", gpus=2), b.node("n2", gpus=2)]


@pytest.mark.parametrize("events, expected", [
    # the GPU is free again once the first attempt ended
    ([*NODES, *clean_job("j1"), *clean_job("j2")], []),
    # preempted, cancelled and failed attempts give their GPUs back too
    ([*NODES, b.scheduled("j1", {"n1": (0,)}), b.preempted("j1"), b.scheduled("j2", {"n1": (0,)}),
      b.cancelled("j2", attempt=1), b.scheduled("j3", {"n1": (0,)}), b.failed("j3"),
      b.scheduled("j4", {"n1": (0,)})], []),
    ([*NODES, b.scheduled("j1", {"n1": (0, 1)}), b.scheduled("j2", {"n2": (0,), "n1": (1,)})],
     ["GPU n1/1 given to job j2 attempt 1 (seq 4) while job j1 attempt 1 holds it"]),
    ([*NODES, b.scheduled("j1", {"n1": (2,)})],
     ["job j1 attempt 1 (seq 3) placed on GPU n1/2, which the node does not have"]),
    # asked for reclaim but not yet stopped: the GPU is still held
    ([*NODES, b.scheduled("j1", {"n1": (0,)}), b.reclaim_requested("j1"), b.scheduled("j2", {"n1": (0,)})],
     ["GPU n1/0 given to job j2 attempt 1 (seq 5) while job j1 attempt 1 holds it"]),
])
def test_gpus_never_shared(events, expected):
    assert invariants.gpus_never_shared(logged(*events)) == expected


def test_malformed_answered():
    sent = {10: "nul", 11: "bom", 12: "type-mangled", 13: "deep-nesting"}
    assert invariants.malformed_answered(sent, rejected={10, 13}, dead_lettered={11}, submitted={12}) == [
        "malformed command (type-mangled) at intake sequence 12 was accepted (JobSubmitted)"]
    assert invariants.malformed_answered({5: "bom"}, set(), set(), set()) == [
        "malformed command (bom) at intake sequence 5 has no JobRejected and no dead letter"]


def test_the_same_seed_gives_the_same_run():
    def draw(seed):
        rng = random.Random(seed)
        return workload.plan(rng, 300, 60), faults.schedule(rng, 60), [fuzz.malformed(rng, i) for i in range(24)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.mark.parametrize("seed", range(20))
def test_the_schedule_kills_every_service_twice_and_each_broker_once(seed):
    schedule = faults.schedule(random.Random(seed), 200)
    kills = Counter(f.target for f in schedule)
    assert all(kills[s] >= 2 for s in faults.PROCESSES) and kills["nats"] == kills["postgres"] == 1
    for before, after in zip(schedule, schedule[1:]):
        assert before.at + before.down_s < after.at  # one fault is over before the next
    assert schedule[-1].at < 0.85 * 200


def test_the_load_has_every_shape():
    actions = workload.plan(random.Random(3), 3000, 200)
    specs = [a.command.spec for a in actions if a.verb == "submit"]
    assert len(specs) == 3000 and len({a.command.job_id for a in actions if a.verb == "submit"}) == 3000
    assert sum(s.gang_size > 1 for s in specs) > 100
    assert sum("sim.gpusched.io/exit-code" in s.annotations for s in specs) > 200
    assert Counter(s.priority_class for s in specs)["inference-sla"] > 50
    assert sum(a.verb == "cancel" for a in actions) > 100
    assert [a.at for a in actions] == sorted(a.at for a in actions)


def test_the_fuzzer_makes_every_kind():
    made = [fuzz.malformed(random.Random(5), i) for i in range(len(fuzz.MAKERS))]
    assert {m.kind for m in made} == set(fuzz.MAKERS)
    assert all(m.verb in ("submit", "cancel", "checkpoint", "delete", "submit.extra", "admin") for m in made)


def test_a_malformed_command_is_described_by_its_start():
    m = fuzz.Malformed("oversized", "team-a", "submit", b'{"x": "' + b"y" * 1000 + b'"}')
    assert m.describe(limit=10) == "oversized, 1009 bytes on .submit: b'{\"x\": \"yyy'"


def test_every_malformed_command_is_refused_by_admissions_core():
    """What the chaos run's fuzzer sends must be refused (a rejection or a dead letter), or its
    check ("malformed commands answered") fails minutes into the run; found here in milliseconds."""
    from datetime import UTC, datetime

    from schemas import JobRejected
    from schemas.commands import intake_principal
    from services.admission.domain import AdmissionCore, PoisonCommand

    rng = random.Random(11)
    for i in range(len(fuzz.MAKERS) * 20):
        m = fuzz.malformed(rng, i)
        if m.kind == "oversized":
            continue  # the stream refuses some at publish; the rest are checked by size in the core
        try:
            sender = intake_principal(f"gpusched.intake.{m.team}.{m.verb}")
            handle = getattr(AdmissionCore(), f"handle_{sender.verb}")
            args = (m.payload, sender, 1, datetime.now(UTC)) if sender.verb != "cancel" else \
                (m.payload, sender, datetime.now(UTC))
            out = handle(*args)
        except (PoisonCommand, ValueError):
            continue
        assert out and all(isinstance(e, JobRejected) for e in out), m.describe()
