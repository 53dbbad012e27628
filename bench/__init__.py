"""Benchmarks. `make bench` runs them; figures are printed beside the raw ceilings measured in
the same run, as ratios, because these 2-core machines are noisy."""
