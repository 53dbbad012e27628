"""Admission of fractional jobs (JobSpec.gpu_milli): a job that asks for a fraction of one GPU
is rejected when every flavor it may use has nodes and none of them shares its GPUs, instead of
waiting for ever with quota held."""

from __future__ import annotations

import json

import pytest

from schemas import JobAdmitted, JobRejected, RejectReason
from services.admission.domain import AdmissionCore
from tests.unit.builders import T0, node, queue, sender, spec_dict, submit_payload

QUEUES = (
    queue("research", ("team-a",), {"a100": 8, "l4": 8}),
    queue("small", ("team-a",), {"a100": 8}),
)


def decide(spec_overrides: dict, *events) -> JobAdmitted | JobRejected:
    core = AdmissionCore()
    for e in (*QUEUES, *events):
        core.evolve(e)
    payload = submit_payload(spec_dict(**spec_overrides), job_id="j1")
    for e in core.handle_submit(json.dumps(payload).encode(), sender("team-a"), 1, T0):
        core.evolve(e)
    (event,) = core.decide(T0)
    return event


SHARED_L4 = node("l1", "l4", 4, gpu_sharable=True)
PLAIN_A100 = node("a1", "a100", 8)


@pytest.mark.parametrize(
    "overrides, nodes, at_fault",
    [
        # the only allowed flavor's nodes do not share their GPUs
        ({"gpus": 1, "gpu_milli": 250, "gpu_flavors": ["a100"]}, [PLAIN_A100, SHARED_L4], "spec.gpu_milli"),
        # any flavor of the queue: one of them shares
        ({"gpus": 1, "gpu_milli": 250}, [PLAIN_A100, SHARED_L4], None),
        ({"gpus": 1, "gpu_milli": 250, "gpu_flavors": ["l4"]}, [PLAIN_A100, SHARED_L4], None),
        # a flavor with no node known yet: the benefit of the doubt
        ({"gpus": 1, "gpu_milli": 250}, [PLAIN_A100], None),
        # whole GPUs are not concerned
        ({"gpus": 1, "gpu_flavors": ["a100"]}, [PLAIN_A100], None),
        # a shared node must still meet the other requirements
        ({"gpus": 1, "gpu_milli": 250, "gpu_flavors": ["l4"], "node_features": ["rdma"]},
         [SHARED_L4, node("l2", "l4", 4, features=("rdma",))], "spec.node_features"),
        ({"gpus": 1, "gpu_milli": 250, "gpu_flavors": ["l4"], "gang_size": 2}, [SHARED_L4], "spec.gang_size"),
        ({"gpus": 1, "gpu_milli": 250, "gpu_flavors": ["l4"], "gang_size": 2},
         [SHARED_L4, node("l2", "l4", 4, gpu_sharable=True)], None),
    ],
)
def test_a_fraction_needs_a_node_that_shares_its_gpus(overrides, nodes, at_fault):
    event = decide(overrides, *nodes)
    if at_fault is None:
        assert isinstance(event, JobAdmitted), event
    else:
        assert isinstance(event, JobRejected), event
        assert (event.reason, event.field) == (RejectReason.UNSATISFIABLE, at_fault)
        assert event.message.startswith(f"{at_fault}: ")


def test_the_message_names_the_flavors_and_what_the_queue_accepts():
    event = decide({"gpus": 1, "gpu_milli": 250, "gpu_flavors": ["a100"]}, PLAIN_A100, SHARED_L4)
    assert event.message == (
        "spec.gpu_milli: 250 thousandths of a GPU needs a node whose GPUs are shared, and none of the nodes of "
        "flavors ['a100'] shares its GPUs; accepted: whole GPUs (no gpu_milli), or gpu_flavors with shared GPUs "
        "on queue 'research': l4")


def test_a_queue_without_shared_flavors_says_none():
    event = decide({"gpus": 1, "gpu_milli": 500, "queue": "small"}, PLAIN_A100, SHARED_L4)
    assert event.field == "spec.gpu_milli"
    assert event.message.endswith("gpu_flavors with shared GPUs on queue 'small': (none)")
