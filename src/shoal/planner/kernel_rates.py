"""Published kernel measurements the cost model prices by shape: fused attention's rate by head dimension,
sequence length and causal masking, and the tile and wave quantization of a GEMM on a device's SMs.

These are kernel-level sources, kept apart from the published training runs the planner is checked
against (bench/published_runs.py): each table names the paper and figure it was read from. Rates are
FLOP/s as the source counts them (FlashAttention's convention: a forward of 4 * B * H * T * T * d FLOPs,
halved under a causal mask; a backward of 2.5 forwards; shoal.planner.compute.FUSED_BACKWARD). No torch.
"""

from __future__ import annotations

import math

TERA = 1e12
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
"""The sequence lengths of the FlashAttention-3 paper's benchmark (batch x length = 16K tokens, 2048 hidden)."""

FA2_H100: dict[str, dict[int, tuple[float, ...]]] = {
    # FlashAttention-2 on an H100 80GB SXM5, bf16, TFLOP/s at SEQ_LENS: Shah et al. 2024, "FlashAttention-3"
    # (arXiv 2407.08608), figure 5 (forward; (a)-(c) without, (d)-(f) with the causal mask) and figure 6
    # (backward, without the mask), the FlashAttention-2 bars. Values as printed above the bars.
    "forward": {64: (282, 306, 318, 321, 322, 324), 128: (309, 350, 362, 368, 370, 370)},
    "forward_causal": {64: (180, 229, 262, 284, 295, 299), 128: (191, 260, 298, 319, 333, 335)},
    "backward": {64: (198, 238, 264, 279, 287, 291), 128: (214, 260, 291, 310, 318, 322)},
}
"""The paper prints no causal backward for FlashAttention-2: a causal backward is priced at the non-causal one,
which is optimistic by at most the forward's causal gap (10% at 8K with head dim 128, figure 5b against 5e).
Cross-check, not used: Azure's AI-benchmarking-guide (Azure_Results/ND_H100_v5_results.md, "Flash Attention 2.0")
measured 327.9 TFLOP/s at head dim 128, batch 2, length 8192 on an H100 80GB; this table gives 322 (causal) to 331
(not) forward and backward together at that shape."""

ATTENTION_TABLES = {"FA2-H100": FA2_H100}
"""Tables by the name a DeviceSpec's `attention_table` gives."""


def _interpolate(points: dict[int, tuple[float, ...]], head_dim: float, seq_len: float) -> float:
    """The table's TFLOP/s at (head_dim, seq_len): linear in log2(seq_len) between the benchmarked lengths and
    linear in the head dimension between the benchmarked ones, held at the nearest outside either range."""
    x = math.log2(min(max(seq_len, SEQ_LENS[0]), SEQ_LENS[-1]))
    logs = [math.log2(s) for s in SEQ_LENS]
    i = min(max(0, sum(x >= v for v in logs) - 1), len(logs) - 2)
    t = (x - logs[i]) / (logs[i + 1] - logs[i])

    def at(dim: int) -> float:
        row = points[dim]
        return row[i] + t * (row[i + 1] - row[i])

    dims = sorted(points)
    d = min(max(head_dim, dims[0]), dims[-1])
    j = min(max(0, sum(d >= v for v in dims) - 1), len(dims) - 2)
    u = (d - dims[j]) / (dims[j + 1] - dims[j])
    return at(dims[j]) + u * (at(dims[j + 1]) - at(dims[j]))


def attention_rates(table: str, *, head_dim: float, seq_len: float, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOP/s of the fused attention kernel `table` measured, at one sequence's length
    `seq_len` (queries and keys) and `head_dim`, in FlashAttention's FLOP convention."""
    if table not in ATTENTION_TABLES:
        raise ValueError(f"no attention table {table!r}; valid: {', '.join(ATTENTION_TABLES)}")
    rates = ATTENTION_TABLES[table]
    forward = rates["forward_causal" if causal else "forward"]
    return (_interpolate(forward, head_dim, seq_len) * TERA,
            _interpolate(rates["backward"], head_dim, seq_len) * TERA)


GEMM_TILES = ((256, 128), (128, 128), (256, 64), (128, 64), (64, 64))
"""The output tiles of cuBLAS's tensor-core kernels, most efficient first (NVIDIA, "Matrix Multiplication Background
User's Guide", DU-09799-001, 2023, section 2.3 "Typical Tile Dimensions in cuBLAS and Performance": 256x128 and
128x256, 128x128, 256x64 and 64x256, 128x64 and 64x128, 64x64), each laid either way round on the output."""


def tile_efficiency(rows: float, cols: float, sms: int, tile: tuple[int, int]) -> float:
    """Fraction of the SMs' tile slots that do useful work when a (rows x cols) output is cut into `tile`s (its
    longer side along the longer dimension) that run one per SM in waves of `sms` (the guide above, section 3.1
    "Tile Quantization": partial tiles at the edges cost whole ones; section 3.2 "Wave Quantization": the last
    wave leaves SMs idle)."""
    if sms < 1 or rows <= 0 or cols <= 0:
        raise ValueError(f"need sms >= 1 and a non-empty output, got sms={sms}, {rows} x {cols}")
    long_side, short_side = max(tile), min(tile)
    a, b = (rows, cols) if rows >= cols else (cols, rows)
    tiles = math.ceil(a / long_side) * math.ceil(b / short_side)
    waves = math.ceil(tiles / sms)
    return (a * b) / (waves * sms * long_side * short_side)


def quantization_efficiency(rows: float, cols: float, sms: int) -> float:
    """The best `tile_efficiency` of a (rows x cols) GEMM output over cuBLAS's tiles (GEMM_TILES): its heuristics
    pick a tile per shape (section 2.3). The smaller tiles' lower data reuse is not charged, so this is
    the quantization's lower bound on the time a shape loses."""
    return max(tile_efficiency(rows, cols, sms, tile) for tile in GEMM_TILES)
