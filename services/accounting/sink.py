"""The idempotent sink: applies a batch of operations and the stream position in one
transaction, skipping what the read models already contain. Killed mid-batch, it commits all of
the batch or none of it; redelivered, it skips what it has.

A batch is planned without the database (:func:`prepare`: its statements grouped, its ledger
facts collected); applying it (:func:`apply_batch`) reads what the read models hold of the
attempts that end in it (:func:`prior_facts`), computes their ledger rows
(:mod:`services.accounting.ledger`) and writes everything, large groups by COPY
(:mod:`services.accounting.bulk.copy`).
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, field
from importlib import resources

import asyncpg

from schemas.jobstate import JobState
from services.accounting import ledger
from services.accounting import operations as ops
from services.accounting.bulk import copy
from services.accounting.sql import JOB_COLUMNS, JOB_DEFAULTS, JOB_SPEC_COLUMNS

log = logging.getLogger(__name__)

PROJECTION = "read-models"
_MIGRATION_LOCK = 0x6770_7573  # advisory lock key for migrations ("gpus")

# Operations of these statements are applied grouped, in this phase order (log order within each
# statement). That is safe because a job's row is inserted before any update to it, every job
# change is one statement (job_update) kept in log order, a reservation is inserted before its
# release, and the attempt tables are keyed by (job, attempt). The ledger rows go last (their
# values are computed; they read nothing). Every other statement keeps strict log order,
# consecutive runs of one statement grouped.
_PHASE = {"job_submitted": 0, "job_rejected": 1, "job_update": 2, "attempt_queued": 3, "reservation": 3,
          "checkpoint": 3, "reservation_released": 4}

# operation type -> the statement (:data:`.sql.SQL`) it is applied with; its fields are the
# statement's parameters (but InsertJob's and InsertReservation's: :func:`_fold` completes
# them). SetJobState and SetWaitReason fold into job_update; AttemptEnded is the ledger's.
STATEMENTS: dict[type, str] = {
    ops.InsertJob: "job_submitted", ops.RejectJob: "job_rejected", ops.InsertAttempt: "attempt_queued",
    ops.InsertReservation: "reservation", ops.ReleaseReservation: "reservation_released",
    ops.InsertCheckpoint: "checkpoint", ops.UpsertNode: "node", ops.MarkNodeLost: "node_lost",
    ops.MarkNodesLost: "nodes_lost", ops.RecordClusterReport: "cluster_reported", ops.MarkClusterLost: "cluster_lost",
    ops.InsertGpuTelemetry: "gpu_telemetry", ops.UpsertCohort: "cohort", ops.UpsertQueue: "queue",
    ops.MarkQueueDeleted: "queue_deleted", ops.InsertQuotaVersion: "quota_history", ops.InsertPriceBook: "price_book",
    ops.UpsertTeam: "team", ops.InsertPolicy: "policy", ops.InsertApiToken: "api_token",
    ops.RevokeApiToken: "api_token_revoked", ops.InsertStatement: "statement", ops.UpsertService: "service_deployed",
    ops.UpdateService: "service_updated", ops.RequestScale: "service_scale_requested",
    ops.SetServiceScale: "service_scaled", ops.SetServiceLoad: "service_load",
    ops.MarkServiceDeleted: "service_deleted", ops.InsertReplica: "replica_requested",
    ops.SetReplicaState: "replica_state",
}

# A job_update row: (job id, state or None, sequence, then per JOB_COLUMNS column a flag, then
# its value); the flag of each column at this position.
_FLAG_AT: dict[str, int] = {c: 3 + 2 * i for i, (c, _) in enumerate(JOB_COLUMNS)}
_NO_CHANGE = (False, None) * len(JOB_COLUMNS)
_SUBMITTED = JobState.SUBMITTED.value  # a new job row's state


# operation type -> its group in a plan: (phase, statement) for the phased statements; the
# statement alone for those kept in log order
_GROUP: dict[type, tuple[int, str]] = {kind: (_PHASE[name], name) for kind, name in STATEMENTS.items()
                                       if name in _PHASE}
_IN_ORDER: dict[type, str] = {kind: name for kind, name in STATEMENTS.items() if name not in _PHASE}


def _unknown_column(columns) -> ValueError:
    unknown = sorted(set(columns) - set(_FLAG_AT))
    return ValueError(f"SetJobState: no job column {unknown[0]!r}; columns: {sorted(_FLAG_AT)}")


def plan(operations: list[ops.Operation], book: ledger.Book | None = None) -> list[tuple[str, list[tuple]]]:
    """The batch's operations as (statement, rows) groups in the order they are executed, by
    each operation's type; ``book`` (if given) collects the batch's ledger facts and its
    attempts' ends, in log order.

    A job's changes (:class:`.operations.SetJobState`, :class:`.operations.SetWaitReason`) fold
    into one job_update row per job as they come, in log order: the later value of each column
    wins, the latest state and sequence. Nothing in a batch reads a job's mutable columns
    between its updates (phase order), so one update per job has the same effect as several.
    The rows of job_submitted and reservation are their operations until :func:`_fold`
    completes them. This loop runs for every operation of a replay, so the fold is written out
    here rather than called."""
    grouped: dict[tuple[int, str], list] = {}
    ordered: list[tuple[str, list]] = []
    updates: dict[str, list] = {}
    group_of, flag_at, set_state, wait_reason = _GROUP, _FLAG_AT, ops.SetJobState, ops.SetWaitReason
    take = None if book is None else book.add
    for op in operations:
        kind = type(op)
        if take is not None:
            take(op)
        key = group_of.get(kind)
        if key is not None:
            rows = grouped.get(key)
            if rows is None:
                grouped[key] = rows = []
            rows.append(op)
            continue
        if kind is set_state:
            job_id, state, seq, columns = op
        elif kind is wait_reason:
            job_id, state, seq, columns = op.job_id, None, op.seq, {"reason": op.reason, "message": op.message}
        else:
            name = _IN_ORDER.get(kind)
            if name is not None:
                if ordered and ordered[-1][0] == name:
                    ordered[-1][1].append(op)
                else:
                    ordered.append((name, [op]))
            elif kind is not ops.AttemptEnded:  # an attempt's end is the ledger's (the book took it)
                raise ValueError(f"no statement for operation {op!r}")
            continue
        row = updates.get(job_id)
        if row is None:
            updates[job_id] = row = [job_id, state, seq, *_NO_CHANGE]
        else:
            if state is not None:
                row[1] = state
            row[2] = seq
        for column, value in columns.items():
            at = flag_at.get(column)
            if at is None:
                raise _unknown_column(columns)
            row[at] = True
            row[at + 1] = value
    if updates:
        grouped[(_PHASE["job_update"], "job_update")] = [tuple(r) for r in updates.values()]
    return [(name, rows) for (_, name), rows in sorted(grouped.items())] + ordered


async def _fold(conn: asyncpg.Connection, groups: list[tuple[str, list[tuple]]]) -> list[tuple[str, list[tuple]]]:
    """Rows the batch inserts and then changes, inserted changed: a job submitted and updated in
    the batch is one insert with its final state (not an insert and an update: a second version
    of the row and of each of its index entries), a reservation reserved and released in it is
    one insert with its release. Only for rows that do not exist yet (one indexed probe): the
    change to a row that exists stays an update. The same effect as the phases, applied in order.
    Completes the rows of job_submitted and reservation (their operations in the plan)."""
    groups = [(name, list(rows)) for name, rows in groups]
    by_name = {name: rows for name, rows in groups if name in _PHASE}  # one group per phased statement
    subs, updates = by_name.get("job_submitted"), by_name.get("job_update")
    if subs:
        folded_jobs: dict[int, tuple] = {}
        if updates:
            rejected = {r.job_id for r in by_name.get("job_rejected", ())}
            update_of = {r[0]: r for r in updates}  # merged: one per job
            first: dict[str, int] = {}
            for i, sub in enumerate(subs):
                if sub.job_id in update_of and sub.job_id not in rejected:
                    first.setdefault(sub.job_id, i)
            if first:
                exists = {r[0] for r in await conn.fetch("SELECT job_id FROM jobs WHERE job_id = ANY($1::text[])",
                                                         list(first))}
                spec, folded = len(JOB_SPEC_COLUMNS), set()
                for job_id, i in first.items():
                    if job_id in exists:
                        continue
                    upd = update_of[job_id]  # (job, state, seq, flag, value, ...)
                    row = [*subs[i]._replace(seq=upd[2]), _SUBMITTED if upd[1] is None else upd[1], *JOB_DEFAULTS]
                    for k in range(len(JOB_COLUMNS)):
                        if upd[3 + 2 * k]:
                            row[spec + 1 + k] = upd[4 + 2 * k]
                    folded_jobs[i] = tuple(row)
                    folded.add(job_id)
                updates[:] = [r for r in updates if r[0] not in folded]
        subs[:] = [folded_jobs.get(i) or (*sub, _SUBMITTED, *JOB_DEFAULTS) for i, sub in enumerate(subs)]
    reservations, releases = by_name.get("reservation"), by_name.get("reservation_released")
    if reservations:
        folded_reservations: dict[int, tuple] = {}
        if releases:
            release_of: dict[tuple[str, int], ops.ReleaseReservation] = {}
            for r in releases:
                release_of.setdefault((r.job_id, r.attempt), r)  # the first release of an attempt is the one applied
            firsts: dict[tuple[str, int], int] = {}
            for i, r in enumerate(reservations):
                if (r.job_id, r.attempt) in release_of:
                    firsts.setdefault((r.job_id, r.attempt), i)
            if firsts:
                keys = list(firsts)
                exists_r = {(r[0], r[1]) for r in await conn.fetch(
                    "SELECT job_id, attempt FROM reservations WHERE (job_id, attempt) IN "
                    "(SELECT * FROM unnest($1::text[], $2::integer[]))", [k[0] for k in keys], [k[1] for k in keys])}
                folded_keys = set()
                for key, i in firsts.items():
                    if key in exists_r:
                        continue
                    release = release_of[key]  # the row takes the release's sequence and time
                    folded_reservations[i] = (*reservations[i]._replace(seq=release.seq), release.released_at)
                    folded_keys.add(key)
                releases[:] = [r for r in releases if (r.job_id, r.attempt) not in folded_keys]
        reservations[:] = [folded_reservations.get(i) or (*r, None)  # not released
                           for i, r in enumerate(reservations)]
    return [(name, rows) for name, rows in groups if rows]


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply the numbered SQL files not applied yet; safe when several replicas start at once."""
    applied: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        files = sorted(
            (f for f in resources.files("services.accounting.migrations").iterdir() if f.name.endswith(".sql")),
            key=lambda f: f.name,
        )
        for f in files:
            version = f.name.removesuffix(".sql")
            if version in done:
                continue
            await conn.execute(f.read_text())
            await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
            applied.append(version)
    if applied:
        log.info("applied migrations", extra={"versions": applied})
    return applied


