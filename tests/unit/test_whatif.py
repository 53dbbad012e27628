"""The what-if replay (gpusched/sim/whatif.py): what it takes from a recorded log, that a replay with
no change reproduces the recorded decisions, that a change takes effect at the window's start,
and how the report's figures are computed."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench import history
from gpusched.sim import trace as tracesim
from gpusched.sim import whatif
from gpusched.cli import whatif as whatif_cli
from gpusched.sim import whatif_trace
from gpusched.userinput import UserError
from schemas import FailureReason, PriceBookUpdated, new_event
from schemas.accounting import FlavorPrice
from tests.unit.builders import (
    T0, admitted, at, cancel_requested, cancelled, failed, node, preempted, queue, reserved, scheduled, spec,
    started, submitted, succeeded,
)


def recording_of(events, **window) -> whatif.Recording:
    rec = whatif.Recording(**window)
    for seq, e in enumerate(events, start=1):
        rec.add(seq, e)
    return rec


@pytest.fixture(scope="module")
def recorded():
    """A recorded history: 300 jobs of three teams through the cores with no service lag."""
    return history.record(300, seed=5, scale=1)


# -- the window --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("..", (None, None)),
    ("", (None, None)),
    ("10..20", (10, 20)),
    ("10..", (10, None)),
    ("..20", (None, 20)),
    ("2026-11-01..2026-11-02T12:00:00Z", (datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 2, 12, tzinfo=UTC))),
    ("5..2026-11-02", (5, datetime(2026, 11, 2, tzinfo=UTC))),
])
def test_a_range_is_sequences_or_event_times(text, expected):
    assert whatif_cli.parse_range(text) == expected


@pytest.mark.parametrize("text, message", [
    ("10", "not a range; accepted: FROM..TO"),
    ("0..5", "stream sequences start at 1"),
    ("20..10", "FROM is after TO"),
    ("yesterday..", "neither a stream sequence nor a time with a zone"),
    ("2026-11-01T00:00:00..", "neither a stream sequence nor a time with a zone"),
])
def test_a_bad_range_says_what_is_accepted(text, message):
    with pytest.raises(UserError, match=message):
        whatif_cli.parse_range(text)


# -- the recording -----------------------------------------------------------------------------


def test_runs_are_the_attempts_that_ended_by_themselves():
    j = spec(gpus=2)
    events = [
        node("n1", gpus=8), queue(), submitted("j1", j, when=at(0)), admitted("j1", when=at(0)),
        started("j1", ["n1"], attempt=1, when=at(10)),
        preempted("j1", attempt=1, when=at(100)),  # not a run: it was stopped
        started("j1", ["n1"], attempt=2, when=at(200)),
        failed("j1", FailureReason.OOM_KILLED, attempt=2, exit_code=137, started_at=at(200), when=at(260)),
        started("j1", ["n1"], attempt=3, when=at(300)),
        succeeded("j1", attempt=3, started_at=at(300), when=at(420)),
    ]
    rec = recording_of(events)
    assert rec.runs["j1"] == [whatif.Run(60.0, FailureReason.OOM_KILLED, 137), whatif.Run(120.0, None, 0)]
    assert [type(e).__name__ for _, _, e in rec.inputs] == ["QueueConfigured", "JobSubmitted"]
    assert list(rec.nodes) == ["n1"]


def test_the_window_cuts_the_report_not_a_jobs_runtime():
    events = [node("n1", gpus=8), queue(), submitted("j1", spec(gpus=1), when=at(0)),
              started("j1", ["n1"], when=at(10)), succeeded("j1", started_at=at(10), when=at(5000))]
    rec = recording_of(events, end=at(100))
    assert rec.runs["j1"] == [whatif.Run(4990.0, None, 0)]  # known past the window
    assert rec.window == (T0, at(100))
    (job,) = rec.actual.jobs.values()
    assert job.first_start == at(10) and job.attempts[1].ended_at is None  # it ended after the window


# -- the replay --------------------------------------------------------------------------------


def test_a_replay_with_no_change_reproduces_every_recorded_decision(recorded):
    rec = recording_of(recorded)
    report, _ = whatif.whatif(rec, [], set(), whatif.Options())
    d = report["decisions"]
    assert d["jobs"] == 300 and d["same"] == 300 and d["same_with_times"] == 300, d["first_different"]
    for group in report["teams"].values():
        assert group["actual"] == group["baseline"] == group["whatif"]
    assert report["fidelity"]["decisions"]["same"] == 300 and report["changed"]["different"] == 0


def test_the_same_inputs_give_byte_identical_reports(recorded):
    rec = recording_of(recorded)
    runs = [json.dumps(whatif.whatif(rec, [], set(), whatif.Options())[0], sort_keys=True) for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_change_takes_effect_at_the_windows_start_and_the_file_wins_for_what_it_names(recorded, tmp_path):
    changes_file = tmp_path / "changes.yaml"
    changes_file.write_text(
        "queues:\n"
        "  - name: research\n    cohort: shared\n    allowed_teams: [team-research]\n"
        "    quotas: [{flavor: h100-80gb, nominal: 2}, {flavor: a100-40gb, nominal: 2}]\n")
    rec = recording_of(recorded)
    changes, described = whatif_cli.changes_of(changes_file, rec)
    assert described == [{"event": "QueueConfigured", "name": "research",
                          "change": "quotas[a100-40gb].nominal: 8 → 2; quotas[h100-80gb].borrowing_limit: 8 → None; "
                                    "quotas[h100-80gb].nominal: 8 → 2"}]
    report, log = whatif.whatif(rec, changes, whatif.overridden_by(changes), whatif.Options(), described,
                                keep_log=True)
    research = [e for e in log if e.type == "QueueConfigured" and e.name == "research"]
    assert [q.quotas[0].nominal for q in research] == [2]  # the recorded definition was left out
    r = report["teams"]["team-research"]
    assert r["whatif"]["borrowed_share"] > r["actual"]["borrowed_share"]  # less of its own: it borrows more
    assert report["decisions"]["same"] < report["decisions"]["jobs"]


def test_a_policy_change_changes_the_priority_admission_gives(recorded, tmp_path):
    classes = "\n".join(f"  - {{name: {n}, value: {v}, preemptible: {str(p).lower()}}}" for n, v, p in (
        ("inference-sla", 1000, False), ("deadline-training", 800, True), ("training", 500, True),
        ("experiment", 650, True), ("batch-low", 100, True)))
    changes_file = tmp_path / "policy.yaml"
    changes_file.write_text(f"priority_classes:\n{classes}\n")
    rec = recording_of(recorded)
    changes, described = whatif_cli.changes_of(changes_file, rec)
    assert "priority_classes[experiment].value: 200 → 650" in described[0]["change"]
    _, log = whatif.whatif(rec, changes, whatif.overridden_by(changes), whatif.Options(), keep_log=True)
    experiments = {e.aggregate_id for e in recorded if e.type == "JobSubmitted" and e.spec.priority_class == "experiment"}
    values = {e.priority for e in log if e.type == "JobAdmitted" and e.aggregate_id in experiments}
    assert values == {650}


def test_a_recorded_cancel_of_a_job_that_ended_sooner_in_the_replay_is_not_sent():
    events = [node("n1", gpus=8), queue(), submitted("j1", spec(gpus=1, expected_runtime_seconds=30), when=at(0)),
              admitted("j1", when=at(0)), reserved("j1", gpus=1, when=at(0)),
              cancel_requested("j1", when=at(500)), cancelled("j1", when=at(500))]
    replay = whatif.Replay(recording_of(events), whatif.Options(), keep_log=True)
    replay.run([], set())
    assert "JobSucceeded" in [e.type for e in replay.log if e.aggregate_id == "j1"]
    assert not any(e.type == "JobCancelRequested" for e in replay.log)


# -- the report --------------------------------------------------------------------------------


def test_figures_from_a_small_log():
    book = new_event(PriceBookUpdated, aggregate_id="default", producer="config", occurred_at=T0, key="p",
                     effective_from=T0 - timedelta(days=1), gpu_prices=(FlavorPrice(flavor="a100", gpu_hour=3.6),))
    events = [node("n1", gpus=8), queue(), book]
    for job, wait, gpus, borrowed in (("a", 0, 2, 0), ("b", 100, 4, 2), ("c", 300, 2, 0)):
        events += [submitted(job, spec(gpus=gpus), when=at(0)), admitted(job, when=at(0)),
                   reserved(job, gpus=gpus, when=at(wait)).model_copy(update={"borrowed": borrowed}),
                   scheduled(job, {"n1": tuple(range(gpus))}, when=at(wait)),
                   started(job, ["n1"], when=at(wait))]
    events += [succeeded("a", started_at=at(0), when=at(3600)),
               preempted("b", when=at(1900)),
               succeeded("c", started_at=at(300), when=at(3900))]
    rec = recording_of(events)
    jobs = whatif.fold_jobs(events, T0, at(3900))
    figures = whatif._figures(list(jobs.values()), at(3900), 8.0, 3900.0, whatif.PriceBook(rec.prices))
    assert figures["wait_p50_s"] == 100.0 and figures["wait_p95_s"] == 300.0
    assert figures["preemptions"] == 1 and figures["work_lost_gpu_h"] == round(4 * 1800 / 3600, 3)
    gpu_s = 2 * 3600 + 4 * 1800 + 2 * 3600
    assert figures["gpu_h"] == round(gpu_s / 3600, 3)
    assert figures["borrowed_share"] == round(2 * 1800 / gpu_s, 4)
    assert figures["utilization"] == round(gpu_s / (8 * 3900), 4)
    assert figures["cost"] == round(gpu_s / 3600 * 3.6, 2)


# -- a trace instead of a log ------------------------------------------------------------------


def test_a_trace_replays_with_its_qos_as_teams(tmp_path):
    directory = tracesim.write_synthetic_trace(tmp_path / "trace", nodes=8, tasks=120)
    rec = whatif_trace.recording(directory)
    report, _ = whatif.whatif(rec, [], set(), whatif.Options())
    assert report["decisions"] is None  # a trace records no decisions
    be = report["teams"]["be"]
    assert be["actual"]["jobs"] == be["whatif"]["jobs"] == len(rec.actual.jobs)
    assert be["actual"]["wait_p95_s"] == 0  # the synthetic trace starts every task when it arrives
    assert be["whatif"]["started"] > 0


def test_a_trace_without_time_columns_is_refused(tmp_path):
    directory = tracesim.write_synthetic_trace(tmp_path / "trace", nodes=4, tasks=10)
    pods = directory / tracesim.POD_FILE
    rows = [",".join(line.split(",")[:7]) for line in pods.read_text().splitlines()]
    pods.write_text("\n".join(rows) + "\n")
    with pytest.raises(tracesim.TraceError, match="no time columns"):
        whatif_trace.recording(directory)


def test_the_example_queues_file_is_a_changes_file(recorded):
    rec = recording_of(recorded)
    changes, described = whatif_cli.changes_of(Path("gpusched/examples/queues.yaml"), rec)
    assert changes == [] and described == []  # the history was configured from it: nothing changes


def test_a_window_by_sequences_counts_the_jobs_submitted_between_them(recorded):
    submitted_at = [i for i, e in enumerate(recorded, start=1) if e.type == "JobSubmitted"]
    lo, hi = submitted_at[20], submitted_at[49]
    rec = recording_of(recorded, from_seq=lo, to_seq=hi)
    assert len(rec.actual.jobs) == 30
    assert rec.window == (recorded[lo - 1].occurred_at, max(e.occurred_at for e in recorded[:hi]))
    report, _ = whatif.whatif(rec, [], set(), whatif.Options())
    assert report["decisions"]["jobs"] == 30 and report["decisions"]["same"] == 30


def test_the_table_prints_what_a_change_names(recorded, tmp_path):
    from rich.console import Console

    changes_file = tmp_path / "changes.yaml"
    changes_file.write_text("preemption_limits: {max_per_window: 5}\nqueues:\n  - name: research\n    cohort: shared\n"
                            "    allowed_teams: [team-research]\n    quotas: [{flavor: h100-80gb, nominal: 2}]\n")
    rec = recording_of(recorded)
    changes, described = whatif_cli.changes_of(changes_file, rec)
    result, _ = whatif.whatif(rec, changes, whatif.overridden_by(changes), whatif.Options(), described)
    console = Console(record=True, width=200)
    whatif_cli.render(result, console)
    text = console.export_text()
    assert "quotas[h100-80gb].nominal: 8 → 2" in text and "quotas[a100-40gb]: removed" in text
    assert "per team: actual | baseline (no change) | what-if" in text and "team-research" in text
    assert "baseline fidelity: 300 of 300 jobs decided as the log did (100.0 %; 300 at the same times)" in text
