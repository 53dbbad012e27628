"""The Kubernetes NATS configuration as it is committed (k8s/components/nats/nats-server.conf),
run: three nats-servers on loopback, each with that file unchanged but for what a pod's network,
volumes and Secrets give it (its ports, its store and pid file, POD_NAME, the passwords in the
environment, the routes include of the Secret gpusched-nats-routes), form a JetStream cluster
that replicates an R3 stream on all three; a server whose routes carry a wrong route password
is refused by every one of them. Its JetStream limits and its accounts, users and permissions are
the ones of the cluster the other tests run on (the nats_cluster fixture)."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import subprocess
import time
import urllib.request
from pathlib import Path

import nats
import pytest

from conftest import TEST_TEAMS
from gpusched.dev import natsconf
from gpusched.dev import stack as devstack
from runtime import eventlog

K8S_CONF = Path(__file__).resolve().parents[2] / "k8s" / "components" / "nats" / "nats-server.conf"


def _pod_config(text: str, client: int, route: int, http: int, data: Path) -> str:
    """The committed configuration as pod ``data`` runs it: only its ports (each pod has its own
    network, here they share loopback), its store and its pid file (its volumes) differ."""
    for old, new in [('"listen": "0.0.0.0:4222"', f'"listen": "127.0.0.1:{client}"'),
                     ('"listen": "0.0.0.0:6222"', f'"listen": "127.0.0.1:{route}"'),
                     ('"http_port": 8222', f'"http": "127.0.0.1:{http}"'),
                     ('"store_dir": "/data/jetstream"', f'"store_dir": "{data / "jetstream"}"'),
                     ('"pid_file": "/var/run/nats/nats.pid"', f'"pid_file": "{data / "nats.pid"}"')]:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


class Pod:
    """One NATS pod: /etc/nats-config/nats.conf (the ConfigMap) and /etc/nats-routes/routes.conf
    (the Secret), laid out the same way under ``root`` (the include's path is relative)."""

    def __init__(self, root: Path, name: str, ports: tuple[int, int, int], env: dict[str, str],
                 routes: list[str], route_password: str) -> None:
        self.name, (self.client, self.route, self.http) = name, ports
        (root / "nats-config").mkdir(parents=True)
        (root / "nats-routes").mkdir()
        (root / "nats-config" / "nats.conf").write_text(_pod_config(K8S_CONF.read_text(), *ports, root))
        (root / "nats-routes" / "routes.conf").write_text(natsconf.k8s_routes_include(routes, route_password))
        self.log = root / "nats.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [devstack._bin("nats-server"), "-c", str(root / "nats-config" / "nats.conf")],
                env={**env, "POD_NAME": name, natsconf.K8S_ROUTE_PASSWORD: route_password},
                stdout=out, stderr=subprocess.STDOUT)

    def get(self, path: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}{path}", timeout=2) as answer:
                return json.loads(answer.read())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(0.1)
    return result


@pytest.fixture
def k8s_pods(tmp_path):
    """Three pods of the StatefulSet, and what each got from the Secrets."""
    users = sorted(set(re.findall(r"\$(GPUSCHED_NATS_PASSWORD_[A-Z0-9_]+)", K8S_CONF.read_text())))
    env = {"PATH": "/usr/bin:/bin", **{var: "p" + secrets.token_hex(12) for var in users}}
    route_password = "r" + secrets.token_hex(24)
    ports = devstack.free_ports(12)
    pods: list[Pod] = []
    routes = [f"127.0.0.1:{ports[3 * i + 1]}" for i in range(3)]  # the headless Service's names, on loopback
    try:
        for i in range(3):
            pods.append(Pod(tmp_path / f"nats-{i}", f"nats-{i}", tuple(ports[3 * i:3 * i + 3]), env, routes,
                            route_password))
        yield pods, env, routes, ports[9:]
    finally:
        for pod in pods:
            pod.stop()


