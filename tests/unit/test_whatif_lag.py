"""The what-if's baseline replays the live services' lag (gpusched/sim/whatif.py, ``Lag``), and
every report sets three columns side by side: what happened, the replay with no change (the
model's baseline) and the replay with the change, with the baseline's fidelity first.

The fixture ``data/whatif-live-300.ndjson.gz`` is a real recording from the dev stack:
``gpusched dev up --demo-jobs 300`` (time scale 120: a quarter of a second of a service's lag is
30 s of platform time), run on 2026-12-07 from a copy of the working tree frozen at 15:25 UTC on
the shared 2-core VM (other tests running beside it), its log read after about 4 minutes of wall
time (9.4 hours of platform time) with ``gpusched log -o ndjson --limit 1000000`` and kept to the
event types the what-if reads (``gpusched.api.whatif.RECORDED_TYPES``), each line with its stream
sequence. The fidelity it checks is the model's for the decision cores that made the log: if the
cores' rules change, record it again the same way."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gpusched.cli import whatif as whatif_cli
from gpusched.sim import whatif
from schemas import parse_event
from tests.unit.builders import admitted, at, node, queue, released, reserved, scheduled, spec, started, submitted, succeeded

FIXTURE = Path(__file__).parent / "data" / "whatif-live-300.ndjson.gz"
CHANGES = """
queues:
  - name: research
    cohort: shared
    allowed_teams: [team-research]
    quotas: [{flavor: h100-80gb, nominal: 16, borrowing_limit: 8}, {flavor: a100-40gb, nominal: 8}]
"""


def live() -> whatif.Recording:
    rec = whatif.Recording()
    with gzip.open(FIXTURE, "rt") as lines:
        for line in lines:
            event = json.loads(line)
            seq = event.pop("sequence")
            rec.add(seq, parse_event(event))
    return rec


def recording_of(events) -> whatif.Recording:
    rec = whatif.Recording()
    for seq, e in enumerate(events, start=1):
        rec.add(seq, e)
    return rec


def test_the_baseline_reproduces_a_live_log_with_its_lag():
    rec = live()
    assert sorted(rec.lags["admission"])[len(rec.lags["admission"]) // 2] > 0  # the services did decide late
    report, _ = whatif.whatif(rec, [], set(), whatif.Options())
    d = report["fidelity"]["decisions"]
    assert d["jobs"] >= 250 and d["same"] / d["jobs"] >= 0.98, d
    for team, waits in report["fidelity"]["waits"].items():
        for figure in ("wait_p50_s", "wait_p95_s"):
            w = waits[figure]
            assert w["actual"] > 0 and w["error"] <= 0.10, (team, figure, w)


def test_a_report_has_three_columns_with_the_baselines_fidelity_first(tmp_path):
    from rich.console import Console

    rec = live()
    changes_file = tmp_path / "changes.yaml"
    changes_file.write_text(CHANGES)
    changes, described = whatif_cli.changes_of(changes_file, rec)
    plain, _ = whatif.whatif(rec, [], set(), whatif.Options())
    result, _ = whatif.whatif(rec, changes, whatif.overridden_by(changes), whatif.Options(), described)
    assert result["fidelity"] == plain["fidelity"]  # the baseline does not depend on the change
    assert 0 < result["changed"]["different"] < result["changed"]["jobs"]
    for by in ("teams", "queues"):
        for name, cols in result[by].items():
            assert cols["actual"] == plain[by][name]["actual"]  # what happened
            assert cols["baseline"] == plain[by][name]["whatif"]  # the replay with no change
            for f in whatif.FIGURES:
                b, w = cols["baseline"][f], cols["whatif"][f]
                assert cols["delta"][f] == (None if b is None or w is None else round(w - b, 6))
    research = result["teams"]["team-research"]
    assert research["whatif"] != research["baseline"] and any(research["delta"].values())

    console = Console(record=True, width=200)
    whatif_cli.render(result, console)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[1].startswith("baseline fidelity: ") and " jobs decided as the log did (" in lines[1]
    assert all(f"  {team}: wait p50 " in text for team in result["teams"])
    assert text.index("baseline fidelity") < text.index("per team: actual | baseline (no change) | what-if")
    assert "the change decides " in text and " jobs differently from the baseline" in text

    again, _ = whatif.whatif(live(), changes, whatif.overridden_by(changes), whatif.Options(), described)
    assert json.dumps(again, sort_keys=True) == json.dumps(result, sort_keys=True)  # deterministic


def _lagged_log():
    """One job that each service decided late: admission 30 s after the submission, quota 10 s
    after that, the scheduler 5 s, the executor 5 s; the run took 60 s, quota released it 5 s
    after its end."""
    return [node("n1", gpus=8), queue(),
            submitted("j1", spec(gpus=1), when=at(0)), admitted("j1", when=at(30)),
            reserved("j1", gpus=1, when=at(40)), scheduled("j1", when=at(45)), started("j1", when=at(50)),
            succeeded("j1", started_at=at(50), when=at(110)), released("j1", gpus=1, when=at(115))]


def test_each_decision_is_made_when_its_service_made_it():
    events = _lagged_log()
    replay = whatif.Replay(recording_of(events), whatif.Options(), keep_log=True)
    replay.run([], set())
    times = {e.type: e.occurred_at for e in replay.log if e.aggregate_id == "j1"}
    assert times["JobAdmitted"] == at(30) and times["QuotaReserved"] == at(40)
    assert times["JobScheduled"] == at(45) and times["JobStarted"] == at(50) and times["JobSucceeded"] == at(110)
    report, _ = whatif.whatif(recording_of(events), [], set(), whatif.Options())
    assert report["fidelity"]["decisions"]["same_with_times"] == 1
    assert report["fidelity"]["waits"]["team-a"]["wait_p50_s"] == {"actual": 50.0, "baseline": 50.0, "error": 0.0}


def test_a_decision_the_log_does_not_hold_waits_a_lag_its_service_had():
    rec = recording_of(_lagged_log())
    lag = whatif.Lag(rec)
    # admission decided in the log at 0 and 30 s: a new decision waits for its next cycle there ...
    assert lag.at(("admission", "j8"), at(10)) == at(30)
    # ... and after its last one, a lag drawn from its recorded ones (one: 30 s)
    assert lag.at(("admission", "j9"), at(100)) == at(130)
    assert lag.at(("admission", "j9"), at(200)) == at(130)  # fixed the first time it could be made
    # with a change, a recorded decision waits what it waited in the baseline, from when it can be made
    changed = whatif.Lag(rec, measured={("admission", "j1"): 30.0})
    assert changed.at(("admission", "j1"), at(7)) == at(37)


@pytest.mark.parametrize("service", ["admission", "quota-read", "scheduler-read", "start", "quota", "report"])
def test_every_service_has_its_recorded_lags(service):
    assert whatif.Lag(live()).samples[service], service
