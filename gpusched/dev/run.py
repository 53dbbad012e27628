"""`make run`: the whole platform on this machine, with a demo workload and a live summary.

NATS and Postgres are started from their wheels unless GPUSCHED_NATS_URL / GPUSCHED_PG_DSN
point at external ones. Data stays in ``.data/`` so a second run continues where the first
stopped, on the same clock (``run/clock.json``); a fresh one's platform clock starts 6 platform
hours before a month's end (``--clock-start``, :func:`plan_clock`), so a month closes, and its
statements are issued, minutes in. Services that die are restarted (they rebuild from the log). The supervisor outlives its
dependencies: while NATS or Postgres is away the summary says so and it reconnects; a nats-server
or Postgres it started itself that died is started again, on the same port and data.

Ports: the API's and the services' metrics sockets are bound here, first, and inherited by the
processes (gpusched.dev.stack.Listeners); the connection file is written only once everything it
names is held, and removed when the run ends. A port another process holds (the API's
GPUSCHED_API_PORT, or NATS's or Postgres's when one of them is started again) ends the run with
the reason and exit status 4 (runtime.observability.EXIT_CANNOT_LISTEN) instead of a restart loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

import asyncpg
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gpusched.gateway import commands
from gpusched.gateway import connection
from gpusched.dev import clusters as devclusters
from gpusched.dev import stack as devstack
from gpusched.gateway import history
from gpusched.config import pricebook
from gpusched.config import queues as queueconfig
from gpusched.api import tokens
from gpusched.api.__main__ import API_FD
from gpusched.errors import UserError
from gpusched.permissions import API_USER, CLUSTER_EXECUTOR_PREFIX
from runtime import eventlog, observability
from runtime.clock import ScaledClock
from runtime.settings import NatsTls, Settings
from schemas import JobSpec, SubmitJob
from schemas.auth import Role
from schemas.job import JobKind
from schemas.jobstate import JobState
from services.accounting import queries
from services.executor.cluster import ClusterSpec, load_cluster  # the dev stack runs the sim clusters it loads

console = Console(width=None if Console().is_terminal else 150)
TEAMS = ("team-research", "team-product", "team-platform")
QUEUE_OF = {"team-research": "research", "team-product": "product", "team-platform": "platform"}


def example(name: str) -> Path:
    return Path(str(resources.files("gpusched.examples") / name))


def demo_workload(n: int, seed: int = 7) -> list[tuple[float, SubmitJob]]:
    """(delay before it, command): a mixed, reproducible workload for three teams."""
    return list(itertools.islice(demo_stream(seed), n))


def demo_stream(seed: int = 7) -> Iterator[tuple[float, SubmitJob]]:
    """:func:`demo_workload` without an end: job ``demo-<i>`` is the same in both."""
    rng = random.Random(seed)
    shapes = {
        "team-research": [("h100-80gb", 8, JobKind.TRAINING), ("a100-40gb", 4, JobKind.TRAINING),
                          ("a100-40gb", 1, JobKind.EVALUATION), ("h100-80gb", 2, JobKind.TRAINING)],
        "team-product": [("l4", 1, JobKind.INFERENCE), ("l4", 2, JobKind.INFERENCE), ("h100-80gb", 4, JobKind.TRAINING),
                         ("l4", 1, JobKind.INFERENCE, 250)],  # a quarter of one shared L4 (gpu_milli)
        "team-platform": [("a100-40gb", 2, JobKind.BATCH), ("l4", 1, JobKind.BATCH), ("a100-40gb", 8, JobKind.TRAINING)],
    }
    for i in itertools.count():
        team = TEAMS[i % 3]
        shape = rng.choice(shapes[team])
        flavor, gpus, kind = shape[:3]
        milli = shape[3] if len(shape) > 3 else None  # thousandths of one GPU
        annotations = {}
        if i % 17 == 5:  # a flaky job: first attempt fails on a lost node, the retry succeeds
            annotations = {"sim.gpusched.io/exit-code": "1", "sim.gpusched.io/fail-attempts": "1",
                           "sim.gpusched.io/failure-reason": "node-lost"}
        spec = JobSpec(
            kind=kind, queue=QUEUE_OF[team] if i % 23 != 11 else "no-such-queue", team=team,
            project=rng.choice(["llm", "vision", "ranking"]),
            priority_class="inference-sla" if kind == JobKind.INFERENCE else "training",
            image="registry.example/train:latest", command=("python", "train.py"),
            gpus=gpus, gpu_milli=milli, gpu_flavors=(flavor,), expected_runtime_seconds=rng.choice([600, 1200, 1800, 3600]),
            retry={"max_attempts": 3, "backoff_seconds": 60}, annotations=annotations,
        )
        yield rng.uniform(0.05, 0.6), SubmitJob(job_id=f"demo-{i:04d}", on_behalf_of=f"{team}-bot", spec=spec)


DEMO_TRICKLE_S = 3600.0
"""After its first ``--demo-jobs`` (a burst), the demo submits the stream's next job every this
many platform seconds (30 wall s at 120x) for as long as it runs: the log's time keeps moving, and
accounting closes a month (issues its statements) only once events logged past its end plus
GPUSCHED_STATEMENT_GRACE_S say so (services/accounting/statements.py), not on the clock alone."""


async def _submit_demo(js, stream: Iterator[tuple[float, SubmitJob]], burst: int, trickle_s: float,
                       stop: asyncio.Event) -> None:
    """The example inference service, the stream's first ``burst`` jobs at their own short delays,
    then one every ``trickle_s`` wall seconds until ``stop``."""
    # the example inference service, once (a second run's deploy of the same spec records nothing)
    deploy = commands.deploy_command_from_file(example("service.yaml"))
    await _publish_until_stored(js, deploy.model_copy(update={"on_behalf_of": "team-product-bot"}), stop,
                                team=deploy.spec.team, verb="deploy", msg_id="demo-deploy:chat")
    for i, (delay, command) in enumerate(stream):
        if stop.is_set():
            return
        await asyncio.sleep(delay if i < burst else trickle_s)
        await _publish_until_stored(js, command, stop, team=command.spec.team, verb="submit",
                                    msg_id=f"demo-submit:{command.job_id}")


async def _publish_until_stored(js, command, stop: asyncio.Event, *, team: str, verb: str, msg_id: str) -> None:
    """Publish, again while NATS is away; the message id makes a repeat of a stored one a no-op."""
    failures = 0
    while not stop.is_set():
        try:
            await commands.publish_command(js, team, verb, command, headers={"Nats-Msg-Id": msg_id})
            return
        except eventlog.BROKER_ERRORS:
            failures += 1
            await asyncio.sleep(eventlog.retry_delay(failures))


@dataclass
class Dependencies:
    """NATS and Postgres as the supervisor sees them: the pieces the dev stack started itself
    (restarted when they die), a Postgres connection for the summary (reconnected when lost), and
    what it noticed, in order (shown in the summary)."""

    started: list  # devstack.NatsServer / devstack.Postgres this run started
    pg_connect: Callable[[], Awaitable[asyncpg.Connection]]
    conn: asyncpg.Connection | None = None
    notes: list[str] = field(default_factory=list)
    down: set[str] = field(default_factory=set)  # "NATS", "Postgres": unreachable right now

    def note(self, text: str) -> None:
        if not self.notes or self.notes[-1] != text:
            self.notes.append(text)

    def mark(self, name: str, up: bool) -> None:
        if up and name in self.down:
            self.down.discard(name)
            self.note(f"{name} back")
        elif not up and name not in self.down:
            self.down.add(name)
            self.note(f"{name} down")

    async def revive(self) -> None:
        """Start again each piece this run started that has died (same port, same data)."""
        for piece in self.started:
            if piece.alive():
                continue
            name = piece_name(piece)
            self.mark(name, False)
            try:
                await asyncio.to_thread(piece.start)
                self.note(f"{name} restarted")
            except observability.CannotListen:  # another process has its port: our clients must not reach it
                raise
            except Exception as err:  # still shutting down, ...: try again next tick
                self.note(f"{name} restart failed ({err}); retrying")

    async def postgres(self) -> asyncpg.Connection | None:
        """The summary's connection, made again if it was lost; None while Postgres is away."""
        if self.conn is not None and not self.conn.is_closed():
            return self.conn
        try:
            self.conn = await asyncio.wait_for(self.pg_connect(), 5)
        except Exception:  # refused, timed out, not ready yet (the CLI's connection says UserError)
            self.conn = None
        return self.conn

    def lost_postgres(self) -> None:
        if self.conn is not None:
            self.conn.terminate()
        self.conn = None

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.terminate()


