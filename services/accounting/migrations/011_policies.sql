-- Policy history (PolicyConfigured): every policy applied, in log order. The one with the
-- highest sequence is in force; the others say what was in force before (what-if and audits).
CREATE TABLE policies (
    sequence         bigint PRIMARY KEY,
    configured_at    timestamptz NOT NULL,
    priority_classes jsonb NOT NULL,
    preemption       jsonb NOT NULL
);
