"""Shared fixtures: a real nats-server (JetStream, temp store, free port) and a real Postgres,
both from the project's wheels, started once per test session; a clean event log and a fresh
database for each test that asks for one."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats
import pytest
import pytest_asyncio

from gpusched.dev import stack as devstack
from runtime import eventlog
from runtime.settings import Settings

TEST_TEAMS = ("team-a", "team-b", "team-c")


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> devstack.NatsServer:
    server = devstack.NatsServer(tmp_path_factory.mktemp("nats"), teams=TEST_TEAMS, clusters=("east",)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory) -> devstack.NatsCluster:
    """A JetStream cluster of three nats-servers on loopback (routes between them, a store each,
    the same accounts and users as :func:`nats_server`); its ``env()`` gives a process every
    server's URL and GPUSCHED_STREAM_REPLICAS=3. A test may kill a server (``kill(i)``) and must
    start it again (``start()``)."""
    cluster = devstack.NatsCluster(tmp_path_factory.mktemp("nats-cluster"), size=3, teams=TEST_TEAMS,
                                   clusters=("east",)).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def postgres(tmp_path_factory) -> devstack.Postgres:
    server = devstack.Postgres(tmp_path_factory.mktemp("pg"), fsync=False).start()
    yield server
    server.stop()


async def connect_as(server: devstack.NatsServer | devstack.NatsCluster, user: str, **options) -> nats.NATS:
    """A client as ``user``, with its own inbox prefix (the only inbox its permissions allow); to
    a cluster, with every server's URL."""
    return await nats.connect(server.urls(), user=user, password=server.creds.users[user], connect_timeout=5,
                              inbox_prefix=eventlog.inbox_prefix(user), **options)


async def reset_log(js, *, immutable: bool = True, replicas: int = 1) -> None:
    """Empty streams, provisioned as `gpusched init` does (``immutable`` False: messages may be
    deleted, for a test that needs a gap in the log; ``replicas``: on a cluster)."""
    for stream in (eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM):
        with contextlib.suppress(Exception):
            await js.delete_stream(stream)
    for team in TEST_TEAMS:  # in the team's own account
        with contextlib.suppress(Exception):
            await eventlog.tenant_js(js, team).delete_stream(eventlog.tenant_stream(team))
    await eventlog.provision(js, eventlog.StreamLimits(immutable=immutable, replicas=replicas), teams=TEST_TEAMS)


@pytest_asyncio.fixture
async def admin_js(nats_server) -> AsyncIterator:
    """JetStream as the admin user, over freshly provisioned (empty) streams."""
    nc = await connect_as(nats_server, "admin")
    js = nc.jetstream()
    await reset_log(js)
    yield js
    await nc.close()


@pytest_asyncio.fixture
async def pg_dsn(postgres) -> AsyncIterator[str]:
    """A fresh, empty database for one test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres.dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    yield postgres.dsn.rsplit("/", 1)[0] + f"/{name}"


def service_settings(server: devstack.NatsServer | devstack.NatsCluster, user: str, **overrides) -> Settings:
    base = dict(nats_url=server.url(), nats_user=user, nats_password=server.creds.users[user], tick_s=0.05,
                stream_replicas=getattr(server, "replicas", 1))
    base.update(overrides)
    return Settings(**base)


@contextlib.asynccontextmanager
async def running(service) -> AsyncIterator:
    """Run a service object with ``run()``/``stop()`` as a task for the duration of a block."""
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        service.stop()
        try:
            await asyncio.wait_for(task, 10)
        except asyncio.TimeoutError:
            task.cancel()


async def eventually(predicate, timeout_s: float = 15.0, interval_s: float = 0.05):
    """Poll an async or sync predicate until it returns a truthy value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).parent
