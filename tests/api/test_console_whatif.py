"""The console's what-if page in a real browser (Debian's Chromium driven by Playwright): an
operator uploads a queues file and reads the baseline's fidelity first, then per team what
happened, the replay with no change, the replay with the change and the change's effect; a bad
file is answered with what is wrong and what is accepted; a member has no such page.

The log is the live recording tests/unit/data/whatif-live-300.ndjson.gz (how it was recorded:
tests/unit/test_whatif_lag.py), appended to a fresh stack's log with only accounting and the API
running, so the page replays exactly that history."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

from gpusched.api import whatif as run
from gpusched.sim import whatif
from schemas import parse_event
from tests.api.stack import ApiStack
from tests.api.test_console import ROOT, browser, login  # noqa: F401 - the browser, as the console's tests have it
from tests.unit.test_whatif_lag import CHANGES, FIXTURE


def _events() -> list:
    with gzip.open(FIXTURE, "rt") as lines:
        return [parse_event({k: v for k, v in json.loads(line).items() if k != "sequence"}) for line in lines]


@pytest.fixture(scope="module")
def shots() -> Path:
    out = Path(os.environ.get("GPUSCHED_ARTIFACTS", ROOT / ".artifacts")) / "console-whatif"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


@pytest.fixture(scope="module")
def whatif_stack(postgres, tmp_path_factory):
    # before the browser: Playwright's sync API holds an event loop that the stack's start would meet
    stack = ApiStack(tmp_path_factory.mktemp("whatif-stack"), postgres, history=_events(),
                     processes=("accounting", "api")).start()
    yield stack
    crashed = stack.stop()
    assert not crashed, f"tracebacks in the logs of {crashed}: {[stack.log(n)[-2000:] for n in crashed]}"


def _expected() -> dict:
    rec = whatif.Recording()
    with gzip.open(FIXTURE, "rt") as lines:
        for line in lines:
            event = json.loads(line)
            seq = event.pop("sequence")
            rec.add(seq, parse_event(event))
    changes, described = run.changes_from(run.read_text(CHANGES, "queues file 'changes.yaml'"),
                                          "queues file 'changes.yaml'", rec)
    result, _ = whatif.whatif(rec, changes, whatif.overridden_by(changes), run.options_from_env(None), described)
    return result


def test_an_operator_uploads_a_queues_file_and_reads_three_columns(whatif_stack, browser, shots, tmp_path):  # noqa: F811
    changes = tmp_path / "changes.yaml"
    changes.write_text(CHANGES)
    page = login(browser, whatif_stack, "ops")
    page.click("nav >> text=What-if")
    page.wait_for_selector("#whatif-form")
    page.set_input_files("#file", str(changes))
    page.click("#whatif-run")
    page.wait_for_selector("#whatif-result", timeout=120_000)
    page.screenshot(path=shots / "whatif.png", full_page=True)

    expected = _expected()
    currency = "USD"  # the recording's price book
    fidelity = page.inner_text("#whatif-fidelity").splitlines()
    assert [" ".join(line.split()) for line in fidelity if line.strip()] == [
        " ".join(line.split()) for line in run.fidelity_lines(expected)]  # HTML collapses runs of spaces
    assert fidelity[0].startswith("baseline fidelity: ")
    assert "QueueConfigured research: quotas[h100-80gb].nominal: 8 → 16" in page.inner_text("#whatif-changes")
    for team, cols in expected["teams"].items():
        for f in whatif.FIGURES:
            row = page.locator(f"#whatif-teams tr[data-team='{team}'][data-figure='{f}']")
            cells = [row.locator(f"td.{c}").inner_text() for c in ("actual", "baseline", "whatif", "delta")]
            assert cells == [run.cell(f, cols["actual"][f], currency), run.cell(f, cols["baseline"][f], currency),
                             run.cell(f, cols["whatif"][f], currency),
                             run.delta_cell(f, cols["delta"][f], currency)], (team, f)
            if f == "wait_p50_s" and cols["actual"][f]:
                assert cells[0].endswith((" s", " min", " h")), cells  # a duration, not bare seconds
            if f == "cost" and cols["actual"][f]:
                assert cells[0].endswith(f" {currency}"), cells
    assert any(page.locator("#whatif-teams td.delta").all_inner_texts())  # the change did something

    page.fill("#queues", "queues: [")
    page.set_input_files("#file", [])
    page.click("#whatif-run")
    error = page.inner_text("#whatif-error")
    assert error.startswith("queues (pasted):") and "queues.yaml" not in error


def test_a_member_has_no_what_if_page(whatif_stack, browser):  # noqa: F811
    page = login(browser, whatif_stack, "alice")
    assert "What-if" not in page.inner_text("nav")
    page.goto(f"{whatif_stack.url}/console/whatif")
    assert "What-if is for operators and admins" in page.inner_text("#error")
    with whatif_stack.client("alice") as client:
        assert client.post("/console/whatif", data={"queues": CHANGES}).status_code == 403
