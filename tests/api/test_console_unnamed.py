"""A member's job page never names another team's job: team-b's job preempted team-a's, and
team-a's timeline reads "a higher-priority job of another team" in its steps and in the events
behind them, while an operator's names the job. A stack of accounting and the API alone over a
recorded history (real nats-server, real Postgres; nothing else runs, so nothing else happens)."""

from __future__ import annotations

import html
from datetime import timedelta

import pytest

from tests.api.stack import ApiStack
from tests.unit.builders import (T0, admitted, preempted, preemption_requested, queue, reserved, scheduled, spec,
                                 started, submitted)

VICTIM, THEIRS, THEIR_QUEUE = "a-victim", "b-secret-job", "q-team-b"


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def _history() -> list:
    return [queue("q-team-a", ("team-a",), {"a100": 8}), queue(THEIR_QUEUE, ("team-b",), {"a100": 8}),
            submitted(VICTIM, spec(team="team-a", queue="q-team-a", gpus=8), when=at(0)),
            admitted(VICTIM, "q-team-a", when=at(1)),
            reserved(VICTIM, "q-team-a", gpus=8, when=at(2)),
            scheduled(VICTIM, {"node-0": tuple(range(8))}, when=at(3)),
            started(VICTIM, ("node-0",), when=at(4)),
            submitted(THEIRS, spec(team="team-b", queue=THEIR_QUEUE, gpus=8), when=at(3600)),
            preemption_requested(VICTIM, THEIRS, grace_seconds=120, when=at(3601)),
            preempted(VICTIM, by=THEIRS, when=at(3721))]


@pytest.fixture(scope="module")
def unnamed_stack(postgres, tmp_path_factory):
    stack = ApiStack(tmp_path_factory.mktemp("unnamed-stack"), postgres, history=_history(),
                     processes=("accounting", "api")).start()
    yield stack
    crashed = stack.stop()
    assert not crashed, f"tracebacks in the logs of {crashed}: {[stack.log(n)[-2000:] for n in crashed]}"


def job_page(stack: ApiStack, holder: str) -> str:
    import time

    deadline = time.monotonic() + 60
    with stack.client(holder) as http:
        while True:  # the read models follow the log: the page is there once accounting has the job
            response = http.get(f"/console/jobs/{VICTIM}")
            if response.status_code == 200 and "Preempted" in response.text:
                return html.unescape(response.text)
            assert time.monotonic() < deadline, (response.status_code, response.text[-2000:])
            time.sleep(0.5)


def test_a_member_reads_who_preempted_its_job_without_the_other_teams_job(unnamed_stack):
    mine = job_page(unnamed_stack, "alice")
    assert ("Preemption notice: it is stopped for a higher-priority job of another team, which needs its GPUs; "
            "checkpoint before 2026-01-01 01:02:01 UTC (120 s)") in mine
    assert "Preempted: its GPUs or quota went to a job of another team" in mine
    for secret in (THEIRS, THEIR_QUEUE, "team-b"):  # nor in the events behind the steps
        assert secret not in mine, secret
    theirs = job_page(unnamed_stack, "ops")  # an operator reads the log as it is
    assert "Preemption notice: it is stopped for higher-priority job b-secret-job, which needs its GPUs" in theirs
    assert f'"for_job": "{THEIRS}"' in theirs