async def position(conn: asyncpg.Connection, projection: str = PROJECTION) -> int:
    value = await conn.fetchval("SELECT last_sequence FROM projection_position WHERE projection = $1", projection)
    return value or 0


PARTITION_ROWS = "projection = 'read-models' OR projection LIKE 'read-models/p%'"
"""SQL condition: every accounting partition's position row (services/accounting/partition.py)."""
_CLAIM_LOCK = 0x6770_7370  # advisory lock key for a partition's start ("gpsp")


class PartitioningChanged(RuntimeError):
    """The position rows say another number of partitions than this process runs with."""


async def partition_rows(conn: asyncpg.Connection) -> dict[str, tuple[int, int]]:
    """Every partition's position row: projection -> (last sequence, partitions)."""
    return {r[0]: (r[1], r[2]) for r in await conn.fetch(
        f"SELECT projection, last_sequence, partitions FROM projection_position WHERE {PARTITION_ROWS}")}


async def complete_position(conn: asyncpg.Connection) -> int:
    """The position up to which the read models hold every event: the lowest partition's
    (:mod:`.partition`); the only one's when unpartitioned."""
    return await conn.fetchval(
        f"SELECT coalesce(min(last_sequence), 0) FROM projection_position WHERE {PARTITION_ROWS}")


