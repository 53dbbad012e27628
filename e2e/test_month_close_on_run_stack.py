"""A month closes on `make run`'s own stack (issue 43): `gpusched dev up` on a fresh data directory,
with the demo, as `make run` starts it but at 360 platform seconds a wall second. Its platform
clock starts 6 platform hours before the end of the current month (``--clock-start month-end``,
the default), so the month ends a minute of wall time after the start; once the log's time is an
hour past it (GPUSCHED_STATEMENT_GRACE_S; the demo keeps submitting a job every platform hour),
accounting issues the month's statement. `gpusched chargeback --issued` lists it and `gpusched
chargeback --verify` re-derives it from the log with the same checksum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from gpusched.dev.stack import free_port

pytestmark = pytest.mark.e2e

SCALE = 360.0
MONTH_END_LEAD_S = 6 * 3600.0  # where `--clock-start month-end` starts the clock: 6 platform hours before
REPO = Path(__file__).resolve().parents[1]


def gs(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`gpusched ARGS` through the stack's connection file, as a user in another terminal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(XDG_STATE_HOME=str(tmp_path / "state"),
               GPUSCHED_CONNECTION_FILE=str(tmp_path / ".data" / "run" / "connection.json"))
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_the_demos_first_month_closes_and_its_statement_is_issued_and_verifies(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(XDG_STATE_HOME=str(tmp_path / "state"), GPUSCHED_API_PORT=str(free_port()))
    log = open(tmp_path / "dev-up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "gpusched.cli.main", "dev", "up", "--data-dir",
                           str(tmp_path / ".data"), "--time-scale", f"{SCALE:g}", "--duration", "240"],
                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        connection = tmp_path / ".data" / "run" / "connection.json"
        deadline = time.monotonic() + 120
        while not connection.exists() and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert connection.exists(), (tmp_path / "dev-up.log").read_text()
        clock = json.loads((tmp_path / ".data" / "run" / "clock.json").read_text())
        start = datetime.fromtimestamp(clock.get("start", clock["epoch"]), UTC)
        month_end = datetime(start.year + start.month // 12, start.month % 12 + 1, 1, tzinfo=UTC)
        assert clock["time_scale"] == SCALE and (month_end - start).total_seconds() == MONTH_END_LEAD_S
        closes_at = clock["epoch"] + MONTH_END_LEAD_S / SCALE  # wall time of the month's end: a minute in
        assert closes_at - time.time() < 70
        period = f"{start:%Y-%m}"

        issued: list[dict] = []
        while not issued and time.time() < closes_at + 90 and up.poll() is None:
            time.sleep(2)
            listed = gs(tmp_path, "chargeback", "--issued", "-o", "json")
            assert listed.returncode == 0, listed.stderr
            issued = [s for s in json.loads(listed.stdout) if s["period"] == period]
        waited = time.time() - closes_at
        assert issued, (f"no statement for {period} {waited:.0f} wall s after its end; "
                        f"{(tmp_path / 'dev-up.log').read_text()[-3000:]}")
        statement = issued[0]
        assert statement["group_by"] == "team"
        assert {line["key"] for line in statement["body"]["lines"]} == {"team-research", "team-product",
                                                                         "team-platform"}
        assert any(Decimal(item["gpu_hours"]) > 0 for item in statement["body"]["items"])  # the demo ran in it
        table = gs(tmp_path, "chargeback", "--issued")
        assert table.returncode == 0 and statement["statement_id"] in table.stdout, table.stdout + table.stderr

        verified = gs(tmp_path, "chargeback", "--verify", statement["statement_id"], "--format", "json")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        result = json.loads(verified.stdout)
        assert result["verified"] and result["replayed_checksum"] == result["issued_checksum"] == statement["checksum"]
        print(f"{statement['statement_id']} listed {waited:.0f} wall s after {period}'s end "
              f"({closes_at - clock['epoch']:.0f} wall s after the start), verified")
    finally:
        up.send_signal(2)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()
    for service_log in (tmp_path / ".data" / "logs").glob("*.log"):
        assert "Traceback" not in service_log.read_text(), f"{service_log.name} crashed"