def piece_name(piece) -> str:
    return "NATS" if isinstance(piece, (devstack.NatsServer, devstack.NatsCluster)) else "Postgres"


@dataclass(frozen=True)
class Layout:
    """The stack's clusters: name -> its spec ({"": spec}: one unnamed cluster)."""

    specs: dict[str, ClusterSpec]
    single_file: Path | None = None  # the spec file of the one unnamed cluster

    @property
    def named(self) -> tuple[str, ...]:
        return tuple(name for name in self.specs if name)

    def capacity(self, lost: Collection[str] = ()) -> int:
        """The GPUs of the clusters not ``lost``."""
        return sum(devclusters.gpus(spec) for name, spec in self.specs.items() if name not in lost)


def _cluster_line(layout: Layout, reports: list[dict], procs: devstack.ServiceProcesses) -> str:
    """``clusters: east 20 GPUs reporting (executor pid 123) · west 20 GPUs LOST (<reason>) (executor stopped)``."""
    by_name = {r["name"]: r for r in reports}
    parts = []
    for name in layout.named:
        report = by_name.get(name)
        state = "not reported yet" if report is None else (
            f"LOST ({report['lost_reason']})" if report["lost_at"] is not None else "reporting")
        proc = procs.procs.get(f"{CLUSTER_EXECUTOR_PREFIX}{name}")
        executor = ("stopped" if f"{CLUSTER_EXECUTOR_PREFIX}{name}" in procs.stopped
                    else "down" if proc is None or proc.poll() is not None else f"pid {proc.pid}")
        parts.append(f"{name} {devclusters.gpus(layout.specs[name])} GPUs {state} (executor {executor})")
    return "clusters: " + " · ".join(parts)


