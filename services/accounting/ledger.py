"""The usage ledger's rules: what an attempt that ended is charged, from the facts the log gave
about it before it ended. Pure: no database, no clock.

An attempt's row (``usage_ledger``) needs its job's submission (team, project, queue, GPUs, the
fraction of one GPU a member asks for, CPU and memory per replica), the reservation quota made
for the attempt (queue, flavor, GPUs, the borrowed part), when the attempt became eligible
(admission or the retry decision), its checkpoints, the job's flavor as last set, and the event
that ended it. Each fact's first occurrence stands (a re-decided submission or reservation under
a new event id changes nothing), as in the read models, and only facts logged before the end
count.

:class:`Book` collects these facts from one batch's operations in log order; the facts of
earlier batches come from the read models (:class:`Prior`, read by the sink in the batch's
transaction); :func:`usage_row` combines both and computes the row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from services.accounting.operations import (
    AttemptEnded, InsertAttempt, InsertCheckpoint, InsertJob, InsertReservation, Operation, SetJobState,
)

USAGE_COLUMNS = ("job_id", "attempt", "team", "project", "queue", "flavor", "gpus", "started_at", "ended_at",
                 "gpu_seconds", "outcome", "sequence", "borrowed_gpus", "borrowed_gpu_seconds", "lost_gpu_seconds",
                 "last_checkpoint_at", "queued_at", "wait_seconds", "cpu_core_seconds", "memory_gib_seconds")
PREEMPTED = "JobPreempted"  # the outcome whose work since the last checkpoint is lost
MILLI = 1000  # JobSpec.gpu_milli is in thousandths of one GPU


class JobFacts(NamedTuple):
    """What a job's submission says (``cpu_millis``/``memory_mib``: the whole gang's;
    ``gpu_milli``: the thousandths of its one GPU each member asks for, None for whole GPUs)."""
    team: str
    project: str | None
    queue: str
    total_gpus: int
    cpu_millis: int | None
    memory_mib: int | None
    gpu_milli: int | None = None

    @property
    def gpu_share(self) -> float:
        """The part of each GPU held that is charged: 1, or the fraction a shared GPU's member asked for."""
        return 1.0 if self.gpu_milli is None else self.gpu_milli / MILLI


class Reservation(NamedTuple):
    """Quota's reservation for the attempt: ``gpus``, ``borrowed`` in whole GPUs, and for a
    fractional job ``gpu_milli``, ``borrowed_milli`` in thousandths (QuotaReserved)."""
    queue: str
    flavor: str
    gpus: int
    borrowed: int
    gpu_milli: int | None = None
    borrowed_milli: int | None = None


Ended = AttemptEnded
"""An attempt's end, as the converter emits it (:class:`.operations.AttemptEnded`)."""


class Facts(NamedTuple):
    """What is known about an attempt when it ends. ``flavor``: the job's flavor as last set
    (None: never set)."""
    job: JobFacts | None = None
    flavor: str | None = None
    reservation: Reservation | None = None
    queued_at: datetime | None = None
    checkpoints: tuple[tuple[datetime, int], ...] = ()  # (checkpointed_at, sequence)

    def after(self, later: Facts, *, flavor_set: bool) -> Facts:
        """These facts (earlier ones) followed by ``later``'s: the first of each stands, the
        flavor is the last set, checkpoints add up."""
        return Facts(self.job or later.job, later.flavor if flavor_set else self.flavor,
                     self.reservation or later.reservation, self.queued_at or later.queued_at,
                     self.checkpoints + later.checkpoints)


def usage_row(facts: Facts, end: Ended) -> tuple | None:
    """The attempt's ledger row (columns :data:`USAGE_COLUMNS`), or None when it is not charged:
    its job was never submitted, or no flavor is known (neither reserved nor set). A fractional
    job is charged its fraction of each GPU it held: ``gpus`` and ``borrowed_gpus`` are GPUs
    charged, 0.25 for a quarter of one (what its reservation holds in thousandths; reservations
    written before they were counted so held whole GPUs, and are charged the job's fraction of them)."""
    job, res = facts.job, facts.reservation
    if job is None:
        return None
    flavor = res.flavor if res is not None else facts.flavor
    if flavor is None:
        return None
    share = job.gpu_share
    if res is None:
        gpus, borrowed = job.total_gpus * share, 0.0
    else:
        gpus = res.gpus * share if res.gpu_milli is None else res.gpu_milli / 1000
        borrowed = res.borrowed * share if res.borrowed_milli is None else res.borrowed_milli / 1000
    seconds = end.seconds
    checkpoint = max((at for at, seq in facts.checkpoints if seq < end.sequence and at <= end.ended_at),
                     default=None)
    lost = 0.0
    if end.outcome == PREEMPTED:
        since = end.started_at if checkpoint is None else max(end.started_at, checkpoint)
        lost = gpus * max(0.0, (end.ended_at - since).total_seconds())
    wait = None if facts.queued_at is None else max(0.0, (end.started_at - facts.queued_at).total_seconds())
    return (end.job_id, end.attempt, job.team, job.project, res.queue if res is not None else job.queue, flavor,
            gpus, end.started_at, end.ended_at, gpus * seconds, end.outcome, end.sequence, borrowed,
            borrowed * seconds, lost, checkpoint, facts.queued_at, wait,
            (job.cpu_millis or 0) / 1000 * seconds, (job.memory_mib or 0) / 1024 * seconds)


