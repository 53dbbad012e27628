-- Many clusters (docs/executor.md, "Many clusters"): the cluster of each node, and each cluster
-- as its executor's heartbeats and the scheduler tell it.
ALTER TABLE nodes ADD COLUMN cluster text;
CREATE TABLE clusters (
    name          text PRIMARY KEY,
    last_report   timestamptz NOT NULL,       -- the latest ClusterReported
    nodes         integer NOT NULL,           -- nodes its executor saw then
    lost_at       timestamptz,                -- ClusterLost, until it reports again
    lost_reason   text,
    last_sequence bigint NOT NULL
);