def _summary(counts: list[dict], procs: devstack.ServiceProcesses, restarts: dict[str, int],
             last_seq: int | None, usage: list[dict], capacity: int, running_gpus: int,
             deps: Dependencies | None = None, clusters: str = "") -> Table:
    states = [s.value for s in JobState if s not in (JobState.PREEMPTING, JobState.CANCELLING)]  # brief states left out
    events = "? events (NATS down)" if last_seq is None else f"{last_seq} events"
    table = Table(title=f"gpusched — {events} in the log — GPUs busy {running_gpus}/{capacity}")
    table.add_column("team")
    for s in states:
        table.add_column(s, justify="right")
    table.add_column("GPU-h", justify="right")
    gpu_hours = {}
    for u in usage:
        gpu_hours[u["team"]] = gpu_hours.get(u["team"], 0) + float(u["gpu_hours"])
    teams = sorted({c["team"] for c in counts})
    for team in teams:
        row = {c["state"]: c["n"] for c in counts if c["team"] == team}
        table.add_row(team, *(str(row.get(s, "")) for s in states), f"{gpu_hours.get(team, 0):.1f}")
    alive = ", ".join(
        f"{name}{'' if p.poll() is None else ' (stopped)' if name in procs.stopped else ' (down)'}"
        f"{f' ↻{restarts[name]}' if restarts.get(name) else ''}"
        for name, p in procs.procs.items()
    )
    down = "".join(f"    {name} down, reconnecting" for name in sorted(deps.down)) if deps else ""
    table.caption = f"services: {alive}{down}    (Ctrl-C stops everything)" + (f"\n{clusters}" if clusters else "")
    return table


async def _main(data_dir: Path, time_scale: float, demo: bool, demo_jobs: int, duration: float,
                cluster_names: tuple[str, ...], cluster_file: Path | None, nats_cluster: int = 1,
                clock_start: str | None = None) -> int:
    started: list = []  # NATS and Postgres, if we started them: stopped whatever happens
    listeners = devstack.Listeners()  # held from the start to the end
    run_dir = data_dir.resolve() / "run"
    _forget_connection(run_dir)  # a crashed run's: it names ports nothing of ours holds
    try:
        layout = _layout(cluster_names, cluster_file, run_dir)
        _check_nats_layout(nats_cluster, data_dir.resolve())
        # Before anything starts: an API port asked for (GPUSCHED_API_PORT) and taken ends the run here.
        listeners.hold_metrics(devstack.process_names(layout.named, api=True))
        listeners.hold(API_USER, API_FD, _api_listener())
        return await _run(data_dir.resolve(), time_scale, demo, demo_jobs, duration, started, listeners, layout,
                          nats_cluster, clock_start)
    except UserError as err:
        console.print(f"gpusched dev up: {err}", style="red", markup=False, soft_wrap=True)
        return 2
    except observability.CannotListen as err:
        console.print(f"gpusched dev up: {err}", style="red", markup=False, soft_wrap=True)
        return observability.EXIT_CANNOT_LISTEN
    finally:
        for piece in reversed(started):
            piece.stop()
        listeners.close()
        _forget_connection(run_dir)


