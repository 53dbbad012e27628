"""What the CLI, the dev stack, the tests and the benchmarks use to talk to a running platform:
operator connections, submitting commands, reading a job's history, applying queue config, and
the read-model queries. Changes happen only by publishing; reads come from Postgres or the log."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
import yaml
from nats.js import JetStreamContext
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime import eventlog, observability
from schemas import (
    CancelJob, CohortConfigured, Event, QueueConfigured, QueueDeleted, ReportCheckpoint, SubmitJob, new_event,
    parse_event,
)
from schemas.commands import job_id_for_key
from schemas.job import rejection_id
from schemas.registry import SUBJECT_PREFIX

CONNECTION_FILE = Path(".data/run/connection.json")
TERMINAL_TYPES = {"JobSucceeded", "JobRejected", "JobCancelled"}


class UserError(Exception):
    """Shown to the user as is: what was wrong, which value, what is accepted."""


@dataclass(frozen=True)
class Connection:
    nats_url: str
    nats_user: str | None
    nats_password: str | None
    pg_dsn: str | None

    @classmethod
    def resolve(cls) -> "Connection":
        """Environment first (GPUSCHED_NATS_URL, GPUSCHED_NATS_USER, GPUSCHED_NATS_PASSWORD,
        GPUSCHED_PG_DSN); otherwise what a local `make run` wrote to .data/run/connection.json."""
        saved: dict[str, Any] = {}
        path = Path(os.environ.get("GPUSCHED_CONNECTION_FILE", CONNECTION_FILE))
        if path.exists():
            saved = json.loads(path.read_text())
        return cls(
            nats_url=os.environ.get("GPUSCHED_NATS_URL") or saved.get("nats_url") or "nats://127.0.0.1:4222",
            nats_user=os.environ.get("GPUSCHED_NATS_USER") or saved.get("nats_user"),
            nats_password=os.environ.get("GPUSCHED_NATS_PASSWORD") or saved.get("nats_password"),
            pg_dsn=os.environ.get("GPUSCHED_PG_DSN") or saved.get("pg_dsn"),
        )

    async def nats(self) -> nats.NATS:
        kwargs: dict[str, Any] = {}
        if self.nats_user:
            kwargs = {"user": self.nats_user, "password": self.nats_password or ""}
        try:
            return await nats.connect(self.nats_url, connect_timeout=3, max_reconnect_attempts=2,
                                      allow_reconnect=False, name="gpusched-cli", **kwargs)
        except Exception as err:  # nats-py raises several unrelated types here
            raise UserError(f"cannot connect to NATS at {self.nats_url}: {err!r} (is `make run` running?)") from None

    async def pg(self) -> asyncpg.Connection:
        if not self.pg_dsn:
            raise UserError("no Postgres configured: set GPUSCHED_PG_DSN or start `make run`")
        try:
            return await asyncpg.connect(self.pg_dsn, timeout=5)
        except (OSError, asyncpg.PostgresError) as err:
            raise UserError(f"cannot connect to Postgres: {err}") from None


def first_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"{source}: {where}: {e['msg']}")
    return "\n".join(lines)


def load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as err:
        raise UserError(f"{path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML: {err}") from None


def submit_command_from_file(path: Path, submitter: str | None = None) -> SubmitJob:
    """A job file is either a SubmitJob (with `spec:`) or a bare job spec."""
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping with the job spec, got {type(raw).__name__}")
    if "spec" not in raw:
        raw = {"spec": raw}
    raw.setdefault("submitter", submitter or os.environ.get("USER") or "cli")
    try:
        command = SubmitJob.model_validate(raw)
    except ValidationError as err:
        raise UserError(first_error(err, str(path))) from None
    if command.job_id is None:
        command = command.model_copy(update={"job_id": new_job_id(command)})
    return command


def new_job_id(command: SubmitJob) -> str:
    if command.spec.idempotency_key:
        return job_id_for_key(command.spec.team, command.spec.idempotency_key)
    return "j-" + uuid.uuid4().hex[:16]


async def publish_command(js: JetStreamContext, team: str, verb: str, command: BaseModel,
                          headers: dict[str, str] | None = None) -> int:
    hdrs = dict(headers or {})
    observability.inject_trace(hdrs)
    ack = await js.publish(f"{SUBJECT_PREFIX}.intake.{team}.{verb}", command.model_dump_json().encode(),
                           headers=hdrs or None, timeout=10)
    return ack.seq


async def job_events(js: JetStreamContext, job_id: str) -> list[tuple[int, Event]]:
    out = []
    async for msg in eventlog.read(js, subjects=[f"{SUBJECT_PREFIX}.job.{job_id}.>"]):
        out.append((msg.metadata.sequence.stream, parse_event(msg.data)))
    return out


async def wait_for_decision(js: JetStreamContext, job_id: str, intake_seq: int, timeout_s: float = 15.0) -> Event | None:
    """JobAdmitted / JobRejected for this submission (filed under the job id, or under the
    rejection id derived from the intake sequence), or the existing job's JobSubmitted when the
    submission was an idempotent repeat."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for subject_id in (job_id, rejection_id(intake_seq)):
            for _, event in await job_events(js, subject_id):
                if event.type in ("JobAdmitted", "JobRejected"):
                    return event
        await asyncio.sleep(0.2)
    return None


