"""Re-derive a gpusched chargeback statement's checksum: python verify.py < statement.json
(an issued ChargebackStatementIssued from the log, or GET /v1/chargeback's answer)."""
import hashlib
import json
import sys

import rfc8785  # RFC 8785 (JCS); pip install rfc8785

FIELDS = ("period", "group_by", "currency", "minor_unit", "idle_quota", "items", "adjustments", "lines",
          "total_gpu_hours", "total_cost", "first_sequence", "last_sequence", "checksum_alg")
statement = json.load(sys.stdin)
if statement.get("checksum_alg") != "jcs-sha256":
    sys.exit(f"checksum_alg {statement.get('checksum_alg')}: only jcs-sha256 is re-derivable")
derived = "sha256:" + hashlib.sha256(rfc8785.dumps({k: statement[k] for k in FIELDS})).hexdigest()
ok = derived == statement["checksum"]
print(f"verified {derived}" if ok else f"MISMATCH: issued {statement['checksum']}, derived {derived}")
sys.exit(0 if ok else 1)
