"""Calibration: the alpha-beta fit, the profile file, the cluster built from it, one real run (on a pool)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from shoal.calibration.calibrate import calibrate
from shoal.planner import profile as prof
from shoal.planner.profile import (
    COLLECTIVES,
    CollectiveFit,
    Profile,
    collective_time,
    default_profile_path,
    fit_alpha_beta,
    load_profile,
    local_cluster,
    save_profile,
)


def _line(alpha: float, beta: float, sizes: tuple[int, ...] = (1024, 16384, 2**20, 2**24)) -> CollectiveFit:
    return CollectiveFit(alpha=alpha, beta=beta, points=tuple((b, alpha + beta * b) for b in sizes))


def _profile() -> Profile:
    """A hand-made profile: each figure at world size 4 is half (or twice the time) of that at 2."""
    return Profile(
        hostname="box", torch_version="2.13.0", cpu_model="Test CPU", date="2026-11-22T00:00:00+00:00", quick=True,
        load_average=0.25,
        matmul_flops={1: {"fp32": 100e9, "bf16": 200e9}, 2: {"fp32": 90e9}, 4: {"fp32": 45e9}},
        matmul_by_shape={1: {"fp32": {"128x128x128": 100e9}, "bf16": {"128x128x128": 200e9}},
                         2: {"fp32": {"128x128x128": 90e9}}, 4: {"fp32": {"128x128x128": 45e9}}},
        memory_bw={1: 30e9, 2: 20e9, 4: 10e9},
        memory_by_op={n: {"add": bw, "copy": bw} for n, bw in {1: 30e9, 2: 20e9, 4: 10e9}.items()},
        collectives={2: {kind: _line(200e-6, 1e-9) for kind in COLLECTIVES},
                     4: {kind: _line(800e-6, 2e-9) for kind in COLLECTIVES}},
    )


def test_profile_and_lookups_import_no_torch():
    """The planner reads a profile and prices collectives on it without torch: only measuring needs it."""
    code = ("import sys, shoal.planner.profile, shoal.calibration.calibrate; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------- the fit


def test_fit_recovers_a_line_exactly():
    alpha, beta = 250e-6, 1 / 3e9
    points = [(b, alpha + beta * b) for b in (1024, 16384, 2**20, 2**24)]
    assert fit_alpha_beta(points) == pytest.approx((alpha, beta), rel=1e-9)


def test_fit_never_goes_negative():
    # Time falls with size: the best line has beta < 0, so beta is 0 and alpha fits alone.
    alpha, beta = fit_alpha_beta([(1000, 2e-3), (2000, 1e-3)])
    assert beta == 0.0 and alpha > 0
    # A line through the origin's far side: alpha would be < 0, so it is 0 and beta fits alone.
    alpha, beta = fit_alpha_beta([(1000, 1e-6), (2000, 3e-6)])
    assert alpha == 0.0 and beta > 0
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_alpha_beta([(1024, 1e-3), (1024, 2e-3)])


def test_collective_time_is_the_fitted_line():
    profile = _profile()
    assert collective_time(profile, "all_reduce", 2, 1e6) == pytest.approx(200e-6 + 1e-9 * 1e6)
    assert collective_time(profile, "all_to_all", 4, 0) == pytest.approx(800e-6)
    assert collective_time(profile, "broadcast", 1, 1e9) == 0.0  # nothing to talk to
    assert collective_time(profile, "send_recv", 8, 0) == pytest.approx(800e-6)  # nearest: 4
    with pytest.raises(ValueError, match="valid: all_reduce"):
        collective_time(profile, "allreduce", 2, 1e6)


def test_a_steps_collectives_pay_the_in_step_latency_of_their_group_size():
    """Profile.in_step replaces alpha for the calls a step blocks on, looked up by group size (the
    world's processes still set the bytes' cost); a pipeline's sends keep alpha; a ring hop is
    priced on send_recv's bytes."""
    in_step = {4: {"2": {"all_gather": 3e-3, "ring": 5e-3}, "4": {"all_gather": 6e-3}}}
    profile = dataclasses.replace(_profile(), in_step=in_step)
    assert collective_time(profile, "all_gather", 4, 1e6, group=2) == pytest.approx(3e-3 + 2e-9 * 1e6)
    assert collective_time(profile, "all_gather", 4, 1e6) == pytest.approx(6e-3 + 2e-9 * 1e6)  # the whole world
    assert collective_time(profile, "all_reduce", 4, 0, group=2) == pytest.approx(800e-6)  # not measured: alpha
    assert collective_time(profile, "send_recv", 4, 0, group=2) == pytest.approx(800e-6)  # posted ahead: alpha
    assert collective_time(profile, "ring", 4, 1e6, group=2) == pytest.approx(5e-3 + 2e-9 * 1e6)
    assert collective_time(profile, "all_gather", 2, 0) == pytest.approx(200e-6)  # no in-step figure at 2
    assert Profile.from_json(profile.to_json()) == profile
    old = json.loads(_profile().to_json())
    del old["in_step"]  # a profile written before in-step latencies were measured still loads
    assert Profile.from_json(json.dumps(old)).in_step == {}


# ----------------------------------------------------------------------------- the file


