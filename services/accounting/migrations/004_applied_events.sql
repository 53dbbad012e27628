-- Event ids applied to the read models: an event appended twice (a producer re-deciding after
-- JetStream's duplicate window) lands at a new sequence; its second copy changes nothing.
CREATE TABLE applied_events (
    event_id text PRIMARY KEY,
    sequence bigint NOT NULL
);
