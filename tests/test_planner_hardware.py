"""Hardware specs and clusters as data: hand-checked numbers, cluster strings, which link a group
crosses, TOML files, and one-line errors naming the valid values. Pure: no process, no torch."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import shoal.planner
from shoal.planner import cluster_file, hardware, kernel_rates
from shoal.planner.cluster_file import dump_cluster, load_cluster, parse_cluster
from shoal.planner.hardware import ALIASES, DEVICES, Cluster, DeviceSpec, Link, get_device
from shoal.testing.asserts import one_line_error


def test_count_fills_whole_nodes():
    cluster = parse_cluster("64xA100-80GB")
    assert (cluster.num_nodes, cluster.per_node, cluster.world_size) == (8, 8, 64)
    assert cluster.device.memory_bytes == 80 * 2**30
    assert cluster.intra is cluster.device.intra and cluster.inter is cluster.device.inter


def test_nodes_by_per_node_and_small_counts():
    cluster = parse_cluster("2x4xH100")
    assert (cluster.num_nodes, cluster.per_node, cluster.device.name) == (2, 4, "H100-80GB")
    cpus = parse_cluster("4xcpu")
    assert (cpus.num_nodes, cpus.per_node, cpus.world_size, cpus.device.name) == (1, 4, 4, "cpu")
    six = parse_cluster(" 6 x a100 ")  # a count under per_node is one node; names are case-insensitive
    assert (six.num_nodes, six.per_node, six.device.name) == (1, 6, "A100-80GB")


def test_aliases_resolve_case_insensitively():
    for alias, name in ALIASES.items():
        assert get_device(alias.lower()) is DEVICES[name]
    assert get_device("h200-141gb") is DEVICES["H200"]


def test_link_picks_intra_inside_a_node_and_inter_across():
    cluster = parse_cluster("64xA100-80GB")
    assert cluster.link(8, 1) is cluster.intra  # tp8 over the 8 GPUs of a node: span 7 < 8
    assert cluster.link(8, 8) is cluster.inter  # dp8 at stride 8: one rank per node
    assert cluster.link(1, 8) is cluster.intra  # a group of one crosses nothing
    assert cluster.link(2, 4) is cluster.intra  # ranks 0 and 4: same node
    assert cluster.link(2, 8) is cluster.inter  # ranks 0 and 8: next node
    assert parse_cluster("4xcpu").link(4, 1) is parse_cluster("4xcpu").intra
    assert "world has 64" in one_line_error(cluster.link, 9, 8)


def test_hand_checked_numbers():
    a100, v100, h100 = DEVICES["A100-80GB"], DEVICES["V100-32GB"], DEVICES["H100-80GB"]
    assert a100.intra.bandwidth == 300e9  # NVLink 3: 600 GB/s both directions
    assert a100.inter.bandwidth == 25e9  # 8 x HDR 200 Gb/s per 8 GPUs = 200e9 / 8 bytes/s each
    assert h100.inter.bandwidth == 50e9  # 8 x NDR 400 Gb/s per 8 GPUs
    assert v100.inter.bandwidth == 6.25e9  # 4 x EDR 100 Gb/s per 8 GPUs = 50 Gb/s each
    assert a100.inter.achievable == pytest.approx(24e9)  # 192 GB/s of all-reduce bus bandwidth over 8 HDR NICs
    assert h100.inter.achievable == pytest.approx(47e9)  # 46-48 GB/s per NDR NIC
    assert h100.flops("bf16") == pytest.approx(794.5e12)  # the measured maximum achievable matmul rate
    # A100: its measured maximum (271.2 of 312 TFLOP/s) at the clock it sustains (1200 of 1410 MHz)
    assert a100.flops("bf16") == pytest.approx(271.2e12 * 1200 / 1410)
    assert a100.flops("fp32") == pytest.approx(19.5e12 * 271.2 / 312 * 1200 / 1410)  # tf32 off, PyTorch's default
    assert DEVICES["H200"].flops("bf16") == h100.flops("bf16")
    assert DEVICES["H200"].memory_bw == 4.15e12 and DEVICES["A100-40GB"].memory_bw == 1555e9  # Triad; data sheet
    assert h100.memory_bw == 2.97e12  # STREAM Triad on an H100 80GB HBM3


def test_bf16_without_bf16_costs_as_fp16():
    for name in ("V100-32GB", "P100-16GB"):
        device = DEVICES[name]
        assert "bf16" not in device.peak_flops
        assert device.flops("bf16") == device.flops("fp16") == (device.peak_flops["fp16"] * device.matmul_efficiency
                                                                  * device.sustained_clock)
    assert "valid: fp32, bf16, fp16" in one_line_error(DEVICES["V100-32GB"].flops, "fp8")


@pytest.mark.parametrize("name", list(DEVICES))
def test_every_table_is_sane(name):
    device = DEVICES[name]
    assert device.name == name and device.source
    assert device.intra.achievable > device.inter.achievable  # a node's own link beats the network
    assert 0 < device.matmul_efficiency <= 1 and device.memory_bytes > 0
    assert device.flops("fp32") > 0 and device.flops("bf16") > 0


def test_describe():
    assert parse_cluster("64xA100-80GB").describe() == (
        "64 x A100-80GB (80 GiB): 8 nodes of 8, NVLink 3 (300 GB/s) within, InfiniBand HDR (25 GB/s per device) "
        "across")
    assert parse_cluster("4xcpu").describe() == "4 x cpu (16 GiB): 1 node of 4, gloo loopback (2 GB/s) within"


@pytest.mark.parametrize("text, names", [
    ("64xTPUv9", ["A100-80GB", "H200", "cpu", "H100"]),  # unknown device: every name and alias
    ("0xA100", ["positive integer"]),
    ("65xA100", ["1-8", "64", "72", "NODESxPER_NODExA100-80GB"]),
    ("2x0xA100", ["positive integers"]),
    ("A100", ["COUNTxDEVICE", "NODESxPER_NODExDEVICE", ".toml"]),
    ("", ["COUNTxDEVICE"]),
    ("missing.toml", ["missing.toml"]),
])
def test_bad_cluster_strings(text, names):
    message = one_line_error(parse_cluster, text)
    for name in names:
        assert name in message


def test_bad_device_values():
    assert "in (0, 1]" in one_line_error(Link, bandwidth=1e9, efficiency=1.5, latency=0.0, name="x")
    assert "fp32, bf16, fp16" in one_line_error(
        dataclasses.replace, DEVICES["cpu"], peak_flops={"int4": 1e12})
    assert "num_nodes" in one_line_error(dataclasses.replace, parse_cluster("8xcpu"), num_nodes=0)


def test_toml_overrides_a_base_device(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("""
nodes = 2
per_node = 4

