"""The console in a real browser: Debian's Chromium (`make chromium`) driven by Playwright. A
member logs in with its token, submits a job from the form and watches it go from queued to
running to succeeded on the page (live, from the team's event stream), opens a waiting job and
reads why it waits, and finds nothing of another team's. Screenshots of each step are kept under
$GPUSCHED_ARTIFACTS/console (default .artifacts/console)."""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from pathlib import Path

import pytest

from gpusched.api.console import cohort_totals
from tests.api.stack import job_document

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("GPUSCHED_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("GPUSCHED_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{CHROMIUM} is missing: run `make chromium`")
        pytest.skip(f"{CHROMIUM} is missing: `make chromium` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots() -> Path:
    out = Path(os.environ.get("GPUSCHED_ARTIFACTS", ROOT / ".artifacts")) / "console"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def login(browser, api_stack, holder: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(30_000)
    page.goto(f"{api_stack.url}/console")
    assert page.url.endswith("/console/login")  # no token yet: the login page
    page.fill("#token", api_stack.tokens[holder])
    page.click("#login")
    page.wait_for_url(re.compile(r".*/console$"))
    return page


def test_a_member_submits_and_watches_a_job_finish(browser, api_stack, shots):
    page = login(browser, api_stack, "alice")
    assert "alice · member · team-a" in page.inner_text("#whoami")
    page.screenshot(path=shots / "01-cluster.png", full_page=True)
    assert page.locator("#flavors").inner_text().count("a100") == 1

    page.goto(f"{api_stack.url}/console/jobs")
    page.fill("input[name=runtime]", "60")  # 3 s at the stack's time scale: past a 2 s stream's end
    page.click("#submit-button")
    page.wait_for_selector("#submitted-job")
    job_id = page.inner_text("#submitted-job")
    assert page.inner_text("#submit-result").startswith("admitted")
    row = page.locator(f"tr[data-job='{job_id}']")
    row.wait_for()  # the live refresh brought it into the table
    page.screenshot(path=shots / "02-submitted.png", full_page=True)
    seen = set()
    deadline = time.monotonic() + 60
    while "succeeded" not in seen:
        assert time.monotonic() < deadline, f"states seen on the page: {seen}"
        state = page.locator(f"tr[data-job='{job_id}']").get_attribute("data-state")
        seen.add(state)
        if state == "running" and not (shots / "03-running.png").exists():
            page.screenshot(path=shots / "03-running.png", full_page=True)
        time.sleep(0.05)
    page.screenshot(path=shots / "04-succeeded.png", full_page=True)
    assert "running" in seen, f"states seen on the page: {seen}"  # live on its way, not only at the end

    page.click(f"tr[data-job='{job_id}'] a")
    page.wait_for_selector("#timeline")
    page.wait_for_selector("#timeline li.ev-JobSucceeded")  # the ledger's row (the usage table) may trail it
    page.wait_for_selector("#usage td.cost")
    timeline = page.inner_text("#timeline")
    steps = ("Submitted by alice to queue q-team-a", "Admitted and queued in q-team-a", "Quota reserved: 1 GPU of a100",
             "Placed on ", "Started on ", "Succeeded after ")
    for step in steps:  # one plain step a line, in order, each with its time and no event name
        assert step in timeline, timeline
    assert [timeline.index(step) for step in steps] == sorted(timeline.index(step) for step in steps)
    assert not re.search(r"\b(Job|Quota)[A-Z][a-z]+", timeline), timeline  # no JobSubmitted, QuotaReserved, ...
    assert re.search(r"Succeeded after \d+(\.\d)? s|Succeeded after \d+ min \d+ s", timeline), timeline
    usage = page.inner_text("#usage")  # the attempt: how long it ran, in human units, and its cost with currency
    assert re.search(r"\t(\d+(\.\d)? s|\d+ min \d+ s)\t", usage) and re.search(r"\d\.\d\d [A-Z]{3}", usage), usage
    assert "succeeded" in usage and "JobSucceeded" not in usage
    page.screenshot(path=shots / "05-job.png", full_page=True)
    page.close()


def test_a_waiting_job_says_why_and_another_teams_job_is_not_there(browser, api_stack, shots):
    with api_stack.client("alice") as alice, api_stack.client("bob") as bob:
        blockers = [f"hog-{uuid.uuid4().hex[:6]}" for _ in range(2)]
        for job_id in blockers:  # 2 × 8 GPUs in a queue of 8: the second waits for quota
            assert alice.post("/v1/jobs", json=job_document(job_id, "team-a", gpus=8, runtime_s=3000)).status_code == 201
        theirs = f"bobs-{uuid.uuid4().hex[:6]}"
        assert bob.post("/v1/jobs", json=job_document(theirs, "team-b")).status_code == 201
    page = login(browser, api_stack, "alice")
    page.goto(f"{api_stack.url}/console/jobs?state=queued")
    waiting = page.locator("tr[data-state='queued'] a").first
    waiting.wait_for()
    waiting.click()
    page.wait_for_selector("#why")
    assert page.inner_text("#why-code")  # the reason code, e.g. queue-exhausted
    assert "8" in page.inner_text("#why-message")  # its message names the numbers
    timeline = page.inner_text("#timeline")  # its timeline says so in words, not as an event name
    assert "Waiting for quota because queue q-team-a" in timeline and "QuotaPendingReasonChanged" not in timeline
    page.screenshot(path=shots / "06-waiting.png", full_page=True)

    page.goto(f"{api_stack.url}/console/jobs")
    assert theirs not in page.inner_text("#jobs")
    response = page.goto(f"{api_stack.url}/console/jobs/{theirs}")
    assert response.status == 404
    page.screenshot(path=shots / "07-other-team.png", full_page=True)

    page.goto(f"{api_stack.url}/console/jobs/{blockers[0]}")
    page.once("dialog", lambda d: d.accept())
    page.click("#cancel")
    page.wait_for_function("() => document.getElementById('job-state').textContent.trim() === 'cancelled'",
                           timeout=60_000)  # a function: the page's CSP refuses to eval a string
    page.close()
    with api_stack.client("alice") as alice:  # leave team-a's queue free for the tests that follow
        assert alice.post(f"/v1/jobs/{blockers[1]}/cancel", json={}).status_code == 200


def test_pages_for_an_operator(browser, api_stack, shots):
    page = login(browser, api_stack, "ops")
    for path, selector in (("/console/queues", "#queues"), ("/console/charts", "figure.chart svg"),
                           ("/console/usage", "#usage"), ("/console/deadletters", "#deadletters")):
        page.goto(f"{api_stack.url}{path}")
        page.wait_for_selector(selector)
        page.screenshot(path=shots / f"08-operator-{path.rsplit('/', 1)[1]}.png", full_page=True)
        if path == "/console/queues":
            assert "q-team-a" in page.inner_text("#queues") and "q-team-b" in page.inner_text("#queues")
    page.click("header form.who button")  # log out: the cookie is gone, pages send to the login page
    page.wait_for_url(re.compile(r".*/console/login$"))
    page.goto(f"{api_stack.url}/console/jobs")
    assert page.url.endswith("/console/login")
    page.close()
    member = login(browser, api_stack, "alice")
    member.goto(f"{api_stack.url}/console/queues")
    assert "q-team-b" not in member.inner_text("#queues")
    menu = member.inner_text("header nav")  # links only to the pages a member may open
    assert "Jobs" in menu and "Usage" in menu and "Dead letters" not in menu and "What-if" not in menu
    for path, name in (("/console/deadletters", "Dead letters"), ("/console/whatif", "What-if")):
        assert member.goto(f"{api_stack.url}{path}").status == 403  # a page that says why, not a bare 403
        assert member.inner_text("#error-title") == "Not for your role"
        assert member.inner_text("#error") == (f"{name} is for operators and admins; you are logged in as alice "
                                               "(member of team-a).")
        assert "Jobs" in member.inner_text("#error-pages")
    member.screenshot(path=shots / "08-member-403.png", full_page=True)
    member.goto(f"{api_stack.url}/console/usage")  # costs in the price book's currency for every role
    assert re.search(r"cost \([A-Z]{3}, estimate\)", member.inner_text("#usage"))
    member.close()


def test_a_chargeback_reader_sees_its_pages_only(browser, api_stack):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{api_stack.url}/console/login")
    page.fill("#token", api_stack.tokens["money"])
    page.click("#login")
    page.wait_for_url(re.compile(r".*/console/charts$"))  # not the cluster page: its API is not for this role
    assert page.inner_text("header nav").split() == ["Charts", "Usage"]
    assert page.goto(f"{api_stack.url}/console/jobs").status == 403
    assert page.inner_text("#error") == "Jobs is for members, operators and admins; you are logged in as money " \
                                        "(chargeback)."
    page.close()


def test_the_console_has_an_icon(browser, api_stack):
    page = login(browser, api_stack, "alice")
    icon = page.get_attribute("link[rel=icon]", "href")
    assert icon is not None, "no <link rel=icon>"
    for path in (icon, "/favicon.ico"):  # what the page names and where a browser looks unasked
        response = page.request.get(f"{api_stack.url}{path}")
        assert response.status == 200 and response.headers["content-type"].startswith("image/svg+xml"), path
        assert response.body().startswith(b"<svg")
    page.close()


def test_a_teams_services_page_shows_its_replicas_and_only_its_own(browser, api_stack, shots):
    from tests.api.test_api_services import service

    name = f"web-{uuid.uuid4().hex[:6]}"
    with api_stack.client("bob") as bob:
        assert bob.post("/v1/services", json=service(name, 2)).status_code == 201
        page = login(browser, api_stack, "bob")
        deadline = time.monotonic() + 60
        while True:  # the read models follow the replicas; the page shows what they hold
            page.goto(f"{api_stack.url}/console/services")
            row = page.locator(f"#services tr[data-service='{name}']")
            if row.count() and row.locator("td.ready").inner_text() == "2":
                break
            assert time.monotonic() < deadline, page.inner_text("#services")
            time.sleep(0.5)
        states = page.locator(f"table.replicas[data-service='{name}'] tr[data-state]")
        assert [states.nth(i).get_attribute("data-state") for i in range(states.count())] == ["ready", "ready"]
        page.screenshot(path=shots / "09-services.png", full_page=True)
        page.close()
        other = login(browser, api_stack, "alice")
        other.goto(f"{api_stack.url}/console/services")
        assert name not in other.inner_text("main")
        other.close()
        assert bob.delete(f"/v1/services/{name}").status_code == 200


def test_cohort_totals_sum_queues_up_the_tree():
    from services.accounting.queries import Cohort

    cohorts = [Cohort("org", None), Cohort("ml", "org"), Cohort("idle", None)]
    keys = ("queue", "cohort", "flavor", "nominal", "used", "borrowed", "lent", "pending_jobs")
    rows = [dict(zip(keys, r, strict=True)) for r in (
        ("a", "ml", "a100", 8, 10, 2, 0, 3), ("a", "ml", "h100", 4, 0, 0, 0, 3),
        ("b", "org", "a100", 8, 6, 0, 2, 1), ("c", None, "a100", 8, 8, 0, 0, 5))]
    totals = {(t["cohort"], t["flavor"]): t for t in cohort_totals(rows, cohorts)}
    assert set(totals) == {("ml", "a100"), ("ml", "h100"), ("org", "a100"), ("org", "h100"), ("idle", "–")}
    assert totals[("ml", "a100")] == {"cohort": "ml", "parent": "org", "flavor": "a100", "queues": 1, "nominal": 8,
                                      "used": 10, "borrowed": 2, "lent": 0, "pending_jobs": 3}
    org = totals[("org", "a100")]
    assert (org["queues"], org["nominal"], org["used"], org["borrowed"], org["lent"]) == (2, 16, 16, 2, 2)
    assert org["pending_jobs"] + totals[("org", "h100")]["pending_jobs"] == 4  # queue a's 3 counted once
    assert totals[("idle", "–")]["queues"] == 0
