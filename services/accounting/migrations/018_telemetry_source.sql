-- Where a telemetry window's figures come from (NodeTelemetryReported.source): 'nvml', measured on
-- the node, or 'simulated', modelled by the sim executor. Rows written before are NVML's.
ALTER TABLE gpu_telemetry ADD COLUMN source text NOT NULL DEFAULT 'nvml'
    CHECK (source IN ('nvml', 'simulated'));
