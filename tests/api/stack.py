"""The whole platform as processes with the HTTP API in front, for the API, console, SDK and
notebook tests: its own nats-server (so other tests' stream resets never reach it), a database
of the session's Postgres, two teams with a queue each, and a token of every role."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import nats

from gpusched.dev import stack as devstack
from gpusched.api import tokens
from runtime import eventlog
from schemas.auth import Role
from tests.unit.builders import queue

TEAMS = ("team-a", "team-b")
CLUSTER = ("groups:\n"
           "  - {prefix: node, count: 2, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 81920}\n")
TIME_SCALE = 20.0
HOLDERS = {  # token name -> (role, team)
    "alice": (Role.MEMBER, "team-a"),
    "bob": (Role.MEMBER, "team-b"),
    "ops": (Role.OPERATOR, None),
    "money": (Role.CHARGEBACK, None),
    "root": (Role.ADMIN, None),
}


@dataclass
class ApiStack:
    root: Path
    postgres: devstack.Postgres
    nats_server: devstack.NatsServer | None = None
    procs: devstack.ServiceProcesses | None = None
    dsn: str = ""
    url: str = ""
    tokens: dict[str, str] = field(default_factory=dict)  # holder name -> token
    metrics_ports: dict[str, int] = field(default_factory=dict)  # process -> its Prometheus port
    # A recorded history appended in place of the default queues, and the processes to start
    # (default: all); with only accounting and the API nothing but that history is in the log.
    history: list | None = None
    processes: tuple[str, ...] = ()
    # Another platform than the default's (the console screens' demo stack): more teams' NATS
    # accounts, another sim cluster, another time scale.
    teams: tuple[str, ...] = TEAMS
    cluster: str = CLUSTER
    time_scale: float = TIME_SCALE

    def start(self) -> "ApiStack":
        try:
            return self._start()
        except BaseException:
            self.stop()  # nothing started may outlive a failed start
            raise

    def _start(self) -> "ApiStack":
        self.nats_server = devstack.NatsServer(self.root / "nats", teams=self.teams).start()
        self.dsn = asyncio.run(self._database())
        asyncio.run(self._provision())
        cluster = self.root / "cluster.yaml"
        cluster.write_text(self.cluster)
        port, *metrics = devstack.free_ports(1 + len(devstack.PROCESSES))
        self.metrics_ports = dict(zip(devstack.PROCESSES, metrics))
        env = devstack.service_env(self.nats_server.env, self.dsn, cluster=cluster, time_scale=self.time_scale,
                                   epoch=time.time(), api_port=port, metrics_ports=self.metrics_ports,
                                   extra={"GPUSCHED_TICK_S": "0.05", "GPUSCHED_API_STREAM_MAX_S": "2"})
        self.procs = devstack.ServiceProcesses(self.root / "logs", env)
        for name in self.processes or tuple(env):
            self.procs.start(name)
        self.url = f"http://127.0.0.1:{port}"
        devstack.wait_for_port(port, timeout_s=60, proc=self.procs.procs["api"])
        self.tokens = asyncio.run(self._issue_tokens())
        return self

    def stop(self) -> list[str]:
        """Stop everything; the services whose logs hold a traceback."""
        crashed = []
        if self.procs is not None:
            self.procs.stop_all()
            for name in self.procs.procs:
                log = self.root / "logs" / f"{name}.log"
                if log.exists() and "Traceback" in log.read_text():
                    crashed.append(name)
        if self.nats_server is not None:
            self.nats_server.stop()
        return crashed

    def log(self, name: str) -> str:
        return (self.root / "logs" / f"{name}.log").read_text()

    def client(self, holder: str | None = None, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.tokens[holder]}"} if holder else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)

    async def admin(self) -> nats.NATS:
        assert self.nats_server is not None
        return await nats.connect(self.nats_server.url(), user="admin", password=self.nats_server.creds.users["admin"],
                                  inbox_prefix=eventlog.inbox_prefix("admin"))

    async def _database(self) -> str:
        name = f"api_{uuid.uuid4().hex[:12]}"
        conn = await asyncpg.connect(self.postgres.dsn)
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()
        return self.postgres.dsn.rsplit("/", 1)[0] + f"/{name}"

    async def _provision(self) -> None:
        nc = await self.admin()
        js = nc.jetstream()
        await eventlog.provision(js, teams=self.teams)
        log = eventlog.EventLog(js)
        for event in self.history if self.history is not None else [queue(f"q-{team}", (team,), {"a100": 8})
                                                                       for team in TEAMS]:
            await log.append(event)
        await nc.close()

    async def _issue_tokens(self) -> dict[str, str]:
        nc = await self.admin()
        log = eventlog.EventLog(nc.jetstream())
        out = {}
        for holder, (role, team) in HOLDERS.items():
            minted = tokens.mint()
            await log.append(tokens.issued(minted, name=holder, role=role, team=team, issued_by="admin",
                                           now=datetime.now(UTC)))
            out[holder] = minted.token
        await nc.close()
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            while True:  # accounting has projected them when the API knows every one
                codes = [(await client.get("/v1/whoami", headers={"Authorization": f"Bearer {t}"})).status_code
                         for t in out.values()]
                if all(c == 200 for c in codes):
                    return out
                if time.monotonic() > deadline:
                    raise AssertionError(f"tokens not usable within 60 s: {codes}\n{self.log('api')[-3000:]}")
                await asyncio.sleep(0.2)


def job_document(job_id: str | None, team: str, *, gpus: int = 1, runtime_s: float = 20, queue_name: str | None = None,
                 **spec) -> dict:
    doc = {"spec": {"kind": "training", "queue": queue_name or f"q-{team}", "team": team, "image": "img", "gpus": gpus,
                    "gpu_flavors": ["a100"], "expected_runtime_seconds": runtime_s, **spec}}
    if job_id is not None:
        doc["job_id"] = job_id
    return doc


def dumps(doc: dict) -> str:
    return json.dumps(doc)