async def claim(conn: asyncpg.Connection, projection: str, names: list[str], *, may_change: bool) -> int | None:
    """Where a partition (position row ``projection``, one of ``names``: every partition's)
    starts, or None when the rows are not exactly ``names``, each saying ``len(names)``
    partitions, and the caller may not change them. ``may_change`` (partition 0): the rows are
    then set to ``names``, each at the lowest position there was, so that each partition reads
    again from there, passing over what it applied already by event id. Only partition 0 changes
    them: in a rolling change of the number, a pod still on the old number restarting cannot
    turn it back."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _CLAIM_LOCK)
        rows = await partition_rows(conn)
        if set(rows) == set(names) and all(n == len(names) for _, n in rows.values()):
            return rows[projection][0]
        if not may_change:
            return None
        floor = min((seq for seq, _ in rows.values()), default=0)
        if rows:
            log.warning("accounting partitions changed: every partition starts again from the lowest position",
                        extra={"partitions": len(names), "before": sorted(rows), "from_sequence": floor})
        await conn.execute(f"DELETE FROM projection_position WHERE {PARTITION_ROWS}")
        await conn.executemany("INSERT INTO projection_position (projection, last_sequence, partitions) "
                               "VALUES ($1, $2, $3)", [(name, floor, len(names)) for name in names])
        return floor


Entry = tuple[int, list[ops.Operation]] | tuple[int, str | None, list[ops.Operation]]
"""(sequence, ops) or (sequence, event id, ops); an entry without an id is not de-duplicated by id."""


@dataclass(frozen=True)
class Prepared:
    """What applying a batch takes that needs no database, worked out ahead (a replay's writer
    does it while an earlier batch is being written): the batch's event ids at their first
    sequence in it, the plan of every event in it but the copies of an id earlier in the
    batch, and its ledger facts. Valid as long as the target has none of the batch yet (its
    position is below the batch, and no id in it was applied before); :func:`apply_batch`
    checks, and works it out again for what is left when not."""

    entries: list[tuple[int, str | None, list[ops.Operation]]]
    first: dict[str, int]  # event id -> its first sequence in the batch
    groups: list[tuple[str, list[tuple]]]
    applied: int  # events planned
    low: int  # the batch's lowest and highest sequence (0 if empty)
    high: int
    book: ledger.Book = field(default_factory=ledger.Book)


def prepare(batch: list[Entry], skip: frozenset[str] | set[str] = frozenset()) -> Prepared:
    """The batch's plan, less the events whose id is in ``skip`` (applied by an earlier batch)."""
    entries = [(e[0], e[1] if len(e) == 3 else None, e[-1]) for e in batch]
    first: dict[str, int] = {}
    for seq, event_id, _ in entries:
        if event_id is not None and event_id not in first:
            first[event_id] = seq
    planned: list[ops.Operation] = []
    applied = 0
    for seq, event_id, event_ops in entries:
        if event_id is not None and (event_id in skip or first[event_id] != seq):
            continue  # the same event appended again: no effect
        planned += event_ops
        applied += 1
    seqs = [e[0] for e in entries]
    book = ledger.Book()
    return Prepared(entries, first, plan(planned, book), applied, min(seqs, default=0), max(seqs, default=0), book)


