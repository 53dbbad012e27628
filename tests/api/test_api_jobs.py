"""The API over the running platform: submit and wait for admission's answer, idempotency, a
job's events and reason, cancel, and what each team may see."""

from __future__ import annotations

import time
import uuid

from tests.api.stack import job_document


def new_id(prefix: str = "j") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(interval_s)


def test_a_member_submits_and_gets_the_admission_decision(api_stack):
    with api_stack.client("alice") as alice:
        job_id = new_id()
        r = alice.post("/v1/jobs", json=job_document(job_id, "team-a", runtime_s=5))
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["decision"] == "admitted" and body["job_id"] == job_id and body["queue"] == "q-team-a"
        job = wait_for(lambda: (g := alice.get(f"/v1/jobs/{job_id}")).status_code == 200 and g.json())
        assert job["team"] == "team-a" and job["submitter"] == "alice"
        wait_for(lambda: alice.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded", timeout_s=90)
        types = [e["type"] for e in alice.get(f"/v1/jobs/{job_id}/events").json()]
        assert types[:2] == ["JobSubmitted", "JobAdmitted"] and "JobSucceeded" in types


def test_the_same_idempotency_key_gives_the_same_job_once(api_stack):
    with api_stack.client("alice") as alice:
        key = uuid.uuid4().hex
        first = alice.post("/v1/jobs", json=job_document(None, "team-a"), headers={"Idempotency-Key": key})
        assert first.status_code == 201, first.text
        again = alice.post("/v1/jobs", json=job_document(None, "team-a"), headers={"Idempotency-Key": key})
        assert again.status_code == 200, again.text
        assert again.json()["job_id"] == first.json()["job_id"] and again.json()["repeat"] is True


def test_a_rejection_is_a_problem_naming_the_reason(api_stack):
    with api_stack.client("alice") as alice:
        r = alice.post("/v1/jobs", json=job_document(new_id(), "team-a", queue_name="q-team-b"))
        assert r.status_code == 409, r.text
        problem = r.json()
        assert r.headers["content-type"].startswith("application/problem+json")
        assert problem["type"].endswith("/rejected") and problem["reason"] and problem["detail"]


def test_bad_input_names_the_field(api_stack):
    with api_stack.client("alice") as alice:
        doc = job_document(new_id(), "team-a")
        doc["spec"]["gpus"] = "2"
        r = alice.post("/v1/jobs", json=doc)
        assert r.status_code == 422
        assert r.json()["errors"][0]["field"] == "body.spec.gpus"
        r = alice.get("/v1/jobs", params={"limit": 0})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "query.limit"


def test_a_member_sees_only_its_team(api_stack):
    with api_stack.client("alice") as alice, api_stack.client("bob") as bob, api_stack.client("ops") as ops:
        theirs = new_id("b")
        assert bob.post("/v1/jobs", json=job_document(theirs, "team-b")).status_code == 201
        wait_for(lambda: bob.get(f"/v1/jobs/{theirs}").status_code == 200)
        assert alice.get(f"/v1/jobs/{theirs}").status_code == 404
        assert alice.get(f"/v1/jobs/{theirs}/events").status_code == 404
        assert all(j["team"] == "team-a" for j in alice.get("/v1/jobs", params={"limit": 500}).json()["items"])
        assert alice.get("/v1/jobs", params={"team": "team-b"}).status_code == 403
        assert alice.post("/v1/jobs", json=job_document(new_id(), "team-b")).status_code == 403
        assert alice.post(f"/v1/jobs/{theirs}/cancel", json={}).status_code == 404
        taken = alice.post("/v1/jobs", json=job_document(theirs, "team-a"))  # not a repeat: not hers to see
        assert taken.status_code == 409 and taken.json()["reason"] == "duplicate-job-id", taken.text
        assert "q-team-b" not in taken.text
        assert alice.get("/v1/deadletters").status_code == 403
        assert [q["queue"] for q in alice.get("/v1/queues").json()] == ["q-team-a"]
        assert ops.get(f"/v1/jobs/{theirs}").status_code == 200


def test_no_token_or_a_bad_one_is_401(api_stack):
    with api_stack.client() as anonymous:
        assert anonymous.get("/v1/jobs").status_code == 401
        r = anonymous.get("/v1/jobs", headers={"Authorization": "Bearer gst_aaaaaaaaaaaa_" + "x" * 43})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")


def test_cancel_and_why(api_stack):
    with api_stack.client("alice") as alice:
        big = [new_id("big") for _ in range(3)]
        for job_id in big:  # 3 × 8 GPUs in a queue of 8: two wait
            assert alice.post("/v1/jobs", json=job_document(job_id, "team-a", gpus=8, runtime_s=600)).status_code == 201
        waiting = wait_for(lambda: [j for j in big if (alice.get(f"/v1/jobs/{j}/why").json().get("reason"))])
        why = alice.get(f"/v1/jobs/{waiting[0]}/why").json()
        assert why["waiting_for_quota"] and why["reason"]["code"]
        for job_id in big:
            r = alice.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "test over"})
            assert r.status_code == 200 and r.json()["outcome"] in ("JobCancelRequested", "JobCancelled"), r.text


def test_the_command_carries_the_requests_trace_and_the_metrics_count_it(api_stack):
    import asyncio

    import httpx

    from runtime import eventlog

    with api_stack.client("alice") as alice:
        assert alice.post("/v1/jobs", json=job_document(new_id("t"), "team-a")).status_code == 201

    async def last_intake():
        nc = await api_stack.admin()
        raw = await nc.jetstream().get_msg(eventlog.INTAKE_STREAM, subject="gpusched.intake.team-a.user.alice.submit",
                                           direct=True)
        await nc.close()
        return raw.headers or {}
    headers = asyncio.run(last_intake())
    assert headers.get("traceparent", "").startswith("00-") and headers.get("Nats-Msg-Id", "").startswith("submit-id/team-a/")
    metrics = httpx.get(f"http://127.0.0.1:{api_stack.metrics_ports['api']}/metrics").text
    assert 'gpusched_api_requests_total{method="POST",route="/v1/jobs",status="201"}' in metrics
    assert 'gpusched_api_decision_wait_seconds_count{verb="submit"}' in metrics