NATS_CLUSTER_DIR = "nats-cluster"
"""Where a run with --nats-cluster keeps its servers' stores (``n0``, ``n1``, ...), beside the one
server's ``nats``."""


def _check_nats_layout(size: int, data_dir: Path) -> None:
    """A data directory keeps the log of the broker it ran with, and Postgres's read models of that
    log: a run with another broker (one server after a cluster, a cluster after one server, a
    cluster of another size) would start on an empty log under read models of another. Refused,
    as is --nats-cluster with external NATS (GPUSCHED_NATS_URL)."""
    if size < 1:
        raise UserError(f"--nats-cluster {size}: accepted: 1 (one nats-server) to 5 servers (3: the usual cluster)")
    if size > 1 and os.environ.get("GPUSCHED_NATS_URL"):
        raise UserError(f"--nats-cluster {size} starts its own nats-servers, but GPUSCHED_NATS_URL names external "
                        "ones; accepted: one of them (unset GPUSCHED_NATS_URL, or leave out --nats-cluster)")
    single = data_dir / "nats" / "jetstream"
    members = sorted(p.name for p in (data_dir / NATS_CLUSTER_DIR).glob("n[0-9]*") if (p / "jetstream").is_dir())
    if size == 1 and members:
        raise UserError(f"{data_dir} holds a platform that ran on a cluster of {len(members)} nats-servers (its log "
                        f"is in {data_dir / NATS_CLUSTER_DIR}); accepted: --nats-cluster {len(members)}, another data "
                        "directory (--data-dir), or this one deleted first")
    if size > 1 and single.is_dir():
        raise UserError(f"--nats-cluster {size}: {data_dir} holds a platform that ran on one nats-server (its log is "
                        f"in {single.parent}), whose read models would face an empty log; accepted: another data "
                        f"directory (`--data-dir .data/nats-cluster`; with make: ARGS=\"--data-dir .data/nats-cluster "
                        f"--nats-cluster {size}\"), this one deleted first, or no --nats-cluster")
    if size > 1 and members and len(members) != size:
        raise UserError(f"--nats-cluster {size}: {data_dir} holds a platform that ran on a cluster of {len(members)} "
                        f"nats-servers; accepted: --nats-cluster {len(members)}, another data directory "
                        "(--data-dir), or this one deleted first")


def _layout(names: tuple[str, ...], cluster_file: Path | None, run_dir: Path) -> Layout:
    """The clusters this run starts (:mod:`gpusched.dev.clusters`). A data directory that ran one
    unnamed cluster cannot run named ones: the unnamed executor's nodes would stay registered
    with nobody to run what is placed there (docs/executor.md, "Many clusters")."""
    specs = devclusters.plan(names, cluster_file, example("cluster.yaml"))
    if specs is None:
        single = devclusters.single_spec(cluster_file, example("cluster.yaml"))
        return Layout({"": load_cluster(single)}, single)
    record = run_dir / "clusters.json"
    ran = json.loads(record.read_text()) if record.exists() else None
    if (run_dir / "clock.json").exists() and not ran:
        raise UserError(f"--clusters {','.join(specs)}: {run_dir.parent} holds a platform that ran one unnamed "
                        "cluster, whose nodes would stay registered with no executor to run them; accepted: "
                        "another data directory (`--data-dir .data/many-clusters`; with make: "
                        "ARGS=\"--data-dir .data/many-clusters\"), this one deleted first, or no --clusters")
    return Layout(specs)


