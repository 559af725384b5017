"""Hardware as data: what one device computes and moves, and how a cluster of them is wired.

The planner's cost formulas read only these numbers, so a prediction for a machine you do not
have is as good as its data sheet here, and a prediction for this machine is as good as its
calibration (`shoal plan --calibrate` replaces the numbers with measured ones). Every table
names its sources; every efficiency is the fraction of a nominal figure that large operations
reach in practice. Units are FLOP/s, bytes, bytes/s and seconds; the tables convert with the
named constants below. A cluster written as text (`--cluster 64xA100-80GB`, a TOML file) is read
and written by shoal.planner.cluster_file. No torch import, so `shoal plan` answers at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.planner import kernel_rates

TERA = 1e12  # FLOP/s per TFLOP/s
GB = 1e9  # bytes per GB: data sheets quote bandwidth in decimal gigabytes
GiB = 2**30  # bytes per GiB: device memory is sized in binary gibibytes
US = 1e-6  # seconds per microsecond
DTYPES = ("fp32", "bf16", "fp16", "tf32", "fp8")
"""Matmul rates a device may list; "tf32" is fp32 matmuls on TF32 tensor cores (torch's float32 matmul precision
"high", which `shoal train` sets by default: --tf32 on), priced for fp32 runs on GPUs that list it; "fp8" is e4m3
products on float8 tensor cores, the bound of a plan's `fp8=` blocks (`DeviceSpec.fp8_flops`)."""
FP8_BLOCK_SPEEDUP = {"tensorwise": 1.64, "rowwise": 1.22}
"""bf16 time over float8 time of the transformer blocks' linear layers under torchao's float8 training (their casts
and scales included), by recipe. From torchao's published end-to-end measurement (github.com/pytorch/ao,
docs/source/workflows/training.md, "e2e training benchmarks", NVIDIA H100: Llama3-8B on 8 H100s, FSDP2, compile,
per-op selective recompute, sequence 8192, torchtitan): 6150 tokens/s in bf16, 7689.5 tensorwise with float8
all-gather (1.2503x), 6768 rowwise (1.1005x). Only the blocks' linear layers change, so by Amdahl's law their speedup
is r = f / (1/s - (1 - f)), f their share of the bf16 step: 0.515 as this planner prices that run (`shoal plan
--model llama3-8b --cluster 8xH100-80GB --global-batch 8 --seq-len 8192 --plan fsdp8,ac=selective`: block matmuls
0.466 s less the head's 7% of a 0.841 s step). tensorwise's share of the float8 all-gather's saving is in its figure."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of interconnect as seen by one device: the alpha-beta cost model's numbers."""

    bandwidth: float  # bytes/s per device, one direction, nominal (data sheet)
    efficiency: float  # fraction of `bandwidth` large collectives reach (nccl-tests bus bw / nominal)
    latency: float  # seconds per message step (alpha)
    name: str  # "NVLink 3", "InfiniBand HDR", "gloo (calibrated)"
    allreduce_busbw: tuple[tuple[int, float], ...] = ()
    """Measured all-reduce bus bandwidth by buffer size, (bytes, bytes/s) smallest first, as nccl-tests reports it
    (busbw = algbw * 2(n-1)/n) on one node's devices: where given, an all-reduce on this link is priced from it
    (shoal.planner.comm.allreduce_curve_time), whatever algorithm NCCL picks at that size; other collectives, and
    links without one, by the alpha-beta ring."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "allreduce_busbw", tuple(tuple(p) for p in self.allreduce_busbw))
        sizes = [size for size, _ in self.allreduce_busbw]
        if sizes != sorted(set(sizes)) or any(not (size > 0 and rate > 0) for size, rate in self.allreduce_busbw):
            raise ValueError(f"link {self.name!r}: allreduce_busbw needs positive (bytes, bytes/s) pairs by "
                             f"increasing size, got {self.allreduce_busbw}")
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if not self.latency >= 0:
            raise ValueError(f"link {self.name!r}: latency must be >= 0 s, got {self.latency}")

    @property
    def achievable(self) -> float:
        """Bytes/s per device that large collectives reach."""
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process) and the links of the node it usually sits in."""

    name: str  # "A100-80GB"
    peak_flops: dict[str, float]  # dense matmul peak FLOP/s per compute dtype; absent = unsupported
    matmul_efficiency: float  # fraction of peak that a large GEMM reaches
    memory_bytes: int  # device memory
    memory_bw: float  # device memory bytes/s
    intra: Link  # the usual link inside a node
    inter: Link  # the usual network across nodes, per device
    per_node: int = 8  # devices per node by default
    source: str  # where the numbers come from
    op_overhead: float = 0.0
    """Host seconds per eager op beyond its arithmetic (dispatch, autograd bookkeeping), backward
    included. On a CPU the same cores run the ops, so it adds to the step; on a GPU the host
    queues kernels ahead of the device and it is hidden unless it exceeds the device's time."""
    dtensor_overhead: float = 0.0
    """The same for an op on a DTensor (tensor parallelism's ops), which adds sharding propagation."""
    gemm_square: tuple[tuple[int, float], ...] = ()
    """Measured rates of square bf16 GEMMs, (size, FLOP/s) by size: a GEMM's rate relative to the
    largest is `gemm_factor` (empty: every GEMM at `matmul_efficiency`)."""
    sustained_clock: float = 1.0
    """Fraction of the clock the peak is quoted at that tensor cores hold through a sustained load
    within the device's power limit (a short benchmark, as `matmul_efficiency`'s, runs boosted)."""
    attention_efficiency: float | None = None
    """Fraction of peak the fused attention kernel PyTorch's SDPA picks reaches, forward and backward
    together (None: the matmul efficiency). Attention runs well below GEMMs: FlashAttention-2
    reaches ~0.6 of A100 peak and ~0.35 of H100's (Dao 2023, figures 5-7; Shah et al. 2024,
    "FlashAttention-3", figure 1 for FA2 on H100); pre-Ampere GPUs have only the memory-efficient
    kernel (xFormers, Rabe and Staats 2021), ~0.3 of fp16 peak."""
    attention_table: str | None = None
    """A published table of the fused attention kernel's rate by head dimension, sequence length and causal
    mask (shoal.planner.kernel_rates.ATTENTION_TABLES), used for 16-bit attention in place of
    `attention_efficiency`; measured at the clock `sustained_clock` is relative to."""
    sm_count: int = 0
    """Streaming multiprocessors (data sheet), for the tile and wave quantization of GEMMs
    (shoal.planner.kernel_rates.quantization_efficiency) where no measured `gemm_square` table is given (0: none)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))  # never shared between specs
        bad = [k for k in self.peak_flops if k not in DTYPES or not self.peak_flops[k] > 0]
        if not self.peak_flops or bad:
            raise ValueError(f"device {self.name!r}: peak_flops needs positive rates keyed by "
                             f"{', '.join(DTYPES)}; got {self.peak_flops}")
        for field_name in ("matmul_efficiency", "sustained_clock"):
            if not 0 < getattr(self, field_name) <= 1:
                raise ValueError(f"device {self.name!r}: {field_name} must be in (0, 1], "
                                 f"got {getattr(self, field_name)}")
        if not (self.memory_bytes > 0 and self.memory_bw > 0 and self.per_node >= 1):
            raise ValueError(f"device {self.name!r}: memory_bytes, memory_bw and per_node must be positive")

    def flops(self, dtype: str) -> float:
        """Achievable matmul FLOP/s in `dtype`. bf16 on a device without it is costed at the fp16
        rate, the rate the same run switched to fp16 would get."""
        key = "fp16" if dtype == "bf16" and "bf16" not in self.peak_flops else dtype
        if key not in self.peak_flops:
            valid = [d for d in DTYPES if d in self.peak_flops or (d == "bf16" and "fp16" in self.peak_flops)]
            raise ValueError(f"{self.name} has no {dtype!r} matmul rate; valid: {', '.join(valid)}")
        return self.peak_flops[key] * self.matmul_efficiency * self.sustained_clock

    def fp8_flops(self, recipe: str) -> float | None:
        """Achievable FLOP/s of the blocks' linear layers under a plan's `fp8=recipe`: the bf16 rate times the
        recipe's measured speedup (FP8_BLOCK_SPEEDUP), at most the float8 peak at the bf16 products' efficiency;
        None on a device that lists no float8 rate (its fp8 runs are priced at bf16: a CPU emulates float8)."""
        if "fp8" not in self.peak_flops:
            return None
        peak = self.peak_flops["fp8"] * self.matmul_efficiency * self.sustained_clock
        return min(self.flops("bf16") * FP8_BLOCK_SPEEDUP[recipe], peak)

    def gemm_factor(self, m: float, n: float, k: float) -> float:
        """The rate of an (m x k) @ (k x n) product relative to a large one: the measured square GEMM of
        the same work (size (m n k)^(1/3)), interpolated in log2 of the size, over the largest measured;
        without such a table, the tile and wave quantization of its (m x n) output on the device's SMs
        (`matmul_efficiency` being the rate of a shape that fills them); without either, 1."""
        if not self.gemm_square:
            return kernel_rates.quantization_efficiency(m, n, self.sm_count) if self.sm_count else 1.0
        sizes, rates = zip(*self.gemm_square)
        x = math.log2(max(sizes[0], min(sizes[-1], (m * n * k) ** (1 / 3))))
        for (s0, r0), (s1, r1) in zip(self.gemm_square, self.gemm_square[1:]):
            if x <= math.log2(s1):
                t = (x - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return (r0 + t * (r1 - r0)) / max(rates)
        return rates[-1] / max(rates)

    def attention_flops(self, dtype: str) -> float:
        """Achievable FLOP/s of the attention kernel (QK^T, softmax, AV) in `dtype`."""
        efficiency = self.attention_efficiency or self.matmul_efficiency
        return self.flops(dtype) / self.matmul_efficiency * efficiency

    def attention_rates(self, dtype: str, *, head_dim: float, seq_len: float, causal: bool) -> tuple[float, float]:
        """(forward, backward) FLOP/s of the fused attention kernel on sequences of `seq_len` (FlashAttention's
        FLOP convention: shoal.planner.kernel_rates): from the device's published table for 16-bit types, held to
        its sustained clock; otherwise `attention_flops` both ways."""
        if self.attention_table and dtype in ("bf16", "fp16"):
            forward, backward = kernel_rates.attention_rates(self.attention_table, head_dim=head_dim,
                                                             seq_len=seq_len, causal=causal)
            return forward * self.sustained_clock, backward * self.sustained_clock
        rate = self.attention_flops(dtype)
        return rate, rate


def _nvlink(generation: int, total_gbs: float, efficiency: float,
            allreduce: tuple[tuple[int, float], ...] = ()) -> Link:
    # NVLink data sheets add both directions together; a Link is one direction. Latency: 5 us a ring step, so a
    # 2-rank all-reduce of a few bytes (2 steps) takes 10 us, as nccl-tests measured on two A100-SXM4-40GB
    # (all_reduce_perf, 32 B: 10.14 us; github.com/NVIDIA/nccl issue 583).
    return Link(name=f"NVLink {generation}", bandwidth=total_gbs / 2 * GB, efficiency=efficiency, latency=5e-6,
                allreduce_busbw=allreduce)


def _infiniband(kind: str, gbit_per_nic: int, nics_per_8_devices: int, efficiency: float) -> Link:
    # Latency: 10 us a ring step. Cross-check, not fitted: nccl-tests all_reduce_perf of 8 B between two A100-SXM4-80GB
    # in two nodes over HDR InfiniBand took 19.90 us out of place, 18.96 in place, two ring steps (github.com/NVIDIA/
    # nccl-tests issue 150). That a ring's latency grows with its rank count, so mid-sized buffers lose bandwidth as
    # nodes are added while the largest do not, is what NCCL's engineers describe (nccl issue 1712) and what the
    # alpha-beta ring prices; NCCL's trees for small all-reduces over many nodes (8 B over
    # 256 A100s in 32 nodes: 63 us, nccl issue 652) are not modelled: the ring charges such a call (n-1) steps.
    per_device = gbit_per_nic / 8 * GB * nics_per_8_devices / 8
    return Link(name=f"InfiniBand {kind}", bandwidth=per_device, efficiency=efficiency, latency=10e-6)


# Efficiencies: NVLink ~0.75-0.8 and InfiniBand ~0.85-0.96 are the bus bandwidth nccl-tests
# all_reduce_perf reports at large sizes over the nominal per-direction figure on DGX systems
# (8 x A100 NVLink 3: 230-250 GB/s of 300; docs.alayanew.com "NCCL-tests in practice", reference table;
# InfiniBand: _IB_HDR, _IB_NDR below); matmul ~0.8 is what cuBLAS reaches on large square GEMMs. Older parts
# get the lower ends.
_NCCL = "efficiencies: nccl-tests all_reduce_perf bus bandwidth on DGX systems; matmul: large cuBLAS GEMMs"
# A100 and H100 matmul efficiency: the Maximum Achievable Matmul FLOPS of a bf16 matmul over a search of
# shapes (S. Bekman, ml-engineering, compute/accelerator/README.md, table "Maximum Achievable Matmul
# FLOPS", torch 2.6-2.7): A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989 ("H200 is the same").
_MAMF_A100, _MAMF_H100 = 271.2 / 312, 794.5 / 989
# A100's sustained clock: a FlashAttention-2 kernel run back to back drops the A100's SM clock from its
# 1410 MHz boost to ~1200 MHz at the power limit (github.com/liangan1/GPU_travel,
# performance/flash-attn/README.md, "Frequency"). The H100 at 700 W has no such figure: 1.0.
_A100_SUSTAINED = 1200 / 1410
# H100 at a 500 W board limit: the average SM clock a compute-bound load holds under a 500 W cap, over the
# clock it holds at 700 W, on an HBM2e H100 SXM of 94 GiB (the memory type and size class of torchtitan's
# 96 GB Grand Teton parts): 1731 of 1969 MHz (Ujeniya, Eitzinger, Hager and Wellein 2026, arXiv 2604.11391,
# figure 6b: ViT-L/16 at batch 256, a GEMM-bound load; the values printed on the figure). Tensor-core rates
# (matmul, attention) scale with the SM clock; the memory bandwidth is left at its measured figure. Cross-check,
# not used: an 8B Llama training step on the same part at 500 W runs at 27,705 of 30,271 tokens/s at 700 W (0.915;
# Mayr et al. 2026, arXiv 2603.16164, table 4), a whole step with its memory-bound work included.
_H100_500W_SUSTAINED = 1731 / 1969
# H100 square bf16 GEMMs, TFLOP/s by size (torch 2.7 / CUDA 12.8 on an H100 80GB HBM3; github.com/zzc0721/
# torch-performance-test-data issue 79): small products leave SMs idle. Beyond 8192 the rate falls again
# (10240: 720), which a training step's products do not reach; the table stops at 8192.
_H100_SQUARE = ((1024, 176.62 * TERA), (2048, 676.59 * TERA), (4096, 788.72 * TERA), (8192, 797.51 * TERA))
# H100 NVLink 4 within a node: 370 GB/s of bus bandwidth for ring collectives (all-gather, reduce-scatter, or
# all-reduce with NCCL_ALGO=RING) of the 450 GB/s line rate, ~20% protocol overhead (S. Jeaugey, NCCL maintainer,
# github.com/NVIDIA/nccl-tests issue 212). All-reduce with NVLink SHARP reaches ~480 GB/s bus bandwidth
# on 8 GPUs there (_H100_NVLS_ALLREDUCE below measures it).
_NVLINK4_RING = 370 / 450


def _busbw(gbs: tuple[float, ...]) -> tuple[tuple[int, float], ...]:
    """(bytes, bytes/s) pairs from GB/s at buffers of 1 KiB, 2 KiB, ... doubling."""
    return tuple((2 ** (10 + i), rate * GB) for i, rate in enumerate(gbs))


# NCCL all-reduce bus bandwidth (GB/s) against buffer size on the 8 GPUs of one node, nccl-tests in place, buffers
# of 1 KiB to 8 GiB doubling (the page labels them 1K, 2K, ..., 65K, 132K, ..., 1G .. 8G), NCCL 2.18.5: Azure's
# github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md (8 x A100-SXM4-80GB, NVLink 3 through
# NVSwitch; the page calls the algorithm NVLS, which the A100 lacks: NCCL's default) and ND_H100_v5_results.md (8 x
# H100 80GB HBM3, NVLink SHARP; read from the fork samuel-bohman/AI-benchmarking-guide at 26d18e9), section "NCCL
# Bandwidth". The H100's peak, 479 GB/s, is NVLink SHARP's ~480 (issue 212 above). A group of fewer than 8 ranks of
# a node is priced from the same curve.
_A100_ALLREDUCE = _busbw((0.04, 0.08, 0.17, 0.33, 0.67, 1.37, 2.70, 5.15, 10.11, 19.24, 36.22, 53.54, 71.43, 89.99,
                          109.22, 132.77, 166.63, 174.18, 213.87, 221.58, 228.10, 230.22, 230.48, 231.58))
_H100_NVLS_ALLREDUCE = _busbw((0.07, 0.14, 0.27, 0.53, 0.95, 1.71, 2.72, 5.40, 10.86, 21.35, 43.70, 81.93, 128.73,
                               172.13, 234.45, 295.53, 361.78, 400.61, 423.38, 438.46, 466.35, 472.36, 475.54, 478.87))
# InfiniBand across nodes: the all-reduce bus bandwidth NCCL's engineers report measuring over a node's NICs. DGX A100,
# 8 x HDR 200 Gb/s (25 GB/s each): "we measure 192GB/s AllReduce BusBW", 24 GB/s a NIC (github.com/NVIDIA/nccl issue
# 812; likewise "24 (what we see ourselves in general on perfect setups)" of a 200 Gb/s NIC, nccl-tests issue 160).
# DGX H100, 8 x NDR 400 Gb/s (50 GB/s each): "46-48GB/s per NIC" with NCCL_ALGO=RING (nccl-tests issue 290), 47
# taken. EDR (DGX-1), which has no such figure, takes the generic 0.85.
_IB_HDR, _IB_NDR = 24 / 25, 47 / 50
_DGX1_IB = _infiniband("EDR", 100, 4, 0.85)  # DGX-1: 4 x EDR 100 Gb/s per 8 GPUs
_DGX_A100_IB = _infiniband("HDR", 200, 8, _IB_HDR)  # DGX A100: 8 x HDR 200 Gb/s per 8 GPUs
_DGX_H100_IB = _infiniband("NDR", 400, 8, _IB_NDR)  # DGX H100/H200: 8 x NDR 400 Gb/s per 8 GPUs
# Jean Zay's A100 80GB nodes (BLOOM-176B's run): 8 GPUs on NVLink and 4 Omni-Path links per node ("8 GPUs per node
# Using NVLink 4 inter-gpu connects, 4 OmniPath links"; "Inter-node connect: Omni-Path Architecture (OPA)", the BLOOM
# model card, huggingface.co/bigscience/bloom, section "Hardware"; the same in bigscience/bloomz's card), 100 Gb/s
# each (Intel Omni-Path 100 series). Without an NCCL measurement over Omni-Path: EDR's generic 0.85 (the same
# 100 Gb/s class) and InfiniBand's per-step latency.
_JEAN_ZAY_OPA = Link(name="Omni-Path 100", bandwidth=100 / 8 * GB * 4 / 8, efficiency=0.85, latency=10e-6)
# A100 square GEMMs, TFLOP/s by size: cuBLASLt, fp16 (the A100's bf16 rate), random inputs, 10,000 warm-up
# iterations, on an A100-SXM4-80GB (github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md,
# "GEMM CuBLASLt"): used, as the H100's table is, for each product's rate relative to the largest. Its absolute level
# (256.5, 0.82 of peak, after a long warm-up) is above what the A100's constants give a large GEMM (MAMF's 271.2 at
# the 1200 MHz a sustained FlashAttention load holds: 230.8); the constants stand, as for the H100.
_A100_SQUARE = ((1024, 119.4 * TERA), (2048, 221.8 * TERA), (4096, 228.0 * TERA), (8192, 253.7 * TERA),
                (16384, 256.5 * TERA))
# A100 FlashAttention-2, forward and backward together, head dim 64, batch 2, length 8192, no causal mask: 179.5
# TFLOP/s, 0.575 of the 312 peak (the same Azure page, "Flash Attention 2.0"; the script runs FlashAttention's
# benchmark_flash_attention.py, whose first block is causal=False, headdim=64). One shape, which stands for all.
_FA2_A100 = 179.5 / 312
# TF32 tensor-core peaks are the data sheets' dense figures (half the "with sparsity" ones they print).
_A100: dict[str, Any] = dict(peak_flops={"fp32": 19.5 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA,
                                         "tf32": 156 * TERA},
                             matmul_efficiency=_MAMF_A100, sustained_clock=_A100_SUSTAINED,
                             attention_efficiency=_FA2_A100, gemm_square=_A100_SQUARE, sm_count=108,
                             intra=_nvlink(3, 600, 0.78, _A100_ALLREDUCE), inter=_DGX_A100_IB)
# FP8 (e4m3/e5m2) tensor-core peak, dense: 1,979 TFLOP/s for the H100 SXM and the H200 SXM alike (NVIDIA H100 Tensor
# Core GPU data sheet and NVIDIA H200 data sheet: "FP8 Tensor Core 3,958 teraFLOPS" with sparsity, twice the dense).
_H100: dict[str, Any] = dict(peak_flops={"fp32": 67 * TERA, "bf16": 989 * TERA, "fp16": 989 * TERA,
                                         "tf32": 494.5 * TERA, "fp8": 1979 * TERA},
                             matmul_efficiency=_MAMF_H100, gemm_square=_H100_SQUARE, attention_efficiency=0.35,
                             attention_table="FA2-H100", sm_count=132,
                             intra=_nvlink(4, 900, _NVLINK4_RING, _H100_NVLS_ALLREDUCE),
                             inter=_DGX_H100_IB)


def _cpu() -> DeviceSpec:
    """One CPU process on one thread talking gloo. These are modest placeholders so that a plan
    can be ranked without a GPU; real numbers come from calibration (`shoal plan --calibrate`)."""
    return DeviceSpec(
        name="cpu", peak_flops={d: 50e9 for d in ("fp32", "bf16", "fp16")}, matmul_efficiency=1.0, op_overhead=10e-6,
        dtensor_overhead=100e-6,
        memory_bytes=16 * GiB, memory_bw=10 * GB,
        intra=Link(name="gloo loopback", bandwidth=2 * GB, efficiency=1.0, latency=200e-6),
        inter=Link(name="gloo over 10 GbE", bandwidth=1.25 * GB, efficiency=0.7, latency=500e-6),
        source="placeholder for one 1-thread process; calibrate for real numbers")


DEVICES: dict[str, DeviceSpec] = {d.name: d for d in [
    DeviceSpec(name="P100-16GB", peak_flops={"fp32": 10.6 * TERA, "fp16": 21.2 * TERA},
               matmul_efficiency=0.75, attention_efficiency=0.3, sm_count=56, memory_bytes=16 * GiB,
               memory_bw=732 * GB,
               intra=_nvlink(1, 160, 0.75), inter=_DGX1_IB,
               source=f"NVIDIA Tesla P100 SXM2 data sheet; DGX-1 data sheet; {_NCCL}"),
    DeviceSpec(name="V100-32GB", peak_flops={"fp32": 15.7 * TERA, "fp16": 125 * TERA},
               matmul_efficiency=0.75, attention_efficiency=0.3, sm_count=80, memory_bytes=32 * GiB,
               memory_bw=900 * GB,
               intra=_nvlink(2, 300, 0.75), inter=_DGX1_IB,
               source=f"NVIDIA Tesla V100 SXM2 data sheet; DGX-1 (V100) data sheet; {_NCCL}"),
    DeviceSpec(name="A100-40GB", memory_bytes=40 * GiB, memory_bw=1555 * GB, **_A100,
               source=f"NVIDIA A100 SXM4 data sheet (dense, tf32 off); DGX A100 data sheet; {_NCCL}"),
    # Memory bandwidth: what a streaming read kernel reaches on an A100 80GB SXM, 1.80 of the data sheet's
    # 2.04 TB/s (88%, Nsight Compute agreeing; NVIDIA developer forum, "Trouble to Reach Peak Bandwidth of A100",
    # thread 339083, which cites a GTC talk whose best kernel reached ~90%), not the data-sheet figure. Cross-check,
    # not used: STREAM Triad on an A100-SXM4-80GB, 1.70 TB/s (Azure AI-benchmarking-guide, ND_A100_v4_results.md).
    DeviceSpec(name="A100-80GB", memory_bytes=80 * GiB, memory_bw=1800 * GB, **_A100,
               source=f"NVIDIA A100 SXM4 data sheet (dense, tf32 off); measured HBM read bandwidth; DGX A100 data "
                      f"sheet; {_NCCL}"),
    DeviceSpec(name="A100-80GB-OPA", memory_bytes=80 * GiB, memory_bw=1800 * GB, **{**_A100, "inter": _JEAN_ZAY_OPA},
               source=f"A100-80GB's figures; across nodes 4 Omni-Path 100 Gb/s links per 8 GPUs (Jean Zay, BLOOM's "
                      f"model card); {_NCCL}"),
    # Memory bandwidth: STREAM Triad on an H100 80GB HBM3 SXM, 2.97 of the data sheet's 3.35 TB/s (copy 2.90); on an
    # H200, 4.15 of 4.8 (github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md, "HBM
    # Bandwidth", read from the copy in its fork samuel-bohman/AI-benchmarking-guide at 26d18e9, and
    # ND_H200_v5_results.md): Triad, STREAM's reference kernel.
    DeviceSpec(name="H100-80GB", memory_bytes=80 * GiB, memory_bw=2970 * GB, **_H100,
               source=f"NVIDIA H100 SXM5 data sheet (dense); measured HBM3 Triad bandwidth; DGX H100 data sheet; "
                      f"{_NCCL}"),
    # Meta's Grand Teton H100s (torchtitan's runs): HBM2e, 96 GB, the board held to 500 W. Bandwidth: 2.41 TB/s, the
    # HBM2e H100's figure as Ujeniya et al. 2026 (arXiv 2604.11391, section 3) list it beside the H200's 4.89, and
    # torchtitan's benchmark page's "2.4 TB/sec peak": a peak, not a streaming measurement (this part has none; the
    # HBM3 H100's Triad reaches 0.887 of its sheet), so elementwise work is priced optimistically on it.
    # Its tensor cores held to the clock a 500 W cap leaves them (_H100_500W_SUSTAINED).
    DeviceSpec(name="H100-96GB-500W", memory_bytes=96 * GiB, memory_bw=2410 * GB,
               **{**_H100, "sustained_clock": _H100_500W_SUSTAINED},
               source=f"H100 SXM5 compute (data sheet) at the 500 W SM clock and the HBM2e peak bandwidth of arXiv "
                      f"2604.11391; {_NCCL}"),
    DeviceSpec(name="H200", memory_bytes=141 * GiB, memory_bw=4150 * GB, **_H100,
               source=f"NVIDIA H200 SXM data sheet (H100 compute); measured HBM3e Triad bandwidth; DGX H200 data "
                      f"sheet; {_NCCL}"),
    _cpu(),
]}
ALIASES: dict[str, str] = {"V100": "V100-32GB", "P100": "P100-16GB", "A100": "A100-80GB",
                           "A100-SXM4-40GB": "A100-40GB", "A100-PCIE-40GB": "A100-40GB", "H100": "H100-80GB",
                           "H200-141GB": "H200"}
"""The devices' other names: what `--cluster` takes beside DEVICES' own, and what the names torch gives GPUs
(torch.cuda.get_device_name()) contain (`gpu_device`)."""
_LOOKUP = {k.lower(): v for k, v in {**{n: n for n in DEVICES}, **ALIASES}.items()}


def host_memory_bytes() -> int:
    """This machine's physical memory (the CPU device spec's figure where the OS does not say)."""
    names = ("SC_PAGE_SIZE", "SC_PHYS_PAGES")
    if all(n in os.sysconf_names for n in names):
        return os.sysconf(names[0]) * os.sysconf(names[1])
    return DEVICES["cpu"].memory_bytes


def available_memory_bytes() -> int:
    """What this machine can still give: the kernel's MemAvailable (free memory plus what it can reclaim);
    its physical memory where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return host_memory_bytes()


