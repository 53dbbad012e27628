"""Issue 44's CLI promises without a platform (a fake gateway): `gpusched queues` shows per flavor
only that flavor's figures, the queue's own once; `-o json` is one JSON document for every list
(`log` streams only with `-o ndjson`); `token list` labels its wall-clock times."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from typer.testing import CliRunner

from gpusched.cli import common
from gpusched.cli import log as log_cli
from gpusched.cli import tokens as token_cli
from gpusched.cli.main import app

runner = CliRunner()


def _row(flavor: str, used: int, weight: float) -> dict:
    # The queue: 2 jobs wait, 8 a100 held (weight 2: weighted 16), nothing on h100.
    return {"queue": "research", "cohort": "shared", "flavor": flavor, "nominal": 8, "borrowing_limit": None,
            "lending_limit": None, "used": used, "borrowed": 0, "lendable": 0, "lent": 0, "pending_jobs": 2,
            "cohort_root": "shared", "weight": weight, "weighted_limit": 40.0, "weighted_used": 16.0,
            "class_limits": [], "budget_gpu_hours": None, "budget_period": None, "budget_used_gpu_hours": None,
            "budget_left_gpu_hours": None}


class FakeGateway:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def queues(self):
        return [_row("a100", 8, 2.0), _row("h100", 0, 4.0)]


class FakeConnection:
    def gateway(self):
        return FakeGateway()


def _table_lines(output: str) -> dict[str, list[str]]:
    """The table's data lines by their flavor cell, split into cells."""
    out = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) > 3 and cells[2] in ("(queue)", "a100", "h100"):
            out[cells[2]] = cells
    return out


def test_queues_rows_show_per_flavor_figures_and_the_queues_own_once(monkeypatch):
    monkeypatch.setattr(common, "connection", lambda: FakeConnection())
    result = runner.invoke(app, ["queues"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "pending_jobs" in line)
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    rows = _table_lines(result.output)
    cell = {flavor: dict(zip(columns, cells)) for flavor, cells in rows.items()}
    assert (cell["(queue)"]["queue"], cell["(queue)"]["pending_jobs"], cell["(queue)"]["weighted"]) == \
        ("research", "2", "16/40")
    assert (cell["a100"]["pending_jobs"], cell["a100"]["weighted"], cell["a100"]["used"]) == ("", "16", "8")
    # nothing waits for or uses h100: its row says so
    assert (cell["h100"]["pending_jobs"], cell["h100"]["weighted"], cell["h100"]["used"]) == ("", "0", "0")


def test_log_json_is_one_array_and_ndjson_one_event_per_line(monkeypatch):
    entries = [(1, None, "gpusched.job.p1.submitted"), (2, None, "gpusched.job.p2.submitted")]

    async def with_js(action):
        return await action(None)

    async def read(js, query, limit):
        return entries, None
    monkeypatch.setattr(log_cli, "with_js", with_js)
    monkeypatch.setattr(log_cli, "read", read)
    as_json = runner.invoke(app, ["log", "-o", "json"])
    assert as_json.exit_code == 0, as_json.output
    assert [e["sequence"] for e in json.loads(as_json.stdout)] == [1, 2]
    as_lines = runner.invoke(app, ["log", "-o", "ndjson"])
    assert as_lines.exit_code == 0, as_lines.output
    assert [json.loads(line)["sequence"] for line in as_lines.stdout.splitlines()] == [1, 2]


def test_token_list_labels_its_wall_clock_times(monkeypatch):
    issued = datetime(2026, 3, 1, 9, 30, 15, 123456, tzinfo=UTC)
    row = {"token_id": "abc", "name": "demo", "role": "member", "team": "team-a", "issued_by": "admin",
           "issued_at": issued, "expires_at": None, "revoked_at": None, "revoked_by": None}

    async def with_pg(query):
        return [dict(row)]
    monkeypatch.setattr(token_cli, "with_pg", with_pg)
    table = runner.invoke(app, ["token", "list"], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    assert "issued (wall)" in table.output and "expires (wall)" in table.output
    assert "2026-03-01T09:30:15+00:00" in table.output and "issued_at" not in table.output
    as_json = runner.invoke(app, ["token", "list", "-o", "json"])
    assert json.loads(as_json.stdout)[0]["issued_at"] == issued.isoformat()
