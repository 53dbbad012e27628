"""The relay: the platform's topology with no logic, the ceiling `python -m bench` sets the services
against (issue 47).

One process per service (admission, quota, scheduler, executor, notifier, accounting, serving),
each reading the log through its own durable pull consumer (``runtime.eventlog.PullConsumer``, as
the services read) and parsing every message it gets (``schemas.parse_event``; admission's
intake: ``parse_command``). Four append the next event of a
job's chain, as the services do (``runtime.eventlog.EventLog.append``: ``Nats-Msg-Id`` and the
aggregate's expected last subject sequence), real pydantic events of the real sizes:

    intake SubmitJob -admission-> JobSubmitted -admission-> JobAdmitted -quota-> QuotaReserved
    -scheduler-> JobScheduled -executor-> JobStarted -executor-> JobSucceeded -quota-> QuotaReleased

The notifier copies each job event to the team's tenant stream; accounting and serving only read.
A batch's appends are awaited together, then its messages are acked.

``filtered``: each process reads only the subjects it acts on (one durable per subject); accounting
and the notifier still read every job event, serving only its own aggregate's.

    python -m bench.relay ROLE [--filtered]   (one process; NATS from GPUSCHED_NATS_URL/_USER/_PASSWORD)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import nats

from runtime import eventlog
from schemas import (JobAdmitted, JobScheduled, JobStarted, JobSubmitted, JobSucceeded, NodeAssignment, QuotaReleased,
                     QuotaReserved, SubmitJob, new_event, parse_event)
from schemas.commands import parse_command
from schemas.registry import SUBJECT_PREFIX

ROLES = ("admission", "quota", "scheduler", "executor", "notifier", "accounting", "serving")
BATCH = 256  # the services' default batch size (GPUSCHED_BATCH_SIZE)
JOB = f"{SUBJECT_PREFIX}.job"
PLACEMENT = (NodeAssignment(node="n0", gpus=1, gpu_indices=(0,)),)


def _next(e, now, producer):
    """The event that follows ``e`` in a job's chain, or None."""
    def make(cls, key, **fields):
        return new_event(cls, aggregate_id=e.aggregate_id, producer=producer, occurred_at=now, key=key,
                         cause=e, **fields)
    if e.type == "JobSubmitted":
        return make(JobAdmitted, "decision", queue=e.spec.queue, priority=500, preemptible=True)
    if e.type == "JobAdmitted":
        return make(QuotaReserved, "1", attempt=1, queue=e.queue, flavor="a100", gpus=1)
    if e.type == "QuotaReserved":
        return make(JobScheduled, "1", attempt=1, flavor=e.flavor, placement=PLACEMENT)
    if e.type == "JobScheduled":
        return make(JobStarted, "1", attempt=1, nodes=("n0",))
    if e.type == "JobStarted":
        return make(JobSucceeded, "1", attempt=1, started_at=e.occurred_at)
    if e.type == "JobSucceeded":
        return make(QuotaReleased, "1", attempt=1, queue="bench", flavor="a100", gpus=1, reason="JobSucceeded")
    return None


ACTS = {"admission": ("submitted",), "quota": ("admitted", "succeeded"), "scheduler": ("quota_reserved",),
        "executor": ("scheduled", "started")}
"""The job events each appending role acts on (last subject token)."""


def consumers(role: str, filtered: bool) -> list[tuple[str, str | None]]:
    """(stream, filter subject or None: everything) of each durable the role reads."""
    events = eventlog.EVENTS_STREAM
    intake = [(eventlog.INTAKE_STREAM, None)] if role == "admission" else []
    if not filtered or role == "accounting":
        return intake + [(events, None)]
    if role == "notifier":
        return [(events, f"{JOB}.>")]
    if role == "serving":
        return [(events, f"{SUBJECT_PREFIX}.service.>")]
    return intake + [(events, f"{JOB}.*.{token}") for token in ACTS[role]]


async def pump(js, role: str, stream: str, sub: eventlog.PullConsumer, team: str) -> None:
    log = eventlog.EventLog(js)
    while True:
        msgs = await sub.fetch(BATCH, 1.0)
        now, work = datetime.now(UTC), []
        for m in msgs:
            if stream == eventlog.INTAKE_STREAM:
                cmd = parse_command(SubmitJob, m.data)
                seq = m.metadata.sequence.stream
                work.append(log.append(new_event(
                    JobSubmitted, aggregate_id=cmd.job_id, producer="admission", occurred_at=now, key=str(seq),
                    spec=cmd.spec, submitter=cmd.on_behalf_of or "bench", intake_sequence=seq), expected_last_seq=0))
                continue
            e = parse_event(m.data)
            if role == "notifier" and m.subject.startswith(JOB + "."):
                copy = f"{SUBJECT_PREFIX}.tenant.{team}.{m.subject[len(SUBJECT_PREFIX) + 1:]}"
                work.append(js.publish(copy, m.data, headers={"Nats-Msg-Id": e.event_id}, timeout=10))
            elif m.subject.rsplit(".", 1)[-1] in ACTS.get(role, ()):
                work.append(log.append(_next(e, now, role), expected_last_seq=m.metadata.sequence.stream))
        await asyncio.gather(*work)
        for m in msgs:
            await m.ack()


async def serve(role: str, filtered: bool, team: str) -> None:
    user = os.environ["GPUSCHED_NATS_USER"]
    nc = await nats.connect(os.environ["GPUSCHED_NATS_URL"], user=user, password=os.environ["GPUSCHED_NATS_PASSWORD"],
                            inbox_prefix=eventlog.inbox_prefix(user))
    js = nc.jetstream()
    subs = []
    for i, (stream, subject) in enumerate(consumers(role, filtered)):
        durable = f"relay-{role}-{i}"
        subs.append((stream, await eventlog.durable_consumer(js, stream=stream, durable=durable,
                                                             filter_subjects=[subject] if subject else None)))
    print("ready", flush=True)
    await asyncio.gather(*(pump(js, role, stream, sub, team) for stream, sub in subs))


class Relay:
    """The relay's processes, started (each has made its durables when :meth:`start` returns) and stopped."""

    def __init__(self, env: dict[str, str], filtered: bool = False, team: str = "team-a") -> None:
        self.env, self.filtered, self.team = env, filtered, team
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> "Relay":
        root = Path(__file__).resolve().parents[1]
        for role in ROLES:
            argv = [sys.executable, "-m", "bench.relay", role, "--team", self.team] + (["--filtered"] if self.filtered else [])
            self.procs[role] = subprocess.Popen(argv, cwd=root, env={**os.environ, **self.env}, stdout=subprocess.PIPE,
                                                text=True)
        for role, proc in self.procs.items():
            if proc.stdout.readline().strip() != "ready":
                self.stop()
                raise RuntimeError(f"relay process {role} exited before its consumers were ready (rc {proc.wait()})")
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.wait(10)
            proc.stdout.close()

    def __enter__(self) -> "Relay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--filtered", action="store_true", help="read only the subjects the role acts on")
    parser.add_argument("--team", default="team-a", help="the team whose tenant stream the notifier copies to")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.role, args.filtered, args.team))
    except KeyboardInterrupt:
        pass
