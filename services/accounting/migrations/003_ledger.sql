-- Usage ledger: guaranteed vs borrowed, work lost to preemption, queue wait; price books,
-- quota history (idle guaranteed quota), issued statements. Rows keyed by (job, attempt) so that
-- the order in which a batch's operations of different kinds are applied does not matter.

ALTER TABLE usage_ledger
    ADD COLUMN borrowed_gpus         integer NOT NULL DEFAULT 0,
    ADD COLUMN borrowed_gpu_seconds  double precision NOT NULL DEFAULT 0,
    ADD COLUMN lost_gpu_seconds      double precision NOT NULL DEFAULT 0,  -- preempted: since last checkpoint
    ADD COLUMN last_checkpoint_at    timestamptz,
    ADD COLUMN queued_at             timestamptz,                          -- attempt became eligible
    ADD COLUMN wait_seconds          double precision,                     -- queued_at -> started_at
    ADD COLUMN cpu_core_seconds      double precision NOT NULL DEFAULT 0,
    ADD COLUMN memory_gib_seconds    double precision NOT NULL DEFAULT 0;
CREATE INDEX usage_ledger_ended ON usage_ledger (ended_at);

ALTER TABLE jobs
    ADD COLUMN cpu_millis integer,
    ADD COLUMN memory_mib integer;

-- When each attempt became eligible for quota: admission (attempt 1) or the retry decision.
CREATE TABLE attempts (
    job_id    text NOT NULL,
    attempt   integer NOT NULL,
    queued_at timestamptz NOT NULL,
    sequence  bigint NOT NULL,
    PRIMARY KEY (job_id, attempt)
);

CREATE TABLE checkpoints (
    job_id          text NOT NULL,
    attempt         integer NOT NULL,
    checkpointed_at timestamptz NOT NULL,
    sequence        bigint NOT NULL,        -- lost work counts checkpoints logged before the attempt ended
    PRIMARY KEY (job_id, attempt, sequence)
);

-- Every price book version; the latest version per (name, effective_from) wins.
CREATE TABLE price_books (
    name            text NOT NULL,
    effective_from  timestamptz NOT NULL,
    currency        text NOT NULL,
    gpu_prices      jsonb NOT NULL,         -- {"flavor": price per GPU-hour}
    cpu_core_hour   double precision,
    memory_gib_hour double precision,
    idle_quota      text NOT NULL,          -- showback | charge-owner
    sequence        bigint NOT NULL,
    PRIMARY KEY (name, effective_from, sequence)
);

-- Guaranteed (nominal) quota per queue and flavor over time, for idle-quota reporting.
CREATE TABLE quota_history (
    queue          text NOT NULL,
    owner          text,                    -- the queue's first allowed team
    effective_from timestamptz NOT NULL,
    quotas         jsonb NOT NULL,          -- {"flavor": nominal GPUs}; {} when deleted
    sequence       bigint NOT NULL,
    PRIMARY KEY (queue, sequence)
);

CREATE TABLE statements (
    statement_id   text PRIMARY KEY,
    period         text NOT NULL,
    group_by       text NOT NULL,
    checksum       text NOT NULL,
    first_sequence bigint NOT NULL,
    last_sequence  bigint NOT NULL,
    total_cost     double precision NOT NULL,
    body           jsonb NOT NULL,
    sequence       bigint NOT NULL
);
