"""k8s/overlays on a real kube-apiserver (docs/operations.md, "Deploying on Kubernetes"):
``kubectl apply --server-side -k`` of the dev overlay, then of the prod overlay over it (an
upgrade), each applying cleanly; the Prometheus Operator's real ServiceMonitor CRD (from its Go
module) is installed first, so the ServiceMonitor is checked against its schema. kwok plays a
CPU node for the platform's pods, three volumes bind the NATS servers' claims, and every
Deployment and the NATS StatefulSet become ready at the replicas each overlay asks for. Its own
control plane: the platform's pods never meet the other tests' nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.executor.conftest import K8S
from tests.executor.controlplane.cluster import KWOK_NODE_ANNOTATION, REPO

pytestmark = pytest.mark.skipif(not K8S, reason="the Kubernetes tests run with `make test-k8s`")

KUBECTL = Path(sys.executable).parent / "kubectl"
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.88.0"
NAMESPACE = "gpusched"


def servicemonitor_crd() -> Path:
    """The ServiceMonitor CRD as the Prometheus Operator publishes it, from its Go module (the
    module proxy; cached in the Go module cache)."""
    out = subprocess.run(["go", "mod", "download", "-json", PROMETHEUS_OPERATOR], check=True, capture_output=True,
                         text=True, env={**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}, timeout=600)
    return Path(json.loads(out.stdout)["Dir"]) / "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"


@pytest.fixture(scope="module")
def plane():
    from tests.executor.controlplane import cluster

    started = cluster.start()
    try:
        yield started
    finally:
        started.stop()


def kubectl(plane, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run([str(KUBECTL), f"--kubeconfig={plane.kubeconfig}", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def cpu_node(name: str) -> dict:
    """A node kwok runs pods on, without the GPU taint: the platform's pods land here."""
    res = {"cpu": "32", "memory": "128Gi", "pods": "110"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                         "labels": {"kubernetes.io/hostname": name, "type": "kwok"}},
            "status": {"capacity": res, "allocatable": res}}


def volume(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": f"/tmp/{name}"}}}


def ready(plane, want: dict[str, int]) -> dict[str, int] | None:
    """Ready replicas of every Deployment and StatefulSet of the namespace, once each has ``want``'s."""
    items = json.loads(kubectl(plane, "get", "deployments,statefulsets", "-n", NAMESPACE, "-o", "json"))["items"]
    got = {f"{i['kind']}/{i['metadata']['name']}": i.get("status", {}).get("readyReplicas", 0) for i in items}
    return got if all(got.get(k) == v for k, v in want.items()) else None


def wait_ready(plane, want: dict[str, int], timeout: float = 180) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := ready(plane, want)) is not None:
            return got
        time.sleep(1)
    pods = kubectl(plane, "get", "pods", "-n", NAMESPACE, "-o", "wide")
    pvcs = kubectl(plane, "get", "pvc", "-n", NAMESPACE)
    raise AssertionError(f"not ready within {timeout}s: want {want}\n{pods}\n{pvcs}\n{plane.logs('kube-scheduler')}")


SERVICES = ("quota", "scheduler", "executor", "serving", "api")
"""Deployments; the notifier, accounting and admission are StatefulSets (admission: two pods per
partition)."""


def test_the_dev_then_the_prod_overlay_apply_server_side_and_come_up(plane):
    from kubernetes import client

    core = client.CoreV1Api(plane.api_client())
    core.create_node(cpu_node("kwok-cpu-0"))
    for i in range(3):
        core.create_persistent_volume(volume(f"nats-data-{i}"))
    kubectl(plane, "apply", "--server-side", "-f", str(servicemonitor_crd()))
    kubectl(plane, "wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com", "--timeout=60s")

    out = kubectl(plane, "apply", "--server-side", "-k", str(REPO / "k8s/overlays/dev"))
    assert "statefulset.apps/nats serverside-applied" in out, out
    dev = {f"Deployment/gpusched-{s}": 1 for s in SERVICES} | {"StatefulSet/nats": 1, "StatefulSet/gpusched-notifier": 1,
                                                               "StatefulSet/gpusched-accounting": 1,
                                                               "StatefulSet/gpusched-admission": 1}
    wait_ready(plane, dev)

    # the upgrade to prod: the same objects take prod's replicas, config and image; prod's own appear
    out = kubectl(plane, "apply", "--server-side", "-k", str(REPO / "k8s/overlays/prod"))
    for created in ("networkpolicy.networking.k8s.io/nats", "poddisruptionbudget.policy/nats",
                    "servicemonitor.monitoring.coreos.com/gpusched", "service/gpusched-quota-metrics"):
        assert f"{created} serverside-applied" in out, out
    prod = ({f"Deployment/gpusched-{s}": 1 for s in SERVICES}
            | {f"Deployment/gpusched-{s}": 2 for s in ("quota", "scheduler", "api")}
            | {"StatefulSet/nats": 3, "StatefulSet/gpusched-notifier": 2, "StatefulSet/gpusched-accounting": 2,
               "StatefulSet/gpusched-admission": 4})
    got = wait_ready(plane, prod)
    print(f"\nprod overlay ready: {got}")
    # applied again: nothing changes, nothing conflicts
    kubectl(plane, "apply", "--server-side", "-k", str(REPO / "k8s/overlays/prod"))
    image = kubectl(plane, "get", "deployment/gpusched-quota", "-n", NAMESPACE,
                    "-o", "jsonpath={.spec.template.spec.containers[0].image}")
    assert image == "registry.example.com/gpusched:0.1.0"
    claims = json.loads(kubectl(plane, "get", "pvc", "-n", NAMESPACE, "-o", "json"))["items"]
    assert sorted(c["status"]["phase"] for c in claims) == ["Bound"] * 3

    # TLS for every NATS client on top (k8s/overlays/prod-tls): the Secret it names, then the
    # same objects rolled with the CA mounted, and NATS exposed to the other clusters
    kubectl(plane, "create", "secret", "generic", "nats-tls", "-n", NAMESPACE,
            "--from-literal=tls.crt=placeholder", "--from-literal=tls.key=placeholder",
            "--from-literal=ca.crt=placeholder")
    out = kubectl(plane, "apply", "--server-side", "-k", str(REPO / "k8s/overlays/prod-tls"))
    for created in ("service/nats-external", "networkpolicy.networking.k8s.io/nats-from-remote-clusters"):
        assert f"{created} serverside-applied" in out, out
    wait_ready(plane, prod)
    env = kubectl(plane, "get", "statefulset/gpusched-accounting", "-n", NAMESPACE,
                  "-o", "jsonpath={.spec.template.spec.containers[0].env[?(@.name=='GPUSCHED_NATS_TLS_CA')].value}")
    assert env == "/etc/nats-ca/ca.crt"
