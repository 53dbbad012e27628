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
from gpusched.dev import natsconf
from gpusched.dev import stack as devstack
from gpusched.gateway.connection import Connection
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
    block = natsconf.tls_block(pki["cert"], pki["key"], pki["ca"] if verify_clients else None)
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
            # without TLS (the server waits for a handshake that never comes), or trusting another CA: refused
            for tls, says in (({}, "TimeoutError"), ({"ca": pki["other_ca"]}, "certificate verify failed")):
                cli_env(monkeypatch, server, "operator", **tls)
                with pytest.raises(UserError, match=f"cannot connect to NATS .*{says}"):
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


async def test_a_service_that_cannot_verify_the_server_says_so_and_keeps_trying(tmp_path, pki, monkeypatch, caplog):
    """A wrong CA at a service's start: each try is bounded (nats-py may otherwise wait for ever
    closing the refused socket), the refusal is logged as a TLS one, and the service tries again."""
    monkeypatch.setattr(eventlog, "CONNECT_ATTEMPT_S", 2.0)
    with tls_server(tmp_path, pki) as server:
        task = asyncio.create_task(eventlog.connect(
            service_settings(server, "quota", nats_tls=NatsTls(ca=pki["other_ca"])), "test-quota"))
        try:
            await eventually(lambda: len([r for r in caplog.records if "TLS handshake failed" in r.getMessage()]) >= 2,
                             timeout_s=30)
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_client_with_tls_never_goes_on_in_plain_text(nats_server, pki, monkeypatch):
    """A client with GPUSCHED_NATS_TLS_* starts with the TLS handshake (tls_handshake_first):
    against a server that answers in plain text (what a server without TLS, or anything posing
    as one, does) it is refused before it sends its user and password."""
    cli_env(monkeypatch, nats_server, "operator", ca=pki["ca"])
    with pytest.raises(UserError, match="cannot connect to NATS"):
        await Connection.resolve().nats()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(eventlog.connect(service_settings(nats_server, "quota", nats_tls=NatsTls(ca=pki["ca"])),
                                                "test-quota"), 3)


async def test_the_apis_broker_connects_over_tls(tmp_path, pki):
    """The API's FastStream broker (its intake publishes and answer subscriptions) with the same
    settings as every other client."""
    from gpusched.api.bus import new_broker

    with tls_server(tmp_path, pki) as server:
        broker = new_broker(service_settings(server, "api", nats_tls=NatsTls(ca=pki["ca"])))
        client = await asyncio.wait_for(broker.connect(), 10)
        try:
            # (nats-py keeps its transport's stream writer private: the one way to see the TLS layer)
            assert client.is_connected and client._transport._io_writer.get_extra_info("ssl_object") is not None
        finally:
            await broker.stop()


@pytest.mark.parametrize(("env", "message"), [
    ({"CERT": "client_cert"}, "GPUSCHED_NATS_TLS_CERT and GPUSCHED_NATS_TLS_KEY go together"),
    ({"CA": "/nonexistent/ca.pem"}, "GPUSCHED_NATS_TLS_CA='/nonexistent/ca.pem' is not a readable file"),
    ({"CA": "/tmp"}, "GPUSCHED_NATS_TLS_CA='/tmp' is not a readable file"),  # a directory
    ({"CA": "key"}, "cannot be loaded"),  # not a certificate
    ({"CERT": "client_cert", "KEY": "key"}, "cannot be loaded"),  # another certificate's key
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