[device]
base = "a100"
name = "A100-custom"
peak_tflops_bf16 = 300
memory_gib = 40

[inter]
name = "RoCE 100 Gb/s"
bandwidth_gbs = 12.5
latency_us = 20
""")
    for cluster in (load_cluster(path), parse_cluster(str(path))):
        device = cluster.device
        assert (cluster.num_nodes, cluster.per_node, cluster.world_size) == (2, 4, 8)
        assert (device.name, device.memory_bytes) == ("A100-custom", 40 * 2**30)
        assert device.peak_flops == {"fp32": 19.5e12, "bf16": 300e12, "fp16": 312e12, "tf32": 156e12}
        inherited = DEVICES["A100-80GB"].inter.efficiency  # the key left out comes from the base device
        assert cluster.inter == Link(name="RoCE 100 Gb/s", bandwidth=12.5e9, efficiency=inherited, latency=20e-6)
        assert cluster.intra == DEVICES["A100-80GB"].intra and device.inter == cluster.inter


@pytest.mark.parametrize("text", ["16xH100", "2x4xV100", "4xcpu", "8xP100"])
def test_toml_round_trip(tmp_path, text):
    cluster = parse_cluster(text)
    path = tmp_path / "cluster.toml"
    path.write_text(dump_cluster(cluster))
    assert load_cluster(path) == cluster


def test_toml_device_from_scratch(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(dump_cluster(parse_cluster("4xcpu")).replace('name = "cpu"', 'name = "my-cpu"'))
    assert load_cluster(path).device.name == "my-cpu"
    path.write_text('[device]\nname = "x"\npeak_tflops_fp32 = 1\n')
    message = one_line_error(load_cluster, path)
    assert "matmul_efficiency" in message and "memory_gib" in message and "A100-80GB" in message


@pytest.mark.parametrize("text, names", [
    ('device = "A100"\nnode = 2\n', ["'node'", "nodes, per_node, device, intra, inter"]),
    ('device = "A100"\n[intra]\nbandwidth = 1\n', ["'bandwidth'", "bandwidth_gbs", "latency_us"]),
    ('[device]\nbase = "A100"\nmemory_gb = 80\n', ["'memory_gb'", "memory_gib", "peak_tflops_bf16"]),
    ('device = "TPU"\n', ["'TPU'", "A100-80GB"]),
    ('nodes = 2\n', ["missing device", "A100-80GB"]),
    ('device = "A100"\nnodes = 0\n', ["nodes", "positive"]),
    ('device = "A100"\n[inter]\nefficiency = "high"\n', ["efficiency", "number"]),
    ('device = "A100"\nnodes = \n', ["not valid TOML"]),
])
def test_bad_toml(tmp_path, text, names):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    message = one_line_error(load_cluster, path)
    for name in names:
        assert name in message


def test_no_torch_import():
    for module in (hardware, cluster_file):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert "torch" not in imported, module.__name__
    assert isinstance(DEVICES["cpu"], DeviceSpec) and isinstance(parse_cluster("1xcpu"), Cluster)


BELOW_PLANNER = ("shoal.planner", "shoal.rules", "shoal.plan", "shoal.models", "shoal.moe", "shoal.loss", "shoal.infra")
"""The packages the planner may import: itself and those below it in the layer order."""


@pytest.mark.parametrize("name", ["shoal.planner"] + sorted(
    f"shoal.planner.{m.name}" for m in pkgutil.iter_modules(shoal.planner.__path__)))
def test_every_planner_module_imports_no_torch_and_nothing_above_it(name):
    """Imported alone in a fresh interpreter, a planner module loads no torch module and no shoal package above the
    planner (so `shoal plan` answers at once, and the layers hold with every import counted)."""
    code = (f"import importlib, json, sys; importlib.import_module({name!r}); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'shoal'))))")
    src = str(Path(shoal.planner.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert not [m for m in loaded if m.split(".")[0] == "torch"], name
    above = [m for m in loaded if m != "shoal" and not any(m == p or m.startswith(p + ".") for p in BELOW_PLANNER)]
    assert not above, (name, above)


def test_gemm_factor_by_hand():
    """The H100's square-GEMM table: a 2048^3 product runs at 676.59 / 797.51 of the largest; a product of
    the same work in another shape (4096 x 2048 x 1024) at the same rate; halfway in log2 between 2048 and
    4096 (2896.3 ~ 2^11.5) the mean of the two rates; beyond the table, the ends."""
    h100 = DEVICES["H100-80GB"]
    assert h100.gemm_factor(2048, 2048, 2048) == pytest.approx(676.59 / 797.51)
    assert h100.gemm_factor(4096, 2048, 1024) == pytest.approx(676.59 / 797.51)
    side = 2 ** 11.5
    assert h100.gemm_factor(side, side, side) == pytest.approx((676.59 + 788.72) / 2 / 797.51)
    assert h100.gemm_factor(2**15, 2**15, 2**15) == 1.0
    assert h100.gemm_factor(64, 64, 64) == pytest.approx(176.62 / 797.51)
    assert DEVICES["V100-32GB"].gemm_factor(64, 64, 64) == pytest.approx(1 / 80)  # no table: one 64 x 64 tile
    a100 = DEVICES["A100-80GB"]  # Azure's cuBLASLt table: 1024 119.4, 2048 221.8, 4096 228.0, 8192 253.7, 16384 256.5
    assert a100.gemm_factor(4096, 4096, 4096) == pytest.approx(228.0 / 256.5)
    assert a100.gemm_factor(side, side, side) == pytest.approx((221.8 + 228.0) / 2 / 256.5)
    assert a100.gemm_factor(2**15, 2**15, 2**15) == 1.0
    assert a100.gemm_factor(64, 64, 64) == pytest.approx(119.4 / 256.5)
    assert DEVICES["cpu"].gemm_factor(64, 64, 64) == 1.0  # neither table nor SM count: every GEMM at the large rate


def test_tile_and_wave_quantization_by_hand():
    """NVIDIA's Matrix Multiplication Background guide, sections 3.1-3.2: a 2048 x 9600 output in 256 x 128 tiles
    (256 along the 9600 side) is 38 x 16 = 608 tiles, 6 waves of 108 SMs, so 2048 * 9600 / (6 * 108 * 256 * 128) of
    the slots work; 2048 x 128 in 64 x 64 tiles is 64 tiles in one wave of 108."""
    assert kernel_rates.tile_efficiency(2048, 9600, 108, (256, 128)) == \
        pytest.approx(2048 * 9600 / (6 * 108 * 256 * 128))
    assert kernel_rates.tile_efficiency(9600, 2048, 108, (128, 256)) == \
        kernel_rates.tile_efficiency(2048, 9600, 108, (256, 128))
    assert kernel_rates.tile_efficiency(2048, 128, 108, (64, 64)) == pytest.approx(64 / 108)
    assert kernel_rates.quantization_efficiency(2048, 128, 108) == pytest.approx(64 / 108)  # 64 x 64 is the best tile
    assert kernel_rates.quantization_efficiency(108 * 256, 128, 108) == 1.0  # one full wave of 256 x 128 tiles
    v100 = DEVICES["V100-32GB"]  # no square table: quantization, 64 x 64 tiles, 32 x 2 = 64 of 80 SMs
    assert v100.gemm_factor(2048, 128, 4096) == pytest.approx(64 / 80)
    assert DEVICES["H100-80GB"].gemm_factor(2048, 128, 4096) == DEVICES["H100-80GB"].gemm_factor(4096, 2048, 128)
    with pytest.raises(ValueError, match="sms >= 1"):
        kernel_rates.tile_efficiency(10, 10, 0, (64, 64))


def test_attention_rates_from_the_flashattention3_figures_by_hand():
    """FlashAttention-2 on an H100 (arXiv 2407.08608, figures 5-6): head dim 128 at 8K, 333 TFLOP/s forward under
    the causal mask, 370 without, 318 backward; between the benchmarked points, linear in log2 of the length and
    in the head dimension; held at the ends."""

    T = 1e12

    def rates(head_dim: float, seq_len: float, causal: bool) -> tuple[float, float]:
        return kernel_rates.attention_rates("FA2-H100", head_dim=head_dim, seq_len=seq_len, causal=causal)

    assert rates(128, 8192, True) == pytest.approx((333 * T, 318 * T))
    assert rates(128, 8192, False) == pytest.approx((370 * T, 318 * T))
    # head dim 96, length 4096 * sqrt(2): the middle of (284, 295) at 64 and of (319, 333) at 128, forward causal
    fwd, bwd = rates(96, 4096 * 2**0.5, True)
    assert fwd == pytest.approx(((284 + 295) / 2 + (319 + 333) / 2) / 2 * T)
    assert bwd == pytest.approx(((279 + 287) / 2 + (310 + 318) / 2) / 2 * T)
    assert rates(256, 2**20, True) == pytest.approx((335 * T, 322 * T))
    assert rates(32, 100, False) == pytest.approx((282 * T, 198 * T))
    with pytest.raises(ValueError, match="valid: FA2-H100"):
        kernel_rates.attention_rates("FA9", head_dim=128, seq_len=8192, causal=True)


def test_h100_at_500_watts_runs_its_tensor_cores_at_the_capped_clock():
    """arXiv 2604.11391, figure 6b: 1731 MHz at a 500 W cap against 1969 MHz at 700 W. Matmul and attention rates
    scale by it; memory bandwidth is the HBM2e part's own; a 16-bit dtype reads the attention table, fp32 does not."""
    capped, sxm = DEVICES["H100-96GB-500W"], DEVICES["H100-80GB"]
    assert capped.sustained_clock == pytest.approx(1731 / 1969)
    assert capped.flops("bf16") == pytest.approx(sxm.flops("bf16") * 1731 / 1969)
    assert capped.attention_rates("bf16", head_dim=128, seq_len=8192, causal=True) == pytest.approx(
        (333e12 * 1731 / 1969, 318e12 * 1731 / 1969))
    assert capped.attention_rates("fp32", head_dim=128, seq_len=8192, causal=True) == (
        capped.attention_flops("fp32"), capped.attention_flops("fp32"))
    a100 = DEVICES["A100-80GB"]  # no table: the single efficiency both ways
    assert a100.attention_rates("bf16", head_dim=128, seq_len=8192, causal=True) == (
        a100.attention_flops("bf16"), a100.attention_flops("bf16"))


