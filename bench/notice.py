"""Notice, then grace, then stop, on `make run`'s own stack: how long before its deadline a
team's webhook receives the preemption notice, and that the attempt stops at the deadline or
after it (never before), unless it ends on its own first.

It starts `gpusched dev up` (the demo workload, the demo's time scale) as `make run` does, gives
every demo team a webhook (a real HTTP receiver here) with `gpusched apply -f`, and records each
POST's wall time. A notice's margin is its deadline minus its arrival, both on the platform clock
(arrival = the stack's clock at the POST's wall time, from the run's clock.json); the ceiling is the
grace itself (a notice that took no time at all). `e2e/test_notice_on_run_stack.py`
runs the same measurement for a short while and holds every notice to it.

    python -m bench.notice [--seconds 300] [--time-scale 120] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from gpusched.dev.run import TEAMS
from gpusched.dev.stack import free_port
from runtime.clock import ScaledClock

KINDS = ["started", "preemption-notice", "preempted", "succeeded", "failed", "cancelled"]
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Notice:
    job_id: str
    attempt: int
    deadline: float  # platform epoch seconds
    grace_s: float
    arrived: float  # platform epoch seconds
    started: bool = False  # the attempt had started (an attempt not yet running is stopped at once)
    end_kind: str | None = None  # how the attempt ended: preempted, succeeded, failed, cancelled
    end_at: float | None = None  # the end's event time (platform)
    end_arrived: float | None = None  # when the end's POST arrived (platform)

    @property
    def margin_s(self) -> float:
        return self.deadline - self.arrived


@dataclass
class Run:
    notices: list[Notice] = field(default_factory=list)
    posts: int = 0
    time_scale: float = 0.0

    def stopped(self) -> list[Notice]:
        """The notices of running attempts that were then stopped (JobPreempted)."""
        return [n for n in self.notices if n.started and n.end_kind == "preempted"]

    def problems(self) -> list[str]:
        """Every broken promise: a notice that arrived at or after its deadline; an attempt stopped
        (JobPreempted) before its deadline; an end told before its notice."""
        out = []
        for n in self.notices:
            if n.arrived >= n.deadline:
                out.append(f"{n.job_id}/{n.attempt}: notice arrived {n.arrived - n.deadline:.1f} s after its deadline")
            if n.started and n.end_kind == "preempted" and n.end_at is not None and n.end_at < n.deadline - 1e-3:
                out.append(f"{n.job_id}/{n.attempt}: stopped {n.deadline - n.end_at:.1f} s before its deadline")
            if n.end_arrived is not None and n.end_arrived < n.arrived:
                out.append(f"{n.job_id}/{n.attempt}: its end ({n.end_kind}) was told before its notice")
        return out


class Receiver:
    """A real HTTP receiver for the teams' webhooks: every POST's wall time and body."""

    def __init__(self) -> None:
        self.posts: list[tuple[float, dict]] = []
        posts = self.posts

        class Hook(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append((time.time(), json.loads(body)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def close(self) -> None:
        self.server.shutdown()


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def fold(posts: list[tuple[float, dict]], epoch: float, scale: float, start: float | None = None) -> Run:
    """The notices and the ends of their attempts, from the receiver's POSTs (a notification is
    delivered at least once: the first arrival counts)."""
    run = Run(posts=len(posts), time_scale=scale)
    notices: dict[tuple[str, int], Notice] = {}
    ends: dict[tuple[str, int], tuple[str, float, float]] = {}
    started: set[tuple[str, int]] = set()
    for wall, body in sorted(posts, key=lambda p: p[0]):
        key = (body["job_id"], body.get("attempt") or 0)
        arrived = ScaledClock(scale, epoch, start).platform(wall)
        if body["kind"] == "started":
            started.add(key)
        elif body["kind"] == "preemption-notice":
            if key not in notices:
                notices[key] = Notice(key[0], key[1], _stamp(body["deadline"]), body["grace_seconds"], arrived)
        elif key not in ends:
            ends[key] = (body["kind"], _stamp(body["occurred_at"]), arrived)
    for key, n in notices.items():
        n.started = key in started
        if key in ends:
            n.end_kind, n.end_at, n.end_arrived = ends[key]
    run.notices = sorted(notices.values(), key=lambda n: n.arrived)
    return run


def measure(data_dir: Path, seconds: float, *, time_scale: float = 120.0, enough: int | None = None) -> Run:
    """Run `gpusched dev up` with the demo for ``seconds`` (or until ``enough`` running attempts
    have had their notice and been stopped) and fold what the webhooks received."""
    receiver = Receiver()
    env = {**os.environ, "GPUSCHED_API_PORT": str(free_port()),
           "GPUSCHED_WEBHOOK_ALLOW": "127.0.0.0/8"}  # the receiver is on this machine's loopback
    for name in ("GPUSCHED_NATS_URL", "GPUSCHED_PG_DSN", "GPUSCHED_CONNECTION_FILE"):
        env.pop(name, None)  # the stack's own NATS and Postgres
    log = open(data_dir / "dev-up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "gpusched.cli", "dev", "up", "--data-dir", str(data_dir),
                           "--time-scale", str(time_scale)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        conn = data_dir / "run" / "connection.json"
        _wait(lambda: conn.exists() or up.poll() is not None, 120, "the stack's connection file")
        if up.poll() is not None:
            raise RuntimeError(f"gpusched dev up ended with {up.returncode}: {(data_dir / 'dev-up.log').read_text()}")
        clock = json.loads((data_dir / "run" / "clock.json").read_text())
        queues = yaml.safe_load((ROOT / "gpusched" / "examples" / "queues.yaml").read_text())
        queues["teams"] = [{"name": t, "notify": {"webhooks": [{"url": receiver.url, "kinds": KINDS}]}}
                           for t in TEAMS]
        teams_file = data_dir / "queues-with-webhooks.yaml"
        teams_file.write_text(yaml.safe_dump(queues))
        subprocess.run([sys.executable, "-m", "gpusched.cli", "apply", "-f", str(teams_file)], cwd=ROOT, check=True,
                       env={**env, "GPUSCHED_CONNECTION_FILE": str(conn)}, capture_output=True)
        ended = time.time() + seconds

        def done() -> bool:
            if time.time() >= ended:
                return True
            run = fold(list(receiver.posts), clock["epoch"], clock["time_scale"], clock.get("start"))
            return enough is not None and len(run.stopped()) >= enough
        _wait(lambda: done() or up.poll() is not None, seconds + 1, "")
        if up.poll() is not None:
            raise RuntimeError(f"gpusched dev up ended with {up.returncode}: {(data_dir / 'dev-up.log').read_text()}")
        time.sleep(2)  # the ends of the last notices' attempts
        return fold(list(receiver.posts), clock["epoch"], clock["time_scale"], clock.get("start"))
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()
        receiver.close()


def _wait(ready, timeout_s: float, what: str) -> None:
    until = time.time() + timeout_s
    while not ready():
        if time.time() > until:
            raise TimeoutError(f"no {what} within {timeout_s} s" if what else "timed out")
        time.sleep(0.2)


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))]


def report(run: Run) -> dict:
    margins = [n.margin_s for n in run.notices]
    graces = [n.grace_s for n in run.notices]
    ends: dict[str, int] = {}
    for n in run.notices:
        ends[n.end_kind or "not yet"] = ends.get(n.end_kind or "not yet", 0) + 1
    out = {"notices": len(run.notices), "posts": run.posts, "time_scale": run.time_scale, "ends": ends,
           "problems": run.problems()}
    if margins:
        out.update(margin_p50_s=pct(margins, 50), margin_p99_s=pct(margins, 1),  # p99: the 1st percentile margin
                   margin_min_s=min(margins), grace_p50_s=pct(graces, 50),
                   margin_p50_wall_ms=pct(margins, 50) / run.time_scale * 1000,
                   margin_p99_wall_ms=pct(margins, 1) / run.time_scale * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="wall seconds of the demo to watch")
    parser.add_argument("--time-scale", type=float, default=120.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpusched-bench-notice-") as tmp:
        run = measure(Path(tmp), args.seconds, time_scale=args.time_scale)
    r = report(run)
    print(f"preemption notices on `gpusched dev up` (demo, time scale {r['time_scale']:g}, {args.seconds:g} wall s): "
          f"{r['notices']} notices, ends {r['ends']}")
    if run.notices:
        print(f"  notice-to-deadline margin (platform s): p50 {r['margin_p50_s']:.1f}  p99 {r['margin_p99_s']:.1f}  "
              f"min {r['margin_min_s']:.1f}; ceiling: the grace, p50 {r['grace_p50_s']:.0f} s -> ratio "
              f"{r['margin_p50_s'] / r['grace_p50_s']:.2f} (p50)")
        print(f"  in wall time: p50 {r['margin_p50_wall_ms']:.0f} ms  p99 {r['margin_p99_wall_ms']:.0f} ms")
    print(f"  broken promises: {len(r['problems'])}" + "".join(f"\n    {p}" for p in r["problems"]))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
