-- applied_events' key (the md5 of the event id as a uuid, migration 007) computed by Postgres as
-- a stored generated column rather than sent by the writer: a replay records one id per event,
-- and the digest costs far less in Postgres than in the writer's Python (hashing, hex, the
-- uuid's text encoding). Same values, same primary key; dropping the column drops the old key.
ALTER TABLE applied_events DROP COLUMN event_key;
ALTER TABLE applied_events ADD COLUMN event_key uuid GENERATED ALWAYS AS (md5(event_id)::uuid) STORED;
ALTER TABLE applied_events ADD PRIMARY KEY (event_key);
