"""`make test-chaos`: at least 3,000 jobs of mixed shapes on a real stack while every service is
killed with SIGKILL at least twice, nats-server and Postgres once each, and a fuzzer publishes
malformed commands on the tenant subjects; then the invariants (tests/chaos/invariants.py) are
checked from the log and the read models. The same run again on a JetStream cluster of three
(every stream R3), killing its meta leader, its GPUSCHED_EVENTS leader, a follower and the whole
cluster. docs/testing.md describes the run and its knobs."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosRun, Config, say

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nats_servers", [None, 3], ids=["as-configured", "nats-cluster-3"])
async def test_chaos_run_keeps_every_invariant(nats_servers: int | None) -> None:
    """Once as GPUSCHED_CHAOS_NATS_CLUSTER says (one nats-server unless set), once on a JetStream
    cluster of three whose meta leader, GPUSCHED_EVENTS leader, a follower and then every server
    at once are killed with SIGKILL and started again (faults.CLUSTER_BROKERS)."""
    config = Config.from_env()
    if nats_servers is not None:
        if config.nats_servers == nats_servers:
            pytest.skip(f"GPUSCHED_CHAOS_NATS_CLUSTER={nats_servers}: the run as configured is this one")
        if os.environ.get("GPUSCHED_CHAOS_DIR"):  # beside the other run's data, not over it
            root = config.root / f"nats-cluster-{nats_servers}"
        else:
            config.root.rmdir()  # made empty by from_env: this run has its own
            root = Path(tempfile.mkdtemp(prefix="gpusched-chaos-cluster-"))
        # A third of the load by default (GPUSCHED_CHAOS_CLUSTER_JOBS): R3 appends cost about twice
        # as much here, and CI runs both (its budget: .ci/run under 30 min).
        jobs = int(os.environ.get("GPUSCHED_CHAOS_CLUSTER_JOBS") or 1000)
        config = dataclasses.replace(config, nats_servers=nats_servers, root=root, jobs=jobs,
                                     load_s=max(60.0, jobs / 15), malformed=max(60, jobs // 10))
    report = await ChaosRun(config).execute()
    print("\n" + report.summary(), flush=True)
    if report.total == 0 and not config.keep:
        shutil.rmtree(config.root, ignore_errors=True)
        say(f"passed; removed {config.root}")
    else:
        say(f"data and service logs kept in {config.root}")
    assert report.total == 0, f"{report.total} violation(s); see the summary above and the logs in {config.root}"