async def cancel(js: JetStreamContext, job_id: str, team: str, requested_by: str, reason: str = "") -> int:
    return await publish_command(js, team, "cancel", CancelJob(job_id=job_id, requested_by=requested_by, reason=reason))


async def report_checkpoint(js: JetStreamContext, job_id: str, team: str, attempt: int, *, reported_by: str,
                            checkpointed_at: datetime | None = None, step: int | None = None,
                            location: str = "") -> int:
    """Publish ReportCheckpoint on ``gpusched.intake.<team>.checkpoint``; admission records
    JobCheckpointed, or dead-letters the report with the reason (see ``gpusched dlq``)."""
    try:
        command = ReportCheckpoint(job_id=job_id, attempt=attempt, checkpointed_at=checkpointed_at or utcnow(),
                                   step=step, location=location, reported_by=reported_by)
    except ValidationError as err:
        raise UserError(first_error(err, "checkpoint")) from None
    return await publish_command(js, team, "checkpoint", command)


# -- queue configuration ----------------------------------------------------------------------


class QueueSpec(BaseModel):
    """One queue in queues.yaml: the QueueConfigured fields without the envelope."""

    model_config = ConfigDict(extra="forbid")
    name: str
    cohort: str | None = None
    allowed_teams: list[str] = Field(default_factory=list)
    allowed_users: list[str] = Field(default_factory=list)
    allowed_priority_classes: list[str] = Field(default_factory=list)
    quotas: list[dict[str, Any]] = Field(default_factory=list)
    strict_fifo: bool = False
    budget: dict[str, Any] | None = None
    preemption: dict[str, Any] = Field(default_factory=dict)


class CohortSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    parent: str | None = None
    usage_half_life_seconds: float | None = None
    history_weight: float = 0.5

    def same_as(self, event: CohortConfigured) -> bool:
        return (self.parent, self.usage_half_life_seconds, self.history_weight) == (
            event.parent, event.usage_half_life_seconds, event.history_weight)


class QueuesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cohorts: list[CohortSpec] = Field(default_factory=list)
    queues: list[QueueSpec]


def _config_payload(event: QueueConfigured) -> dict[str, Any]:
    return event.model_dump(mode="json", exclude={"event_id", "occurred_at", "producer", "causation_id",
                                                   "correlation_id", "aggregate_id", "schema_version", "type"})


@dataclass
class QuotaConfig:
    """The queue and cohort configuration as the log has it now."""

    queues: dict[str, QueueConfigured]
    cohorts: dict[str, CohortConfigured]


async def current_queues(js: JetStreamContext) -> QuotaConfig:
    config = QuotaConfig({}, {})
    async for msg in eventlog.read(js, subjects=[f"{SUBJECT_PREFIX}.queue.>", f"{SUBJECT_PREFIX}.cohort.>"]):
        event = parse_event(msg.data)
        if isinstance(event, QueueConfigured):
            config.queues[event.name] = event
        elif isinstance(event, QueueDeleted):
            config.queues.pop(event.name, None)
        elif isinstance(event, CohortConfigured):
            config.cohorts[event.name] = event
    return config


