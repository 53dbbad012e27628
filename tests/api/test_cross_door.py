"""One truth behind every door (docs/architecture.md, "One owner per rule"): on one recorded
history (tests/api/recorded.py: two teams in a cohort, a retry, a borrow, a preemption and its
requeue, waiting jobs, a cancel, a rejection, a service), the same question asked through the CLI
(``-o json``, the operator's NATS + Postgres), the HTTP API, the SDK and the console gives the
same answer: chargeback totals per team, budget left, wait p50/p95, each job's state, queue
position and why-reason.

Only accounting and the API run, so nothing but that history (and the tokens the stack issues)
is in the log: every door is asked at one log position."""

from __future__ import annotations

import asyncio
import csv
import html
import io
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from runtime import eventlog
from schemas.wording import duration
from tests.api.recorded import JOBS, QUEUES, history
from tests.api.stack import ApiStack


def _base() -> datetime:
    """Where the history starts: 50 minutes ago, inside this month (so its statement is the
    open month's and a budget period holds it all)."""
    now = datetime.now(UTC)
    base = now - timedelta(minutes=50)
    return base if base.month == now.month else now.replace(day=1, hour=0, minute=1, second=0, microsecond=0)


@pytest.fixture(scope="module")
def door_stack(postgres, tmp_path_factory):
    stack = ApiStack(tmp_path_factory.mktemp("cross-door"), postgres, history=history(_base()),
                     processes=("accounting", "api")).start()
    try:
        asyncio.run(_caught_up(stack))
        yield stack
    finally:
        crashed = stack.stop()
        assert not crashed, f"tracebacks in the logs of {crashed}: {[stack.log(n)[-2000:] for n in crashed]}"


async def _caught_up(stack: ApiStack, timeout_s: float = 60.0) -> None:
    """Until the read models hold the whole log (the chargeback statement's range ends at the
    log's last sequence)."""
    nc = await stack.admin()
    last = (await nc.jetstream().stream_info(eventlog.EVENTS_STREAM)).state.last_seq
    await nc.close()
    month = datetime.now(UTC).strftime("%Y-%m")
    deadline = asyncio.get_running_loop().time() + timeout_s
    with stack.client("money") as http:
        while True:
            body = http.get("/v1/chargeback", params={"period": month}).json()
            if body.get("last_sequence") == last:
                return
            assert asyncio.get_running_loop().time() < deadline, f"accounting at {body} of {last}"
            await asyncio.sleep(0.2)


