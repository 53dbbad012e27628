"""The nats-server configuration of every deployment: the dev stack's and the tests' (one server
on loopback), deploy/nats-server.conf and the Kubernetes ones (k8s/). Built from the
permissions of gpusched.permissions; `gpusched dev nats-config` writes the committed files."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from gpusched import permissions

PROCESSES = (*permissions.SERVICES, permissions.API_USER)
"""Every process of deploy/Procfile: the services and the HTTP API (tests/unit/test_deploy.py checks they agree)."""

@dataclass
class Credentials:
    users: dict[str, str]  # user -> password

    @classmethod
    def load_or_create(cls, path: Path, teams: tuple[str, ...] = ()) -> "Credentials":
        existing = json.loads(path.read_text()) if path.exists() else {}
        wanted = ["admin", "operator", *PROCESSES, *teams]  # a tenant user is named after its team
        for user in wanted:
            existing.setdefault(user, secrets.token_urlsafe(18))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(existing, indent=2))
        path.chmod(0o600)
        return cls(existing)


def password_variable(user: str) -> str:
    return "GPUSCHED_NATS_PASSWORD_" + re.sub(r"[^A-Z0-9]", "_", user.upper())


def nats_config(port: int, store_dir: Path, creds: Credentials, *, sync_always: bool = False,
                listen_host: str = "127.0.0.1", password_refs: bool = False, extra: dict | None = None) -> str:
    """The nats-server configuration: JetStream, the platform's account and one account per team
    (gpusched.permissions.accounts), and one user per service, tenant, operator and admin with
    its permissions. ``password_refs`` writes ``$GPUSCHED_NATS_PASSWORD_<USER>`` environment
    references instead of the passwords (deploy/nats-server.conf)."""
    accounts = permissions.accounts(sorted(creds.users))
    for account in accounts.values():
        account["jetstream"] = "enabled"
        account["users"] = [{"user": user, "password": f"${password_variable(user)}" if password_refs
                             else creds.users[user], "permissions": permissions.permissions(user)}
                            for user in account["users"]]
    config = {
        "listen": f"{listen_host}:{port}",
        "server_name": "gpusched",
        "max_payload": 2 * 1024 * 1024,
        "jetstream": {
            "store_dir": str(store_dir),
            "max_file_store": 20 * 1024**3,
            "max_memory_store": 1024**3,
            # 'always' fsyncs each write: no acknowledged event is lost on power failure.
            **({"sync_interval": "always"} if sync_always else {}),
        },
        "accounts": accounts,
        **(extra or {}),
    }
    # The NATS config format accepts JSON; an environment reference is an unquoted $NAME.
    text = json.dumps(config, indent=2)
    return re.sub(r'"\$((GPUSCHED_NATS_PASSWORD_|POD_)[A-Z0-9_]+)"', r"$\1", text) if password_refs else text


CLUSTER_NAME = "gpusched"
ROUTE_USER = "route"
"""The user each server of a cluster authenticates as on the others' route port (nats-server's
``cluster.authorization``): a process that merely reaches a route port cannot join the cluster."""


def cluster_block(listen: str, routes: list[str], route_password: str | None = None) -> dict:
    """A JetStream cluster's ``cluster`` block (every server's, each with a ``server_name`` of its
    own): it listens for routes on ``listen`` and routes to each of ``routes`` (``host:port``, every
    server's, its own included: nats-server skips it). With ``route_password`` a route must
    authenticate as :data:`ROUTE_USER`, and each route URL carries the credential."""
    creds = f"{ROUTE_USER}:{route_password}@" if route_password else ""
    block: dict = {"name": CLUSTER_NAME, "listen": listen, "routes": [f"nats://{creds}{r}" for r in routes]}
    if route_password:
        block["authorization"] = {"user": ROUTE_USER, "password": route_password, "timeout": 5}
    return {"cluster": block}


def tls_block(cert: Path, key: Path, ca: Path | None = None) -> dict:
    """The server's TLS (nats-server's ``tls`` block): every client connection is TLS with this
    certificate; with ``ca``, each client must also present a certificate that CA signed."""
    block: dict = {"cert_file": str(cert), "key_file": str(key), "timeout": 5,
                   # TLS from the first byte: no client sends anything, credentials included,
                   # before the handshake (the clients connect with tls_handshake_first)
                   "handshake_first": True}
    if ca is not None:
        block.update(ca_file=str(ca), verify=True)
    return {"tls": block}


K8S_NATS = "nats"
"""The NATS StatefulSet of k8s/components/nats (headless Service nats-headless, client Service
nats, in the gpusched namespace)."""

K8S_ROUTE_PASSWORD = "GPUSCHED_NATS_ROUTE_PASSWORD"
"""The environment variable a Kubernetes NATS server reads its route password from (Secret
gpusched-nats-routes, key ``password``): the password every route must present as
:data:`ROUTE_USER` (the cluster block's ``authorization``)."""

K8S_ROUTES_INCLUDE = "../nats-routes/routes.conf"
"""Where a Kubernetes NATS server's routes are (Secret gpusched-nats-routes, key ``routes.conf``,
mounted on /etc/nats-routes): nats-server joins an ``include`` path to the directory of the file
that includes it (/etc/nats-config), so the path is relative. A route URL carries the route
password and cannot take an environment reference, so the routes come from the Secret."""


def k8s_route_hosts(replicas: int) -> list[str]:
    """Each NATS pod's route address (``host:port``) through the headless Service."""
    return [f"{K8S_NATS}-{i}.{K8S_NATS}-headless.gpusched.svc:6222" for i in range(replicas)]


def k8s_routes_include(hosts: list[str], route_password: str) -> str:
    """The text of the routes include (the Secret's ``routes.conf``): every server's route URL with
    the route user's credential. ``route_password`` goes into the URLs unescaped and into the
    environment variable :data:`K8S_ROUTE_PASSWORD`, whose value nats-server parses as a
    configuration value (digits alone are a number, a space or a comma ends it): 16 or more letters
    and digits, a letter first."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{15,}", route_password):
        raise ValueError(f"route_password: {len(route_password)} characters, not a letter followed by letters and "
                         "digits; accepted: 16 or more letters and digits, a letter first (e.g. 'r' and 48 hex digits)")
    return "routes: " + json.dumps(cluster_block("", hosts, route_password)["cluster"]["routes"], indent=2) + "\n"


def k8s_nats_config(replicas: int, teams: tuple[str, ...] = ("team-research", "team-product", "team-platform"),
                    clusters: tuple[str, ...] = (), tls: dict | None = None) -> str:
    """k8s/components/nats/nats-server.conf (``replicas`` 3: a JetStream cluster, routes between
    the StatefulSet's pods) or k8s/overlays/dev/nats-single/nats-server.conf (1: one server): the reference
    configuration (fsync always, passwords from the environment) with the pod's name as the
    server's, monitoring on 8222 for the probes."""
    executors = [f"{permissions.CLUSTER_EXECUTOR_PREFIX}{c}" for c in clusters]
    users = {u: "" for u in ["admin", "operator", *PROCESSES, *executors, *teams]}
    extra: dict = {"server_name": "$POD_NAME", "http_port": 8222, "pid_file": "/var/run/nats/nats.pid",
                   "lame_duck_duration": "30s", "lame_duck_grace_period": "10s", **(tls or {})}
    if replicas > 1:
        # The cluster block of the dev stack's and the tests' cluster (gpusched.dev.stack.NatsCluster):
        # its authorization with the password from the environment, its routes from the Secret's
        # include (k8s_routes_include), the last key of the block.
        block = cluster_block("0.0.0.0:6222", [], f"${K8S_ROUTE_PASSWORD}")["cluster"]
        del block["routes"]
        extra["cluster"] = {**block, "include": K8S_ROUTES_INCLUDE}
    flags = f"--k8s {replicas}"
    if tls:
        flags += f" --tls-cert {tls['tls']['cert_file']} --tls-key {tls['tls']['key_file']}"
        flags += f" --tls-ca {tls['tls']['ca_file']}" if "ca_file" in tls["tls"] else ""
    header = (
        f"# gpusched nats-server configuration for Kubernetes ({replicas} server{'s' if replicas > 1 else ''}), "
        f"generated by\n# `gpusched dev nats-config {flags}`\n# (do not edit: a test fails when this file and the "
        "generator disagree). Passwords come from the\n# environment (Secret gpusched-nats-server); the server's name "
        "is its pod's.\n")
    if replicas > 1:
        header += (f"# The routes' password comes from ${K8S_ROUTE_PASSWORD} and the routes from {K8S_ROUTES_INCLUDE}\n"
                   "# (Secret gpusched-nats-routes, keys password and routes.conf: docs/operations.md).\n")
    text = nats_config(4222, Path("/data/jetstream"), Credentials(users), sync_always=True,
                       listen_host="0.0.0.0", password_refs=True, extra=extra)
    # nats-server's include directive and an environment reference are unquoted
    text = text.replace(f'"${K8S_ROUTE_PASSWORD}"', f"${K8S_ROUTE_PASSWORD}")
    text = text.replace(f'"include": "{K8S_ROUTES_INCLUDE}"', f'include "{K8S_ROUTES_INCLUDE}"')
    return header + text + "\n"


def reference_nats_config(teams: tuple[str, ...] = ("team-research", "team-product", "team-platform"),
                          clusters: tuple[str, ...] = (), tls: dict | None = None) -> str:
    """deploy/nats-server.conf: production settings (fsync always), passwords from the environment;
    with ``clusters``, a credential ``executor-<cluster>`` for each cluster's executor; ``tls``:
    :func:`tls_block`."""
    executors = [f"{permissions.CLUSTER_EXECUTOR_PREFIX}{c}" for c in clusters]
    users = {u: "" for u in ["admin", "operator", *PROCESSES, *executors, *teams]}
    header = (
        "# gpusched nats-server configuration, generated by `gpusched dev nats-config` (do not edit:\n"
        "# a test fails when this file and the generator disagree). Each password is read from the\n"
        "# environment variable named in it. Each team is an account of its own (TEAM_<team>): add a\n"
        "# team by generating this file again with --team for every team, never by adding a user here.\n"
    )
    return header + nats_config(4222, Path("/data/jetstream"), Credentials(users), sync_always=True,
                                listen_host="0.0.0.0", password_refs=True, extra=tls) + "\n"
