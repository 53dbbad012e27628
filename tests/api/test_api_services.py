"""Inference services through the API over the running platform (the serving controller among
the processes): a member deploys, scales and deletes its team's service and watches its replicas
become ready; another team sees nothing of it and may not touch it; a deploy admission would not
admit is refused with the reason."""

from __future__ import annotations

import uuid

from tests.api.test_api_jobs import wait_for


def service(name: str, desired: int, team: str = "team-b", **replica) -> dict:
    return {"spec": {"name": name, "team": team, "queue": f"q-{team}",
                     "replicas": {"min": 1, "max": 4, "desired": desired},
                     "replica": {"kind": "inference", "queue": f"q-{team}", "team": team, "image": "srv", "gpus": 1,
                                 "gpu_flavors": ["a100"], "priority_class": "inference-sla", **replica},
                     "readiness": {"delay_seconds": 10}}}


def test_a_member_deploys_scales_and_deletes_its_service_and_another_team_sees_none_of_it(api_stack):
    name = f"chat-{uuid.uuid4().hex[:6]}"
    with api_stack.client("bob") as bob, api_stack.client("alice") as alice:
        r = bob.post("/v1/services", json=service(name, 1))
        assert r.status_code == 201, r.text
        assert (r.json()["outcome"], r.json()["generation"]) == ("ServiceDeployed", 1)

        def ready(n):
            return lambda: [s for s in bob.get("/v1/services").json() if s["service"] == name and s["ready"] == n]
        wait_for(ready(1))
        again = bob.post("/v1/services", json=service(name, 1))  # the spec it has: nothing changes
        assert again.status_code == 200 and again.json() == {
            "service": name, "intake_sequence": None, "outcome": "ServiceDeployed", "repeat": True, "generation": 1}

        assert [s for s in alice.get("/v1/services").json() if s["service"] == name] == []
        assert alice.get(f"/v1/services/{name}").status_code == 404
        assert alice.post(f"/v1/services/{name}/scale", json={"replicas": 3}).status_code == 404

        r = bob.post(f"/v1/services/{name}/scale", json={"replicas": 3})
        assert r.status_code == 200 and r.json()["outcome"] == "ScaleRequested", r.text
        wait_for(ready(3))
        detail = bob.get(f"/v1/services/{name}").json()
        assert sorted(x["state"] for x in detail["replicas_detail"]) == ["ready"] * 3

        assert bob.delete(f"/v1/services/{name}").json()["outcome"] == "ServiceDeleted"
        wait_for(lambda: not [s for s in bob.get("/v1/services").json() if s["service"] == name])
        replicas = [x["job_id"] for x in detail["replicas_detail"]]
        wait_for(lambda: all(bob.get(f"/v1/jobs/{j}").json()["state"] == "cancelled" for j in replicas))


def test_a_deploy_admission_would_not_admit_is_refused_with_the_field(api_stack):
    with api_stack.client("bob") as bob:
        r = bob.post("/v1/services", json=service(f"bad-{uuid.uuid4().hex[:6]}", 1, priority_class="gold"))
        assert r.status_code == 409, r.text
        assert "spec.replica.priority_class" in r.json()["detail"]
        r = bob.post("/v1/services", json=service("x", 1, team="team-a"))  # another team's
        assert r.status_code == 403, r.text
        r = bob.post("/v1/services", json={"spec": {**service("x", 1)["spec"], "replicas": {"min": 3, "desired": 1}}})
        assert r.status_code == 422 and "min <= desired <= max" in r.text
