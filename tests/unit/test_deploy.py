"""deploy/: the Procfile the local run starts and the reference nats-server configuration."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpusched import permissions
from gpusched.dev import natsconf
from gpusched.dev import stack as devstack

ROOT = Path(__file__).resolve().parents[2]


def test_procfile_lists_every_service_as_a_module_and_the_api():
    procs = devstack.read_procfile()
    assert list(procs) == ["admission", "quota", "scheduler", "executor", "accounting", "notifier", "serving", "api"]
    assert tuple(procs) == devstack.PROCESSES == (*permissions.SERVICES, permissions.API_USER)
    for name, argv in procs.items():
        assert argv[1:] == ["-m", "gpusched.api" if name == "api" else f"services.{name}"]


def test_committed_nats_config_matches_the_generator():
    committed = (ROOT / "deploy" / "nats-server.conf").read_text()
    assert committed == natsconf.reference_nats_config(), "run `gpusched dev nats-config --out deploy/nats-server.conf`"


def test_nats_server_accepts_the_config_and_names_a_missing_password(tmp_path):
    conf = ROOT / "deploy" / "nats-server.conf"
    binary = devstack._bin("nats-server")
    env = _passwords()
    ok = subprocess.run([binary, "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    del env[natsconf.password_variable("quota")]
    bad = subprocess.run([binary, "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert bad.returncode != 0
    assert "GPUSCHED_NATS_PASSWORD_QUOTA" in bad.stderr + bad.stdout


def _passwords() -> dict[str, str]:
    """The environment nats-server reads the reference configurations' passwords from."""
    users = ["admin", "operator", *permissions.SERVICES, permissions.API_USER, "team-research", "team-product",
             "team-platform"]
    return {**os.environ, **{natsconf.password_variable(u): f"pw-{u}" for u in users}}


K8S_NATS_CONFIGS = {3: ROOT / "k8s" / "components" / "nats" / "nats-server.conf",
                    1: ROOT / "k8s" / "overlays" / "dev" / "nats-single" / "nats-server.conf"}


K8S_NATS_TLS_CONFIG = ROOT / "k8s" / "components" / "nats-tls" / "nats-server.conf"
K8S_TLS = natsconf.tls_block(Path("/etc/nats-tls/tls.crt"), Path("/etc/nats-tls/tls.key"))


def test_committed_k8s_nats_configs_match_the_generator():
    for replicas, path in K8S_NATS_CONFIGS.items():
        assert path.read_text() == natsconf.k8s_nats_config(replicas), (
            f"run `gpusched dev nats-config --k8s {replicas} --out {path.relative_to(ROOT)}`")
    assert K8S_NATS_TLS_CONFIG.read_text() == natsconf.k8s_nats_config(3, tls=K8S_TLS), (
        "run `gpusched dev nats-config --k8s 3 --tls-cert /etc/nats-tls/tls.crt --tls-key /etc/nats-tls/tls.key "
        "--out k8s/components/nats-tls/nats-server.conf`")


ROUTE_PASSWORD = "r" + "0123456789abcdef" * 3


def _k8s_pod(tmp_path: Path, config: str) -> Path:
    """A NATS pod's files as the StatefulSet mounts them: the ConfigMap's nats.conf in
    nats-config/, the Secret gpusched-nats-routes's routes.conf in nats-routes/ (the config's
    include is relative to its own directory); the config's path."""
    (tmp_path / "nats-config").mkdir(parents=True)
    (tmp_path / "nats-routes").mkdir()
    (tmp_path / "nats-routes" / "routes.conf").write_text(
        natsconf.k8s_routes_include(natsconf.k8s_route_hosts(3), ROUTE_PASSWORD))
    conf = tmp_path / "nats-config" / "nats.conf"
    conf.write_text(config)
    return conf


def _k8s_env() -> dict[str, str]:
    """A NATS pod's environment: POD_NAME, and the passwords of the Secrets gpusched-nats-server
    and gpusched-nats-routes."""
    return {**_passwords(), "POD_NAME": "nats-0", natsconf.K8S_ROUTE_PASSWORD: ROUTE_PASSWORD}


def test_nats_server_accepts_the_k8s_tls_config_with_certificates_where_it_says(tmp_path):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("nats.gpusched.svc")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    conf = _k8s_pod(tmp_path, K8S_NATS_TLS_CONFIG.read_text().replace("/etc/nats-tls/", f"{tmp_path}/"))
    env = _k8s_env()
    ok = subprocess.run([devstack._bin("nats-server"), "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    (tmp_path / "tls.key").unlink()  # the key where the configuration says is what it runs with
    bad = subprocess.run([devstack._bin("nats-server"), "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "tls.key" in bad.stderr + bad.stdout


def test_nats_server_accepts_the_k8s_configs_cluster_and_single(tmp_path):
    binary = devstack._bin("nats-server")
    env = _k8s_env()
    for replicas, path in K8S_NATS_CONFIGS.items():
        text = path.read_text()
        assert ('"sync_interval": "always"' in text) and (('"cluster": {' in text) == (replicas > 1)), path
        conf = _k8s_pod(tmp_path / str(replicas), text)
        ok = subprocess.run([binary, "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
        assert ok.returncode == 0, ok.stderr + ok.stdout


def test_the_k8s_cluster_config_takes_its_routes_and_their_password_from_the_secret(tmp_path):
    """Routes authenticate (user route, the password from the environment) and their URLs, which
    carry that password, come from the Secret's routes.conf: without either, the server names it."""
    binary = devstack._bin("nats-server")
    conf = _k8s_pod(tmp_path, K8S_NATS_CONFIGS[3].read_text())
    routes = (tmp_path / "nats-routes" / "routes.conf").read_text()
    assert f"nats://route:{ROUTE_PASSWORD}@nats-2.nats-headless.gpusched.svc:6222" in routes
    env = _k8s_env()
    del env[natsconf.K8S_ROUTE_PASSWORD]
    bad = subprocess.run([binary, "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and natsconf.K8S_ROUTE_PASSWORD in bad.stderr + bad.stdout
    (tmp_path / "nats-routes" / "routes.conf").unlink()
    bad = subprocess.run([binary, "-t", "-c", str(conf)], env=_k8s_env(), capture_output=True, text=True)
    assert bad.returncode != 0 and "routes.conf" in bad.stderr + bad.stdout


def test_the_routes_include_takes_only_a_password_nats_server_reads_back():
    for wrong in ["short1", "0123456789abcdef0123", "has space in it 0123", "with,comma0123456789", "url/unsafe+0123456"]:
        try:
            natsconf.k8s_routes_include(["h:6222"], wrong)
        except ValueError as e:
            assert "route_password" in str(e) and "accepted" in str(e)
        else:
            raise AssertionError(f"{wrong!r} accepted")
