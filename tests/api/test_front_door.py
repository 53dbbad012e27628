"""The front door as a security review sees it: /docs works with no internet (Swagger UI's files
come from the API itself), every HTML response carries the Content-Security-Policy and the other
security headers (every response at least nosniff), the console runs under that policy with no
violation, and a hostile string put in by a user is shown as text, never run, in the pages, in
their live refresh and in the charts. Browser tests use Debian's Chromium as tests/api/test_console.py."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

from markupsafe import Markup

from gpusched.api.charts import Series, time_chart
from gpusched.api.console import templates
from tests.api.stack import job_document
from tests.api.test_console import browser, login  # noqa: F401  (browser: the module's fixture)

HOSTILE = """</td><script>alert(1)</script>"><svg onload=alert(1)><img src=x onerror=alert(1)>"""
PAGES = ("/console", "/console/queues", "/console/jobs", "/console/jobs-table", "/console/services",
         "/console/charts", "/console/usage", "/console/deadletters")


def policy(header: str) -> dict[str, set[str]]:
    """A Content-Security-Policy header as directive -> its sources."""
    directives = (d.split() for d in header.split(";") if d.strip())
    return {name: set(sources) for name, *sources in directives}


def assert_html_headers(response) -> None:
    where = f"{response.request.method} {response.request.url.path}"
    assert response.headers["content-type"].startswith("text/html"), where
    csp = policy(response.headers.get("content-security-policy", ""))
    assert csp.get("default-src") == {"'self'"}, (where, csp)
    assert csp.get("script-src") == {"'self'"}, (where, csp)  # no 'unsafe-inline', no 'unsafe-eval'
    assert "'unsafe-inline'" not in csp.get("style-src", {"'unsafe-inline'"}), (where, csp)
    assert csp.get("img-src") == {"'self'", "data:"}, (where, csp)
    assert csp.get("frame-ancestors") == {"'none'"}, (where, csp)
    assert csp.get("base-uri") == {"'none'"}, (where, csp)
    assert csp.get("form-action") == {"'self'"}, (where, csp)
    assert response.headers.get("x-frame-options") == "DENY", where
    assert response.headers.get("x-content-type-options") == "nosniff", where
    assert response.headers.get("referrer-policy") in ("no-referrer", "same-origin"), where


def csp_violations(page) -> list[str]:
    """What the page logs about the Content-Security-Policy (Chromium: "Refused to ... because it
    violates the following Content Security Policy directive ...")."""
    seen: list[str] = []
    page.on("console", lambda m: seen.append(m.text) if "Content Security Policy" in m.text else None)
    return seen


def dialogs(page) -> list[str]:
    """The messages of every alert/confirm the page opens (each dismissed)."""
    opened: list[str] = []

    def on_dialog(dialog) -> None:
        opened.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    return opened


def test_every_html_response_carries_the_policy_and_every_response_nosniff(api_stack):
    with api_stack.client("ops") as ops, api_stack.client() as anonymous:
        for path in PAGES:
            response = ops.get(path)
            assert response.status_code == 200, path
            assert_html_headers(response)
        for response in (anonymous.get("/console/login"), anonymous.get("/docs"),
                         ops.get("/console/jobs/no-such-job")):  # the login page, /docs, an error page
            assert response.status_code in (200, 404)
            assert_html_headers(response)
        for response in (ops.get("/v1/jobs"), anonymous.get("/v1/jobs"), anonymous.get("/healthz"),
                         anonymous.get("/openapi.json"), anonymous.get("/static/console.js"),
                         anonymous.get("/docs/static/swagger-ui-bundle.js")):
            assert response.headers.get("x-content-type-options") == "nosniff", response.request.url
        assert anonymous.get("/redoc").status_code == 404  # not served: it needs inline styles and workers