def describe_change(event: Event, config: QuotaConfig) -> str:
    """What an apply event changes, field by field (quotas matched by flavor)."""
    if isinstance(event, QueueDeleted):
        return "deleted"
    if isinstance(event, CohortConfigured):
        old = config.cohorts.get(event.name)
        if old is None:
            return "new"
        return "; ".join(f"{f}: {getattr(old, f)} → {getattr(event, f)}"
                         for f in ("parent", "usage_half_life_seconds", "history_weight")
                         if getattr(old, f) != getattr(event, f))
    old = config.queues.get(event.aggregate_id)
    if old is None:
        return "new"
    before, after = _config_payload(old), _config_payload(event)
    changes = []
    for field_name in sorted(set(before) | set(after)):
        if field_name == "quotas":
            b = {q["flavor"]: q for q in before.get("quotas", [])}
            a = {q["flavor"]: q for q in after.get("quotas", [])}
            for flavor in sorted(set(b) | set(a)):
                if flavor not in a:
                    changes.append(f"quotas[{flavor}]: removed")
                elif flavor not in b:
                    changes.append(f"quotas[{flavor}]: added {a[flavor]}")
                else:
                    changes += [f"quotas[{flavor}].{k}: {b[flavor].get(k)} → {a[flavor].get(k)}"
                                for k in sorted(a[flavor]) if a[flavor].get(k) != b[flavor].get(k)]
        elif before.get(field_name) != after.get(field_name):
            changes.append(f"{field_name}: {before.get(field_name)} → {after.get(field_name)}")
    return "; ".join(changes)


def plan_queues(path: Path, config: QuotaConfig, now: datetime, prune: bool = False) -> list[Event]:
    """The events that make the log's queue and cohort configuration equal the file's: changed
    or new cohorts first, then queues; with ``prune``, QueueDeleted for queues the file lacks."""
    current = config.queues
    raw = load_yaml(path)
    try:
        parsed = QueuesFile.model_validate(raw)
    except ValidationError as err:
        raise UserError(first_error(err, str(path))) from None
    out: list[Event] = []
    for i, c in enumerate(parsed.cohorts):
        existing_c = config.cohorts.get(c.name)
        if existing_c is not None and c.same_as(existing_c):
            continue
        try:
            out.append(new_event(CohortConfigured, aggregate_id=c.name, producer="config", occurred_at=now,
                                 key=f"{c.model_dump_json()}@{now.isoformat()}", **c.model_dump()))
        except ValidationError as err:
            raise UserError(first_error(err, f"{path}: cohorts[{i}] ({c.name})")) from None
    names = [q.name for q in parsed.queues]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"{path}: queues: name(s) {dupes} appear more than once; each queue once")
    for i, q in enumerate(parsed.queues):
        try:
            event = QueueConfigured(
                event_id="pending", aggregate_id=q.name, occurred_at=now, producer="config", **q.model_dump()
            )
        except ValidationError as err:
            raise UserError(first_error(err, f"{path}: queues[{i}] ({q.name})")) from None
        existing = current.get(q.name)
        if existing is not None and _config_payload(existing) == _config_payload(event):
            continue
        digest = json.dumps(_config_payload(event), sort_keys=True)
        out.append(new_event(QueueConfigured, aggregate_id=q.name, producer="config", occurred_at=now,
                             key=f"{digest}@{now.isoformat()}", **q.model_dump()))
    if prune:
        for name in sorted(current.keys() - set(names)):
            out.append(new_event(QueueDeleted, aggregate_id=name, producer="config", occurred_at=now,
                                 key=now.isoformat(), name=name))
    return out


# -- read models ------------------------------------------------------------------------------


async def list_jobs(conn: asyncpg.Connection, team: str | None = None, state: str | None = None,
                    limit: int = 50) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        """SELECT job_id, team, queue, state, attempt, total_gpus, flavor, submitted_at, finished_at
           FROM jobs WHERE ($1::text IS NULL OR team = $1) AND ($2::text IS NULL OR state = $2)
           ORDER BY submitted_at DESC NULLS LAST, job_id LIMIT $3""",
        team, state, limit,
    )
    return [dict(r) for r in rows]


async def get_job(conn: asyncpg.Connection, job_id: str) -> dict[str, Any] | None:
    row = await conn.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
    if row is None:
        return None
    job = dict(row)
    job["usage"] = [dict(r) for r in await conn.fetch(
        "SELECT attempt, flavor, gpus, started_at, ended_at, gpu_seconds, outcome FROM usage_ledger "
        "WHERE job_id = $1 ORDER BY attempt", job_id)]
    return job


async def usage_by_team(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        """SELECT team, flavor, count(*) AS attempts, sum(gpu_seconds) / 3600.0 AS gpu_hours
           FROM usage_ledger GROUP BY team, flavor ORDER BY team, flavor"""
    )
    return [dict(r) for r in rows]


