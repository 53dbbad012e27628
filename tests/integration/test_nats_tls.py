"""TLS to NATS against a real nats-server that requires it (`gpusched dev nats-config --tls-*`'s
block): the services (runtime.eventlog.connect), the CLI and a rebuild's writer processes connect
with GPUSCHED_NATS_TLS_CA, and with a client certificate where the server verifies clients; a
client that does not trust the server's CA, or brings no certificate, is refused. What a remote
cluster's executor needs to reach the platform's NATS across networks (docs/operations.md, "TLS")."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import trustme

from conftest import eventually, service_settings
from gpusched import devstack
from gpusched.connection import Connection
from gpusched.userinput import UserError
from runtime import eventlog
from runtime.settings import ConfigError, NatsTls
from services.accounting import __main__ as accounting
from services.accounting import replay, sink
from tests.integration.test_accounting import lifecycle


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the server's certificate (127.0.0.1) and a client's, as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("executor-east.gpusched")
    paths = {"ca": root / "ca.pem", "cert": root / "server.pem", "key": root / "server.key",
             "client_cert": root / "client.pem", "client_key": root / "client.key"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    other = root / "other-ca.pem"  # a CA that signed nothing here
    trustme.CA().cert_pem.write_to_path(str(other))
    paths["other_ca"] = other
    return paths


@contextlib.contextmanager
def tls_server(tmp_path, pki, *, verify_clients: bool = False):
    block = devstack.tls_block(pki["cert"], pki["key"], pki["ca"] if verify_clients else None)
    server = devstack.NatsServer(tmp_path / "nats", clusters=("east",), tls=block).start()
    try:
        yield server
    finally:
        server.stop()


def cli_env(monkeypatch, server, user: str, **tls) -> None:
    monkeypatch.setenv("GPUSCHED_NATS_URL", server.url())
    monkeypatch.setenv("GPUSCHED_NATS_USER", user)
    monkeypatch.setenv("GPUSCHED_NATS_PASSWORD", server.creds.users[user])
    monkeypatch.setenv("GPUSCHED_CONNECTION_FILE", "/nonexistent")
    for var in ("CA", "CERT", "KEY"):
        monkeypatch.delenv(f"GPUSCHED_NATS_TLS_{var}", raising=False)
    for name, path in tls.items():
        monkeypatch.setenv(f"GPUSCHED_NATS_TLS_{name.upper()}", str(path))


async def test_services_the_cli_and_a_rebuild_connect_with_the_servers_ca(tmp_path, pki, pg_dsn, monkeypatch):
    with tls_server(tmp_path, pki) as server:
        admin = await eventlog.connect(service_settings(server, "admin", nats_tls=NatsTls(ca=pki["ca"])), "test-admin")
        try:
            js = admin.jetstream()
            await eventlog.provision(js)
            log = eventlog.EventLog(js)
            for e in lifecycle("t1", gpus=2, runtime_s=100):
                await log.append(e)
            # a service over TLS: accounting projects the log
            stop = asyncio.Event()
            settings = service_settings(server, "accounting", pg_dsn=pg_dsn, nats_tls=NatsTls(ca=pki["ca"]))
            task = asyncio.create_task(accounting.run(settings, stop))
            try:
                await eventually(lambda: _position(pg_dsn, 6))
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)
            # the CLI, and a rebuild whose writer processes connect on their own
            cli_env(monkeypatch, server, "operator", ca=pki["ca"])
            nc = await Connection.resolve().nats()
            try:
                assert await eventlog.last_sequence(nc.jetstream()) == 6
                progress = await replay.rebuild(nc, pg_dsn, "over_tls")
                assert progress.applied == 6
            finally:
                await nc.close()
            # not trusting the server's CA (the system's store, or another CA): refused
            for tls in ({}, {"ca": pki["other_ca"]}):
                cli_env(monkeypatch, server, "operator", **tls)
                with pytest.raises(UserError, match="cannot connect to NATS .*certificate verify failed"):
                    await Connection.resolve().nats()
        finally:
            await admin.close()
        assert "TLS handshake error" in (tmp_path / "nats" / "nats.log").read_text()


async def test_a_server_that_verifies_clients_takes_only_certificates_its_ca_signed(tmp_path, pki, monkeypatch):
    with tls_server(tmp_path, pki, verify_clients=True) as server:
        cli_env(monkeypatch, server, "executor-east", ca=pki["ca"])
        with pytest.raises(UserError, match="cannot connect to NATS"):
            await Connection.resolve().nats()  # no client certificate
        cli_env(monkeypatch, server, "executor-east", ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"])
        nc = await Connection.resolve().nats()
        try:
            assert nc.is_connected and nc.client_id is not None
        finally:
            await nc.close()


@pytest.mark.parametrize(("env", "message"), [
    ({"CERT": "client_cert"}, "GPUSCHED_NATS_TLS_CERT and GPUSCHED_NATS_TLS_KEY go together"),
    ({"CA": "/nonexistent/ca.pem"}, "GPUSCHED_NATS_TLS_CA='/nonexistent/ca.pem' is not a readable file"),
])
def test_tls_settings_say_what_is_wrong(pki, monkeypatch, env, message):
    for var in ("CA", "CERT", "KEY"):
        monkeypatch.delenv(f"GPUSCHED_NATS_TLS_{var}", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(f"GPUSCHED_NATS_TLS_{var}", str(pki.get(value, value)))
    with pytest.raises(ConfigError, match=message):
        NatsTls.from_env()


async def _position(dsn: str, seq: int) -> bool:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT to_regclass('projection_position') IS NOT NULL") and \
            await sink.complete_position(conn) >= seq
    finally:
        await conn.close()
