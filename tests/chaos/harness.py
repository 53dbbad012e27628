"""One chaos run: a real stack under a mixed load, a seeded fault schedule and a fuzzer, then the
invariants checked from the log and the read models. ``ChaosRun(Config.from_env()).execute()``
returns the :class:`Report`; ``make test-chaos`` runs it through tests/chaos/test_chaos.py."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
from nats.js.errors import APIError

from runtime import eventlog
from schemas import Event, JobAdmitted, JobRejected, JobSubmitted
from schemas.registry import SUBJECT_PREFIX, parse_event
from tests.chaos import faults, fuzz, invariants, workload
from tests.chaos.stack import Stack

MESSAGE_TOO_LARGE = 10054  # JetStream: the message exceeds the stream's maximum size
PROGRESS_EVERY_S = 15.0


@dataclass(frozen=True)
class Config:
    seed: int
    jobs: int
    load_s: float
    malformed: int
    drain_s: float
    root: Path
    keep: bool
    nats_servers: int = 1

    @classmethod
    def from_env(cls) -> "Config":
        """GPUSCHED_CHAOS_SEED (default: a new one, printed), GPUSCHED_CHAOS_JOBS (3000),
        GPUSCHED_CHAOS_LOAD_S (jobs / 15, at least 60), GPUSCHED_CHAOS_MALFORMED (jobs / 10, at
        least 60), GPUSCHED_CHAOS_DRAIN_S (300), GPUSCHED_CHAOS_DIR (a new temporary directory),
        GPUSCHED_CHAOS_KEEP=1 keeps the directory after a run that passed; GPUSCHED_CHAOS_NATS_CLUSTER=3
        runs it on a JetStream cluster of three servers (R3; faults.CLUSTER_BROKERS)."""
        env = os.environ.get
        jobs = int(env("GPUSCHED_CHAOS_JOBS") or 3000)
        seed = env("GPUSCHED_CHAOS_SEED")
        root = env("GPUSCHED_CHAOS_DIR")
        return cls(
            seed=int(seed) if seed else random.SystemRandom().randrange(1_000_000),
            jobs=jobs,
            load_s=float(env("GPUSCHED_CHAOS_LOAD_S") or max(60.0, jobs / 15)),
            malformed=int(env("GPUSCHED_CHAOS_MALFORMED") or max(60, jobs // 10)),
            drain_s=float(env("GPUSCHED_CHAOS_DRAIN_S") or 300),
            root=Path(root) if root else Path(tempfile.mkdtemp(prefix="gpusched-chaos-")),
            keep=env("GPUSCHED_CHAOS_KEEP") == "1",
            nats_servers=int(env("GPUSCHED_CHAOS_NATS_CLUSTER") or 1),
        )

    @property
    def brokers(self) -> tuple[str, ...]:
        return faults.CLUSTER_BROKERS if self.nats_servers > 1 else faults.BROKERS


async def _expected(err: Exception) -> None:
    """The harness's own clients lose the broker on purpose: no traceback for each reconnect."""


async def connect(stack: Stack, user: str) -> nats.NATS:
    """A client that reconnects for ever, as the services do: the broker restarts mid-run."""
    return await nats.connect(stack.nats.urls(), user=user, password=stack.nats.creds.users[user],
                              inbox_prefix=eventlog.inbox_prefix(user), max_reconnect_attempts=-1, reconnect_time_wait=0.25, connect_timeout=5,
                              error_cb=_expected)