@dataclass
class Book:
    """The ledger facts of one batch, collected from its operations in log order (:meth:`add`);
    each :class:`AttemptEnded` is kept with the facts the batch had given by then (:attr:`ended`)."""

    jobs: dict[str, JobFacts] = field(default_factory=dict)
    flavors: dict[str, str | None] = field(default_factory=dict)  # job -> flavor last set in the batch
    reservations: dict[tuple[str, int], Reservation] = field(default_factory=dict)
    queued: dict[tuple[str, int], datetime] = field(default_factory=dict)
    checkpoints: dict[tuple[str, int], list[tuple[datetime, int]]] = field(default_factory=dict)
    ended: list[tuple[Ended, Facts, bool]] = field(default_factory=list)  # (end, the batch's facts, flavor set)

    def add(self, op: Operation) -> None:
        """Take note of one operation (run for every operation of a replay: one dictionary
        lookup for those that carry no ledger fact)."""
        take = _TAKE.get(type(op))
        if take is not None:
            take(self, op)

    def keys(self) -> list[tuple[str, int]]:
        """The attempts that end in the batch: whose earlier facts the read models are asked for."""
        return list(dict.fromkeys((end.job_id, end.attempt) for end, _, _ in self.ended))


def _submitted(book: Book, op: InsertJob) -> None:
    if op.job_id not in book.jobs:
        book.jobs[op.job_id] = JobFacts(op.team, op.project, op.queue, op.total_gpus, op.cpu_millis, op.memory_mib,
                                        op.gpu_milli)


def _reserved(book: Book, op: InsertReservation) -> None:
    if (key := (op.job_id, op.attempt)) not in book.reservations:
        book.reservations[key] = Reservation(op.queue, op.flavor, op.gpus, op.borrowed, op.gpu_milli,
                                             op.borrowed_milli)


def _queued(book: Book, op: InsertAttempt) -> None:
    book.queued.setdefault((op.job_id, op.attempt), op.queued_at)


def _checkpointed(book: Book, op: InsertCheckpoint) -> None:
    book.checkpoints.setdefault((op.job_id, op.attempt), []).append((op.checkpointed_at, op.seq))


def _ended(book: Book, end: AttemptEnded) -> None:
    job_id, key = end.job_id, (end.job_id, end.attempt)
    checkpoints = book.checkpoints.get(key)
    book.ended.append((end, Facts(book.jobs.get(job_id), book.flavors.get(job_id), book.reservations.get(key),
                                  book.queued.get(key), tuple(checkpoints) if checkpoints else ()),
                       job_id in book.flavors))


def _state_set(book: Book, op: SetJobState) -> None:
    """A job change that sets the flavor: the job's flavor as last set."""
    if "flavor" in op.columns:
        book.flavors[op.job_id] = op.columns["flavor"]


# operation type -> what the book notes of it; every other type carries no ledger fact
_TAKE: dict[type, Callable[[Book, Any], None]] = {
    InsertJob: _submitted, InsertReservation: _reserved, InsertAttempt: _queued, InsertCheckpoint: _checkpointed,
    AttemptEnded: _ended, SetJobState: _state_set,
}


def rows(book: Book, prior: dict[tuple[str, int], Facts]) -> list[tuple]:
    """The batch's ledger rows: each end's facts from earlier batches (``prior``, by attempt;
    absent: none), then the batch's own."""
    out = []
    for end, facts, flavor_set in book.ended:
        before = prior.get((end.job_id, end.attempt))
        if before is not None:
            facts = before.after(facts, flavor_set=flavor_set)
        if (row := usage_row(facts, end)) is not None:
            out.append(row)
    return out
