"""A real Kubernetes control plane for tests, started like envtest does: etcd, kube-apiserver
(TLS with a throwaway CA, client-certificate authentication, RBAC), kube-controller-manager (the
Job, garbage-collector, TTL and node-lifecycle controllers), kube-scheduler, and kwok playing the
kubelets of fake GPU nodes. Binaries come from ``build.sh`` (built once, cached outside the
repository). ``ControlPlane.stop()`` tears all of it down.

When ``GPUSCHED_K8S_KUBECONFIG`` names a real cluster (kind, a lab cluster), :func:`start`
returns a handle on it instead and starts nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusched.dev.stack import free_port, free_ports

HERE = Path(__file__).parent
STAGES = HERE.parent / "kwok-pod-stages.yaml"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
PLATFORM_NAMESPACE = "gpusched"
"""The services' namespace: the executor's ServiceAccount and the platform's Secrets."""
NAMESPACE = "gpusched-workloads"
"""Where the executor creates the teams' Jobs (k8s/base/namespace.yaml)."""
EXECUTOR_SA = "gpusched-executor"
REPO = HERE.parents[2]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """CA, apiserver serving cert, admin client cert (system:masters), service-account keys."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=gpusched-test-ca", cwd=d)
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subj, ext in (("server", "/CN=kube-apiserver", "server.ext"),
                            ("admin", "/O=system:masters/CN=gpusched-test-admin", "client.ext")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subj, cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", ext, cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def write_kubeconfig(path: Path, server: str, pki: Path) -> None:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: {server}
    certificate-authority: {pki / 'ca.crt'}
users:
- name: admin
  user:
    client-certificate: {pki / 'admin.crt'}
    client-key: {pki / 'admin.key'}
contexts:
- name: test
  context: {{cluster: test, user: admin}}
current-context: test
""")


