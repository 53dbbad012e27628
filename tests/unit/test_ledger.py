"""The usage ledger's rules (services.accounting.ledger): an attempt's row from the facts logged
before it ended, table-driven; and the batch book that collects those facts in log order."""

from __future__ import annotations

import pytest

from services.accounting import ledger, projection
from services.accounting.ledger import Book, Ended, Facts, JobFacts, Reservation, rows, usage_row
from tests.unit.builders import (
    admitted, at, checkpointed, preempted, reserved, retry_scheduled, scheduled, spec, started, submitted, succeeded,
)

JOB = JobFacts(team="team-a", project="vision", queue="research", total_gpus=8, cpu_millis=2000, memory_mib=4096)
RES = Reservation(queue="borrowed-q", flavor="a100", gpus=4, borrowed=1)


def end(outcome="JobSucceeded", *, start=100, stop=200, seq=50, attempt=1) -> Ended:
    return Ended("j1", attempt, at(start), at(stop), max(0.0, float(stop - start)), outcome, seq)


def row(facts: Facts, ended: Ended) -> dict | None:
    r = usage_row(facts, ended)
    return None if r is None else dict(zip(ledger.USAGE_COLUMNS, r))


CASES = [
    ("reserved: the reservation's queue, flavor, GPUs and borrowed part",
     Facts(job=JOB, flavor="h100", reservation=RES, queued_at=at(40)), end(),
     {"team": "team-a", "project": "vision", "queue": "borrowed-q", "flavor": "a100", "gpus": 4,
      "gpu_seconds": 400.0, "borrowed_gpus": 1, "borrowed_gpu_seconds": 100.0, "lost_gpu_seconds": 0.0,
      "queued_at": at(40), "wait_seconds": 60.0, "cpu_core_seconds": 200.0, "memory_gib_seconds": 400.0,
      "last_checkpoint_at": None, "outcome": "JobSucceeded", "sequence": 50}),
    ("no reservation: the job's queue, GPUs and last flavor, nothing borrowed",
     Facts(job=JOB, flavor="h100"), end(),
     {"queue": "research", "flavor": "h100", "gpus": 8, "gpu_seconds": 800.0, "borrowed_gpus": 0,
      "borrowed_gpu_seconds": 0.0, "queued_at": None, "wait_seconds": None}),
    ("no flavor known: not charged", Facts(job=JOB), end(), None),
    ("never submitted: not charged", Facts(flavor="a100", reservation=RES), end(), None),
    ("preempted: the work since the last checkpoint logged before the end is lost",
     Facts(job=JOB, reservation=RES, checkpoints=((at(150), 40), (at(120), 30), (at(190), 60), (at(250), 45))),
     end("JobPreempted"),
     {"last_checkpoint_at": at(150), "lost_gpu_seconds": 4 * 50.0}),
    ("preempted without a checkpoint: all of it is lost",
     Facts(job=JOB, reservation=RES), end("JobPreempted"), {"last_checkpoint_at": None, "lost_gpu_seconds": 400.0}),
    ("preempted with a checkpoint from before the start: lost since the start",
     Facts(job=JOB, reservation=RES, checkpoints=((at(10), 5),)), end("JobPreempted"),
     {"last_checkpoint_at": at(10), "lost_gpu_seconds": 400.0}),
    ("failed: nothing counted as lost, the checkpoint recorded",
     Facts(job=JOB, reservation=RES, checkpoints=((at(150), 40),)), end("JobFailed"),
     {"last_checkpoint_at": at(150), "lost_gpu_seconds": 0.0}),
    ("queued after it started (clock skew): no negative wait",
     Facts(job=JOB, reservation=RES, queued_at=at(130)), end(), {"wait_seconds": 0.0}),
    ("an end before its start: zero time, nothing negative",
     Facts(job=JOB, reservation=RES), end("JobPreempted", start=200, stop=150),
     {"gpu_seconds": 0.0, "lost_gpu_seconds": 0.0, "cpu_core_seconds": 0.0}),
    ("a quarter of one GPU reserved as a whole one (logs before quota counted thousandths): charged a quarter",
     Facts(job=JOB._replace(total_gpus=1, gpu_milli=250), reservation=RES._replace(gpus=1, borrowed=1)),
     end("JobPreempted"),
     {"gpus": 0.25, "gpu_seconds": 25.0, "borrowed_gpus": 0.25, "borrowed_gpu_seconds": 25.0,
      "lost_gpu_seconds": 25.0}),
    ("a quarter of one GPU, its reservation in thousandths: what it holds and borrowed, exactly",
     Facts(job=JOB._replace(total_gpus=1, gpu_milli=250),
           reservation=RES._replace(gpus=1, borrowed=1, gpu_milli=250, borrowed_milli=100)),
     end("JobPreempted"),
     {"gpus": 0.25, "gpu_seconds": 25.0, "borrowed_gpus": 0.1, "borrowed_gpu_seconds": 10.0,
      "lost_gpu_seconds": 25.0}),
    ("a whole GPU that borrowed what fractional jobs left: the borrowed thousandths",
     Facts(job=JOB._replace(total_gpus=1), reservation=RES._replace(gpus=1, borrowed=1, borrowed_milli=750)), end(),
     {"gpus": 1.0, "borrowed_gpus": 0.75, "borrowed_gpu_seconds": 75.0}),
    ("a gang of fractional members without a reservation: the fraction of each member's GPU",
     Facts(job=JOB._replace(total_gpus=2, gpu_milli=500), flavor="l4"), end(),
     {"gpus": 1.0, "gpu_seconds": 100.0, "borrowed_gpus": 0.0}),
    ("no CPU or memory in the spec: zero",
     Facts(job=JOB._replace(cpu_millis=None, memory_mib=None), reservation=RES), end(),
     {"cpu_core_seconds": 0.0, "memory_gib_seconds": 0.0}),
]