async def test_the_k8s_nats_config_forms_a_jetstream_cluster_that_refuses_a_wrong_route_password(k8s_pods, tmp_path):
    pods, env, routes, spare = k8s_pods

    def meta_leader() -> str | None:
        leaders = {((p.get("/jsz") or {}).get("meta_cluster") or {}).get("leader") for p in pods}
        return leaders.pop() if len(leaders) == 1 and None not in leaders else None

    leader = _until(meta_leader, 30, "one meta leader all three servers agree on")
    assert leader in {p.name for p in pods}
    assert all((p.get("/jsz") or {})["meta_cluster"]["cluster_size"] == 3 for p in pods)
    assert all((p.get("/varz") or {})["jetstream"]["config"]["sync_always"] for p in pods)

    nc = await nats.connect([f"nats://127.0.0.1:{p.client}" for p in pods], user="admin",
                            password=env[natsconf.password_variable("admin")], connect_timeout=5,
                            inbox_prefix=eventlog.inbox_prefix("admin"))
    try:
        js = nc.jetstream(timeout=10)
        info = await js.add_stream(name="K8S_R3", subjects=["k8scheck.>"], num_replicas=3)
        for _ in range(100):  # the new stream answers publishes once its replicas have elected a leader
            if info.cluster is not None and info.cluster.leader:
                break
            await asyncio.sleep(0.1)
            info = await js.stream_info("K8S_R3")
        for n in range(10):
            await js.publish(f"k8scheck.{n}", b"x")
        info = await js.stream_info("K8S_R3")
        assert info.config.num_replicas == 3 and info.cluster.leader in {p.name for p in pods}
        assert {r.name for r in info.cluster.replicas} == {p.name for p in pods} - {info.cluster.leader}
    finally:
        await nc.close()

    def stored_everywhere() -> bool:  # each server's own copy of the stream holds the ten messages
        for pod in pods:
            report = pod.get("/jsz?accounts=true&streams=true") or {}
            held = [s["state"]["messages"] for a in report.get("account_details") or []
                    for s in a.get("stream_detail") or [] if s["name"] == "K8S_R3"]
            if held != [10]:
                return False
        return True

    _until(stored_everywhere, 10, "the stream's ten messages on every server")

    # A fourth server with the same configuration whose Secret has another route password.
    intruder = Pod(tmp_path / "nats-3", "nats-3", tuple(spare), env, routes, "r" + secrets.token_hex(24))
    try:
        _until(lambda: all('authentication error - User "route"' in p.log.read_text() for p in pods), 15,
               "every server of the cluster refusing the intruder's route")
        # The intruder keeps dialling its routes; each try is listed on its side until the cluster
        # refuses its credential, so its count is 0 between tries, not at every instant.
        _until(lambda: (intruder.get("/routez") or {}).get("num_routes") == 0, 10, "the intruder without a route")
        for pod in pods:
            remotes = {r.get("remote_name") for r in (pod.get("/routez") or {}).get("routes") or []}
            assert remotes == {p.name for p in pods} - {pod.name}, (pod.name, remotes)
            assert (pod.get("/jsz") or {})["meta_cluster"]["cluster_size"] == 3
    finally:
        intruder.stop()


def _as_json(conf: str) -> dict:
    """A generated configuration read as the JSON it is, its environment references as strings."""
    text = "\n".join(line for line in conf.splitlines() if not line.startswith("#"))
    text = re.sub(r"(?<![\"\w])\$([A-Z0-9_]+)", r'"$\1"', text)
    text = re.sub(r'include "([^"]+)"', r'"include": "\1"', text)
    return json.loads(text)


def test_the_k8s_nats_config_has_the_tested_clusters_limits_and_permissions(nats_cluster):
    """The k8s file against the configuration the nats_cluster fixture's servers run with."""
    k8s = _as_json(K8S_CONF.read_text())
    tested = json.loads((nats_cluster.servers[0].data_dir / "nats.conf").read_text())
    assert k8s["max_payload"] == tested["max_payload"]
    for limit in ("max_file_store", "max_memory_store"):
        assert k8s["jetstream"][limit] == tested["jetstream"][limit], limit
    assert k8s["jetstream"]["sync_interval"] == "always"  # the tests run without fsync: ditto otherwise
    assert {k: v for k, v in k8s["cluster"].items() if k not in ("listen", "include")} == {
        k: v for k, v in tested["cluster"].items() if k not in ("listen", "routes")} | {
        "authorization": {**tested["cluster"]["authorization"], "password": f"${natsconf.K8S_ROUTE_PASSWORD}"}}

    def users(config: dict) -> dict[str, tuple[str, dict]]:
        return {u["user"]: (name, u["permissions"]) for name, account in config["accounts"].items()
                for u in account["users"]}

    def account(config: dict, team: str) -> str:  # a team's account, its password left out, the team renamed
        (name,) = [n for n, a in config["accounts"].items() if any(u["user"] == team for u in a["users"])]
        users = [{**u, "password": None} for u in config["accounts"][name]["users"]]
        return json.dumps({name: {**config["accounts"][name], "users": users}}).replace(team, "TEAM")

    k8s_users, tested_users = users(k8s), users(tested)
    k8s_teams = {"team-research", "team-product", "team-platform"}
    shared = set(k8s_users) & set(tested_users)
    assert shared == set(k8s_users) - k8s_teams  # admin, operator, every service, the API
    assert {u: k8s_users[u] for u in shared} == {u: tested_users[u] for u in shared}  # account, permissions
    assert account(k8s, "team-research") == account(tested, TEST_TEAMS[0])