def cli(stack: ApiStack, *args: str):
    env = {**os.environ, **stack.nats_server.env("operator"), "GPUSCHED_PG_DSN": stack.dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    env.pop("GPUSCHED_API_URL", None)
    done = subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args, "-o", "json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def api(stack: ApiStack, holder: str, path: str, **params):
    with stack.client(holder) as http:
        response = http.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def sdk(stack: ApiStack, holder: str):
    from gpusched_sdk import Client

    return Client(stack.url, stack.tokens[holder])


def console(stack: ApiStack, holder: str, path: str) -> str:
    with stack.client(holder) as http:
        response = http.get(path)
    assert response.status_code == 200, response.text
    return html.unescape(response.text)


def _month() -> str:
    return datetime.now(UTC).strftime("%Y-%m")


def test_chargeback_totals_per_team_are_one_statement(door_stack):
    month = _month()
    by_cli = cli(door_stack, "chargeback", "--period", month, "--by", "team")
    by_api = api(door_stack, "money", "/v1/chargeback", period=month, group_by="team")
    with sdk(door_stack, "money") as client:
        by_sdk = client.chargeback(month, group_by="team")
    page = console(door_stack, "money", "/console/usage")

    assert by_cli == by_api == by_sdk  # the whole statement: lines, totals, range, checksum, id, provisional
    assert by_api["provisional"] is True and by_api["statement_id"]
    totals = {line["key"]: line["total_cost"] for line in by_api["lines"]}
    assert set(totals) >= {"team-a", "team-b"} and all(Decimal(v) > 0 for v in totals.values()), totals
    shown = dict(re.findall(r'<tr data-team="([^"]+)">.*?<td class="total">([0-9.]+) [A-Z]{3}</td>', page, re.S))
    assert shown == totals  # the statement's own figures, to the cent
    assert f"<th>total ({by_api['currency']})</th>" in page


def test_the_chargeback_csv_is_the_same_bytes_through_the_cli_and_the_api(door_stack):
    """`gpusched chargeback --format csv` and GET /v1/chargeback?format=csv: one function renders
    both (services.accounting.chargeback.to_csv), one row per item, summing to the statement."""
    from services.accounting.chargeback import CSV_COLUMNS

    month = _month()
    env = {**os.environ, **door_stack.nats_server.env("operator"), "GPUSCHED_PG_DSN": door_stack.dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    env.pop("GPUSCHED_API_URL", None)
    by_cli = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "chargeback", "--period", month, "--format",
                             "csv"], env=env, capture_output=True, timeout=120)
    assert by_cli.returncode == 0, by_cli.stderr
    with door_stack.client("money") as http:
        by_api = http.get("/v1/chargeback", params={"period": month, "format": "csv"})
    assert by_api.status_code == 200 and by_api.headers["content-type"].startswith("text/csv")
    assert by_cli.stdout == by_api.content

    statement = api(door_stack, "money", "/v1/chargeback", period=month)
    rows = list(csv.DictReader(io.StringIO(by_api.text)))
    assert by_api.text.splitlines()[0].split(",") == list(CSV_COLUMNS) and len(rows) == len(statement["items"])
    assert {r["team"] for r in rows} >= {"team-a", "team-b"}
    assert {(r["statement_id"], r["checksum"], r["provisional"], r["currency"]) for r in rows} == {
        (statement["statement_id"], statement["checksum"], "true", statement["currency"])}
    assert sum(Decimal(r["amount"]) for r in rows) == Decimal(statement["total_cost"])
    both = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "chargeback", "--period", month, "--format",
                           "csv", "--output", "json"], env=env, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and both.stdout == "" and "--format csv and --output json" in both.stderr


def test_the_focus_export_is_the_same_bytes_through_the_cli_and_the_api(door_stack):
    """`gpusched chargeback --format focus` and GET /v1/chargeback?format=focus: one function renders
    both (services.accounting.focus.to_focus); its BilledCost sums to the statement's total."""
    month = _month()
    env = {**os.environ, **door_stack.nats_server.env("operator"), "GPUSCHED_PG_DSN": door_stack.dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    env.pop("GPUSCHED_API_URL", None)
    by_cli = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "chargeback", "--period", month, "--format",
                             "focus"], env=env, capture_output=True, timeout=120)
    assert by_cli.returncode == 0, by_cli.stderr
    with door_stack.client("money") as http:
        by_api = http.get("/v1/chargeback", params={"period": month, "format": "focus"})
    assert by_api.status_code == 200 and by_api.headers["content-type"].startswith("text/csv")
    assert by_cli.stdout == by_api.content

    from services.accounting.focus import COLUMNS

    statement = api(door_stack, "money", "/v1/chargeback", period=month)
    rows = list(csv.DictReader(io.StringIO(by_api.text)))
    assert by_api.text.splitlines()[0].split(",") == list(COLUMNS)
    assert {(r["x_StatementId"], r["x_Checksum"], r["x_Provisional"], r["BillingCurrency"]) for r in rows} == {
        (statement["statement_id"], statement["checksum"], "true", statement["currency"])}
    assert {r["SubAccountId"] for r in rows} >= {"team-a", "team-b"}
    assert sum(Decimal(r["BilledCost"]) for r in rows) == Decimal(statement["total_cost"])


def test_budget_left_is_weighted_the_same_everywhere(door_stack):
    def left(rows) -> dict[str, float]:
        return {r["queue"]: r["budget_left_gpu_hours"] for r in rows if r.get("budget_gpu_hours") is not None}

    by_cli = left(cli(door_stack, "queues"))
    by_api = left(api(door_stack, "ops", "/v1/queues"))
    with sdk(door_stack, "ops") as client:
        by_sdk = left(client.queues())
    page = console(door_stack, "ops", "/console/queues")
    by_console = {queue: float(n) for queue, n in re.findall(
        r"<td>(q-[ab])</td>.*?<td>([0-9.-]+) of [0-9.]+ / (?:day|week|month)</td>", page, re.S)}

    assert by_cli == by_api == by_sdk and set(by_cli) == {"q-a", "q-b"}, (by_cli, by_api, by_sdk)
    assert by_console == pytest.approx(by_api, abs=0.001)
    # q-a's H100 hour counts three times (its weight): 1 GPU for 20 minutes spends 1 GPU-hour
    assert by_api["q-a"] < 40 - 1.0 - 1.0, by_api


