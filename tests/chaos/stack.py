"""The chaos run's stack — nats-server with a file store, Postgres, the services as processes
(admission as two partitions by team) — with the harness as its supervisor: it takes pieces down
with SIGKILL on schedule, brings them back (nats-server on the same port and store, Postgres on
the same data directory), and restarts and records any service that exits on its own."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gpusched.dev import stack as devstack
from tests.chaos.faults import ADMISSION_PARTITIONS, NATS_FAULTS, PROCESSES
from tests.chaos.workload import TEAMS, TIME_SCALE


@dataclass
class Exit:
    """A service that exited without being killed by the schedule."""

    service: str
    code: int | None
    at: float  # seconds since the stack started
    log_tail: str


def log_tail(path: Path, lines: int = 5) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 8192))
        return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])


@dataclass
class Stack:
    root: Path
    nats_servers: int = 1  # more: a JetStream cluster of that many (devstack.NatsCluster)
    nats: devstack.NatsServer | devstack.NatsCluster = field(init=False)
    pg: devstack.Postgres = field(init=False)
    procs: devstack.ServiceProcesses | None = None
    down: set[str] = field(default_factory=set)  # taken down on purpose, not yet back
    kills: Counter = field(default_factory=Counter)
    exits: list[Exit] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    killed_servers: dict[str, list[int]] = field(default_factory=dict)  # a cluster's fault -> the servers it killed

    def __post_init__(self) -> None:
        self.nats = (devstack.NatsCluster(self.root / "nats", size=self.nats_servers, teams=TEAMS)
                     if self.nats_servers > 1 else devstack.NatsServer(self.root / "nats", teams=TEAMS))
        self.pg = devstack.Postgres(self.root / "postgres", fsync=False)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def start_brokers(self) -> None:
        self.nats.start()
        self.pg.start()

    def start_services(self, cluster: Path, epoch: float) -> None:
        # Snapshots every 2,000 events: a service killed mid-run starts again from its latest
        # snapshot and the tail after it, so the invariants hold across that path too.
        env = devstack.service_env(self.nats.env, self.pg.dsn, cluster=cluster, time_scale=TIME_SCALE, epoch=epoch,
                                   extra={"GPUSCHED_TICK_S": "0.1", "GPUSCHED_SNAPSHOT_EVERY": "2000",
                                          "GPUSCHED_SNAPSHOT_MIN_INTERVAL_S": "0"})
        for k, name in enumerate(ADMISSION_PARTITIONS):
            env[name] = {**env["admission"], "GPUSCHED_ADMISSION_PARTITIONS": str(len(ADMISSION_PARTITIONS)),
                         "GPUSCHED_ADMISSION_PARTITION": str(k)}
        self.procs = devstack.ServiceProcesses(self.logs, env, runs={name: "admission" for name in ADMISSION_PARTITIONS})
        self.procs.start_all()

    def take_down(self, target: str) -> str:
        """kill -9: the service, nats-server (on a cluster: the servers ``target`` names,
        faults.CLUSTER_BROKERS), or Postgres with every process it started. What was killed."""
        self.down.add(target)
        self.kills[target] += 1
        if target in NATS_FAULTS:
            self.kills["nats"] += target != "nats"  # every fault of the broker counts as a nats-server restart
        if target == "nats":
            self.nats.kill()
        elif target in NATS_FAULTS:
            servers = self._cluster_targets(target)
            self.killed_servers[target] = servers
            for i in servers:
                self.nats.isolate(i) if target == "nats-partition" else self.nats.kill(i)
            return f"{target} ({', '.join(self.nats.name(i) for i in servers)})"
        elif target == "postgres":
            self.pg.kill()
        else:
            self.procs.kill(target)
        return target

    def _cluster_targets(self, target: str) -> list[int]:
        everyone = list(range(self.nats.size))
        if target == "nats-cluster":
            return everyone
        meta, events = self.nats.meta_leader(), self.nats.stream_leader()
        if target == "nats-meta-leader" and meta is not None:
            return [meta]
        if target in ("nats-events-leader", "nats-partition") and events is not None:
            return [events]
        followers = [i for i in everyone if i not in (meta, events)]
        return followers[:1] or everyone[-1:]

    def bring_up(self, target: str) -> None:
        """Start a piece taken down again, where it was (blocks until it listens)."""
        if target in NATS_FAULTS:
            if target == "nats-partition":
                for i in self.killed_servers[target]:
                    self.nats.heal(i)
            self.nats.start()  # on a cluster: every server that is down, then until one leads the meta group
        elif target == "postgres":
            self.pg.start()
        else:
            self.procs.start(target)
        self.down.discard(target)

    def restart_exited(self) -> list[Exit]:
        """Record and restart every service that exited although the schedule did not kill it."""
        found = []
        for name, proc in list(self.procs.procs.items()):
            if name in self.down or proc.poll() is None:
                continue
            found.append(Exit(name, proc.returncode, round(time.monotonic() - self.started_at, 1),
                              log_tail(self.logs / f"{name}.log")))
            self.procs.start(name)
        self.exits += found
        return found

    def quiet(self) -> None:
        """Stop the executors (SIGTERM: a clean exit) once every job has ended. The sim executor
        reports GPU telemetry on its own clock, a window every few wall seconds, so with it
        running the log never stays quiet long enough to compare the ledger with a rebuild at
        one position (a rebuild goes to where live was when it started)."""
        for name, proc in self.procs.procs.items():
            if name.startswith("executor") and proc.poll() is None:
                self.down.add(name)  # not restarted by restart_exited
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def stop(self) -> None:
        if self.procs is not None:
            self.procs.stop_all()
        self.pg.stop()
        self.nats.stop()

    def tracebacks(self) -> dict[str, int]:
        """Per service, how many tracebacks its log holds."""
        return {name: (self.logs / f"{name}.log").read_text(errors="replace").count("Traceback")
                for name in PROCESSES if (self.logs / f"{name}.log").exists()}
