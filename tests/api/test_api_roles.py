"""Each role against each route: what it may do works, and everything else is refused (403, or
404 for another team's job, which a member cannot tell from a job that does not exist). Tokens:
a revoked or expired one is refused; only the admin's NATS credential can issue one."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import nats
import pytest

from gpusched.api import tokens
from runtime import eventlog
from schemas.auth import Role
from tests.api.stack import job_document

MEMBER, OPERATOR, CHARGEBACK, ADMIN = "alice", "ops", "money", "root"
HOLDERS = (MEMBER, OPERATOR, CHARGEBACK, ADMIN)


@pytest.fixture(scope="module")
def jobs(api_stack) -> dict[str, str]:
    """A job of team-a and one of team-b, in the read models."""
    out = {}
    for holder, team in (("alice", "team-a"), ("bob", "team-b")):
        job_id = f"roles-{team}-{uuid.uuid4().hex[:6]}"
        with api_stack.client(holder) as client:
            assert client.post("/v1/jobs", json=job_document(job_id, team, runtime_s=1)).status_code == 201
            deadline = time.monotonic() + 60
            while client.get(f"/v1/jobs/{job_id}").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        out[team] = job_id
    return out


def routes(jobs: dict[str, str]) -> list[tuple[str, str, dict | None, set[str]]]:
    """(method, path, JSON body, the holders that may) for every route but submit and the streams."""
    mine, theirs = jobs["team-a"], jobs["team-b"]
    readers = {MEMBER, OPERATOR, ADMIN}
    return [
        ("GET", "/v1/jobs", None, readers),
        ("GET", f"/v1/jobs/{mine}", None, readers),
        ("GET", f"/v1/jobs/{mine}/events", None, readers),
        ("GET", f"/v1/jobs/{mine}/why", None, readers),
        ("GET", f"/v1/jobs/{theirs}", None, {OPERATOR, ADMIN}),
        ("GET", f"/v1/jobs/{theirs}/events", None, {OPERATOR, ADMIN}),
        ("GET", f"/v1/jobs/{theirs}/why", None, {OPERATOR, ADMIN}),
        ("POST", f"/v1/jobs/{theirs}/cancel?wait=0", {"reason": "x"}, {OPERATOR, ADMIN}),
        ("POST", f"/v1/jobs/{theirs}/checkpoints?wait=0", {"attempt": 1}, {OPERATOR, ADMIN}),
        ("GET", "/v1/jobs?team=team-b", None, {OPERATOR, ADMIN}),
        ("GET", "/v1/queues", None, readers),
        ("GET", "/v1/cohorts", None, readers),
        ("GET", "/v1/nodes", None, readers),
        ("GET", "/v1/gpus", None, readers),
        ("GET", "/v1/usage", None, set(HOLDERS)),
        ("GET", "/v1/chargeback?period=2026-12", None, {CHARGEBACK, OPERATOR, ADMIN}),
        ("GET", "/v1/metrics/summary", None, set(HOLDERS)),
        ("GET", "/v1/metrics/series?hours=1&bucket_s=600", None, set(HOLDERS)),
        ("GET", "/v1/deadletters", None, {OPERATOR, ADMIN}),
        ("GET", "/v1/tokens", None, {ADMIN}),
        ("GET", "/v1/whoami", None, set(HOLDERS)),
    ]


def test_each_role_may_use_its_routes_and_no_other(api_stack, jobs):
    allowed, refused, wrong = 0, 0, []
    for holder in HOLDERS:
        with api_stack.client(holder) as client:
            for method, path, body, may in routes(jobs):
                status = client.request(method, path, json=body).status_code
                if holder in may:
                    allowed += 1
                    if status >= 400:
                        wrong.append(f"{holder} {method} {path}: {status}, expected success")
                else:
                    refused += 1
                    if status not in (403, 404):
                        wrong.append(f"{holder} {method} {path}: {status}, expected 403/404")
    assert not wrong, "\n".join(wrong)
    print(f"allowed {allowed}, refused {refused}")
    assert refused >= 25


def test_submitting_and_streaming_for_another_team_is_refused(api_stack, jobs):
    with api_stack.client(MEMBER) as alice, api_stack.client(CHARGEBACK) as money:
        assert alice.post("/v1/jobs", json=job_document(None, "team-b")).status_code == 403
        assert money.post("/v1/jobs", json=job_document(None, "team-a")).status_code == 403
        assert alice.get("/v1/teams/team-b/stream").status_code == 403
        assert alice.get(f"/v1/jobs/{jobs['team-b']}/stream").status_code == 404
        assert money.get("/v1/teams/team-a/stream").status_code == 403
        r = alice.post("/v1/jobs", json={**job_document(None, "team-a"), "submitter": "bob"})
        assert r.status_code == 403 and "submitter" in r.json()["detail"]


async def _publish(api_stack, *events) -> None:
    nc = await api_stack.admin()
    log = eventlog.EventLog(nc.jetstream())
    for event in events:
        await log.append(event)
    await nc.close()


def test_a_revoked_or_expired_token_is_refused(api_stack):
    now = datetime.now(UTC)
    fresh, expired = tokens.mint(), tokens.mint()
    asyncio.run(_publish(api_stack,
                         tokens.issued(fresh, name="carol", role=Role.MEMBER, team="team-a", issued_by="admin", now=now),
                         tokens.issued(expired, name="dave", role=Role.MEMBER, team="team-a", issued_by="admin",
                                       now=now, expires_at=now + timedelta(seconds=1))))
    with api_stack.client() as client:
        def status(token: str) -> int:
            return client.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"}).status_code
        deadline = time.monotonic() + 30
        while status(fresh.token) != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert client.get("/v1/whoami", headers={"Authorization": f"Bearer {fresh.token}"}).json()["name"] == "carol"
        time.sleep(1.5)
        assert status(expired.token) == 401
        asyncio.run(_publish(api_stack, tokens.revoked(fresh.token_id, revoked_by="admin", reason="left",
                                                       now=datetime.now(UTC))))
        deadline = time.monotonic() + 30
        while status(fresh.token) != 401:  # within the cache time of accounting recording it
            assert time.monotonic() < deadline
            time.sleep(0.5)
        wrong_secret = fresh.token[:-4] + ("AAAA" if not fresh.token.endswith("AAAA") else "BBBB")
        assert status(wrong_secret) == 401


async def test_only_the_admin_credential_can_issue_a_token(api_stack):
    errors: list[str] = []

    async def on_error(err: Exception) -> None:
        errors.append(str(err))
    server = api_stack.nats_server
    nc = await nats.connect(server.url(), user="operator", password=server.creds.users["operator"],
                            inbox_prefix=eventlog.inbox_prefix("operator"), error_cb=on_error)
    event = tokens.issued(tokens.mint(), name="mallory", role=Role.ADMIN, team=None, issued_by="operator",
                          now=datetime.now(UTC))
    with pytest.raises(nats.errors.Error):
        await eventlog.EventLog(nc.jetstream()).append(event)
    await nc.close()
    assert any("permissions violation" in e.lower() for e in errors)
