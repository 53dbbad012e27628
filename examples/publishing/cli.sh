#!/bin/sh
# Submit a job to gpusched with the plain `nats` CLI and a team's credential, and wait for
# admission's decision on the team's own stream. docs/publishing.md walks through it.
#
#   GPUSCHED_NATS_URL=nats://127.0.0.1:4222 GPUSCHED_NATS_USER=team-a GPUSCHED_NATS_PASSWORD=... \
#     NATS=/path/to/nats sh cli.sh <job-id> <queue> [idempotency-key]
set -eu
JOB="$1"; QUEUE="$2"; KEY="${3:-$1}"
TEAM="$GPUSCHED_NATS_USER"      # a team's credential is named after the team
STREAM="GPUSCHED_TENANT_$TEAM"
nats() {
  "${NATS:-nats}" --no-context --server="$GPUSCHED_NATS_URL" --user="$TEAM" --password="$GPUSCHED_NATS_PASSWORD" \
    --inbox-prefix="_INBOX.$TEAM" "$@"   # the only inbox this credential may use; flag=value: a password may start with "-"
}
# Follow the job on the team's stream first, so that no answer can come before we listen.
CONSUMER="follow-$JOB-$$"   # a new one per run: a consumer remembers what it delivered
nats consumer add "$STREAM" "$CONSUMER" --pull --deliver all --ack none \
  --filter "gpusched.tenant.$TEAM.job.$JOB.>" --inactive-threshold 1m --defaults >/dev/null
# The command, with Nats-Msg-Id: a retry within 120 s is dropped. `req` prints JetStream's ack.
nats req "gpusched.intake.$TEAM.submit" --header "Nats-Msg-Id:submit/$TEAM/$KEY" --raw \
  "{\"job_id\": \"$JOB\", \"spec\": {\"kind\": \"training\", \"queue\": \"$QUEUE\", \"team\": \"$TEAM\",
    \"image\": \"registry.example/train:1\", \"gpus\": 1, \"expected_runtime_seconds\": 60,
    \"idempotency_key\": \"$KEY\"}}"
echo
for _ in 1 2 3 4 5 6; do
  OUT="$(nats consumer next "$STREAM" "$CONSUMER" --count 10 --no-ack --timeout 5s 2>/dev/null || true)"
  case "$OUT" in
    *'"type":"JobAdmitted"'*) echo "admitted $JOB"; exit 0 ;;
    *'"type":"JobRejected"'*) echo "rejected $JOB: $(echo "$OUT" | grep -o '"message":"[^"]*"' | head -1)"; exit 1 ;;
  esac
done
echo "no answer: see the dead letters (an operator's \`gpusched dlq\`)"
exit 2