def test_profile_json_round_trip():
    profile = _profile()
    again = Profile.from_json(profile.to_json())
    assert again == profile
    assert set(again.matmul_flops) == {1, 2, 4}  # world sizes come back as ints, not JSON's strings


def test_save_and_load(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "profile.json"
    assert load_profile(path) is None
    assert save_profile(_profile(), path) == path
    assert load_profile(path) == _profile()
    monkeypatch.setenv("SHOAL_PROFILE", str(path))
    assert default_profile_path() == path and load_profile() == _profile()
    monkeypatch.delenv("SHOAL_PROFILE")
    assert default_profile_path().parts[-3:] == (".cache", "shoal", "profile.json")


def test_save_is_atomic(tmp_path, monkeypatch):
    """A failure after part of the text is written leaves the old file whole and no temporary file."""
    path = tmp_path / "profile.json"
    save_profile(_profile(), path)
    before = path.read_text()

    def fail(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(prof.os, "fsync", fail)
    newer = Profile.from_json(_profile().to_json().replace('"box"', '"other"'))
    with pytest.raises(OSError, match="disk full"):
        save_profile(newer, path)
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["profile.json"]
    with pytest.raises(OSError, match="disk full"):
        save_profile(newer, tmp_path / "fresh.json")
    assert not (tmp_path / "fresh.json").exists()


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": 1}', '{"format": 99}', ""])
def test_corrupt_profile_is_a_one_line_error(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "shoal plan --calibrate" in message


# ----------------------------------------------------------------------------- the cluster


def test_local_cluster_uses_the_numbers_measured_at_that_size():
    profile = _profile()
    cluster = local_cluster(profile, 2)
    assert (cluster.num_nodes, cluster.per_node, cluster.world_size) == (1, 2, 2)
    assert cluster.device.name == "cpu"
    assert cluster.device.flops("fp32") == pytest.approx(90e9)  # efficiency 1: the measured rate
    assert cluster.device.memory_bw == pytest.approx(20e9)
    assert cluster.intra.latency == pytest.approx(200e-6)
    assert cluster.intra.achievable == pytest.approx(1e9)
    assert cluster.device.intra == cluster.intra

    single = local_cluster(profile, 1)
    assert single.device.peak_flops == {"fp32": 100e9, "bf16": 200e9}
    assert single.intra.latency == pytest.approx(200e-6)  # no collectives at 1: the nearest N > 1


def test_local_cluster_takes_the_nearest_size_not_measured():
    profile = _profile()
    three = local_cluster(profile, 3)  # as near 2 as 4: the larger, slower one
    assert three.world_size == 3
    assert three.device.flops("fp32") == pytest.approx(45e9)
    assert three.intra.latency == pytest.approx(800e-6)
    eight = local_cluster(profile, 8)
    assert eight.device.memory_bw == pytest.approx(10e9) and eight.intra.achievable == pytest.approx(0.5e9)


# ----------------------------------------------------------------------------- a real run


def test_quick_calibration_on_this_machine():
    """Measure world sizes 1 and 2 for real and check the figures are sane and the fit follows them.

    Tolerance: timing on a small machine swings with other processes sharing its cores (other test
    runs): a size most of whose repetitions were preempted can have its median an order of
    magnitude above the line. So every size must be within 20x of the line: that still catches a wrong
    fit (a units slip is 1000x; a line through the wrong points is off by the 4 decades the sizes
    span) without failing on a busy machine. The fit itself is checked exactly on made-up points.
    """
    profile = calibrate((1, 2), quick=True, progress=False)
    assert set(profile.matmul_flops) == set(profile.memory_bw) == {1, 2}
    assert profile.load_average >= 0 and profile.cpu_model and profile.torch_version
    assert set(profile.collectives) == {2} and set(profile.collectives[2]) == set(COLLECTIVES)
    for n in (1, 2):
        rates = [*profile.matmul_flops[n].values(), *profile.memory_bw.values()]
        rates += [r for shapes in profile.matmul_by_shape[n].values() for r in shapes.values()]
        assert all(math.isfinite(r) and r > 0 for r in rates), rates
        assert "fp32" in profile.matmul_flops[n]
    for kind, fit in profile.collectives[2].items():
        assert math.isfinite(fit.alpha) and math.isfinite(fit.beta) and fit.alpha >= 0 and fit.beta >= 0, kind
        assert fit.alpha + fit.beta > 0, kind
        assert [b for b, _ in fit.points] == sorted(b for b, _ in fit.points) and len(fit.points) >= 4
        assert all(t > 0 for _, t in fit.points), (kind, fit.points)
        assert all(1 / 20 < fit.time(b) / t < 20 for b, t in fit.points), (kind, fit)
    assert set(profile.dispatch) == {1, 2} and all(0 < d < 1e-3 for d in profile.dispatch.values())
    # The in-step latency of a 4 KB call after compute: above zero, below the 20x-of-a-second bound of a hang.
    assert set(profile.in_step) == {2} and set(profile.in_step[2]) == {"2"}
    assert set(profile.in_step[2]["2"]) == set(prof.IN_STEP_KINDS)
    assert all(0 <= t < 1.0 for t in profile.in_step[2]["2"].values()), profile.in_step
    assert Profile.from_json(profile.to_json()) == profile
