// Re-derive a gpusched chargeback statement's checksum: node verify.mjs < statement.json
// (an issued ChargebackStatementIssued from the log, or GET /v1/chargeback's answer).
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import canonicalize from "canonicalize"; // RFC 8785 (JCS)

const FIELDS = ["period", "group_by", "currency", "minor_unit", "idle_quota", "items", "adjustments", "lines",
  "total_gpu_hours", "total_cost", "first_sequence", "last_sequence", "checksum_alg"];
const statement = JSON.parse(readFileSync(0, "utf8"));
if (statement.checksum_alg !== "jcs-sha256") {
  console.error(`checksum_alg ${statement.checksum_alg}: only jcs-sha256 is re-derivable`);
  process.exit(2);
}
const body = Object.fromEntries(FIELDS.map((k) => [k, statement[k]]));
const derived = "sha256:" + createHash("sha256").update(canonicalize(body), "utf8").digest("hex");
const ok = derived === statement.checksum;
console.log(ok ? `verified ${derived}` : `MISMATCH: issued ${statement.checksum}, derived ${derived}`);
process.exit(ok ? 0 : 1);
