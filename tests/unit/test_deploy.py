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


def test_nats_server_accepts_the_k8s_tls_config_with_certificates_where_it_says(tmp_path):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("nats.gpusched.svc")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    conf = tmp_path / "nats.conf"
    conf.write_text(K8S_NATS_TLS_CONFIG.read_text().replace("/etc/nats-tls/", f"{tmp_path}/"))
    env = {**_passwords(), "POD_NAME": "nats-0"}
    ok = subprocess.run([devstack._bin("nats-server"), "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    (tmp_path / "tls.key").unlink()  # the key where the configuration says is what it runs with
    bad = subprocess.run([devstack._bin("nats-server"), "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "tls.key" in bad.stderr + bad.stdout


def test_nats_server_accepts_the_k8s_configs_cluster_and_single():
    binary = devstack._bin("nats-server")
    env = {**_passwords(), "POD_NAME": "nats-0"}
    for replicas, path in K8S_NATS_CONFIGS.items():
        text = path.read_text()
        assert ('"sync_interval": "always"' in text) and (("routes" in text) == (replicas > 1)), path
        ok = subprocess.run([binary, "-t", "-c", str(path)], env=env, capture_output=True, text=True)
        assert ok.returncode == 0, ok.stderr + ok.stdout
    assert "nats://nats-2.nats-headless.gpusched.svc:6222" in K8S_NATS_CONFIGS[3].read_text()
