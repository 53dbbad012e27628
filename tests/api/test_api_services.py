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
        assert again.status_code == 200 and again.json() | {"intake_sequence": 0} == {
            "service": name, "intake_sequence": 0, "outcome": "ServiceDeployed", "repeat": True, "generation": 1}

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


def test_the_cli_and_the_sdk_run_a_service_through_the_api(api_stack, tmp_path):
    """`gpusched deploy`, `scale`, `services`, `delete-service` with only an API token (no NATS),
    as `make run`'s connection has them, and the SDK's service methods."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from gpusched_sdk import Client, NotFound

    name = f"cli-{uuid.uuid4().hex[:6]}"
    spec_file = tmp_path / "service.json"
    spec_file.write_text(json.dumps(service(name, 1)["spec"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(GPUSCHED_API_URL=api_stack.url, GPUSCHED_API_TOKEN=api_stack.tokens["bob"],
               GPUSCHED_CONNECTION_FILE=str(tmp_path / "none.json"))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(Path(sys.executable).parent / "gpusched"), *args, "--output", "json"], env=env,
                              capture_output=True, text=True, timeout=60)

    deployed = cli("deploy", "-f", str(spec_file))
    assert deployed.returncode == 0, deployed.stderr
    assert json.loads(deployed.stdout)["outcome"] == "ServiceDeployed"
    scaled = cli("scale", name, "2", "--team", "team-b")
    assert scaled.returncode == 0 and json.loads(scaled.stdout)["outcome"] == "ScaleRequested", scaled.stderr
    with Client(api_stack.url, api_stack.tokens["bob"]) as gs:
        wait_for(lambda: [s for s in gs.services() if s["service"] == name and s["ready"] == 2])
        assert len(gs.service(name)["replicas_detail"]) == 2
    listed = cli("services", "--team", "team-b")
    assert name in [s["service"] for s in json.loads(listed.stdout)], listed.stderr
    refused = cli("scale", name, "3", "--team", "team-b", "--on-behalf-of", "carol")
    assert refused.returncode == 2 and "--on-behalf-of" in refused.stderr
    assert json.loads(cli("delete-service", name, "--team", "team-b").stdout)["outcome"] == "ServiceDeleted"
    with Client(api_stack.url, api_stack.tokens["alice"]) as other:
        try:
            other.service(name)
            raise AssertionError("another team's service was visible")
        except NotFound:
            pass