@pytest.mark.parametrize(("facts", "ended", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_usage_row(facts, ended, expected):
    got = row(facts, ended)
    if expected is None:
        assert got is None
    else:
        assert {k: got[k] for k in expected} == expected


def test_earlier_facts_stand_and_the_flavor_is_the_last_set():
    earlier = Facts(job=JOB, flavor="a100", reservation=RES, queued_at=at(1), checkpoints=((at(2), 0),))
    later = Facts(job=JOB._replace(team="team-z"), flavor="h100", reservation=RES._replace(gpus=8),
                  queued_at=at(3), checkpoints=((at(4), 9),))
    assert earlier.after(later, flavor_set=True) == Facts(job=JOB, flavor="h100", reservation=RES, queued_at=at(1),
                                                          checkpoints=((at(2), 0), (at(4), 9)))
    assert earlier.after(later, flavor_set=False).flavor == "a100"
    assert Facts().after(later, flavor_set=True) == later


def book_of(events) -> Book:
    book = Book()
    for seq, event in enumerate(events, start=1):
        for op in projection.convert(event, seq):
            book.add(op)
    return book


def test_the_book_keeps_what_the_batch_logged_before_each_end():
    """Attempt 1 preempted after a checkpoint, attempt 2 succeeds; a re-decided reservation (new
    id, more GPUs) and a checkpoint logged after attempt 1's end change nothing for it. The
    reservations are for one GPU (the spec asks for two: the reservation counts)."""
    events = [
        submitted("j1", spec(gpus=2), when=at(0)), admitted("j1", when=at(0)),
        reserved("j1", flavor="a100", attempt=1, when=at(5)),
        reserved("j1", flavor="a100", attempt=1, when=at(6)).model_copy(update={"event_id": "again", "gpus": 8}),
        scheduled("j1", {"n1": (0, 1)}, flavor="a100", when=at(7)), started("j1", when=at(10)),
        checkpointed("j1", attempt=1, at_=at(40), when=at(41)),
        preempted("j1", started_at=at(10), when=at(70)),
        checkpointed("j1", attempt=1, at_=at(60), when=at(71)),  # logged after the end
        retry_scheduled("j1", 1, not_before=at(80), when=at(80)),
        reserved("j1", flavor="h100", attempt=2, when=at(90)), started("j1", when=at(100)),
        succeeded("j1", attempt=2, started_at=at(100), when=at(200)),
    ]
    book = book_of(events)
    assert book.keys() == [("j1", 1), ("j1", 2)]
    first, second = (dict(zip(ledger.USAGE_COLUMNS, r)) for r in rows(book, {}))
    assert (first["gpus"], first["flavor"], first["last_checkpoint_at"], first["lost_gpu_seconds"]) == (
        1, "a100", at(40), 30.0)
    assert (first["queued_at"], first["wait_seconds"], first["outcome"]) == (at(0), 10.0, "JobPreempted")
    assert (second["flavor"], second["queued_at"], second["wait_seconds"], second["gpu_seconds"]) == (
        "h100", at(80), 20.0, 100.0)


def test_facts_of_earlier_batches_come_first():
    """The read models' facts (an earlier batch's submission and reservation) stand over a
    re-decided copy in this batch; the batch's own later flavor change applies."""
    batch = [reserved("j1", flavor="h100", attempt=1, when=at(5)).model_copy(update={"gpus": 8}),
             started("j1", when=at(10)), succeeded("j1", started_at=at(10), when=at(20))]
    book = book_of(batch)
    prior = {("j1", 1): Facts(job=JOB, flavor="a100", reservation=RES, queued_at=at(0))}
    (r,) = rows(book, prior)
    got = dict(zip(ledger.USAGE_COLUMNS, r))
    assert (got["team"], got["gpus"], got["flavor"], got["queue"]) == ("team-a", 4, "a100", "borrowed-q")
    assert rows(book, {}) == []  # nothing says the job was submitted


def test_a_fractional_attempt_is_charged_its_share_through_the_book():
    """The submission's gpu_milli travels with the job's facts: a quarter of an L4 for an hour is
    a quarter of a GPU-hour, though quota reserved the whole GPU."""
    events = [
        submitted("f1", spec(gpus=1, gpu_milli=250), when=at(0)), admitted("f1", when=at(0)),
        reserved("f1", flavor="l4", gpus=1, when=at(5)), started("f1", when=at(10)),
        succeeded("f1", started_at=at(10), when=at(3610)),
    ]
    (r,) = rows(book_of(events), {})
    got = dict(zip(ledger.USAGE_COLUMNS, r))
    assert (got["gpus"], got["gpu_seconds"], got["flavor"]) == (0.25, 900.0, "l4")
