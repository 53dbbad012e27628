"""Priority classes and the preemption rate limit as configuration (PolicyConfigured): admission,
quota and scheduler use a policy from its event on, keep it in their snapshots, and never
rewrite a decision taken before it."""

from __future__ import annotations

import json
import pickle
import re
from datetime import timedelta

import pytest
from pydantic import ValidationError

from runtime.policy import PolicyBook
from schemas import JobAdmitted, JobRejected, PriorityClass, RejectReason
from schemas.priority import DEFAULT_PRIORITY_CLASSES
from services.admission.domain import AdmissionCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import PreemptionLimits, SchedulerCore
from tests.unit.builders import (
    T0, Log, at, drive, node, policy_configured, queue, sender, spec_dict, started, submit_payload,
)
from tests.unit.test_quota_cohorts import _reclaims, cq, job
from tests.unit.test_scheduler_preemption import H, preemptions

BUILT_IN = tuple(DEFAULT_PRIORITY_CLASSES.values())


def with_class(name: str, **changes) -> tuple[PriorityClass, ...]:
    """The built-in classes with one changed (or added, when ``name`` is new)."""
    base = DEFAULT_PRIORITY_CLASSES.get(name)
    changed = (base.model_copy(update=changes) if base is not None
               else PriorityClass(name=name, **{"preemptible": True, **changes}))
    return tuple(pc for pc in BUILT_IN if pc.name != name) + (changed,)


# -- the event ---------------------------------------------------------------------------------


def test_a_policy_lists_each_class_once_and_at_least_one():
    with pytest.raises(ValidationError, match="more than once"):
        policy_configured(("a", 1, True), ("a", 2, True))
    with pytest.raises(ValidationError, match="at least 1"):
        policy_configured(("a", 1, True)).model_validate({**policy_configured().model_dump(), "priority_classes": []})


def test_the_book_retires_classes_a_policy_drops_but_remembers_them():
    book = PolicyBook()
    book.apply(policy_configured(("gold", 900, False)))
    assert list(book.classes) == ["gold"]
    assert set(book.known) == {"gold", *DEFAULT_PRIORITY_CLASSES}
    assert book.version == 1 and book.preemption is not None


# -- admission ---------------------------------------------------------------------------------


def admit(core: AdmissionCore, seq: int, **spec_fields):
    raw = json.dumps(submit_payload(spec_dict(**spec_fields))).encode()
    out = core.handle_submit(raw, sender("team-a"), seq, T0)
    for e in out:
        core.evolve(e)
    decided = core.decide(T0)
    for e in decided:
        core.evolve(e)
    (decision,) = decided
    return decision


def test_admission_binds_the_value_in_force_when_it_decides():
    core = AdmissionCore()
    core.evolve(queue("research", ("team-a",), {"a100": 8}))
    before = admit(core, 1, priority_class="experiment")
    core.evolve(policy_configured(*with_class("experiment", value=450, preemptible=False)))
    after = admit(core, 2, priority_class="experiment")
    assert isinstance(before, JobAdmitted) and (before.priority, before.preemptible) == (200, True)
    assert isinstance(after, JobAdmitted) and (after.priority, after.preemptible) == (450, False)


def test_admission_refuses_a_retired_class_and_names_the_ones_in_force():
    core = AdmissionCore()
    core.evolve(queue("research", ("team-a",), {"a100": 8}))
    core.evolve(policy_configured(("gold", 900, False), ("bronze", 10, True)))
    rejected = admit(core, 1, priority_class="training")
    assert isinstance(rejected, JobRejected)
    assert rejected.reason == RejectReason.SCHEMA_INVALID
    assert rejected.field == "spec.priority_class" and rejected.accepted == ("bronze", "gold")
    assert isinstance(admit(core, 2, priority_class="gold"), JobAdmitted)


def test_a_queue_that_allows_a_retired_class_accepts_only_those_still_in_force():
    core = AdmissionCore()
    core.evolve(queue("research", ("team-a",), {"a100": 8}, allowed_priority_classes=("training", "gold")))
    core.evolve(policy_configured(("gold", 900, False)))
    rejected = admit(core, 1, priority_class="training")
    assert isinstance(rejected, JobRejected) and rejected.accepted == ("gold",)


# -- scheduler ---------------------------------------------------------------------------------


def test_the_scheduler_takes_the_rate_limit_from_the_policy():
    h = H(*[node(f"n{i}", gpus=1) for i in range(3)])
    for i in range(3):
        h.run(f"b{i}", 1)
    h.feed(policy_configured(*BUILT_IN, max_per_window=1, window_seconds=100, when=at(5)), now=at(5))
    assert h.core.limits.max_per_window == 1
    got = {}
    for i in range(3):
        got.update(preemptions(h.run(f"u{i}", 1, "inference-sla", when=at(10))))
    assert len(got) == 1


