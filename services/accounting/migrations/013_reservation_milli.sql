-- Quota counts thousandths of a GPU: a fractional job (JobSpec.gpu_milli) holds its fraction of a
-- queue's quota, no longer a whole GPU. QuotaReserved's gpu_milli and borrowed_milli, null where
-- the reservation is whole GPUs (gpus × 1000, borrowed × 1000), as in every row written before.
ALTER TABLE reservations ADD COLUMN gpu_milli integer, ADD COLUMN borrowed_milli integer;