async def state_counts(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch("SELECT coalesce(team, '-') AS team, state, count(*) AS n FROM jobs GROUP BY 1, 2")
    return [dict(r) for r in rows]


def utcnow() -> datetime:
    return datetime.now(UTC)


async def why(js: JetStreamContext, job_id: str) -> dict[str, Any]:
    """Where a job stands and why it waits, from its history in the log."""
    history = await job_events(js, job_id)
    if not history:
        raise UserError(f"job {job_id!r} has no events in the log")
    lifecycle = [e for _, e in history if e.type not in ("QuotaPendingReasonChanged", "SchedulingPendingReasonChanged")]
    last = lifecycle[-1] if lifecycle else history[-1][1]
    reasons = [e for _, e in history if e.type == "QuotaPendingReasonChanged"]
    attempt = max((getattr(e, "attempt", 1) or 1 for e in lifecycle), default=1)
    waiting = last.type in ("JobAdmitted", "JobRetryScheduled", "QuotaReleased") and not any(
        e.type in ("JobSucceeded", "JobCancelled", "JobRejected") for e in lifecycle)
    current = next((r for r in reversed(reasons) if r.attempt == attempt), None) if waiting else None
    placing = [e for _, e in history if e.type == "SchedulingPendingReasonChanged"]
    sched = next((r for r in reversed(placing) if r.attempt == attempt), None) if last.type == "QuotaReserved" else None
    return {
        "job_id": job_id,
        "last_event": last.type,
        "since": last.occurred_at,
        "waiting_for_quota": waiting,
        "reason": None if current is None else {
            "code": current.reason.value, "message": current.message, "position": current.position,
            "flavor": current.flavor, "since": current.occurred_at},
        "history": [{"time": r.occurred_at, "attempt": r.attempt, "code": r.reason.value, "position": r.position,
                     "message": r.message} for r in reasons],
        # holding quota, not placed yet: the scheduler's reason (docs/scheduling.md)
        "scheduling_reason": None if sched is None else {
            "code": sched.reason.value, "message": sched.message, "flavor": sched.flavor,
            "free_gpus": sched.free_gpus, "largest_free_block": sched.largest_free_block, "eta": sched.eta,
            "since": sched.occurred_at},
        "scheduling_history": [{"time": r.occurred_at, "attempt": r.attempt, "code": r.reason.value,
                                "message": r.message} for r in placing],
    }


async def queue_usage(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Per queue and flavor: nominal, limits, used, borrowed, lent and pending, from the read
    models. ``lent`` attributes the cohort's borrowing to lenders' unused quota in queue-name
    order (the platform constrains only the totals)."""
    rows = [dict(r) for r in await conn.fetch(
        """SELECT q.name AS queue, q.cohort, fq->>'flavor' AS flavor, (fq->>'nominal')::int AS nominal,
                  (fq->>'borrowing_limit')::int AS borrowing_limit, (fq->>'lending_limit')::int AS lending_limit,
                  coalesce((SELECT sum(r.gpus) FROM reservations r WHERE r.queue = q.name
                            AND r.flavor = fq->>'flavor' AND r.released_at IS NULL), 0)::int AS used
           FROM queues q, jsonb_array_elements(q.config->'quotas') fq
           WHERE NOT q.deleted ORDER BY q.name, fq->>'flavor'""")]
    parents = dict(await conn.fetch("SELECT name, parent FROM cohorts"))
    pending = dict(await conn.fetch(
        "SELECT queue, count(*) FROM jobs WHERE state IN ('queued', 'retrying') GROUP BY queue"))

    def root(cohort: str | None) -> str | None:
        seen = set()
        while cohort is not None and parents.get(cohort) is not None and cohort not in seen:
            seen.add(cohort)
            cohort = parents[cohort]
        return cohort

    pools: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        own = min(r["used"], r["nominal"])
        r["borrowed"] = r["used"] - own
        cap = r["nominal"] if r["lending_limit"] is None else min(r["lending_limit"], r["nominal"])
        r["lendable"] = max(0, min(cap, r["nominal"] - own))
        r["lent"] = 0
        r["pending_jobs"] = pending.get(r["queue"], 0)
        if (top := root(r["cohort"])) is not None:
            pools.setdefault((top, r["flavor"]), []).append(r)
    for members in pools.values():
        to_cover = sum(m["borrowed"] for m in members)
        for m in sorted(members, key=lambda m: m["queue"]):
            m["lent"] = min(m["lendable"], to_cover)
            to_cover -= m["lent"]
    return rows