_PRIOR = """
    SELECT k.job_id, k.attempt, j.team, j.project, j.queue, j.total_gpus, j.cpu_millis, j.memory_mib, j.gpu_milli,
           j.flavor,
           r.queue AS r_queue, r.flavor AS r_flavor, r.gpus AS r_gpus, r.borrowed AS r_borrowed,
           r.gpu_milli AS r_gpu_milli, r.borrowed_milli AS r_borrowed_milli, a.queued_at,
           ARRAY(SELECT c.checkpointed_at FROM checkpoints c
                 WHERE c.job_id = k.job_id AND c.attempt = k.attempt) AS checkpoints
    FROM unnest($1::text[], $2::integer[]) AS k(job_id, attempt)
    LEFT JOIN jobs j ON j.job_id = k.job_id
    LEFT JOIN reservations r ON r.job_id = k.job_id AND r.attempt = k.attempt
    LEFT JOIN attempts a ON a.job_id = k.job_id AND a.attempt = k.attempt"""


async def prior_facts(conn: asyncpg.Connection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], ledger.Facts]:
    """What the read models hold (written by earlier batches) about these attempts: their job's
    submission and flavor, reservation, queue time and checkpoints; an attempt they know
    nothing of is absent. Keyed lookups only."""
    if not keys:
        return {}
    out = {}
    for r in await conn.fetch(_PRIOR, [k[0] for k in keys], [k[1] for k in keys]):
        if r["team"] is None and r["r_flavor"] is None and r["queued_at"] is None and not r["checkpoints"]:
            continue  # no job row (so no flavor either), no reservation, queue time or checkpoint
        job = None if r["team"] is None else ledger.JobFacts(r["team"], r["project"], r["queue"], r["total_gpus"],
                                                             r["cpu_millis"], r["memory_mib"], r["gpu_milli"])
        reservation = None if r["r_flavor"] is None else ledger.Reservation(
            r["r_queue"], r["r_flavor"], r["r_gpus"], r["r_borrowed"], r["r_gpu_milli"], r["r_borrowed_milli"])
        # every checkpoint written before this batch precedes its ends in the log (sequence 0)
        out[(r["job_id"], r["attempt"])] = ledger.Facts(job=job, flavor=r["flavor"], reservation=reservation,
                                                        queued_at=r["queued_at"],
                                                        checkpoints=tuple((at, 0) for at in r["checkpoints"]))
    return out