def test_a100_memory_bandwidth_is_a_measured_kernels():
    """A streaming read kernel on an A100 80GB SXM reaches 1.80 TB/s of the data sheet's 2.04 (NVIDIA developer
    forum thread 339083): elementwise work is priced at that."""
    assert DEVICES["A100-80GB"].memory_bw == 1800e9


def test_allreduce_curve_returns_the_published_bus_bandwidth_at_its_sizes():
    """Azure AI-benchmarking-guide, ND H100 v5 / ND A100 v4, 8 GPUs: all-reduce bus bandwidth by buffer size. At a
    measured size the time is 2(n-1)/n * size / busbw; between two, the bus bandwidth is linear in log2 of the size;
    below 1 KiB the 1 KiB time (latency-bound); beyond 8 GiB the 8 GiB bandwidth."""
    from shoal.planner.comm import RingNetwork, allreduce_curve_time

    h100 = DEVICES["H100-80GB"].intra.allreduce_busbw
    a100 = DEVICES["A100-80GB"].intra.allreduce_busbw
    assert h100[0] == pytest.approx((1024, 0.07e9)) and h100[-1] == pytest.approx((2**33, 478.87e9))
    assert a100[15] == pytest.approx((2**25, 132.77e9)) and len(h100) == len(a100) == 24  # "33M": 32 MiB
    for size, busbw in h100:
        assert allreduce_curve_time(h100, 8, size) == pytest.approx(2 * 7 / 8 * size / busbw)
    middle = 2**25 * 2**0.5  # halfway in log2 between 32 MiB (295.53) and 64 MiB (361.78)
    assert allreduce_curve_time(h100, 8, middle) == pytest.approx(1.75 * middle / ((295.53 + 361.78) / 2 * 1e9))
    small = allreduce_curve_time(h100, 8, 1024)
    assert allreduce_curve_time(h100, 8, 8) == small == pytest.approx(1.75 * 1024 / 0.07e9)
    assert allreduce_curve_time(h100, 8, 2**34) == pytest.approx(1.75 * 2**34 / 478.87e9)
    assert allreduce_curve_time(h100, 2, 2**30) == pytest.approx(1.0 * 2**30 / 466.35e9)  # fewer ranks, same busbw
    assert allreduce_curve_time(h100, 1, 2**30) == 0.0
    net = RingNetwork(parse_cluster("16xA100-80GB"))
    assert net.time("all_reduce", 8, 2**30, stride=1) == pytest.approx(1.75 * 2**30 / 228.10e9)  # inside a node
    inter = parse_cluster("16xA100-80GB").inter  # across nodes: the alpha-beta ring over InfiniBand
    ring = 2 * (inter.latency + 2**30 / 2 / inter.achievable)
    assert net.time("all_reduce", 2, 2**30, stride=8) == pytest.approx(ring)
    with pytest.raises(ValueError, match="increasing size"):
        Link(name="x", bandwidth=1e9, efficiency=1.0, latency=0.0, allreduce_busbw=((2048, 1e9), (1024, 2e9)))


