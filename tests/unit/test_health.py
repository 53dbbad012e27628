"""A process's health as its orchestrator reads it (runtime/health.py): live while the loop turns,
ready when connected to NATS with nothing pending; served beside /metrics on a real port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from gpusched.dev import stack as devstack
from runtime import health, observability
from runtime.health import LIVE_WITHIN_S, Health


@pytest.mark.parametrize("beat, now, ok", [
    (None, 100.0, True),  # not started (still waiting for NATS): not wedged
    (100.0, 100.0 + LIVE_WITHIN_S, True),
    (100.0, 100.1 + LIVE_WITHIN_S, False),  # the loop stopped turning
])
def test_live_while_the_loop_turns(beat, now, ok):
    assert Health(beat=beat).live(now)[0] is ok


def test_ready_when_connected_with_nothing_pending():
    h = Health()
    h.waiting_for("rebuild")
    assert h.ready() == (False, {"ok": False, "waiting_for": ["nats", "rebuild"]})
    h.nats = True
    assert h.ready()[1]["waiting_for"] == ["rebuild"]
    h.done("rebuild")
    h.role = "standby"
    assert h.ready() == (True, {"ok": True, "waiting_for": [], "role": "standby"})
    h.jetstream = False  # connected, but the last fetch or read of the log failed (no JetStream quorum)
    assert h.ready() == (False, {"ok": False, "waiting_for": ["jetstream"], "role": "standby"})


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(health, "HEALTH", Health())
    (port,) = devstack.free_ports(1)
    server = observability.serve_metrics(port)
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_metrics_port_serves_metrics_livez_and_readyz(served):
    status, body = get(f"{served}/readyz")
    assert status == 503 and json.loads(body)["waiting_for"] == ["nats"]
    health.HEALTH.nats = True
    assert get(f"{served}/readyz")[0] == 200
    assert get(f"{served}/livez")[0] == 200
    health.HEALTH.beat = 0.0  # a heartbeat from long ago: wedged
    assert get(f"{served}/livez")[0] == 503
    status, body = get(f"{served}/metrics")
    assert status == 200 and b"gpusched_events_appended_total" in body
