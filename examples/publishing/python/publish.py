"""Submit a job to gpusched from Python (nats-py) with nothing but a team's NATS credential, and
wait for admission's decision on the team's own stream. docs/publishing.md walks through it.

    GPUSCHED_NATS_URL=nats://127.0.0.1:4222 GPUSCHED_NATS_USER=team-a GPUSCHED_NATS_PASSWORD=... \\
      python publish.py <job-id> <queue> [idempotency-key]
"""

import asyncio
import json
import os
import sys

import nats
from nats.js.api import AckPolicy, ConsumerConfig


async def main(job_id: str, queue: str, key: str) -> int:
    team = os.environ["GPUSCHED_NATS_USER"]  # a team's credential is named after the team
    nc = await nats.connect(os.environ["GPUSCHED_NATS_URL"].split(","), user=team, password=os.environ["GPUSCHED_NATS_PASSWORD"],
                            inbox_prefix=f"_INBOX.{team}")  # the only inbox this credential may use
    js = nc.jetstream()
    # Follow the job on the team's stream first, so that no answer can come before we listen.
    sub = await js.pull_subscribe(f"gpusched.tenant.{team}.job.{job_id}.>", stream=f"GPUSCHED_TENANT_{team}",
                                  config=ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=60))
    command = {"job_id": job_id, "spec": {"kind": "training", "queue": queue, "team": team,
                                          "image": "registry.example/train:1", "gpus": 1,
                                          "expected_runtime_seconds": 60, "idempotency_key": key}}
    ack = await js.publish(f"gpusched.intake.{team}.submit", json.dumps(command).encode(),
                           headers={"Nats-Msg-Id": f"submit/{team}/{key}"})  # a retry within 120 s is dropped
    print(f"sent: intake sequence {ack.seq} (duplicate {bool(ack.duplicate)})")
    try:
        for _ in range(6):
            try:
                msgs = await sub.fetch(10, timeout=5)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                event = json.loads(msg.data)
                if msg.headers.get("Gpusched-Type") == "JobAdmitted":
                    print(f"admitted {job_id} into {event['queue']}")
                    return 0
                if msg.headers.get("Gpusched-Type") == "JobRejected":
                    print(f"rejected {job_id}: {event['reason']} ({event['message']})")
                    return 1
        print("no answer: see the dead letters (an operator's `gpusched dlq`)")
        return 2
    finally:
        await nc.close()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: publish.py <job-id> <queue> [idempotency-key]")
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else sys.argv[1])))