def build_binaries() -> Path:
    out = subprocess.run([str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def node_stage_files(bin_dir: Path) -> list[Path]:
    """kwok's own node-initialize and node-heartbeat Stages (saved by build.sh; else from the
    Go module cache)."""
    saved = bin_dir.parent / "stages"
    if saved.is_dir() and any(saved.glob("*.yaml")):
        return sorted(saved.glob("*.yaml"))
    version = os.environ.get("GPUSCHED_KWOK_VERSION", "v0.8.0")
    modcache = subprocess.run(["go", "env", "GOMODCACHE"], check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
    base = Path(modcache) / f"sigs.k8s.io/kwok@{version}/kustomize/stage/node"
    return [base / "fast/node-initialize.yaml", base / "heartbeat/node-heartbeat.yaml"]


@dataclass
class ControlPlane:
    kubeconfig: Path
    server: str = ""
    workdir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    external: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    def api_client(self):
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        return client.ApiClient(cfg)

    def token_client(self, token: str):
        """An API client that authenticates as a ServiceAccount token (for the RBAC tests)."""
        from kubernetes import client, config

        base = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=base)
        cfg = client.Configuration()
        cfg.host = base.host
        cfg.ssl_ca_cert = base.ssl_ca_cert
        cfg.verify_ssl = base.verify_ssl
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    def stop(self) -> None:
        for name in ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.workdir is not None and not os.environ.get("GPUSCHED_K8S_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def logs(self, name: str, tail: int = 40) -> str:
        if self.workdir is None:
            return ""
        try:
            return "\n".join((self.workdir / f"{name}.log").read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return ""


def _wait(predicate, timeout: float, what: str, plane: ControlPlane, log_name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = plane.procs.get(log_name)
        if p is not None and p.poll() is not None:
            raise RuntimeError(f"{log_name} exited with {p.returncode} before {what}:\n{plane.logs(log_name)}")
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}:\n{plane.logs(log_name)}")


def start() -> ControlPlane:
    external = os.environ.get("GPUSCHED_K8S_KUBECONFIG")
    if external:
        return ControlPlane(kubeconfig=Path(external), external=True)
    t0 = time.monotonic()
    bin_dir = build_binaries()
    plane = ControlPlane(kubeconfig=Path(), workdir=Path(tempfile.mkdtemp(prefix="gpusched-k8s-")))
    plane.timings["build_or_cache_s"] = time.monotonic() - t0
    w = plane.workdir
    assert w is not None
    try:
        pki = w / "pki"
        make_pki(pki)
        etcd_port, peer_port, api_port = free_ports(3)

        def launch(name: str, argv: list[str]) -> None:
            log = open(w / f"{name}.log", "wb")
            plane.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 cwd=w)
            log.close()

        t = time.monotonic()
        launch("etcd", [str(bin_dir / "etcd"), "--data-dir", str(w / "etcd"), "--name", "test",
                        "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                        "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                        "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                        "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
                        "--unsafe-no-fsync", "--quota-backend-bytes", str(2 ** 30), "--log-level", "warn"])
        launch("kube-apiserver", [
            str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc", "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true", "--endpoint-reconciler-type=none", "--v=0",
        ])
        plane.server = f"https://127.0.0.1:{api_port}"
        plane.kubeconfig = w / "admin.kubeconfig"
        write_kubeconfig(plane.kubeconfig, plane.server, pki)

        def healthy() -> bool:
            from kubernetes import client

            api = plane.api_client()
            client.VersionApi(api).get_code()
            client.CoreV1Api(api).read_namespace("default")  # created by the bootstrap controller
            return True

        _wait(healthy, 120, "kube-apiserver /readyz", plane, "kube-apiserver")
        plane.timings["apiserver_ready_s"] = time.monotonic() - t
        launch("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={plane.kubeconfig}",
            f"--authentication-kubeconfig={plane.kubeconfig}", f"--authorization-kubeconfig={plane.kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--controllers=*",
            "--node-monitor-grace-period=20s", "--concurrent-job-syncs=20", "--v=0",
        ])
        launch("kube-scheduler", [
            str(bin_dir / "kube-scheduler"), f"--kubeconfig={plane.kubeconfig}",
            f"--authentication-kubeconfig={plane.kubeconfig}", f"--authorization-kubeconfig={plane.kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--v=0",
        ])
        configs = [str(p) for p in [*node_stage_files(bin_dir), STAGES]]
        launch("kwok", [
            str(bin_dir / "kwok"), f"--kubeconfig={plane.kubeconfig}",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            *[f"--config={c}" for c in configs], "--node-lease-duration-seconds=40",
        ])

        def default_sa() -> bool:
            from kubernetes import client

            client.CoreV1Api(plane.api_client()).read_namespaced_service_account("default", "default")
            return True

        _wait(default_sa, 120, "the controller-manager to create the default ServiceAccount", plane,
              "kube-controller-manager")
        time.sleep(0.5)
        for name in ("kube-scheduler", "kwok"):
            p = plane.procs[name]
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{plane.logs(name)}")
        plane.timings["control_plane_ready_s"] = time.monotonic() - t
        return plane
    except BaseException:
        plane.stop()
        raise


def gpu_node(name: str, *, gpus: int = 8, product: str = "NVIDIA-A100-SXM4-80GB", memory_mib: int = 81920,
             rack: str = "rack-1") -> dict:
    """A fake GPU node that kwok manages: capacity nvidia.com/gpu, GPU feature discovery labels,
    topology labels and the usual GPU taint."""
    res = {"cpu": "96", "memory": "1024Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                     "labels": {"kubernetes.io/hostname": name, "type": "kwok",
                                "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(memory_mib),
                                "nvidia.com/gpu.count": str(gpus), "topology.gpusched.io/rack": rack,
                                "feature.gpusched.io/rdma": "true"}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": res, "allocatable": res},
    }


def prepare(plane) -> None:
    """The two namespaces, the executor's ServiceAccount and RBAC exactly as in k8s/base (each
    object in the namespace its file names; applied server-side, so the ``default``
    ServiceAccount the controller-manager creates takes the manifest's settings), a Secret in each
    namespace for the RBAC tests to try, and two fake GPU nodes."""
    import yaml
    from kubernetes import client, dynamic

    api = plane.api_client()
    core = client.CoreV1Api(api)
    resources = dynamic.DynamicClient(api).resources
    for name in ("namespace.yaml", "serviceaccounts.yaml", "executor-rbac.yaml"):
        for doc in yaml.safe_load_all((REPO / "k8s/base" / name).read_text()):
            if not doc:
                continue
            if doc["kind"] == "ServiceAccount" and doc["metadata"]["name"] not in (EXECUTOR_SA, "default"):
                continue
            kind = resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            kind.server_side_apply(body=doc, name=doc["metadata"]["name"], namespace=doc["metadata"].get("namespace"),
                                   field_manager="gpusched-tests", force_conflicts=True)
    for namespace in (PLATFORM_NAMESPACE, NAMESPACE):
        try:
            core.create_namespaced_secret(namespace, {"metadata": {"name": "gpusched-nats-executor"},
                                                      "stringData": {"GPUSCHED_NATS_PASSWORD": "not-for-jobs"}})
        except client.exceptions.ApiException as err:
            if err.status != 409:
                raise
    ensure_nodes(plane)


def ensure_nodes(plane, names: tuple[str, ...] = ("kwok-gpu-0", "kwok-gpu-1")) -> None:
    """The fake GPU nodes exist and are Ready (a test may have deleted one)."""
    from kubernetes import client

    core = client.CoreV1Api(plane.api_client())
    for n in names:
        try:
            core.create_node(gpu_node(n))
        except client.exceptions.ApiException as err:
            if err.status != 409:
                raise
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        nodes = [n for n in core.list_node().items if n.metadata.name in names]
        if len(nodes) == len(names) and all(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or ())
                                   for n in nodes):
            break
        time.sleep(0.3)
    else:
        raise RuntimeError(f"kwok did not make the nodes Ready:\n{plane.logs('kwok')}")
