"""A team's whole view, end to end: every service (the notifier included) as a process, and the
team acting with nothing but its credential and the plain `nats` CLI.

team-a submits a long low-priority job and then an urgent one that needs its GPUs; it watches its
tenant stream with `nats consumer next` and sees the admission, the preemption notice (with its
grace deadline) and the completion of its jobs; its webhook receives the same notice, signed,
before the deadline. team-b's job, running at the same time, never appears in team-a's view, and
team-a's credential is refused team-b's stream and every other inbox."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import eventually
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import TeamConfigured, new_event
from tests.natscli import nats_cli, run_nats  # noqa: F401  (nats_cli is a fixture)
from tests.unit.builders import queue

pytestmark = pytest.mark.e2e

TIME_SCALE = 10.0
# team-b runs on nodes of its own: its job never competes with team-a's, so the notice team-a reads
# is the one its own urgent job causes (tests/integration/test_notifier.py covers a preemption by
# another team's job, which team-a reads unnamed).
CLUSTER = ("groups:\n  - {prefix: node, count: 1, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 40960}\n"
           "  - {prefix: bnode, count: 1, gpu_flavor: h100, gpu_count: 8, gpu_memory_mib: 81920}\n")
SECRET = "team-a-webhook-secret"


FLAVOR = {"team-a": "a100", "team-b": "h100"}


def job(job_id: str, team: str, priority_class: str, runtime_s: float) -> str:
    return json.dumps({"job_id": job_id, "spec": {
        "kind": "training", "queue": f"q-{team}", "team": team, "image": "img", "gpus": 8,
        "gpu_flavors": [FLAVOR[team]], "priority_class": priority_class, "expected_runtime_seconds": runtime_s}})


@pytest.fixture
def receiver():
    """A real HTTP receiver for team-a's webhook: (url, [(wall time, headers, body)])."""
    got: list[tuple[float, dict, bytes]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((time.time(), dict(self.headers), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", got
    server.shutdown()


@pytest.fixture
async def stack(nats_server, postgres, admin_js, pg_dsn, tmp_path, receiver):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    secrets = tmp_path / "webhook-secrets.json"
    secrets.write_text(json.dumps({"team-a": SECRET}))
    epoch = time.time()
    env = devstack.service_env(nats_server.env, pg_dsn, cluster=cluster, time_scale=TIME_SCALE, epoch=epoch,
                               extra={"GPUSCHED_TICK_S": "0.1", "GPUSCHED_WEBHOOK_SECRETS_FILE": str(secrets),
                                      "GPUSCHED_WEBHOOK_ALLOW": "127.0.0.0/8"})  # the receiver is on loopback
    log = eventlog.EventLog(admin_js)
    for team in ("team-a", "team-b"):
        await log.append(queue(f"q-{team}", (team,), {FLAVOR[team]: 8}, preemption={"within_queue": "lower-priority"}))
    url, _ = receiver
    await log.append(new_event(TeamConfigured, aggregate_id="team-a", producer="config", occurred_at=datetime.now(UTC),
                               key="1", name="team-a",
                               notify={"webhooks": [{"url": url, "kinds": ["preemption-notice"]}]}))
    procs = devstack.ServiceProcesses(tmp_path / "logs", env)
    procs.start_all()
    yield epoch
    procs.stop_all()
    for name in devstack.SERVICES:
        text = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in text, f"{name} crashed:\n{text[-3000:]}"


async def test_a_team_sees_its_jobs_with_the_nats_cli_and_nothing_of_another_team(
        nats_server, stack, receiver, nats_cli):
    epoch = stack
    url = nats_server.url()

    def nats(user: str, *args: str, check: bool = True):
        done = run_nats(nats_cli, url, user, nats_server.creds.users[user], *args,
                        inbox_prefix=eventlog.inbox_prefix(user))
        assert not check or done.returncode == 0, f"nats {' '.join(args)}: {done.stderr}"
        return done

    stream = eventlog.tenant_stream("team-a")
    nats("team-a", "consumer", "add", stream, "mine", "--pull", "--deliver", "all", "--ack", "none",
         "--filter", "gpusched.tenant.team-a.notify.>", "--defaults")
    ack = json.loads(nats("team-a", "req", "gpusched.intake.team-a.submit", job("long", "team-a", "batch-low", 3000),
                          "--raw").stdout)
    assert ack["stream"] == eventlog.INTAKE_STREAM
    nats("team-b", "req", "gpusched.intake.team-b.submit", job("theirs", "team-b", "training", 60))
    seen: list[dict] = []

    def notified(job_id: str, kind: str) -> bool:
        out = nats("team-a", "consumer", "next", stream, "mine", "--count", "50", "--raw", "--no-ack",
                   "--timeout", "2s", check=False).stdout
        seen.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
        return any(n["job_id"] == job_id and n["kind"] == kind for n in seen)

    await eventually(lambda: notified("long", "started"), timeout_s=60, interval_s=0.5)
    nats("team-a", "req", "gpusched.intake.team-a.submit", job("urgent", "team-a", "deadline-training", 60))
    await eventually(lambda: notified("long", "preemption-notice"), timeout_s=60, interval_s=0.5)
    await eventually(lambda: notified("urgent", "succeeded"), timeout_s=120, interval_s=0.5)

    kinds = [(n["job_id"], n["kind"]) for n in seen]
    assert kinds.index(("long", "admitted")) < kinds.index(("long", "started")) < \
        kinds.index(("long", "preemption-notice")) < kinds.index(("urgent", "started"))
    notice = next(n for n in seen if n["kind"] == "preemption-notice")
    assert notice["by_job"] == "urgent" and notice["grace_seconds"] > 0
    assert {n["job_id"] for n in seen} == {"long", "urgent"}  # nothing of team-b's job

    # Everything in team-a's stream is team-a's; team-b's job ran meanwhile.
    info = json.loads(nats("team-a", "stream", "info", stream, "--json").stdout)
    assert info["state"]["messages"] > 0
    everything = nats("team-a", "consumer", "add", stream, "all", "--pull", "--deliver", "all", "--ack", "none",
                      "--defaults")
    assert everything.returncode == 0
    dump = nats("team-a", "consumer", "next", stream, "all", "--count", "1000", "--raw", "--timeout", "3s",
                "--no-ack", check=False).stdout
    assert "theirs" not in dump and "team-b" not in dump

    # The credential alone opens nothing else.
    for args in (("consumer", "add", eventlog.tenant_stream("team-b"), "spy", "--pull", "--defaults"),
                 ("stream", "info", eventlog.EVENTS_STREAM),
                 ("sub", "_INBOX.>", "--count", "1", "--timeout", "1s"),
                 ("sub", "gpusched.tenant.team-b.>", "--count", "1", "--timeout", "1s"),
                 ("req", "gpusched.intake.team-b.submit", job("x", "team-b", "training", 1), "--timeout", "2s")):
        refused = nats("team-a", *args, check=False)  # `nats req` reports a violation but exits 0
        assert refused.returncode != 0 or "Permissions Violation" in refused.stderr, args

    # The webhook got the notice, signed with team-a's secret, before the grace deadline.
    _, posts = receiver
    assert posts, "no webhook delivery"
    at, headers, body = posts[0]
    payload = json.loads(body)
    assert (payload["kind"], payload["job_id"]) == ("preemption-notice", "long")
    stamp, signature = (part.split("=", 1)[1] for part in headers["Gpusched-Signature"].split(","))
    expected = hmac.new(SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(signature, expected)
    received_platform_time = epoch + (at - epoch) * TIME_SCALE
    assert received_platform_time < datetime.fromisoformat(payload["deadline"]).timestamp()
