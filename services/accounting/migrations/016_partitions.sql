-- Accounting partitioned by team (services/accounting/partition.py): each partition's position
-- row says how many partitions share the projection, so that a change of their number is seen.
ALTER TABLE projection_position ADD COLUMN partitions integer NOT NULL DEFAULT 1;
