-- Read models. Every row is derived from the event log; the log is the source of truth.

CREATE TABLE projection_position (
    projection    text PRIMARY KEY,
    last_sequence bigint NOT NULL,          -- highest stream sequence applied, same transaction as the rows
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE jobs (
    job_id          text PRIMARY KEY,
    team            text,
    project         text,
    queue           text,
    kind            text,
    priority_class  text,
    submitter       text,
    gpus_per_node   integer,
    gang_size       integer,
    total_gpus      integer,
    state           text NOT NULL,          -- submitted, rejected, queued, reserved, scheduled, running,
                                            -- succeeded, failed, retrying, preempted, cancelling, cancelled
    attempt         integer NOT NULL DEFAULT 1,
    flavor          text,
    nodes           text[],
    reason          text,                   -- rejection or failure reason code
    message         text,
    exit_code       integer,
    submitted_at    timestamptz,
    admitted_at     timestamptz,
    reserved_at     timestamptz,
    scheduled_at    timestamptz,
    started_at      timestamptz,
    finished_at     timestamptz,
    last_sequence   bigint NOT NULL
);
CREATE INDEX jobs_team_state ON jobs (team, state);
CREATE INDEX jobs_queue_state ON jobs (queue, state);

-- One row per attempt that held GPUs: what chargeback is built from.
CREATE TABLE usage_ledger (
    job_id       text NOT NULL,
    attempt      integer NOT NULL,
    team         text NOT NULL,
    project      text,
    queue        text NOT NULL,
    flavor       text NOT NULL,
    gpus         integer NOT NULL,
    started_at   timestamptz NOT NULL,
    ended_at     timestamptz NOT NULL,
    gpu_seconds  double precision NOT NULL,
    outcome      text NOT NULL,             -- the event that ended the attempt
    sequence     bigint NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
CREATE INDEX usage_ledger_team ON usage_ledger (team, ended_at);

CREATE TABLE nodes (
    name           text PRIMARY KEY,
    gpu_flavor     text,
    gpu_product    text,
    gpu_count      integer NOT NULL,
    gpu_memory_mib integer,
    labels         jsonb NOT NULL DEFAULT '{}',
    unschedulable  boolean NOT NULL DEFAULT false,
    lost           boolean NOT NULL DEFAULT false,
    last_sequence  bigint NOT NULL
);

CREATE TABLE queues (
    name          text PRIMARY KEY,
    cohort        text,
    config        jsonb NOT NULL,
    deleted       boolean NOT NULL DEFAULT false,
    last_sequence bigint NOT NULL
);
