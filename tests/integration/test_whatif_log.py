"""`gpusched whatif` on a recorded log in a real nats-server: a few thousand jobs' history, read
back by the CLI as the operator; with no change it reproduces every recorded decision, the same
inputs give byte-identical output, and the file it was asked about is the file `gpusched apply`
then applies."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import history
from runtime import eventlog
from schemas import parse_event

CLI = [sys.executable, "-m", "gpusched.cli.main"]
JOBS = 2000

CHANGES = """
priority_classes:
  - {name: inference-sla, value: 1000, preemptible: false}
  - {name: deadline-training, value: 800, preemptible: true, protection_seconds: 1800, max_preemptions: 2,
     preemption_grace_seconds: 120}
  - {name: training, value: 500, preemptible: true, protection_seconds: 600, max_preemptions: 5,
     preemption_grace_seconds: 60}
  - {name: experiment, value: 600, preemptible: true, protection_seconds: 300}
  - {name: batch-low, value: 100, preemptible: true, preemption_grace_seconds: 10}
queues:
  - name: research
    cohort: shared
    allowed_teams: [team-research]
    quotas:
      - {flavor: h100-80gb, nominal: 24, borrowing_limit: 4}
      - {flavor: a100-40gb, nominal: 16}
"""


def cli(nats_server, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, **nats_server.env("operator")}
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def recorded_log():
    return history.record(JOBS, seed=3, scale=2)


async def test_whatif_over_a_recorded_log(nats_server, admin_js, recorded_log, tmp_path):
    await history.store(admin_js, recorded_log)
    assert (await admin_js.stream_info(eventlog.EVENTS_STREAM)).state.messages == len(recorded_log)

    same = cli(nats_server, "whatif", "-o", "json")
    assert same.returncode == 0, same.stderr
    report = json.loads(same.stdout)
    assert report["decisions"]["jobs"] == JOBS
    assert report["decisions"]["same"] == JOBS and report["decisions"]["same_with_times"] == JOBS
    assert cli(nats_server, "whatif", "-o", "json").stdout == same.stdout  # byte-identical

    changes = tmp_path / "changes.yaml"
    changes.write_text(CHANGES)
    changed = cli(nats_server, "whatif", "--apply", str(changes), "-o", "json")
    assert changed.returncode == 0, changed.stderr
    result = json.loads(changed.stdout)
    assert [(c["event"], c["name"], c["change"]) for c in result["changes"]] == [
        ("PolicyConfigured", "cluster", "priority_classes[experiment].value: 200 → 600"),
        ("QueueConfigured", "research", "quotas[h100-80gb].borrowing_limit: 16 → 4; quotas[h100-80gb].nominal: 16 → 24")]
    assert result["decisions"]["same"] < JOBS
    research = result["teams"]["team-research"]
    assert research["actual"] == report["teams"]["team-research"]["actual"]  # what happened does not change
    assert research["whatif"] != research["actual"]

    # then the same file is applied for real
    applied = cli(nats_server, "apply", "-f", str(changes), "-o", "json")
    assert applied.returncode == 0, applied.stderr
    assert [c["event"] for c in json.loads(applied.stdout)] == ["PolicyConfigured", "QueueConfigured"]
    policies = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.policy.>"])]
    assert {pc.name: pc.value for pc in policies[-1].priority_classes}["experiment"] == 600


async def test_whatif_window_and_bad_input(nats_server, admin_js, recorded_log, tmp_path):
    await history.store(admin_js, recorded_log[:4000])
    submitted = [i for i, e in enumerate(recorded_log[:4000], start=1) if e.type == "JobSubmitted"]
    lo, hi = submitted[10], submitted[40]
    windowed = cli(nats_server, "whatif", "--log", f"{lo}..{hi}", "-o", "json")
    assert windowed.returncode == 0, windowed.stderr
    report = json.loads(windowed.stdout)
    assert report["decisions"]["jobs"] == 31  # those submitted from FROM to TO
    assert report["window"]["from"] == recorded_log[lo - 1].occurred_at.isoformat()

    table = cli(nats_server, "whatif", "--log", f"{lo}..{hi}")
    assert table.returncode == 0 and "per team: actual | baseline (no change) | what-if" in table.stdout and "team-research" in table.stdout

    bad = cli(nats_server, "whatif", "--log", "soon..")
    assert bad.returncode == 2 and "--log 'soon..'" in bad.stderr and "accepted" in bad.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("priority_classes: [{name: gold, value: -1, preemptible: true}]\n")
    refused = cli(nats_server, "whatif", "--apply", str(broken))
    assert refused.returncode == 2 and "priority_classes.0.value" in refused.stderr


async def test_whatif_on_an_empty_log_says_so(nats_server, admin_js):
    empty = cli(nats_server, "whatif")
    assert empty.returncode == 2 and "the log holds no event in the range" in empty.stderr


async def test_whatif_on_a_live_recording_prints_the_baselines_fidelity_first(nats_server, admin_js):
    """The dev stack's own recording (tests/unit/test_whatif_lag.py says how it was made), read
    back by the CLI: the report opens with the baseline's fidelity, at the issue's numbers."""
    import gzip

    from tests.unit.test_whatif_lag import FIXTURE

    with gzip.open(FIXTURE, "rt") as lines:
        events = [parse_event({k: v for k, v in json.loads(line).items() if k != "sequence"}) for line in lines]
    await history.store(admin_js, events)
    table = cli(nats_server, "whatif")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("window ") and lines[1].startswith("baseline fidelity: ")
    assert "no change: the what-if column is the baseline" in table.stdout
    report = json.loads(cli(nats_server, "whatif", "-o", "json").stdout)
    d = report["fidelity"]["decisions"]
    assert d["same"] / d["jobs"] >= 0.98
    assert all(w[f]["error"] <= 0.10 for w in report["fidelity"]["waits"].values() for f in ("wait_p50_s", "wait_p95_s"))
