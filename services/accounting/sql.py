"""The read models' write statements and the column layouts the sink and the bulk loader share.
Every statement writes values an operation carries; none reads other rows."""

from __future__ import annotations

from services.accounting.ledger import USAGE_COLUMNS

# Columns a job's change (operations.SetJobState) may set; anything else is a bug.
STATE_COLUMNS = frozenset(
    {"admitted_at", "reserved_at", "scheduled_at", "started_at", "finished_at", "attempt", "flavor",
     "nodes", "reason", "message", "exit_code"}
)

TS_COLUMNS = ("admitted_at", "reserved_at", "scheduled_at", "started_at", "finished_at")
JOB_COLUMNS: tuple[tuple[str, str], ...] = (
    *((c, "timestamptz") for c in TS_COLUMNS),
    ("attempt", "integer"), ("flavor", "text"), ("nodes", "text[]"), ("reason", "text"), ("message", "text"),
    ("exit_code", "integer"),
)
assert {c for c, _ in JOB_COLUMNS} == STATE_COLUMNS

# One statement for every change to a job row (state transitions and wait reasons): a flag and a
# value per column, so that all of a batch's job updates go to Postgres in one pipelined
# executemany, in log order.
JOB_UPDATE = "UPDATE jobs SET state = coalesce($2, state), last_sequence = $3" + "".join(
    f", {c} = CASE WHEN ${4 + 2 * i}::boolean THEN ${5 + 2 * i}::{t} ELSE {c} END"
    for i, (c, t) in enumerate(JOB_COLUMNS)
) + " WHERE job_id = $1"

# The columns of a new job row: the spec's (from JobSubmitted), then the state and the columns
# job updates set, so that a job submitted and changed in one batch is written once.
JOB_SPEC_COLUMNS = ("job_id", "team", "project", "queue", "kind", "priority_class", "submitter", "gpus_per_node",
                     "gang_size", "total_gpus", "submitted_at", "last_sequence", "cpu_millis", "memory_mib",
                     "gpu_milli")
JOB_INSERT_COLUMNS = (*JOB_SPEC_COLUMNS, "state", *(c for c, _ in JOB_COLUMNS))
JOB_DEFAULTS = tuple(1 if c == "attempt" else None for c, _ in JOB_COLUMNS)  # the table's defaults