@pytest.mark.parametrize("team, holder", [("team-a", "alice"), ("team-b", "bob")])
def test_wait_percentiles_have_one_definition(door_stack, team, holder):
    queue = QUEUES[team]
    samples = cli(door_stack, "metrics")
    by_cli = {float(q): s["value"] for s in samples if s["metric"] == "gpusched_queue_wait_seconds"
              for q in re.findall(rf"queue={queue},quantile=([0-9.]+)", s["labels"])}
    summary = api(door_stack, holder, "/v1/metrics/summary")
    with sdk(door_stack, holder) as client:
        by_sdk = client.summary()["wait_s"]
    page = console(door_stack, holder, "/console")
    shown = re.search(r"p50 ([^,]+),\s*p95 (.+?) over", page)

    by_api = summary["wait_s"]
    assert by_api == by_sdk
    assert by_cli == {0.5: by_api["p50"], 0.95: by_api["p95"]}, (by_cli, by_api)
    assert shown is not None and shown.groups() == (duration(by_api["p50"]), duration(by_api["p95"]))  # in words
    assert by_api["p50"] is not None and by_api["p50"] > 0


EXPECTED_STATES = {"a-done": "succeeded", "a-h100": "succeeded", "a-retry": "running", "a-borrow": "running",
                   "b-victim": "queued",  # preempted, then requeued for attempt 2: queued again
                   "b-urgent": "running", "b-wait": "queued", "b-cancel": "cancelled", "b-rejected": "rejected"}


def test_each_job_has_one_state(door_stack):
    by_cli = {r["job_id"]: r["state"] for r in cli(door_stack, "jobs", "--limit", "100")}
    by_api = {r["job_id"]: r["state"] for r in api(door_stack, "ops", "/v1/jobs", limit=100)["items"]}
    with sdk(door_stack, "ops") as client:
        by_sdk = {j.job_id: j.state.value for j in client.jobs()}
    page = console(door_stack, "ops", "/console/jobs-table")
    by_console = dict(re.findall(r'data-job="([^"]+)" data-state="([^"]+)"', page))

    assert {j: by_api.get(j) for j in JOBS} == EXPECTED_STATES
    for door in (by_cli, by_sdk, by_console):
        assert {j: door.get(j) for j in JOBS} == EXPECTED_STATES
    queued = {r["job_id"] for r in api(door_stack, "ops", "/v1/jobs", state="queued")["items"]}
    assert queued == {"b-victim", "b-wait"}  # a requeued job is found by state=queued


@pytest.mark.parametrize("job_id, position, code", [("b-victim", 1, "nominal-exhausted"),
                                                     ("b-wait", 2, "nominal-exhausted")])
def test_a_waiting_job_has_one_position_and_one_reason(door_stack, job_id, position, code):
    by_cli = cli(door_stack, "why", job_id)
    by_api = api(door_stack, "bob", f"/v1/jobs/{job_id}/why")
    row = next(r for r in api(door_stack, "bob", "/v1/jobs", limit=100)["items"] if r["job_id"] == job_id)
    with sdk(door_stack, "bob") as client:
        by_sdk = client.why(job_id)
    page = console(door_stack, "bob", f"/console/jobs/{job_id}/detail")
    shown = re.search(r'id="why-code">([^<]+)</strong> · position (\d+) in its queue', page)

    assert by_api["position"] == row["position"] == by_cli["position"] == position
    assert by_sdk["position"] == position
    assert by_api["reason"]["code"] == by_cli["reason"]["code"] == by_sdk["reason"]["code"] == code
    assert by_api["reason"]["message"] == by_cli["reason"]["message"]
    assert shown is not None and shown.groups() == (code, str(position))
    if job_id == "b-victim":  # after its preemption: the reason of its current attempt
        assert by_api["attempt"] == by_cli["attempt"] == 2