def test_a_policy_that_disables_preemption_stops_it_from_its_event_on():
    h = H(node("n1", gpus=4))
    h.run("v", 4)
    h.feed(policy_configured(*BUILT_IN, enabled=False, when=at(5)), now=at(5))
    assert preemptions(h.run("urgent", 4, "inference-sla", when=at(10))) == {}


def test_a_protection_window_changed_by_policy_applies_to_choices_after_it():
    h = H(node("n1", gpus=4))
    h.run("t", 4, "training", when=at(0))  # built-in training: protected for 600 s
    h.feed(policy_configured(*with_class("training", protection_seconds=60), when=at(10)), now=at(10))
    out = h.run("urgent", 4, "inference-sla", when=at(100))
    assert list(preemptions(out)) == ["t"]


def test_a_retired_class_keeps_its_last_parameters_for_jobs_admitted_under_it():
    h = H(node("n1", gpus=4))
    h.run("t", 4, "training", when=at(0))  # protected for 600 s
    h.feed(policy_configured(*(pc for pc in BUILT_IN if pc.name != "training"), when=at(10)), now=at(10))
    assert preemptions(h.run("urgent", 4, "inference-sla", when=at(100))) == {}  # still protected
    assert list(preemptions(h.feed(now=at(601)))) == ["t"]


def test_the_policy_travels_in_the_schedulers_snapshot():
    core = SchedulerCore(preemption=PreemptionLimits(max_per_window=20))
    drive(core, [policy_configured(*BUILT_IN, max_per_window=2, window_seconds=50)], T0, log=Log())
    fresh = SchedulerCore(preemption=PreemptionLimits(max_per_window=20))
    fresh.restore_state(pickle.loads(pickle.dumps(core.snapshot_state())))
    assert (fresh.limits.max_per_window, fresh.limits.window_seconds) == (2, 50)
    assert fresh.state.policy.version == 1


def test_before_any_policy_the_services_configured_limits_hold():
    core = SchedulerCore(preemption=PreemptionLimits(enabled=False, max_per_window=7))
    assert (core.limits.enabled, core.limits.max_per_window) == (False, 7)


# -- quota -------------------------------------------------------------------------------------


def test_quota_reclaims_with_the_protection_window_in_force():
    core, log = QuotaCore(), Log()
    drive(core, [cq("owner", "c", a100=1), cq("borrower", "c", a100=0)], T0, log=log)
    drive(core, job("b", "borrower", 1, seq=1, priority_class="batch-low"), T0, log=log)
    drive(core, [started("b", when=T0)], T0, log=log)
    drive(core, [policy_configured(*with_class("batch-low", protection_seconds=3600))], T0, log=log)
    drive(core, job("mine", "owner", 1, seq=2, at_s=60), T0 + timedelta(seconds=60), log=log)
    assert _reclaims(log) == {}  # batch-low is now protected for an hour
    fresh = QuotaCore()
    fresh.restore_state(pickle.loads(pickle.dumps(core.snapshot_state())))
    assert fresh.victim_policy.classes["batch-low"].protection_seconds == 3600
    drive(core, [], T0 + timedelta(seconds=3600), log=log)
    assert _reclaims(log) == {"b": "mine"}


# -- gpusched apply ----------------------------------------------------------------------------


@pytest.mark.parametrize("queue_fields, message", [
    ("allowed_priority_classes: [training, gold]", "allowed_priority_classes names ['gold']"),
    ("class_limits: [{priority_class: gold, max_share: 0.25}]", "class_limits names ['gold']"),
])
def test_apply_refuses_a_queue_that_names_a_class_not_in_force(queue_fields, message):
    import yaml

    from gpusched.config import queues as queueconfig
    from gpusched.userinput import UserError

    document = yaml.safe_load(f"queues:\n  - {{name: research, allowed_teams: [team-a], {queue_fields},\n"
                              "     quotas: [{flavor: a100, nominal: 8}]}\n")
    parsed = queueconfig.parse_queues(document, "queues.yaml")
    with pytest.raises(UserError, match=re.escape(message)):
        queueconfig.plan(parsed, queueconfig.QuotaConfig({}, {}), T0)
    document["priority_classes"] = [{"name": "gold", "value": 900, "preemptible": False},
                                    {"name": "training", "value": 500, "preemptible": True}]
    events = queueconfig.plan(queueconfig.parse_queues(document, "queues.yaml"), queueconfig.QuotaConfig({}, {}), T0)
    assert [e.type for e in events] == ["PolicyConfigured", "QueueConfigured"]
