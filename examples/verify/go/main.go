// Re-derive a gpusched chargeback statement's checksum: go run . < statement.json
// (an issued ChargebackStatementIssued from the log, or GET /v1/chargeback's answer).
package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/gowebpki/jcs" // RFC 8785 (JCS)
)

var fields = []string{"period", "group_by", "currency", "minor_unit", "idle_quota", "items", "adjustments", "lines",
	"total_gpu_hours", "total_cost", "first_sequence", "last_sequence", "checksum_alg"}

func main() {
	raw, err := io.ReadAll(os.Stdin)
	must(err)
	var statement map[string]json.RawMessage
	must(json.Unmarshal(raw, &statement))
	var alg, issued string
	must(json.Unmarshal(statement["checksum_alg"], &alg))
	must(json.Unmarshal(statement["checksum"], &issued))
	if alg != "jcs-sha256" {
		fmt.Fprintf(os.Stderr, "checksum_alg %s: only jcs-sha256 is re-derivable\n", alg)
		os.Exit(2)
	}
	body := map[string]json.RawMessage{}
	for _, f := range fields {
		body[f] = statement[f]
	}
	text, err := json.Marshal(body)
	must(err)
	canonical, err := jcs.Transform(text)
	must(err)
	sum := sha256.Sum256(canonical)
	derived := "sha256:" + hex.EncodeToString(sum[:])
	if derived != issued {
		fmt.Printf("MISMATCH: issued %s, derived %s\n", issued, derived)
		os.Exit(1)
	}
	fmt.Printf("verified %s\n", derived)
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}
