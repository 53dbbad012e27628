"""Accounting partitioned by team (services/accounting/partition.py): what each partition
applies, its position row, its settings. The team lookups and the positions run against a real
nats-server and Postgres in tests/integration/test_accounting_partitions.py."""

from __future__ import annotations

import pytest

from runtime.settings import ConfigError
from runtime.teams import TeamIndex, partition_of
from services.accounting import pipeline
from services.accounting.partition import MAX_PARTITIONS, Partitioning, Share, projection_name
from tests.unit.builders import admitted, node, queue, spec, submitted

A, B = "team-c", "team-a"  # teams of different partitions of two (checked below)


def test_the_two_teams_fall_in_different_partitions():
    assert (partition_of(A, 2), partition_of(B, 2)) == (1, 0)


@pytest.mark.parametrize(("event", "p0", "p1"), [
    (submitted("j1", spec(team=A)), False, True),
    (admitted("j1"), False, True),  # a later event of the job: its submission's team (remembered)
    (submitted("j2", spec(team=B)), True, False),
    (node("n1"), True, False),  # not a job's: partition 0's
    (queue("q", (A,)), True, False),
])
async def test_each_event_is_applied_by_exactly_one_partition(event, p0, p1):
    teams = TeamIndex(js=None)  # what it remembers: these cases never ask the log
    teams.remember("job", "j1", A, 1)
    batch = pipeline.Converted(entries=[(5, event.event_id, [])], events=[event])
    owned = [(await Share(Partitioning(n, k), teams).owned(batch))[0] for n, k in ((2, 0), (2, 1), (1, 0))]
    assert owned == [p0, p1, True]  # unpartitioned: everything


def test_a_job_without_a_team_is_partition_0s():
    assert [Partitioning(2, k).owns(None) for k in (0, 1)] == [True, False]
    assert [Partitioning(2, k).owns(A) for k in (0, 1)] == [False, True]


def test_partition_0_keeps_the_unpartitioned_position_row():
    assert [projection_name(k) for k in range(3)] == ["read-models", "read-models/p1", "read-models/p2"]
    assert Partitioning(3, 2).projection == "read-models/p2" and Partitioning().projection == "read-models"


@pytest.mark.parametrize(("env", "message"), [
    ({"GPUSCHED_ACCOUNTING_PARTITIONS": "2", "GPUSCHED_ACCOUNTING_PARTITION": "2"},
     "GPUSCHED_ACCOUNTING_PARTITION=2 is out of range; accepted: 0..1"),
    ({"GPUSCHED_ACCOUNTING_PARTITIONS": str(MAX_PARTITIONS + 1)}, "GPUSCHED_ACCOUNTING_PARTITIONS"),
    ({"GPUSCHED_ACCOUNTING_PARTITIONS": "two"}, "GPUSCHED_ACCOUNTING_PARTITIONS"),
    # several partitions and no index (a pod-index label missing): every process would be partition 0
    ({"GPUSCHED_ACCOUNTING_PARTITIONS": "2", "GPUSCHED_ACCOUNTING_PARTITION": ""},
     "GPUSCHED_ACCOUNTING_PARTITION is not set; accepted: this process's partition, 0..1"),
    ({"GPUSCHED_ACCOUNTING_PARTITIONS": "2"}, "GPUSCHED_ACCOUNTING_PARTITION is not set"),
])
def test_settings_out_of_range_say_what_is_accepted(monkeypatch, env, message):
    monkeypatch.delenv("GPUSCHED_ACCOUNTING_PARTITION", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        Partitioning.from_env()


def test_a_batch_keeps_only_the_partitions_entries_and_its_positions():
    converted = pipeline.Converted(entries=[(1, "e1", ["op"]), (2, "e2", ["op"]), (3, None, [])])
    converted.keep([True, False, True])
    assert converted.entries == [(1, "e1", ["op"]), (2, None, []), (3, None, [])]
    assert converted.last_sequence == 3


@pytest.mark.parametrize(("subject", "p0", "p1"), [
    ("gpusched.job.j1.submitted", False, False),  # every partition learns the job's team from it
    ("gpusched.job.j1.admitted", True, False),  # j1 is team A's: partition 1's
    ("gpusched.job.j2.admitted", False, True),  # team B's: partition 0's
    ("gpusched.job.j3.admitted", False, False),  # team not remembered: parsed, then looked up
    ("gpusched.node.n1.registered", False, True),  # not a job's: partition 0's
    ("garbage", False, False),  # not an event's subject: parsed, and poison
])
def test_what_a_partition_need_not_parse(subject, p0, p1):
    teams = TeamIndex(js=None)  # only what it remembers: these cases never ask the log
    shares = [Share(Partitioning(2, k), teams) for k in (0, 1)]
    shares[0].seen(submitted("j1", spec(team=A)), 10)
    shares[1].seen(submitted("j2", spec(team=B)), 11)
    assert [s.skip(subject, 20) for s in shares] == [p0, p1]
    assert not Share(Partitioning(), teams).skip(subject, 20)  # unpartitioned: every message is parsed
    if subject.endswith(".admitted"):  # a message before the submission named the team: not skipped
        assert [s.skip(subject, 9) for s in shares] == [False, False]