def test_ring_collectives_across_nodes_add_the_nics_of_a_groups_ranks_in_a_node():
    """NCCL spreads a ring collective's channels over every NIC of a node (nccl issues 812, 412, 569; comm.rail_link):
    a group with g ranks in each node runs across nodes at g NICs' bandwidth, at most the node's NVLink. By hand, on
    DGX A100s (HDR: 25 GB/s a NIC at 24/25; NVLink 3: 300 GB/s at 0.78): 8 ranks a node, min(8 * 24, 234) = 192 GB/s,
    issue 812's measured bus bandwidth; 4 ranks a node (stride 2), 96; 1 (stride 8), 24. On DGX H100s (NDR: 47 GB/s
    a NIC) 8 ranks a node reach min(8 * 47, 370) = 370, the NVLink ring's. All-to-all and point-to-point traffic
    keeps one NIC a rank."""
    from shoal.planner.comm import RingNetwork, members_per_node, rail_link, ring_time

    assert [members_per_node(16, s, 8) for s in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert members_per_node(3, 1, 8) == 3
    assert members_per_node(8, 3, 8) == 3  # ranks 0, 3, 6 of the first node
    a100 = parse_cluster("32xA100-80GB")
    assert rail_link(a100.inter, a100.intra, 8).achievable == pytest.approx(192e9)
    assert rail_link(a100.inter, a100.intra, 4).achievable == pytest.approx(96e9)
    assert rail_link(a100.inter, a100.intra, 1).achievable == pytest.approx(24e9)
    assert rail_link(a100.inter, a100.intra, 16).achievable == pytest.approx(234e9)  # the NVLink caps it
    h100 = parse_cluster("32xH100-80GB")
    assert rail_link(h100.inter, h100.intra, 8).achievable == pytest.approx(370e9)
    assert rail_link(h100.inter, h100.intra, 2).achievable == pytest.approx(94e9)
    net, size, alpha = RingNetwork(a100), 2**30, 10e-6
    assert net.time("all_gather", 32, size, stride=1) == pytest.approx(31 * alpha + 31 / 32 * size / 192e9)
    assert net.time("reduce_scatter", 16, size, stride=2) == pytest.approx(15 * alpha + 15 / 16 * size / 96e9)
    assert net.time("all_reduce", 4, size, stride=8) == pytest.approx(2 * (3 * alpha + 3 / 4 * size / 24e9))
    assert net.time("all_to_all", 32, size, stride=1) == pytest.approx(
        ring_time("all_to_all", 32, size, bandwidth=24e9, latency=alpha))
    assert net.time("send_recv", 2, size, stride=8) == pytest.approx(alpha + size / 24e9)


def test_jean_zay_a100s_cross_nodes_on_four_omni_path_links():
    """BLOOM's nodes (model card, 'Hardware'): 8 A100 80GB on NVLink, 4 Omni-Path 100 Gb/s links a node, so 100 / 8 *
    4 / 8 = 6.25 GB/s a GPU nominal, 0.85 of it achieved (EDR's generic figure): 5.3125 GB/s; the rest is the
    A100-80GB's."""
    opa, a100 = DEVICES["A100-80GB-OPA"], DEVICES["A100-80GB"]
    assert opa.inter.bandwidth == pytest.approx(6.25e9) and opa.inter.achievable == pytest.approx(5.3125e9)
    assert opa.intra == a100.intra and opa.flops("bf16") == a100.flops("bf16") and opa.memory_bw == a100.memory_bw
    assert parse_cluster("48x8xA100-80GB-OPA").world_size == 384