async def _run(data_dir: Path, time_scale: float, demo: bool, demo_jobs: int, duration: float, started: list,
               listeners: devstack.Listeners, layout: Layout, nats_cluster: int = 1,
               clock_start: str | None = None) -> int:
    run_dir = data_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = layout.single_file or example("cluster.yaml")
    spec_files: dict[str, Path] = {}
    for name in layout.named:  # each cluster's executor reads its spec from a file
        spec_files[name] = run_dir / "clusters" / f"{name}.yaml"
        spec_files[name].parent.mkdir(parents=True, exist_ok=True)
        spec_files[name].write_text(devclusters.dump(layout.specs[name]))
    (run_dir / "clusters.json").write_text(json.dumps(list(layout.named)))

    nats_server = None
    if os.environ.get("GPUSCHED_NATS_URL"):
        external_nats_env = {k: os.environ[k] for k in ("GPUSCHED_NATS_URL", "GPUSCHED_NATS_USER",
                                                        "GPUSCHED_NATS_PASSWORD") if k in os.environ}
        admin = connection.Connection.resolve()
    elif nats_cluster > 1:  # every stream, consumer and bucket on each server (GPUSCHED_STREAM_REPLICAS in env())
        nats_server = devstack.NatsCluster(data_dir / NATS_CLUSTER_DIR, size=nats_cluster, teams=TEAMS,
                                           clusters=layout.named)
        started.append(nats_server)
        nats_server.start()
        admin = connection.Connection(nats_server.url(), "admin", nats_server.creds.users["admin"], None)
    else:
        nats_server = devstack.NatsServer(data_dir / "nats", teams=TEAMS, clusters=layout.named).start()
        started.append(nats_server)
        admin = connection.Connection(nats_server.url(), "admin", nats_server.creds.users["admin"], None)
    pg = None
    if os.environ.get("GPUSCHED_PG_DSN"):
        dsn = os.environ["GPUSCHED_PG_DSN"]
    else:
        pg = devstack.Postgres(data_dir / "postgres").start()
        started.append(pg)
        dsn = pg.dsn

    clock_file = run_dir / "clock.json"
    clock = plan_clock(clock_file, time_scale, clock_start)
    clock_file.write_text(json.dumps(clock))
    platform = ScaledClock(clock["time_scale"], clock["epoch"], clock.get("start"))

    operator = connection.Connection(admin.nats_url, "operator" if nats_server else admin.nats_user,
                                 nats_server.creds.users["operator"] if nats_server else admin.nats_password, dsn)

    nc = await eventlog.connect(Settings(nats_url=admin.nats_url, nats_user=admin.nats_user,
                                         nats_password=admin.nats_password,
                                         nats_tls=None if nats_server else NatsTls.from_env()),
                                "gpusched-dev")  # reconnects for ever
    js = nc.jetstream()
    limits = eventlog.StreamLimits.from_settings(Settings.from_env())
    if isinstance(nats_server, devstack.NatsCluster):
        limits = dataclasses.replace(limits, replicas=nats_server.replicas)
    await eventlog.provision(js, limits, teams=TEAMS)
    for event in queueconfig.plan_queues(example("queues.yaml"), await queueconfig.current_queues(js), platform.now()):
        await eventlog.EventLog(js).append(event)
    for event in pricebook.plan(pricebook.read(example("pricebook.yaml")), await pricebook.current(js), platform.now()):
        await eventlog.EventLog(js).append(event)  # so that usage, chargeback and what-if have prices

    metrics_ports = listeners.ports(observability.METRICS_FD)
    api_port = listeners.ports(API_FD)[API_USER]
    # Local NATS: each service its own user. External NATS: the credentials in the environment.
    nats_env = nats_server.env if nats_server else (lambda name: external_nats_env)
    webhook_secrets = devstack.webhook_secrets(run_dir / "webhook-secrets.json", TEAMS)
    env = devstack.service_env(nats_env, dsn, cluster=cluster, time_scale=clock["time_scale"], epoch=clock["epoch"],
                               start=clock.get("start"), metrics_ports=metrics_ports,
                               webhook_secrets=webhook_secrets, api_port=api_port, clusters=spec_files)
    executors = frozenset(f"{CLUSTER_EXECUTOR_PREFIX}{name}" for name in layout.named)
    procs = devstack.ServiceProcesses(data_dir / "logs", env, listeners=listeners, stay_stopped=executors)
    procs.start_all()
    api_tokens = await _demo_tokens(js, run_dir / "api-tokens.json")
    api_url = f"http://127.0.0.1:{api_port}"
    # Every address in it is held by now: NATS and Postgres checked to be ours, the API's socket ours.
    connection.save(dataclasses.replace(operator, api_url=api_url, api_token=api_tokens["operator"]),
                    run_dir / "connection.json")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    demo_task = None
    try:
        shown_pg = f"{pg.dsn_without_password} (password in {pg.password_file})" if pg else "GPUSCHED_PG_DSN"
        console.print(f"NATS {admin.nats_url}   Postgres {shown_pg}   logs {data_dir / 'logs'}", soft_wrap=True)
        console.print(_clock_line(platform), soft_wrap=True)
        if isinstance(nats_server, devstack.NatsCluster):
            console.print(f"NATS cluster of {nats_server.size}: " + "  ".join(
                f"{nats_server.name(i)} pid {s.proc.pid}" for i, s in enumerate(nats_server.servers))
                + f"; every stream, consumer and bucket on each (R{nats_server.replicas}); kill -9 one: it is "
                "started again on its port and store", soft_wrap=True)
        console.print("metrics: " + "  ".join(f"{n} :{p}" for n, p in metrics_ports.items()))
        console.print("CLI: .venv/bin/gpusched jobs | job ID | events ID | usage | services [chat]   "
                      "(reads .data/run/connection.json; from elsewhere ~/.local/state/gpusched/)")
        console.print(f"[bold]console {api_url}/console[/bold]   API {api_url}/docs   demo token "
                      f"({TEAMS[0]} member 'demo'): [bold]{api_tokens['demo']}[/bold]   operator token in "
                      f"{run_dir / 'api-tokens.json'}")
        if nats_server:
            console.print(f"teams: NATS users {', '.join(TEAMS)} (passwords in {nats_server.creds_path}); each reads "
                          f"its stream GPUSCHED_TENANT_<team>; webhook secrets in {webhook_secrets}")
        if layout.named:
            lost_after = float(env[min(executors)]["GPUSCHED_CLUSTER_LOST_AFTER_S"]) / clock["time_scale"]
            console.print("clusters, one sim executor each (executor-<cluster>): "
                          + "   ".join(devclusters.describe(n, layout.specs[n]) for n in layout.named), soft_wrap=True)
            console.print(f"lose a cluster: kill <its executor's pid, in the summary>; it stays stopped, the "
                          f"scheduler declares the cluster lost after {lost_after:g} s of silence and its work is "
                          f"placed in the others (the next `dev up` starts it again)", soft_wrap=True)
        if demo:
            already = await history.job_events(js, "demo-0000")
            offset = 0 if not already else int(time.time()) % 100000  # a second run submits new jobs
            stream = ((d, c.model_copy(update={"job_id": f"{c.job_id}-{offset}" if offset else c.job_id}))
                      for d, c in demo_stream())
            demo_task = asyncio.create_task(_submit_demo(js, stream, demo_jobs, platform.real_seconds(DEMO_TRICKLE_S),
                                                         stop))
        deps = Dependencies(started, operator.pg)
        try:
            await _supervise(procs, js, deps, layout, stop, duration)
        finally:
            await deps.close()
    finally:
        if demo_task:
            demo_task.cancel()
        console.print("stopping services…")
        procs.stop_all()
        await nc.close()
        console.print(f"stopped; data kept in {data_dir}")
    return 0