SQL = {
    # A new job row, with the state its later changes in the same batch give it (the sink folds them).
    "job_submitted": "INSERT INTO jobs (" + ", ".join(JOB_INSERT_COLUMNS) + ") VALUES ("
                     + ", ".join(f"${i + 1}" for i in range(len(JOB_INSERT_COLUMNS))) + ") ON CONFLICT (job_id) DO NOTHING",
    "job_rejected": """
        INSERT INTO jobs (job_id, state, reason, message, finished_at, last_sequence)
        VALUES ($1, 'rejected', $2, $3, $4, $5)
        ON CONFLICT (job_id) DO UPDATE SET state = 'rejected', reason = $2, message = $3,
            finished_at = $4, last_sequence = $5""",
    "job_update": JOB_UPDATE,
    # An attempt's ledger row, computed by services.accounting.ledger; the first row of an attempt stands.
    "usage": "INSERT INTO usage_ledger (" + ", ".join(USAGE_COLUMNS) + ") VALUES ("
             + ", ".join(f"${i + 1}" for i in range(len(USAGE_COLUMNS))) + ") ON CONFLICT (job_id, attempt) DO NOTHING",
    "attempt_queued": "INSERT INTO attempts (job_id, attempt, queued_at, sequence) VALUES ($1, $2, $3, $4) "
                      "ON CONFLICT DO NOTHING",
    "checkpoint": "INSERT INTO checkpoints (job_id, attempt, checkpointed_at, sequence) VALUES ($1, $2, $3, $4) "
                  "ON CONFLICT DO NOTHING",
    "node": """
        INSERT INTO nodes (name, gpu_flavor, gpu_product, gpu_count, gpu_memory_mib, labels, unschedulable,
                           last_sequence, lost, cluster)
        VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8, false, $9)
        ON CONFLICT (name) DO UPDATE SET gpu_flavor = $2, gpu_product = $3, gpu_count = $4,
            gpu_memory_mib = $5, labels = $6::jsonb, unschedulable = $7, last_sequence = $8, lost = false,
            cluster = $9""",
    # A report newer than the one a ClusterLost counted from brings the cluster back.
    "cluster_reported": """
        INSERT INTO clusters (name, last_report, nodes, last_sequence) VALUES ($1, $2, $3, $4)
        ON CONFLICT (name) DO UPDATE SET nodes = $3, last_sequence = $4,
            lost_at = CASE WHEN $2 > clusters.last_report THEN NULL ELSE clusters.lost_at END,
            lost_reason = CASE WHEN $2 > clusters.last_report THEN NULL ELSE clusters.lost_reason END,
            last_report = greatest(clusters.last_report, $2)""",
    "cluster_lost": """
        INSERT INTO clusters (name, last_report, nodes, lost_at, lost_reason, last_sequence)
        VALUES ($1, $2, 0, $3, $4, $5)
        ON CONFLICT (name) DO UPDATE SET lost_at = $3, lost_reason = $4, last_sequence = $5""",
    "nodes_lost": "UPDATE nodes SET lost = true, last_sequence = $2 WHERE name = ANY($1::text[])",
    "reservation": """
        INSERT INTO reservations (job_id, attempt, queue, flavor, gpus, borrowed, gpu_milli, borrowed_milli,
                                  reserved_at, sequence, released_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (job_id, attempt) DO NOTHING""",
    "reservation_released": """
        UPDATE reservations SET released_at = $3, sequence = $4 WHERE job_id = $1 AND attempt = $2
            AND released_at IS NULL""",
    "cohort": """
        INSERT INTO cohorts (name, parent, last_sequence) VALUES ($1, $2, $3)
        ON CONFLICT (name) DO UPDATE SET parent = $2, last_sequence = $3""",
    "node_lost": "UPDATE nodes SET lost = true, last_sequence = $2 WHERE name = $1",
    # One row per (node, GPU, window); the first report of a window stands.
    "gpu_telemetry": """
        INSERT INTO gpu_telemetry (node, gpu, window_start, window_end, utilization, memory_used_mib,
                                   memory_total_mib, power_w, samples, allocated_samples, allocated_utilization,
                                   sequence, source)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
        ON CONFLICT (node, gpu, window_start) DO NOTHING""",
    "queue": """
        INSERT INTO queues (name, cohort, config, last_sequence, deleted) VALUES ($1, $2, $3::jsonb, $4, false)
        ON CONFLICT (name) DO UPDATE SET cohort = $2, config = $3::jsonb, last_sequence = $4, deleted = false""",
    "queue_deleted": "UPDATE queues SET deleted = true, last_sequence = $2 WHERE name = $1",
    "quota_history": "INSERT INTO quota_history (queue, owner, effective_from, quotas, sequence) "
                     "VALUES ($1, $2, $3, $4::jsonb, $5) ON CONFLICT DO NOTHING",
    "price_book": """
        INSERT INTO price_books (name, effective_from, currency, gpu_prices, cpu_core_hour, memory_gib_hour,
                                 idle_quota, sequence)
        VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8) ON CONFLICT DO NOTHING""",
    "service_deployed": """
        INSERT INTO services (name, team, queue, spec, generation, desired, deployed_by, deployed_at, updated_at,
                              last_sequence)
        VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $8, $9)
        ON CONFLICT (name) DO UPDATE SET team = $2, queue = $3, spec = $4::jsonb, generation = $5, desired = $6,
            requested = NULL, requested_by = NULL, requested_at = NULL, deployed_by = $7, deployed_at = $8,
            updated_at = $8, deleted = false, last_sequence = $9
        WHERE services.last_sequence < $9""",
    "service_updated": """
        UPDATE services SET spec = $2::jsonb, generation = $3, desired = $4, updated_at = $5, last_sequence = $6
        WHERE name = $1 AND last_sequence < $6""",
    "service_scale_requested": """
        UPDATE services SET requested = $2, requested_by = $3, requested_at = $4, last_sequence = $5
        WHERE name = $1 AND last_sequence < $5""",
    "service_load": """
        UPDATE services SET load_rps = $2, load_at = $3, last_sequence = $4 WHERE name = $1 AND last_sequence < $4""",
    "service_scaled": """
        UPDATE services SET desired = $2, last_sequence = $3 WHERE name = $1 AND last_sequence < $3""",
    "service_deleted": """
        UPDATE services SET deleted = true, updated_at = $2, last_sequence = $3 WHERE name = $1 AND last_sequence < $3""",
    "replica_requested": """
        INSERT INTO service_replicas (job_id, service, generation, replica_index, state, reason, requested_at,
                                      changed_at, last_sequence)
        VALUES ($1, $2, $3, $4, 'requested', $5, $6, $6, $7) ON CONFLICT (job_id) DO NOTHING""",
    "replica_state": """
        UPDATE service_replicas SET state = $2, attempt = coalesce($3, attempt), nodes = coalesce($4, nodes),
            reason = coalesce($5, reason), changed_at = $6,
            ready_at = CASE WHEN $2 = 'ready' THEN $6 ELSE ready_at END, last_sequence = $7
        WHERE job_id = $1 AND last_sequence < $7""",
    "policy": """
        INSERT INTO policies (sequence, configured_at, priority_classes, preemption)
        VALUES ($1, $2, $3::jsonb, $4::jsonb) ON CONFLICT (sequence) DO NOTHING""",
    "team": """
        INSERT INTO teams (name, notify, configured_at, last_sequence) VALUES ($1, $2::jsonb, $3, $4)
        ON CONFLICT (name) DO UPDATE SET notify = $2::jsonb, configured_at = $3, last_sequence = $4
        WHERE teams.last_sequence < $4""",
    # A token's row: issued once (a re-delivered issue changes nothing), revoked at most once.
    "api_token": """
        INSERT INTO api_tokens (token_id, name, role, team, token_hash, issued_by, issued_at, expires_at, sequence)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (token_id) DO NOTHING""",
    "api_token_revoked": """
        UPDATE api_tokens SET revoked_at = $2, revoked_by = $3 WHERE token_id = $1 AND revoked_at IS NULL""",
    "statement": """
        INSERT INTO statements (statement_id, period, group_by, checksum, first_sequence, last_sequence,
                                total_cost, body, sequence)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9) ON CONFLICT (statement_id) DO NOTHING""",
}

