"""A job id resent without an idempotency key gets one answer whichever door it comes through
(docs/publishing.md, "Resending"): admission's JobRejected duplicate-job-id, filed under
rejected-<intake sequence>. Over HTTP that is a 409 with the reason; the NATS door's test is
tests/integration/test_cli_publish.py (the CLI over NATS exits 1 with the same reason). A key
resent with another spec is admission's JobRejected duplicate-idempotency-key through every door
too, also within JetStream's duplicate window (the message id carries the spec's digest)."""

from __future__ import annotations

import uuid

from tests.api.stack import job_document


def new_id(prefix: str = "j") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_a_job_id_resent_without_a_key_is_rejected_over_http(api_stack):
    with api_stack.client("alice") as alice:
        job_id = new_id("dup")
        assert alice.post("/v1/jobs", json=job_document(job_id, "team-a")).status_code == 201
        again = alice.post("/v1/jobs", json=job_document(job_id, "team-a"))
        assert again.status_code == 409, again.text
        assert again.json()["reason"] == "duplicate-job-id"
        assert again.json()["job_id"].startswith("rejected-")  # filed under rejected-<intake sequence>

        key = uuid.uuid4().hex  # with a key, the same spec again is a repeat (200)
        first = alice.post("/v1/jobs", json=job_document(None, "team-a"), headers={"Idempotency-Key": key})
        repeat = alice.post("/v1/jobs", json=job_document(None, "team-a"), headers={"Idempotency-Key": key})
        assert (first.status_code, repeat.status_code) == (201, 200) and repeat.json()["repeat"] is True


def test_a_key_resent_with_another_spec_is_rejected_over_http(api_stack):
    with api_stack.client("alice") as alice:
        key = uuid.uuid4().hex
        first = alice.post("/v1/jobs", json=job_document(None, "team-a"), headers={"Idempotency-Key": key})
        assert first.status_code == 201, first.text
        other = alice.post("/v1/jobs", json=job_document(None, "team-a", gpus=2), headers={"Idempotency-Key": key})
        assert other.status_code == 409, other.text
        assert other.json()["reason"] == "duplicate-idempotency-key"
        assert other.json()["job_id"].startswith("rejected-")
        again = alice.post("/v1/jobs", json=job_document(None, "team-a"), headers={"Idempotency-Key": key})
        assert again.status_code == 200 and again.json()["job_id"] == first.json()["job_id"]  # the job stands