MONTH_END_LEAD_S = 6 * 3600.0
"""``month-end`` starts the platform clock this many platform seconds before a month's end: at
the demo's time scale (120) the month ends 3 wall minutes after the start, and its statements are
issued once the log's time is past it by GPUSCHED_STATEMENT_GRACE_S (1 platform hour: 30 wall s)."""
DEFAULT_CLOCK_START = "month-end"
CLOCK_START_ACCEPTED = ("month-end (6 platform hours before the end of this UTC month), now (the wall clock), "
                        "or an ISO 8601 time from now on, e.g. 2026-12-31T18:00:00Z (no offset: UTC)")


def parse_clock_start(text: str, wall: float) -> float:
    """The platform time (Unix seconds) at the wall instant ``wall`` that ``--clock-start`` asks
    for. ``month-end``: :data:`MONTH_END_LEAD_S` before the end of the UTC month that instant
    (plus the lead) is in; ``now``: ``wall``; an ISO time: that one (no offset: UTC). Never behind
    the wall clock: events stamped with it (API tokens, issued with wall times) would run the
    log's time, and so the statements, ahead of the platform clock."""
    value = text.strip()
    if value == "now":
        return wall
    if value == "month-end":
        lead = datetime.fromtimestamp(wall + MONTH_END_LEAD_S, UTC)
        end = datetime(lead.year + lead.month // 12, lead.month % 12 + 1, 1, tzinfo=UTC)
        return end.timestamp() - MONTH_END_LEAD_S
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise UserError(f"--clock-start {text!r} is not accepted; accepted: {CLOCK_START_ACCEPTED}") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    if at.timestamp() > 4e9:
        raise UserError(f"--clock-start {text!r} is out of range; accepted: now up to 2096-10-02 (Unix seconds 4e9)")
    if at.timestamp() < wall:  # events stamped with the wall clock (API tokens) would run the log's time ahead
        raise UserError(f"--clock-start {text!r} is before the wall clock "
                        f"({datetime.fromtimestamp(wall, UTC):%Y-%m-%dT%H:%M:%SZ}); accepted: {CLOCK_START_ACCEPTED}, "
                        "not earlier than now")
    return at.timestamp()


def plan_clock(clock_file: Path, time_scale: float, clock_start: str | None, wall: float | None = None) -> dict:
    """The run's clock: the data directory's (``clock.json``: a second run continues its log and
    clock, and a different ``--time-scale`` or ``--clock-start`` is ignored with a warning), or for a
    fresh one ``{epoch: now, time_scale, start}`` with ``start`` from ``clock_start``
    (:data:`DEFAULT_CLOCK_START` when None). A clock.json without ``start`` starts at its epoch."""
    wall = time.time() if wall is None else wall
    if not clock_file.exists():
        start = parse_clock_start(DEFAULT_CLOCK_START if clock_start is None else clock_start, wall)
        return {"epoch": wall, "time_scale": time_scale, "start": start}
    clock = json.loads(clock_file.read_text())
    if clock["time_scale"] != time_scale:
        console.print(f"[yellow]keeping time scale {clock['time_scale']} of the existing data "
                      f"(delete {clock_file} to change it)[/yellow]")
    if clock_start is not None:
        parse_clock_start(clock_start, wall)  # a wrong value is refused all the same
        console.print(f"[yellow]--clock-start {clock_start}: keeping the clock of the existing data "
                      f"(delete {clock_file}, with the rest of that data, to start another)[/yellow]")
    return clock


def _clock_line(clock: ScaledClock) -> str:
    """Where the platform clock is, and when its current month closes (in wall time from now)."""
    now = clock.now()
    end = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    wall_s = clock.real_seconds((end - now).total_seconds())
    return (f"platform clock {now:%Y-%m-%d %H:%M} UTC, {clock.time_scale:g}x: {now:%Y-%m} ends in "
            f"{_duration(wall_s)} of wall time; its statements are issued GPUSCHED_STATEMENT_GRACE_S (default "
            f"1 platform hour) later: `gpusched chargeback --issued`")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86_400:.0f} days"


