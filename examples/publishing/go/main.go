// Submit a job to gpusched from Go with nothing but a team's NATS credential, and wait for
// admission's decision on the team's own stream. docs/publishing.md walks through it.
//
//	GPUSCHED_NATS_URL=nats://127.0.0.1:4222 GPUSCHED_NATS_USER=team-a GPUSCHED_NATS_PASSWORD=... \
//	  go run . <job-id> <queue> [idempotency-key]
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: publish <job-id> <queue> [idempotency-key]")
		os.Exit(2)
	}
	jobID, queue := os.Args[1], os.Args[2]
	key := jobID
	if len(os.Args) > 3 {
		key = os.Args[3]
	}
	team := os.Getenv("GPUSCHED_NATS_USER") // a team's credential is named after the team
	nc, err := nats.Connect(os.Getenv("GPUSCHED_NATS_URL"),
		nats.UserInfo(team, os.Getenv("GPUSCHED_NATS_PASSWORD")),
		nats.CustomInboxPrefix("_INBOX."+team)) // the only inbox this credential may use
	check(err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	check(err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Follow the job on the team's stream first, so that no answer can come before we listen.
	stream := "GPUSCHED_TENANT_" + team
	consumer, err := js.CreateConsumer(ctx, stream, jetstream.ConsumerConfig{
		FilterSubject: fmt.Sprintf("gpusched.tenant.%s.job.%s.>", team, jobID),
		AckPolicy:     jetstream.AckNonePolicy, InactiveThreshold: time.Minute,
	})
	check(err)

	command, _ := json.Marshal(map[string]any{"job_id": jobID, "spec": map[string]any{
		"kind": "training", "queue": queue, "team": team, "image": "registry.example/train:1", "gpus": 1,
		"expected_runtime_seconds": 60, "idempotency_key": key,
	}})
	msg := nats.NewMsg("gpusched.intake." + team + ".submit")
	msg.Data = command
	msg.Header.Set("Nats-Msg-Id", "submit/"+team+"/"+key) // a retry within 120 s is dropped
	ack, err := js.PublishMsg(ctx, msg)
	check(err)
	fmt.Printf("sent: intake sequence %d (duplicate %v)\n", ack.Sequence, ack.Duplicate)

	for {
		batch, err := consumer.Fetch(10, jetstream.FetchMaxWait(5*time.Second))
		check(err)
		for m := range batch.Messages() {
			var event map[string]any
			check(json.Unmarshal(m.Data(), &event))
			switch m.Headers().Get("Gpusched-Type") {
			case "JobAdmitted":
				fmt.Printf("admitted %s into %v\n", jobID, event["queue"])
				return
			case "JobRejected":
				fmt.Printf("rejected %s: %v (%v)\n", jobID, event["reason"], event["message"])
				os.Exit(1)
			}
		}
		check(batch.Error())
		if ctx.Err() != nil {
			fmt.Println("no answer: see the dead letters (an operator's `gpusched dlq`)")
			os.Exit(2)
		}
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(2)
	}
}
