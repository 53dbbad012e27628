-- Team settings (TeamConfigured): the latest configuration of each team; `notify` is its
-- NotifySpec (webhooks every job of the team notifies).
CREATE TABLE teams (
    name          text PRIMARY KEY,
    notify        jsonb NOT NULL,
    configured_at timestamptz NOT NULL,
    last_sequence bigint NOT NULL
);