def _api_listener(default_port: int = 8080) -> socket.socket:
    """The API's socket, bound and listening: on GPUSCHED_API_PORT (CannotListen when another
    process holds it: that port was asked for), else on 8080 when it is free, else on any free port."""
    if os.environ.get("GPUSCHED_API_PORT"):
        return observability.listen("127.0.0.1", int(os.environ["GPUSCHED_API_PORT"]), setting="GPUSCHED_API_PORT")
    try:
        return observability.listen("127.0.0.1", default_port)
    except observability.CannotListen:
        return observability.listen("127.0.0.1", 0)


async def _demo_tokens(js, path: Path) -> dict[str, str]:
    """API tokens for the demo (kept across runs with the data): a member of the first team and
    an operator, issued once as ApiTokenIssued events (the dev stack connects as the admin)."""
    held = json.loads(path.read_text()) if path.exists() else {}
    for holder, role, team in (("demo", Role.MEMBER, TEAMS[0]), ("operator", Role.OPERATOR, None)):
        if holder not in held:
            minted = tokens.mint()
            await eventlog.EventLog(js).append(tokens.issued(minted, name=holder, role=role, team=team,
                                                             issued_by="admin", now=datetime.now(UTC)))
            held[holder] = minted.token
    path.write_text(json.dumps(held, indent=2))
    path.chmod(0o600)
    return held