async def publish(js, subject: str, payload: bytes, msg_id: str, deadline_s: float = 120.0) -> int | None:
    """The intake sequence of a command, retried through a broker outage (the message id makes a
    repeat a duplicate, answered with the first copy's sequence); None when the stream refused
    the message as too large."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            ack = await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id}, timeout=5)
            return ack.seq
        except APIError as err:
            if err.err_code == MESSAGE_TOO_LARGE:
                return None
            failure: Exception = err
        except (nats.errors.Error, asyncio.TimeoutError) as err:
            failure = err
        if time.monotonic() > deadline:
            raise RuntimeError(f"publishing to {subject} failed for {deadline_s:.0f} s: {failure!r}")
        await asyncio.sleep(0.25)


class LogMirror:
    """The events stream read so far, in order, as (sequence, event); reading resumes after the
    last sequence read, so a broker restart during a read loses nothing."""

    def __init__(self, js) -> None:
        self.js = js
        self.events: list[tuple[int, Event]] = []
        self.last = 0

    async def catch_up(self) -> bool:
        """Read what is new; False when the broker was unreachable (read again later)."""
        try:
            async for batch in eventlog.read_batches(self.js, from_seq=self.last + 1, batch=2000):
                for msg in batch:
                    self.events.append((eventlog.sequence(msg), parse_event(msg.data)))
                    self.last = self.events[-1][0]
        except (nats.errors.Error, asyncio.TimeoutError, APIError):
            return False
        return True

    def ended_and_admitted(self) -> tuple[set[str], set[str]]:
        ended, admitted = set(), set()
        for _, e in self.events:
            if isinstance(e, JobAdmitted):
                admitted.add(e.aggregate_id)
            elif e.type in ("JobSucceeded", "JobCancelled", "JobFailed"):
                ended.add(e.aggregate_id)
            elif e.type == "JobRetryScheduled":
                ended.discard(e.aggregate_id)
        return ended, admitted


@dataclass
class Report:
    config: Config
    violations: dict[str, list[str]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    malformed: Counter = field(default_factory=Counter)
    states: Counter = field(default_factory=Counter)
    kills: Counter = field(default_factory=Counter)
    tracebacks: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)

    def add(self, invariant: str, found: list[str]) -> None:
        self.violations[invariant] = self.violations.get(invariant, []) + found

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.violations.values())

    def summary(self) -> str:
        c, cfg = self.counts, self.config
        services = ", ".join(f"{s} {self.kills[s]}" for s in faults.PROCESSES)
        lines = [
            f"chaos run, seed {cfg.seed} (GPUSCHED_CHAOS_SEED={cfg.seed} repeats its load, faults and fuzz)",
            f"jobs: {cfg.jobs} of the load and the final one submitted, {c['JobAdmitted']} admitted; ended "
            + ", ".join(f"{s} {n}" for s, n in sorted(self.states.items())),
            f"  gangs {c['gangs']}, retries {c['JobRetryScheduled']}, preempted {c['JobPreempted']} "
            f"(reclaim {c['ReclaimRequested:reclaim']}, priority in queue {c['ReclaimRequested:priority']}, "
            f"scheduler {c['PreemptionRequested']}), cancel requests {c['JobCancelRequested']}",
            f"kills (SIGKILL, then restart; a partition: cut off, then healed): {services}; "
            f"nats-server {self.kills['nats']}"
            + (f" (cluster of {cfg.nats_servers}: " + ", ".join(f"{b} {self.kills[b]}" for b in cfg.brokers[:-1]) + ")"
               if cfg.nats_servers > 1 else "") + f", postgres {self.kills['postgres']}",
            f"malformed inputs: {sum(self.malformed.values())} ("
            + ", ".join(f"{k} {n}" for k, n in sorted(self.malformed.items())) + ")",
            "invariants: " + ", ".join(f"{k} {len(v)}" for k, v in self.violations.items()),
            f"violations: {self.total}",
        ]
        for invariant, found in self.violations.items():
            lines += [f"  [{invariant}] {v}" for v in found[:20]]
            if len(found) > 20:
                lines.append(f"  [{invariant}] ... and {len(found) - 20} more")
        lines.append("tracebacks in service logs: " + ", ".join(f"{k} {n}" for k, n in self.tracebacks.items()))
        lines.append("wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.phases.items()))
        return "\n".join(lines)


def say(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", flush=True)


class ChaosRun:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.stack = Stack(config.root, config.nats_servers)
        self.report = Report(config)
        self.sent_malformed: dict[int, fuzz.Malformed] = {}  # by intake sequence
        self.final_seq: int | None = None
        self.t0 = time.monotonic()

    async def execute(self) -> Report:
        say(f"seed {self.config.seed}; {self.config.jobs} jobs over {self.config.load_s:.0f} s; "
            + (f"a JetStream cluster of {self.config.nats_servers} (R{self.config.nats_servers}); "
               if self.config.nats_servers > 1 else "")
            + f"data and logs in {self.config.root}")
        try:
            await self._timed("setup", self.setup())
            await self._timed("load and faults", self.load_with_faults())
            await self._timed("drain", self.drain())
            await self._timed("checks", self.check())
        finally:
            self.report.phases["total"] = time.monotonic() - self.t0
            await self.close()
        return self.report

    async def _timed(self, phase: str, work) -> None:
        start = time.monotonic()
        await work
        self.report.phases[phase] = time.monotonic() - start
        say(f"{phase}: {self.report.phases[phase]:.0f} s")

    # -- setup -----------------------------------------------------------------------------
    async def setup(self) -> None:
        await asyncio.to_thread(self.stack.start_brokers)
        self.admin = await connect(self.stack, "admin")
        self.js = self.admin.jetstream()
        await eventlog.provision(self.js, eventlog.StreamLimits(replicas=self.config.nats_servers),
                                 teams=workload.TEAMS)
        for event in workload.queue_events(datetime.now(UTC)):
            await eventlog.EventLog(self.js).append(event)
        cluster = self.config.root / "cluster.yaml"
        cluster.write_text(workload.CLUSTER)
        self.stack.start_services(cluster, epoch=time.time())
        self.tenants = {team: (await connect(self.stack, team)).jetstream() for team in workload.TEAMS}
        self.mirror = LogMirror(self.js)
        await self._until(self._nodes_registered, 60, "the executor registered the sim nodes")

    async def _nodes_registered(self) -> bool:
        await self.mirror.catch_up()
        return sum(e.type == "NodeRegistered" for _, e in self.mirror.events) >= workload.NODES

    async def _until(self, predicate, timeout_s: float, what: str) -> bool:
        deadline = time.monotonic() + timeout_s
        while not await predicate():
            if time.monotonic() > deadline:
                say(f"gave up waiting after {timeout_s:.0f} s until {what}")
                return False
            await asyncio.sleep(1.0)
        return True

    async def close(self) -> None:
        for client in [getattr(self, "admin", None), *(js._nc for js in getattr(self, "tenants", {}).values())]:
            if client is not None:
                await client.close()
        await asyncio.to_thread(self.stack.stop)
        self.report.tracebacks = self.stack.tracebacks()

    # -- load, faults, fuzz ----------------------------------------------------------------
    async def load_with_faults(self) -> None:
        cfg = self.config
        actions = workload.plan(self.rng, cfg.jobs, cfg.load_s)
        malformed = [(self.rng.uniform(0, cfg.load_s), fuzz.malformed(self.rng, i)) for i in range(cfg.malformed)]
        schedule = faults.schedule(self.rng, cfg.load_s, brokers=cfg.brokers)
        say("faults: " + ", ".join(f"{f.target}@{f.at:.0f}s" for f in schedule))
        start = time.monotonic()
        supervisor = asyncio.create_task(self.supervise())
        progress = asyncio.create_task(self.progress())
        try:
            await asyncio.gather(self.publish_load(actions, malformed, start), self.run_faults(schedule, start))
        finally:
            supervisor.cancel()
            progress.cancel()
        self.report.kills = self.stack.kills
        self.stack.restart_exited()

    async def publish_load(self, actions, malformed, start: float) -> None:
        merged = [(a.at, a) for a in actions] + malformed
        for i, (at, item) in enumerate(sorted(merged, key=lambda pair: pair[0])):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            if isinstance(item, workload.Action):
                payload = item.command.model_dump_json().encode()
                await publish(self.tenants[item.team], f"{SUBJECT_PREFIX}.intake.{item.team}.{item.verb}", payload,
                              f"{item.verb}-{item.command.job_id}")
            else:
                await self.publish_malformed(i, item)

    async def publish_malformed(self, i: int, m: fuzz.Malformed) -> None:
        # A tenant may publish only its three intake subjects: an unknown one comes from a credential
        # that may (the admin's), as from a misconfigured producer.
        js = self.js if m.kind == "unknown-subject" else self.tenants[m.team]
        seq = await publish(js, f"{SUBJECT_PREFIX}.intake.{m.team}.{m.verb}", m.payload, f"fuzz-{i}")
        if seq is None:
            self.report.malformed["refused by the stream at publish"] += 1
        else:
            self.sent_malformed[seq] = m
            self.report.malformed[m.kind] += 1

    async def run_faults(self, schedule: list[faults.Fault], start: float) -> None:
        for fault in schedule:
            await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
            killed = self.stack.take_down(fault.target)
            verb = "cut off" if fault.target == "nats-partition" else "kill -9"
            say(f"{verb} {killed}; back in {fault.down_s:.1f} s")
            await asyncio.sleep(fault.down_s)
            await asyncio.to_thread(self.stack.bring_up, fault.target)

    async def supervise(self) -> None:
        while True:
            for exit_ in self.stack.restart_exited():
                say(f"{exit_.service} exited on its own (code {exit_.code}); restarted. Its log ends:\n"
                    f"{exit_.log_tail}")
            await asyncio.sleep(0.5)

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            if await self.mirror.catch_up():
                ended, admitted = self.mirror.ended_and_admitted()
                say(f"log at {self.mirror.last}; admitted {len(admitted)}, ended {len(ended & admitted)}; "
                    f"down now: {sorted(self.stack.down) or 'nothing'}")

    # -- drain -----------------------------------------------------------------------------
    async def drain(self) -> None:
        final = workload.final_command()
        self.final_seq = await publish(self.tenants["team-a"], f"{SUBJECT_PREFIX}.intake.team-a.submit",
                                       final.model_dump_json().encode(), "submit-final")
        say(f"final command published (intake sequence {self.final_seq}); waiting for every job to end")
        await self._until(self._all_ended, self.config.drain_s, "every admitted job ended")
        self.stack.quiet()  # the sim executor's telemetry would keep the log moving
        await self._until(self._projection_caught_up, 120, "accounting applied the whole log")

    async def _all_ended(self) -> bool:
        self.stack.restart_exited()
        if not await self.mirror.catch_up():
            return False
        ended, admitted = self.mirror.ended_and_admitted()
        return workload.FINAL_JOB in ended and admitted <= ended

    async def _projection_caught_up(self) -> bool:
        last = await eventlog.last_sequence(self.js)
        try:
            conn = await asyncpg.connect(self.stack.pg.dsn)
            try:
                position = await conn.fetchval("SELECT coalesce(max(last_sequence), 0) FROM projection_position")
            finally:
                await conn.close()
        except (OSError, asyncpg.PostgresError):  # not migrated yet, or Postgres still recovering
            return False
        await asyncio.sleep(2.0)  # and the log stays quiet
        return position >= last and await eventlog.last_sequence(self.js) == last

    # -- checks ----------------------------------------------------------------------------
    async def check(self) -> None:
        await self.mirror.catch_up()
        logged = self.mirror.events
        histories = invariants.job_histories(logged)
        states, ended_once = invariants.terminal_once(histories)
        r = self.report
        r.counts = invariants.counts(logged)
        r.counts["gangs"] = sum(1 for _, e in logged if isinstance(e, JobSubmitted) and e.spec.gang_size > 1)
        r.states = Counter(states.values())
        r.add("every admitted job ended once", ended_once)
        r.add("every submitted job admitted", self._all_admitted(histories))
        r.add("no attempt started twice", invariants.started_once(logged))
        r.add("no GPU given twice", invariants.gpus_never_shared(logged))
        r.add("no decision appended twice", invariants.decisions_once(logged))
        r.add("read models agree with the log", await self._read_models(states))
        r.add("ledger equals a rebuild", self._rebuild())
        r.add("malformed commands answered", await self._malformed(logged))
        r.add("final command processed", self._final(states, histories))
        r.add("the load took every path", self._coverage())
        r.add("no service exited on its own", [f"{x.service} exited (code {x.code}) at {x.at} s: {x.log_tail}"
                                               for x in self.stack.exits])

    def _coverage(self) -> list[str]:
        """A run that never reclaimed, preempted, retried or cancelled proves nothing about them."""
        c, kills = self.report.counts, self.stack.kills
        wanted = {"gang jobs": c["gangs"], "retries": c["JobRetryScheduled"], "reclaims": c["ReclaimRequested:reclaim"],
                  "priority preemptions in a queue": c["ReclaimRequested:priority"],
                  "cancellations": c["JobCancelled"], "nats-server restarts": kills["nats"],
                  "postgres restarts": kills["postgres"], "malformed commands": len(self.sent_malformed)}
        wanted |= {f"kills of {s}": kills[s] for s in faults.PROCESSES}
        wanted |= {f"kills of {b}": kills[b] for b in self.config.brokers}
        return [f"the run had no {what}" for what, n in wanted.items() if n == 0]

    def _all_admitted(self, histories) -> list[str]:
        """Every job of the load was valid for its queue: each must be admitted."""
        return [f"job cj-{i:05d} was submitted but never admitted: "
                f"{[e.type for _, e in histories.get(f'cj-{i:05d}', [])] or 'no event at all'}"
                for i in range(self.config.jobs) if not invariants.admitted(histories.get(f"cj-{i:05d}", []))]

    async def _read_models(self, states: dict[str, str]) -> list[str]:
        conn = await asyncpg.connect(self.stack.pg.dsn)
        try:
            rows = {r["job_id"]: r["state"] for r in await conn.fetch("SELECT job_id, state FROM jobs")}
        finally:
            await conn.close()
        return [f"job {job} is {rows.get(job, 'missing')} in the read models, {state} in the log"
                for job, state in sorted(states.items()) if rows.get(job) != state]

    def _rebuild(self) -> list[str]:
        """`gpusched replay --into chaos_shadow`: a fresh rebuild compared with the live tables."""
        env = {**os.environ, **self.stack.nats.env("operator"), "GPUSCHED_PG_DSN": self.stack.pg.dsn}
        cmd = [sys.executable, "-m", "gpusched.cli.main", "replay", "--into", "chaos_shadow", "-o", "json"]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if run.returncode not in (0, 1):  # 1: the compare differs (the tables below say where)
            return [f"gpusched replay exited {run.returncode}: {run.stderr.strip()[-500:]}"]
        return [f"table {t['table']}: live {t['live_rows']} rows ({t['live_checksum']}), rebuilt "
                f"{t['shadow_rows']} rows ({t['shadow_checksum']})"
                for t in json.loads(run.stdout)["compare"] if not t["equal"]]

    async def _malformed(self, logged) -> list[str]:
        rejected = {e.intake_sequence for _, e in logged if isinstance(e, JobRejected) and e.intake_sequence}
        submitted = {e.intake_sequence for _, e in logged if isinstance(e, JobSubmitted)}
        dead = set()
        async for msg in eventlog.read(self.js, stream=eventlog.DLQ_STREAM):
            headers = msg.headers or {}
            if headers.get("Gpusched-Original-Stream") == eventlog.INTAKE_STREAM:
                dead.add(int(headers["Gpusched-Original-Sequence"]))
        self.report.counts["dead letters"] = len(dead)
        sent = {seq: m.describe() for seq, m in self.sent_malformed.items()}
        return invariants.malformed_answered(sent, rejected, dead, submitted)

    def _final(self, states: dict[str, str], histories) -> list[str]:
        if states.get(workload.FINAL_JOB) == "succeeded":
            return []
        seen = [e.type for _, e in histories.get(workload.FINAL_JOB, [])]
        return [f"the final command (intake sequence {self.final_seq}) did not succeed: events {seen}"]
