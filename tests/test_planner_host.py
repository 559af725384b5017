"""The planner's host term: a GPU step's phases take the larger of the host's time and the device's, a CPU's add
them (unchanged), and the host's seconds per op that the CUDA calibration measures reach the estimate through the
profile it writes. Pure arithmetic except where a test says it runs torch."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shoal import rules
from shoal.models.config import get_preset
from shoal.plan import Plan
from shoal.planner.cluster_file import load_cluster, parse_cluster
from shoal.planner.costs import HOST_FORWARD_SHARE, OPS_PER_BLOCK, STEP_HOST_OPS, model_ops
from shoal.planner.estimate import Workload, estimate, host_phases
from shoal.planner.hardware import Cluster
from shoal.planner.profile import COLLECTIVES, CollectiveFit, Profile, local_cluster

TINY = get_preset("tiny")  # 4 layers, dim 128
HOST_OP = 60e-6  # seconds per op: the order of a GPU machine's host (docs/measurements.md)


def _gpu(op_overhead: float, name: str = "1xH200") -> Cluster:
    c = parse_cluster(name)
    return dataclasses.replace(c, device=dataclasses.replace(c.device, op_overhead=op_overhead))


def _estimate(text: str, cluster: Cluster, model=TINY, batch: int = 2, seq: int = 128):
    plan = rules.resolve(Plan.parse(text), world_size=cluster.world_size, device=cluster.device_type)
    return estimate(plan, Workload(model=model, global_batch=batch, seq_len=seq), cluster)


def test_each_phase_takes_the_larger_of_host_and_device_by_hand():
    """Forward 1 s on the device, backward 4 s; the host's 5 s split 2 : 3 (HOST_FORWARD_SHARE 0.4). Forward waits
    on the host (2 s), backward on the device (4 s): 6 s, 1 s of it the host's. Neither the sum of host and device
    (10 s) nor the larger of the two whole steps (5 s)."""
    assert HOST_FORWARD_SHARE == 0.4
    fwd, bwd, terms, host_fwd, host_bwd = host_phases(1.0, 4.0, {"compute_matmul": 5.0}, 5.0, on_cpu=False)
    assert (fwd, bwd, host_fwd, host_bwd) == pytest.approx((2.0, 4.0, 2.0, 3.0))
    assert terms == pytest.approx({"compute_matmul": 5.0, "host_bound": 1.0})
    # a CPU's cores run both: its step adds the host in its own terms, this leaves the phases as they are
    assert host_phases(1.0, 4.0, {}, 5.0, on_cpu=True)[:3] == (1.0, 4.0, {})


def test_a_tiny_model_on_a_gpu_is_host_bound_and_its_step_is_the_hosts_time():
    """fp32 on one GPU (no data engine): the tiny model's kernels take microseconds, its host 60 us an op. The step
    is the host's: forward and backward's ops (model_ops: 4 blocks of 42 and the head's 10) and the optimizer's
    few (STEP_HOST_OPS), all at 60 us."""
    e = _estimate("dp1,precision=fp32,compile=off", _gpu(HOST_OP))
    assert e.engine == "none"
    by_hand = {"forward": HOST_FORWARD_SHARE * model_ops(TINY.num_layers) * HOST_OP,
               "backward": (1 - HOST_FORWARD_SHARE) * model_ops(TINY.num_layers) * HOST_OP,
               "optimizer": STEP_HOST_OPS * HOST_OP}
    assert model_ops(TINY.num_layers) == 4 * 42 + 10
    assert e.host == pytest.approx(by_hand, rel=1e-12)
    assert e.time["host_bound"] > 0
    assert e.step_time_s == pytest.approx(sum(by_hand.values()), rel=1e-12)
    assert sum(e.time.values()) == pytest.approx(e.step_time_s, rel=1e-12)  # the terms still add up
    # compiled, each block calls its compiled kernels instead of its eager ops: fewer, so less host time
    compiled = _estimate("dp1,precision=fp32,compile=on", _gpu(HOST_OP))
    assert compiled.host["forward"] == pytest.approx(
        HOST_FORWARD_SHARE * (4 * OPS_PER_BLOCK[True] + 10) * HOST_OP, rel=1e-12)


def test_a_large_model_on_the_same_gpu_is_device_bound():
    """An 8B Llama on one H200 at 60 us an op: its host runs ~0.09 s a step, its kernels ~0.3 s, in every phase
    longer than the host. The step is the device's, to the bit, as it was priced before the host was."""
    plan = "dp1,ac=full"
    host = _estimate(plan, _gpu(HOST_OP), model=get_preset("llama3-8b"), batch=1, seq=2048)
    device = _estimate(plan, _gpu(0.0), model=get_preset("llama3-8b"), batch=1, seq=2048)
    assert host.time["host_bound"] == 0.0
    assert 0 < sum(host.host.values()) < 0.5 * host.step_time_s
    assert host.step_time_s == device.step_time_s


def _fake_calibration(tmp_path, op_overhead: float):
    """The files bench/gpu_check/calibrate_cuda writes, from figures given rather than measured (no GPU here)."""
    from bench.gpu_check.calibrate_cuda import calibrated_cluster, write_profile

    base = parse_cluster("1xH200")
    square = ((1024, 68e12), (8192, 775e12))
    cluster = calibrated_cluster(base, device_name="NVIDIA H200", square=square, matmul_efficiency=0.78,
                                 attention_efficiency=0.3, memory_bw=4.0e12, op_overhead=op_overhead)
    record = {"host_us_per_op": op_overhead * 1e6, "host_forward_share": 0.4}
    return write_profile(tmp_path, "cuda-profile-H200", cluster, record), cluster


def test_the_calibrated_host_cost_reaches_the_estimate_through_the_profile(tmp_path):
    """The calibration's per-op host cost is written into the TOML the planner reads (op_overhead_us), read back
    to the microsecond's float, and prices the step as the same figure given in memory does."""
    (toml_path, json_path), written = _fake_calibration(tmp_path, 41.5e-6)
    assert "op_overhead_us = 41.5" in toml_path.read_text().splitlines()
    assert json.loads(json_path.read_text())["host_us_per_op"] == pytest.approx(41.5)
    read = load_cluster(toml_path)
    assert read.device.op_overhead == 41.5e-6
    e = _estimate("dp1,compile=off", read)
    assert e.host["forward"] + e.host["backward"] == pytest.approx(
        (model_ops(TINY.num_layers) + 2 * (9 * TINY.num_layers + 3)) * 41.5e-6, rel=1e-12)  # + autocast's 2 a tensor
    assert e.step_time_s == _estimate("dp1,compile=off", written).step_time_s


def test_the_report_bench_reads_the_hosts_figure_where_a_report_keeps_it(tmp_path):
    """bench.planner_gpu_report takes the profile's op_overhead_us; a TOML without one, the JSON's host_us_per_op;
    a report without either, its engine part's plain forward and backward over the planner's ops of that model."""
    from bench.planner_gpu_report import ENGINE_LAYERS, ENGINE_TABLE, host_seconds_per_op

    (toml_path, json_path), _ = _fake_calibration(tmp_path, 41.5e-6)
    assert host_seconds_per_op(tmp_path, load_cluster(toml_path))[0] == 41.5e-6
    no_host = _gpu(0.0)
    assert host_seconds_per_op(tmp_path, no_host)[0] == pytest.approx(41.5e-6)
    json_path.write_text(json.dumps({"matmul_efficiency": 0.78}))  # a calibration from before the host was timed
    plain = {"contender": "plain fp32", "ms": 25.7}
    engine = {"parts": {"engine": {"status": "ok", "tables": {ENGINE_TABLE: [plain]}}}}
    (tmp_path / "gpu_check_engine.json").write_text(json.dumps(engine))
    assert host_seconds_per_op(tmp_path, no_host)[0] == pytest.approx(25.7e-3 / model_ops(ENGINE_LAYERS))
    (tmp_path / "gpu_check_engine.json").unlink()
    with pytest.raises(ValueError, match="no host figure"):
        host_seconds_per_op(tmp_path, no_host)


def test_the_report_bench_and_the_calibration_time_the_same_model():
    """The report bench divides the engine part's time by the ops of bench/engine_overhead.py's model, which is the
    model the calibration's measure_host times: one figure, one unit (runs torch: imports only)."""
    from bench import engine_overhead
    from bench.gpu_check import calibrate_cuda
    from bench.planner_gpu_report import ENGINE_LAYERS

    assert ENGINE_LAYERS == engine_overhead.LAYERS == calibrate_cuda.HOST_LAYERS
    assert engine_overhead.TOKENS == calibrate_cuda.HOST_TOKENS


def test_measure_host_runs_on_a_cpu():
    """The calibration's host timing on this CPU (runs torch): a positive cost per op, a forward share within (0, 1)."""
    from bench.gpu_check.calibrate_cuda import measure_host

    got = measure_host("cpu", repeats=3)
    assert got["op_overhead"] > 0 and 0 < got["forward_share"] < 1


def _cpu_profile() -> Profile:
    def line(alpha: float, beta: float) -> CollectiveFit:
        return CollectiveFit(alpha=alpha, beta=beta, points=tuple((b, alpha + beta * b) for b in (1024, 2**20)))

    return Profile(
        hostname="box", torch_version="2.13.0", cpu_model="Test CPU", date="2026-11-22T00:00:00+00:00", quick=True,
        load_average=0.1, matmul_flops={n: {"fp32": 90e9 / max(1, n / 2)} for n in (1, 2, 4)},
        matmul_by_shape={n: {"fp32": {"128x128x128": 90e9 / max(1, n / 2)}} for n in (1, 2, 4)},
        memory_bw={1: 30e9, 2: 20e9, 4: 10e9}, memory_by_op={n: {"add": 1e10, "copy": 1e10} for n in (1, 2, 4)},
        collectives={2: {k: line(300e-6, 1e-9) for k in COLLECTIVES}, 4: {k: line(2e-3, 2e-9) for k in COLLECTIVES}},
        dispatch={1: 12e-6, 2: 14e-6, 4: 20e-6}, dtensor_dispatch={1: 60e-6, 2: 70e-6, 4: 90e-6})


# Step seconds the planner gave these plans on this profile (the tiny preset, 16 x 128 tokens) before it priced a
# GPU's host (since repriced: the ring's fused calls, RING_OPS_PER_HOP; the fused CPU AdamW, OPS_PER_PARAMETER): a
# CPU's host adds to its step as it did.
CPU_STEPS = {
    (4, "dp4"): 0.1366810784, (4, "fsdp4"): 0.24090315679999996, (4, "dp2,tp2"): 0.272525592,
    (4, "dp2,cp2"): 0.17854969440000001, (4, "pp4,mb=8"): 0.21036382399999998, (4, "dp4,ac=full"): 0.1671991968,
    (4, "dp4,compile=on"): 0.1227218848, (1, "dp1"): 0.1529933824, (1, "dp1,compile=on"): 0.13608245759999998,
}


@pytest.mark.parametrize("world, plan", list(CPU_STEPS))
def test_cpu_predictions_are_unchanged(world, plan):
    e = _estimate(plan, local_cluster(_cpu_profile(), world), batch=16)
    assert "host_bound" not in e.time
    assert e.step_time_s == pytest.approx(CPU_STEPS[(world, plan)], rel=1e-12)
