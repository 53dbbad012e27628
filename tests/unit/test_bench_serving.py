"""bench.serving on a small cluster: the scale-up it measures happens, with the victims and the
work lost the scenario implies."""

from __future__ import annotations

import pytest

from bench.serving import GRACE_S, READINESS_S, diurnal, run


# two victims of 2 GPUs each, stopped at their deadline: an hour's work (or the 10 minutes since
# their checkpoint) and the grace is lost
@pytest.mark.parametrize("checkpoints, lost", [(False, 2 * 2 * (3600.0 + GRACE_S)), (True, 2 * 2 * (600.0 + GRACE_S))])
def test_a_small_urgent_scale_up(checkpoints, lost):
    r = run(nodes=2, start=2, to=6, victim_gpus=2, checkpoints=checkpoints)
    assert (r["replicas_ready"], r["asked"]) == (4, 4)
    assert r["latency_max_s"] == GRACE_S + READINESS_S == r["latency_floor_s"]
    assert (r["victims"], r["victims_minimum"]) == (2, 2)
    assert r["work_lost_gpu_s"] == lost


def test_the_diurnal_run_autoscales_below_the_fixed_size_without_more_breach():
    fixed, auto = diurnal(3, False), diurnal(3, True)
    assert fixed["breach_s"] == auto["breach_s"] == READINESS_S  # the first replicas' start only
    assert auto["gpu_hours"] < 0.5 * fixed["gpu_hours"]  # the night's low load on few replicas


def test_a_load_curve_from_a_file_is_followed_linearly():
    from bench.serving import curve_rps

    curve = [(0.0, 10.0), (100.0, 30.0), (200.0, 30.0)]
    assert [curve_rps(curve, t) for t in (-5, 0, 50, 100, 150, 500)] == [10.0, 10.0, 20.0, 30.0, 30.0, 30.0]