async def apply_batch(conn: asyncpg.Connection, batch: list[Entry] | Prepared, projection: str = PROJECTION, *,
                      maybe_applied: Container[str] | None = None, partitions: int | None = None) -> int:
    """Apply the operations of every event newer than the stored position and not applied
    before (by event id), then store the new position, all in one transaction. Returns how many
    events were applied. ``batch``: entries, or entries prepared (:func:`prepare`).
    ``maybe_applied``: see :func:`_record_applied`. ``partitions``: the number of partitions the
    caller runs with; :class:`PartitioningChanged` (nothing applied) if the position row says
    another (a replay into a target of its own passes None)."""
    prepared = batch if isinstance(batch, Prepared) else prepare(batch)
    if not prepared.entries:
        return 0
    try:
        return await _apply_batch(conn, prepared, projection, maybe_applied, partitions)
    except BaseException:
        copy.forget(conn)
        raise


async def _record_applied(conn: asyncpg.Connection, prepared: Prepared,
                          maybe_applied: Container[str] | None = None) -> set[str]:
    """Record the batch's event ids (at their first sequence in it) and return those an earlier
    batch applied. ``maybe_applied``: ids that may have been applied to this target before,
    at least every one that was (for a replay into a fresh shadow: what its Bloom filter of the
    ids applied so far lets through); an id not in it needs no lookup. None: every id is
    looked up."""
    if not prepared.first:
        return set()
    if maybe_applied is None:
        maybe = list(prepared.first)
    else:
        maybe = [event_id for event_id in prepared.first if event_id in maybe_applied]
    earlier: set[str] = set()
    if maybe:  # by the key Postgres derives from the id (migration 008): the primary key's index
        earlier = {r[0] for r in await conn.fetch(
            "SELECT event_id FROM applied_events WHERE event_key = ANY(SELECT md5(i)::uuid FROM unnest($1::text[]) i)",
            maybe)}
    records = list(prepared.first.items())  # (id, its first sequence in the batch)
    if earlier:
        records = [r for r in records if r[0] not in earlier]
    await conn.copy_records_to_table("applied_events", records=records, columns=["event_id", "sequence"])
    return earlier


async def _apply_batch(conn: asyncpg.Connection, prepared: Prepared, projection: str,
                       maybe_applied: Container[str] | None, partitions: int | None) -> int:
    async with conn.transaction():
        if partitions is None:  # a replay's target: its row starts at 0
            await conn.execute(
                "INSERT INTO projection_position (projection, last_sequence) VALUES ($1, 0) ON CONFLICT DO NOTHING",
                projection)
        row = await conn.fetchrow(
            "SELECT last_sequence, partitions FROM projection_position WHERE projection = $1 FOR UPDATE", projection)
        if partitions is not None and (row is None or row["partitions"] != partitions):
            raise PartitioningChanged(
                f"accounting's position rows say {row['partitions'] if row else 'another number of'} partition(s); "
                f"this process runs with GPUSCHED_ACCOUNTING_PARTITIONS={partitions}: it claims its partition again "
                "(services/accounting/partition.py)")
        current = row["last_sequence"]
        if prepared.low <= current:  # some of it is applied already (a redelivery): plan what is left
            prepared = prepare([e for e in prepared.entries if e[0] > current])
        high = max(prepared.high, current)
        earlier = await _record_applied(conn, prepared, maybe_applied)  # ids applied by an earlier batch
        if earlier:
            prepared = prepare(prepared.entries, skip=earlier)
        usage = ledger.rows(prepared.book, await prior_facts(conn, prepared.book.keys()))
        for name, rows in await _fold(conn, prepared.groups):
            await copy.execute(conn, name, rows)
        if usage:
            await copy.execute(conn, "usage", usage)
        if high > current:
            await conn.execute(
                "UPDATE projection_position SET last_sequence = $2, updated_at = now() WHERE projection = $1",
                projection, high,
            )
    return prepared.applied
