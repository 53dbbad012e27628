-- Quota read models: one row per reservation (an attempt holding quota) and the cohort tree.

CREATE TABLE reservations (
    job_id       text NOT NULL,
    attempt      integer NOT NULL,
    queue        text NOT NULL,
    flavor       text NOT NULL,
    gpus         integer NOT NULL,
    borrowed     integer NOT NULL,          -- part of gpus borrowed from the cohort when reserved
    reserved_at  timestamptz NOT NULL,
    released_at  timestamptz,
    sequence     bigint NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
CREATE INDEX reservations_open ON reservations (queue, flavor) WHERE released_at IS NULL;

CREATE TABLE cohorts (
    name          text PRIMARY KEY,
    parent        text,
    last_sequence bigint NOT NULL
);