def _forget_connection(run_dir: Path) -> None:
    """Remove the connection file of this data directory, and this user's copy where it is the same
    (another stack's is left): once a run ends, nothing holds the ports it names, and the next
    process on one of them would get the CLI's credentials."""
    ours = run_dir / "connection.json"
    if not ours.exists():
        return
    copy = connection.user_connection_file()
    if copy.exists() and copy.read_bytes() == ours.read_bytes():
        copy.unlink()
    ours.unlink()


async def _supervise(procs: devstack.ServiceProcesses, js, deps: Dependencies, layout: Layout | int,
                     stop: asyncio.Event, duration: float) -> None:
    """Restart services that die, and NATS or Postgres when this run started them and they died;
    show the live summary until Ctrl-C (or ``duration``). Nothing NATS or Postgres does ends it.
    ``layout``: the stack's clusters (a number: the GPUs of one unnamed cluster)."""
    restarts: dict[str, int] = {}
    deadline = time.monotonic() + duration if duration else None
    live = Live(console=console, refresh_per_second=2, transient=False) if console.is_terminal else None
    last_print = 0.0
    if live:
        live.start()
    try:
        while not stop.is_set():
            for name in procs.restart_dead():
                restarts[name] = restarts.get(name, 0) + 1
            await deps.revive()
            counts, usage, running, reports = await _read_models(deps)
            lost = {r["name"] for r in reports if r["lost_at"] is not None}
            capacity = layout if isinstance(layout, int) else layout.capacity(lost)
            clusters = _cluster_line(layout, reports, procs) if isinstance(layout, Layout) and layout.named else ""
            table = _summary(counts, procs, restarts, await _last_sequence(js, deps), usage, capacity, running, deps,
                             clusters)
            if live:
                live.update(table)
            elif time.monotonic() - last_print > 5:
                console.print(table)
                last_print = time.monotonic()
            if deadline and time.monotonic() > deadline:
                return
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        if live:
            live.stop()


async def _read_models(deps: Dependencies) -> tuple[list[dict], list[dict], int, list[dict]]:
    """(state counts, usage by team, running GPUs, clusters); empty while Postgres is away or
    accounting has not created its tables yet."""
    conn = await deps.postgres()
    deps.mark("Postgres", conn is not None)
    if conn is None:
        return [], [], 0, []
    try:
        counts = await queries.state_counts(conn)
        usage = await queries.usage_by_team(conn)
        running = await queries.running_gpus(conn)
        return counts, usage, running, await queries.clusters(conn)
    except asyncpg.UndefinedTableError:  # accounting has not applied its migrations yet
        return [], [], 0, []
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncio.TimeoutError):
        deps.lost_postgres()
        deps.mark("Postgres", False)
        return [], [], 0, []


async def _last_sequence(js, deps: Dependencies) -> int | None:
    """The log's last sequence; None while NATS is away (the client reconnects by itself)."""
    try:
        seq = await eventlog.last_sequence(js)
    except eventlog.BROKER_ERRORS:
        deps.mark("NATS", False)
        return None
    deps.mark("NATS", True)
    return seq


def run_dev(*, data_dir: Path, time_scale: float, demo: bool, demo_jobs: int, duration: float,
            clusters: tuple[str, ...] = (), cluster_file: Path | None = None, nats_cluster: int = 1,
            clock_start: str | None = None) -> int:
    """``clusters`` / ``cluster_file``: :mod:`gpusched.dev.clusters`; ``nats_cluster``: the
    nats-servers to start (more than one: a JetStream cluster, :class:`gpusched.dev.stack.NatsCluster`);
    ``clock_start``: where a fresh data directory's platform clock starts (:func:`parse_clock_start`;
    None: :data:`DEFAULT_CLOCK_START`)."""
    return asyncio.run(_main(data_dir, time_scale, demo, demo_jobs, duration, clusters, cluster_file, nats_cluster,
                             clock_start))
