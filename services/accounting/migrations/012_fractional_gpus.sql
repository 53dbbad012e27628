-- Fractional GPUs (JobSpec.gpu_milli): the thousandths of one GPU each member of a job asks for,
-- and ledger rows charged by it. usage_ledger.gpus and borrowed_gpus are GPUs charged (0.25 for a
-- quarter of one GPU), no longer whole numbers only; rows written before hold the same values.
ALTER TABLE jobs ADD COLUMN gpu_milli integer;             -- null: whole GPUs
ALTER TABLE usage_ledger
    ALTER COLUMN gpus TYPE double precision,
    ALTER COLUMN borrowed_gpus TYPE double precision;
