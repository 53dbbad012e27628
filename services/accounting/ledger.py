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
from typing import NamedTuple

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


class Ended(NamedTuple):
    """An attempt's end, as the converter emits it (operation ``attempt_ended``)."""
    job_id: str
    attempt: int
    started_at: datetime
    ended_at: datetime
    seconds: float  # ended_at - started_at, never negative
    outcome: str  # the event type that ended it
    sequence: int


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
    each ``attempt_ended`` is kept with the facts the batch had given by then (:attr:`ended`).
    The statement names and argument layouts are the converter's (:mod:`.projection`)."""

    jobs: dict[str, JobFacts] = field(default_factory=dict)
    flavors: dict[str, str | None] = field(default_factory=dict)  # job -> flavor last set in the batch
    reservations: dict[tuple[str, int], Reservation] = field(default_factory=dict)
    queued: dict[tuple[str, int], datetime] = field(default_factory=dict)
    checkpoints: dict[tuple[str, int], list[tuple[datetime, int]]] = field(default_factory=dict)
    ended: list[tuple[Ended, Facts, bool]] = field(default_factory=list)  # (end, the batch's facts, flavor set)

    def add(self, statement: str, args: tuple) -> None:
        """Take note of one operation (run for every operation of a replay: one dictionary
        lookup for those that carry no ledger fact)."""
        take = _TAKE.get(statement)
        if take is None and statement not in _TAKE:
            take = _TAKE[statement] = _flavor_setter(statement)
        if take is not None:
            take(self, args)

    def keys(self) -> list[tuple[str, int]]:
        """The attempts that end in the batch: whose earlier facts the read models are asked for."""
        return list(dict.fromkeys((end.job_id, end.attempt) for end, _, _ in self.ended))


def _submitted(book: Book, args: tuple) -> None:
    # (job, team, project, queue, kind, class, submitter, gpus, gang, total_gpus, at, seq, cpu, mem, gpu_milli)
    if args[0] not in book.jobs:
        book.jobs[args[0]] = JobFacts(args[1], args[2], args[3], args[9], args[12], args[13], args[14])


def _reserved(book: Book, args: tuple) -> None:  # (job, attempt, queue, flavor, gpus, borrowed, at, seq)
    if (key := (args[0], args[1])) not in book.reservations:
        book.reservations[key] = Reservation(*args[2:8])


def _queued(book: Book, args: tuple) -> None:  # (job, attempt, at, seq)
    book.queued.setdefault((args[0], args[1]), args[2])


def _checkpointed(book: Book, args: tuple) -> None:  # (job, attempt, at, seq)
    book.checkpoints.setdefault((args[0], args[1]), []).append((args[2], args[3]))


def _ended(book: Book, args: tuple) -> None:
    end = Ended(*args)
    job_id, key = end.job_id, (end.job_id, end.attempt)
    checkpoints = book.checkpoints.get(key)
    book.ended.append((end, Facts(book.jobs.get(job_id), book.flavors.get(job_id), book.reservations.get(key),
                                  book.queued.get(key), tuple(checkpoints) if checkpoints else ()),
                       job_id in book.flavors))


def _flavor_setter(statement: str) -> Callable[[Book, tuple], None] | None:
    """For ``set_state:a,b`` (arguments: job, state, seq, then the named columns' values) that
    names the flavor: a note of the job's flavor. None for any other statement."""
    if not statement.startswith("set_state:"):
        return None
    columns = statement.split(":", 1)[1].split(",")
    if "flavor" not in columns:
        return None
    at = 3 + columns.index("flavor")

    def note(book: Book, args: tuple) -> None:
        book.flavors[args[0]] = args[at]
    return note


# statement -> what the book notes of it (None: nothing); set_state statements are added as met
_TAKE: dict[str, Callable[[Book, tuple], None] | None] = {
    "job_submitted": _submitted, "reservation": _reserved, "attempt_queued": _queued,
    "checkpoint": _checkpointed, "attempt_ended": _ended,
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
