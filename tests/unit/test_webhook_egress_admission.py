"""Admission refuses a job, or a service's replica template, whose webhook would reach the
platform's own network: the rejection names the field, the rule, the address it understood and
what is accepted; the operator's allow-list (GPUSCHED_WEBHOOK_ALLOW) lets its networks through."""

from __future__ import annotations

import json
from ipaddress import ip_network

import pytest

from schemas import JobAdmitted, JobRejected, RejectReason
from services.admission.domain import AdmissionCore, PoisonCommand
from tests.unit.builders import T0, queue, sender, service_spec, spec_dict, submit_payload


def decided(webhooks: list[str], allow: tuple = ()):
    core = AdmissionCore(webhook_allow=tuple(ip_network(n) for n in allow))
    core.evolve(queue("research", ("team-a",), {"a100": 8}))
    notify = {"webhooks": [{"url": u} for u in webhooks]}
    for e in core.handle_submit(json.dumps(submit_payload(spec_dict(notify=notify), job_id="j1")).encode(),
                                sender("team-a"), 1, T0):
        core.evolve(e)
    (event,) = core.decide(T0)
    return event


def test_a_job_whose_webhook_reaches_loopback_is_rejected_with_the_field_rule_and_what_is_accepted():
    event = decided(["https://hooks.example/ok", "http://2130706433/"])
    assert isinstance(event, JobRejected)
    assert (event.reason, event.field, event.accepted) == (RejectReason.FORBIDDEN, "spec.notify.webhooks[1].url", ())
    assert event.message == (
        "spec.notify.webhooks[1].url http://2130706433/ refused: 127.0.0.1 is a loopback address; "
        "webhooks reach public addresses only (an operator may allow a network with GPUSCHED_WEBHOOK_ALLOW)")


@pytest.mark.parametrize("url, said", [
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
    ("http://127.0.0.1:8222/varz", "127.0.0.1 is a loopback address"),
    ("http://localhost:5432/", "localhost is a name of this machine"),
    ("http://[::1]:22/", "::1 is a loopback address"),
    ("http://[::ffff:10.0.0.1]/", "10.0.0.1 (in ::ffff:a00:1) is a private address"),
])
def test_the_issues_examples_are_rejected(url, said):
    event = decided([url])
    assert isinstance(event, JobRejected) and event.field == "spec.notify.webhooks[0].url"
    assert f"refused: {said};" in event.message


def test_public_webhooks_and_names_are_admitted():
    assert isinstance(decided(["https://hooks.example/a", "http://8.8.8.8/", "http://[2606:4700:4700::1111]/"]),
                      JobAdmitted)


def test_the_allow_list_admits_its_networks_only():
    assert isinstance(decided(["http://127.0.0.1:9000/hook"], allow=("127.0.0.0/8",)), JobAdmitted)
    assert isinstance(decided(["http://10.0.0.1/"], allow=("127.0.0.0/8",)), JobRejected)


def test_a_service_whose_replica_template_has_an_internal_webhook_is_not_deployed():
    core = AdmissionCore()
    core.evolve(queue("research", ("team-a",), {"a100": 8}))
    s = service_spec(notify={"webhooks": [{"url": "http://[fe80::1%25eth0]/"}]})
    with pytest.raises(PoisonCommand) as refused:
        core.handle_deploy(json.dumps({"spec": s.model_dump(mode="json")}).encode(),
                           sender("team-a", "alice", verb="deploy"), 1, T0)
    assert str(refused.value) == (
        "DeployService: its replicas would not be admitted: spec.replica.notify.webhooks[0].url: "
        "spec.notify.webhooks[0].url http://[fe80::1%25eth0]/ refused: fe80::1 is a link-local address; webhooks "
        "reach public addresses only (an operator may allow a network with GPUSCHED_WEBHOOK_ALLOW)")
