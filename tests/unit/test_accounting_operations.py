"""Accounting's typed operations (services/accounting/operations.py): the converter takes a job's
state from the contract's map, the sink applies each operation type with its statement, and a
job's changes fold into one update."""

from __future__ import annotations

import re
import typing

import pytest

from schemas.jobstate import EVENT_STATES, JobState
from services.accounting import operations as ops
from services.accounting import sink
from services.accounting.projection import convert
from services.accounting.sql import JOB_COLUMNS, SQL
from tests.unit.builders import (
    admitted, at, cancel_requested, cancelled, failed, preempted, preemption_requested, reclaim_requested, reserved,
    retry_scheduled, scheduled, started, submitted, succeeded,
)

SEQ = 7


def requeue(after: str | None):
    return retry_scheduled("j1", 1, when=at(40)).model_copy(update={"after": after})


@pytest.mark.parametrize(("after", "state"), [
    ("JobPreempted", JobState.QUEUED),  # requeued: waits for quota for a fresh attempt
    ("JobFailed", JobState.RETRYING),
    (None, JobState.RETRYING),  # logged before `after` was: as a failure's
])
def test_a_retry_sets_the_state_the_contract_gives_with_the_new_attempt(after, state):
    assert convert(requeue(after), SEQ) == [
        ops.SetJobState("j1", state, SEQ, {"attempt": 2, "finished_at": None}),
        ops.InsertAttempt("j1", 2, at(40), SEQ)]


JOB_EVENTS = [
    admitted("j1"), reserved("j1"), scheduled("j1", {"n1": (0,)}), started("j1"), reclaim_requested("j1"),
    preemption_requested("j1"), succeeded("j1", started_at=at(0)), failed("j1", started_at=at(0)),
    preempted("j1", started_at=at(0)), cancel_requested("j1"), cancelled("j1", started_at=at(0)),
]


@pytest.mark.parametrize("event", JOB_EVENTS, ids=[e.type for e in JOB_EVENTS])
def test_a_job_event_sets_the_state_of_the_contracts_map(event):
    (change,) = [op for op in convert(event, SEQ) if isinstance(op, ops.SetJobState)]
    assert change.state is EVENT_STATES[event.type]


def test_a_submission_is_inserted_in_state_submitted():
    plan = sink.plan(convert(submitted("j1"), SEQ))
    assert [name for name, _ in plan] == ["job_submitted"]
    (op,) = plan[0][1]
    assert isinstance(op, ops.InsertJob) and op.job_id == "j1" and op.seq == SEQ


def test_every_operation_type_has_a_statement_or_a_fold():
    every = set(typing.get_args(ops.Operation))
    assert every == set(sink.STATEMENTS) | {ops.SetJobState, ops.SetWaitReason, ops.AttemptEnded}
    assert set(sink.STATEMENTS.values()) <= set(SQL)


def _parameters(statement: str) -> int:
    return max(int(n) for n in re.findall(r"\$(\d+)", SQL[statement]))


@pytest.mark.parametrize("kind", list(sink.STATEMENTS), ids=lambda k: k.__name__)
def test_an_operations_fields_are_its_statements_parameters(kind):
    """In order, by name: the sink passes an operation as it is (InsertJob and InsertReservation
    completed by the columns the converter does not set: the new row's state and job columns,
    the release)."""
    extra = {ops.InsertJob: 1 + len(JOB_COLUMNS), ops.InsertReservation: 1}.get(kind, 0)
    assert len(kind._fields) + extra == _parameters(sink.STATEMENTS[kind])


def test_a_jobs_changes_in_a_batch_fold_into_one_update_in_log_order():
    batch = [*convert(reserved("j1", flavor="h100", when=at(3)), 1),
             ops.SetWaitReason("j1", "fragmentation", "no node", 2),
             *convert(scheduled("j1", {"n1": (0,)}, flavor="a100", when=at(4)), 3),
             ops.SetWaitReason("j1", "late", "a wait reason after the placement", 4)]
    groups = dict(sink.plan(batch))
    (row,) = groups["job_update"]
    columns = {c: (row[3 + 2 * i], row[4 + 2 * i]) for i, (c, _) in enumerate(JOB_COLUMNS)}
    assert row[:3] == ("j1", JobState.SCHEDULED, 4)  # the latest state and sequence
    assert columns["flavor"] == (True, "a100") and columns["nodes"] == (True, ["n1"])
    assert columns["reason"] == (True, "late") and columns["reserved_at"] == (True, at(3))
    assert columns["exit_code"] == (False, None)


def test_a_change_to_a_column_jobs_do_not_have_is_refused():
    with pytest.raises(ValueError, match="no job column 'colour'"):
        sink.plan([ops.SetJobState("j1", JobState.RUNNING, 1, {"colour": "red"})])


def test_an_operation_the_sink_has_no_statement_for_is_refused():
    with pytest.raises(ValueError, match="no statement for operation"):
        sink.plan([("job_rejected", ("j1",))])


def test_the_book_takes_the_ledger_facts_by_name():
    from services.accounting.ledger import Book

    book = Book()
    for op in [*convert(submitted("j1"), 1), *convert(reserved("j1", flavor="h100"), 2),
               *convert(scheduled("j1", {"n1": (0,)}, flavor="a100"), 3)]:
        book.add(op)
    assert book.jobs["j1"].team == "team-a"
    assert book.reservations[("j1", 1)].flavor == "h100"
    assert book.flavors == {"j1": "a100"}  # the flavor last set
