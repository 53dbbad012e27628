"""`make test-chaos`: at least 3,000 jobs of mixed shapes on a real stack while every service is
killed with SIGKILL at least twice, nats-server and Postgres once each, and a fuzzer publishes
malformed commands on the tenant subjects; then the invariants (tests/chaos/invariants.py) are
checked from the log and the read models. docs/testing.md describes the run and its knobs."""

from __future__ import annotations

import shutil

import pytest

from tests.chaos.harness import ChaosRun, Config, say

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(1800)
async def test_chaos_run_keeps_every_invariant() -> None:
    config = Config.from_env()
    report = await ChaosRun(config).execute()
    print("\n" + report.summary(), flush=True)
    if report.total == 0 and not config.keep:
        shutil.rmtree(config.root, ignore_errors=True)
        say(f"passed; removed {config.root}")
    else:
        say(f"data and service logs kept in {config.root}")
    assert report.total == 0, f"{report.total} violation(s); see the summary above and the logs in {config.root}"