def test_docs_render_with_nothing_from_elsewhere(browser, api_stack):  # noqa: F811
    page = browser.new_page()
    elsewhere: list[str] = []

    def same_origin_only(route) -> None:
        if route.request.url.startswith(f"{api_stack.url}/"):
            route.continue_()
        else:  # as on a machine without internet
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", same_origin_only)
    violations = csp_violations(page)
    page.goto(f"{api_stack.url}/docs")
    page.locator(".opblock-summary-path[data-path='/v1/jobs']").first.wait_for(timeout=30_000)
    page.locator(".opblock-summary-path[data-path='/v1/jobs/{job_id}/cancel']").first.wait_for()
    assert elsewhere == [], f"/docs asked for files from elsewhere: {elsewhere}"
    assert violations == []
    page.close()


def test_the_console_runs_under_the_policy(browser, api_stack):  # noqa: F811
    for holder in ("alice", "ops"):
        page = login(browser, api_stack, holder)
        violations = csp_violations(page)
        for path in PAGES:
            if path == "/console/deadletters" and holder == "alice":
                continue  # operators only
            response = page.goto(f"{api_stack.url}{path}")
            assert response.ok, path
            assert policy(response.headers.get("content-security-policy", "")).get("script-src") == {"'self'"}, path
            page.wait_for_load_state("load")
        page.goto(f"{api_stack.url}/console/jobs")  # the script's live refresh swaps the table in
        page.evaluate("document.getElementById('jobs').dataset.old = '1'")
        page.wait_for_function("() => !document.querySelector('#jobs[data-old]')", timeout=15_000)
        assert violations == [], f"{holder}: {violations}"
        page.close()


def test_a_hostile_string_is_text_on_the_page_and_in_its_live_refresh(browser, api_stack):  # noqa: F811
    job_id = f"xss-{uuid.uuid4().hex[:6]}"
    with api_stack.client("bob") as bob:
        assert bob.post("/v1/jobs", json=job_document(job_id, "team-b", runtime_s=3000)).status_code == 201
        page = login(browser, api_stack, "bob")
        opened, violations = dialogs(page), csp_violations(page)
        page.goto(f"{api_stack.url}/console/jobs/{job_id}")  # follows the job's stream, refreshes #live
        page.wait_for_selector("#cancel")
        assert bob.post(f"/v1/jobs/{job_id}/cancel", json={"reason": HOSTILE}).status_code == 200
        html = bob.get(f"/console/jobs/{job_id}").text
    assert HOSTILE not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # escaped by the server
    page.wait_for_function("() => document.getElementById('job-state').textContent.trim() === 'cancelled'",
                           timeout=60_000)
    assert HOSTILE in page.inner_text("#timeline")  # brought in by the live refresh, as text
    assert page.locator("#live script, #live svg, #live img").count() == 0
    # Markup that did get in could not run either: the policy refuses inline event handlers.
    page.evaluate("document.body.insertAdjacentHTML('beforeend', '<img src=\"/nowhere\" onerror=\"alert(2)\">')")
    deadline = time.monotonic() + 3
    while not violations and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert opened == [], f"dialogs opened: {opened}"
    assert violations, "the inline handler ran or was not reported as refused"
    page.close()


def test_charts_are_markup_built_from_escaped_parts():
    times = [datetime(2026, 12, 7, tzinfo=UTC) + timedelta(minutes=30 * i) for i in range(3)]
    svg = time_chart(times, [Series(HOSTILE, [1, None, 3])], HOSTILE)  # a series and a unit named by an attacker
    assert isinstance(svg, Markup)  # the template inserts it as is: no |safe on anything else
    assert "<script>" not in svg and svg.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 5  # 2 dots, legend; unit ×2
    page = templates.get_template("charts.html").render(
        me=None, hours=24, first=times[0], last=times[-1], bucket="30 min",
        charts=[(HOSTILE, HOSTILE, HOSTILE, HOSTILE), ("ok", "ok", "", svg)])
    assert "<script>" not in page and "<svg onload" not in page and "<img src=x" not in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 4 + 5  # id, title, note, a str passed as the SVG
    assert str(svg) in page


def test_no_template_marks_a_value_safe():
    for name in templates.env.list_templates(extensions=["html"]):
        source = templates.env.loader.get_source(templates.env, name)[0]
        assert "|safe" not in source.replace(" ", "") and "Markup(" not in source, name
