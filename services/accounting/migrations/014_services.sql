-- Inference services (docs/serving.md): each service as its last spec and replica counts, and
-- each replica (a job: replica-<service>-<generation>-<index>) with what last happened to it.
CREATE TABLE services (
    name          text PRIMARY KEY,
    team          text NOT NULL,
    queue         text NOT NULL,
    spec          jsonb NOT NULL,
    generation    integer NOT NULL,           -- the replica template in force
    desired       integer NOT NULL,           -- the controller's target (ScaledTo, or the spec)
    requested     integer,                    -- the last ScaleRequested
    requested_by  text,
    requested_at  timestamptz,
    load_rps      double precision,           -- the last ServiceLoadReported
    load_at       timestamptz,
    deployed_by   text NOT NULL,
    deployed_at   timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL,
    deleted       boolean NOT NULL DEFAULT false,
    last_sequence bigint NOT NULL
);
CREATE TABLE service_replicas (
    job_id        text PRIMARY KEY,
    service       text NOT NULL,
    generation    integer NOT NULL,
    replica_index integer NOT NULL,
    state         text NOT NULL,              -- requested, scheduled, ready, lost (its job retries), replaced, retired
    attempt       integer,
    nodes         text[],
    reason        text,                       -- why it was asked for, lost or retired
    requested_at  timestamptz NOT NULL,
    ready_at      timestamptz,                -- of its latest ready attempt
    changed_at    timestamptz NOT NULL,
    last_sequence bigint NOT NULL
);
CREATE INDEX service_replicas_by_service ON service_replicas (service);
