-- GPU telemetry (NodeTelemetryReported): one row per node, GPU and window, as the executor measured
-- it (NVML). Keyed by the window's start, so a redelivered or re-appended report changes nothing.
CREATE TABLE gpu_telemetry (
    node                  text NOT NULL,
    gpu                   integer NOT NULL,          -- NVML index on the node
    window_start          timestamptz NOT NULL,
    window_end            timestamptz NOT NULL,
    utilization           double precision NOT NULL, -- mean NVML utilization.gpu over the window, 0..1
    memory_used_mib       integer NOT NULL,          -- peak in the window
    memory_total_mib      integer NOT NULL,
    power_w               double precision,          -- mean; null when not reported
    samples               integer NOT NULL,
    allocated_samples     integer NOT NULL,          -- samples while a live attempt's placement held the GPU
    allocated_utilization double precision,          -- mean over those samples; null when none
    sequence              bigint NOT NULL,
    PRIMARY KEY (node, gpu, window_start)
);
CREATE INDEX gpu_telemetry_window_end ON gpu_telemetry (window_end);