def get_device(name: str) -> DeviceSpec:
    """The spec for a device name or alias, case-insensitively."""
    key = _LOOKUP.get(name.strip().lower())
    if key is None:
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)} (aliases: {', '.join(ALIASES)})")
    return DEVICES[key]


def gpu_device(torch_name: str) -> DeviceSpec | None:
    """The spec of the GPU torch calls `torch_name` (torch.cuda.get_device_name(): "NVIDIA A100-SXM4-40GB"): the
    longest device name or alias the name contains, case-insensitively; None for a GPU without a spec."""
    name = torch_name.lower()
    found = [key for key in _LOOKUP if key in name and DEVICES[_LOOKUP[key]].name != "cpu"]
    return DEVICES[_LOOKUP[max(found, key=len)]] if found else None


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """`num_nodes` nodes of `per_node` devices; ranks are numbered node-major."""

    device: DeviceSpec
    num_nodes: int
    per_node: int
    intra: Link  # link between devices of one node
    inter: Link  # link across nodes, per device

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.per_node < 1:
            raise ValueError(f"a cluster needs num_nodes >= 1 and per_node >= 1, "
                             f"got {self.num_nodes} and {self.per_node}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.per_node

    @property
    def device_type(self) -> str:
        """The torch device type its processes compute on: "cpu" or "cuda"."""
        return "cpu" if self.device.name == "cpu" else "cuda"

    def link(self, group_size: int, stride: int) -> Link:
        """The slowest link crossed by a group of `group_size` ranks spaced `stride` apart. The group
        is assumed aligned (inner mesh axes are contiguous), so it stays inside a node iff its
        span fits in one."""
        if group_size < 1 or stride < 1:
            raise ValueError(f"group_size and stride must be >= 1, got {group_size} and {stride}")
        span = (group_size - 1) * stride
        if span >= self.world_size:
            raise ValueError(f"a group of {group_size} ranks at stride {stride} spans {span + 1} ranks; "
                             f"the world has {self.world_size}")
        return self.intra if span < self.per_node else self.inter

    def describe(self) -> str:
        """One line for humans, e.g. for the head of `shoal plan` output."""
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''} of {self.per_node}"
        within = f"{self.intra.name} ({self.intra.bandwidth / GB:g} GB/s) within"
        text = f"{self.world_size} x {self.device.name} ({self.device.memory_bytes / GiB:g} GiB): {nodes}, {within}"
        if self.num_nodes > 1:
            text += f", {self.inter.name} ({self.inter.bandwidth / GB:g} GB/s per device) across"
        return text
