// Submit a job to gpusched from Node.js (the `nats` npm package, v2) with nothing but a team's
// NATS credential, and wait for admission's decision on the team's own stream.
// docs/publishing.md walks through it.
//
//   GPUSCHED_NATS_URL=nats://127.0.0.1:4222 GPUSCHED_NATS_USER=team-a GPUSCHED_NATS_PASSWORD=... \
//     node publish.cjs <job-id> <queue> [idempotency-key]
"use strict";
const { connect, headers, AckPolicy, JSONCodec } = require("nats");

async function main() {
  const [jobId, queue, key = jobId] = process.argv.slice(2);
  if (!jobId || !queue) {
    console.error("usage: publish.cjs <job-id> <queue> [idempotency-key]");
    process.exit(2);
  }
  const team = process.env.GPUSCHED_NATS_USER; // a team's credential is named after the team
  const nc = await connect({
    servers: process.env.GPUSCHED_NATS_URL.split(","), user: team, pass: process.env.GPUSCHED_NATS_PASSWORD,
    inboxPrefix: `_INBOX.${team}`, // the only inbox this credential may use
  });
  const js = nc.jetstream();
  const jsm = await nc.jetstreamManager();
  const json = JSONCodec();

  // Follow the job on the team's stream first, so that no answer can come before we listen.
  const stream = `GPUSCHED_TENANT_${team}`;
  const info = await jsm.consumers.add(stream, {
    filter_subject: `gpusched.tenant.${team}.job.${jobId}.>`, ack_policy: AckPolicy.None,
    inactive_threshold: 60e9, // nanoseconds
  });
  const consumer = await js.consumers.get(stream, info.name);

  const command = { job_id: jobId, spec: {
    kind: "training", queue, team, image: "registry.example/train:1", gpus: 1,
    expected_runtime_seconds: 60, idempotency_key: key,
  } };
  const h = headers();
  h.set("Nats-Msg-Id", `submit/${team}/${key}`); // a retry within 120 s is dropped
  const ack = await js.publish(`gpusched.intake.${team}.submit`, json.encode(command), { headers: h });
  console.log(`sent: intake sequence ${ack.seq} (duplicate ${ack.duplicate})`);

  const deadline = Date.now() + 30_000;
  while (Date.now() < deadline) {
    const batch = await consumer.fetch({ max_messages: 10, expires: 5_000 });
    for await (const m of batch) {
      const event = json.decode(m.data);
      const type = m.headers && m.headers.get("Gpusched-Type");
      if (type === "JobAdmitted") {
        console.log(`admitted ${jobId} into ${event.queue}`);
        await nc.close();
        return;
      }
      if (type === "JobRejected") {
        console.log(`rejected ${jobId}: ${event.reason} (${event.message})`);
        await nc.close();
        process.exit(1);
      }
    }
  }
  console.log("no answer: see the dead letters (an operator's `gpusched dlq`)");
  await nc.close();
  process.exit(2);
}

main().catch((err) => {
  console.error("error:", err.message);
  process.exit(2);
});
