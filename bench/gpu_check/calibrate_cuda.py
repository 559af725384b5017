"""CUDA calibration for the planner: the GEMMs and attention of training shapes, memory bandwidth,
and one-GPU predictions against measured runs.

The planner prices a GPU from a DeviceSpec (shoal.planner.hardware): a matmul efficiency, an
attention efficiency and a memory bandwidth. Here they are measured on this GPU at the shapes a
training step runs (the projections and FFN of the 85M and 1.9B shapes of bench/gpu_throughput.py,
forward and the two backward products, each beside what the planner's square-GEMM model says for it;
square GEMMs give the model's table and its large-GEMM efficiency), with the host's seconds per op
(`measure_host`, which the planner compares with the device's time phase by phase), and written as a cluster
file that `shoal plan --cluster FILE.toml` reads: a profile for this device kind, on a host like this one.
It is kept out of shoal.calibration.calibrate (the CPU calibration) on purpose: it is a bench-side
measurement until a GPU run has shown its figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.gpu_check.context import Context
from bench.gpu_check.parts_kernels import _median_time
from bench.gpu_check.parts_train import DEFAULT_PLAN, PLAN_MODEL, PLAN_STEPS, planner_cluster, train_plan
from bench.gpu_check.report import safe_name
from shoal.planner.hardware import Cluster

# (name, tokens per step, dim, heads, kv heads, head dim, ffn, vocab, batch, seq): the training shapes
SHAPES = {"85m": (16 * 1024, 768, 12, 12, 64, 2048, 256, 16, 1024),
          "1.9b": (8 * 2048, 4096, 32, 8, 128, 14336, 128256, 8, 2048)}
DRY_SHAPES = {"toy": (256, 64, 4, 4, 16, 128, 256, 2, 128)}
SQUARES = {False: (1024, 2048, 4096, 8192), True: (32, 64, 128)}
"""Square GEMM sizes measured for the planner's table (DeviceSpec.gemm_square); True: the dry run's."""


def gemms(shape: tuple) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of one step's weight products: each forward product (M x K) @ (K x N) and its
    two backward products, the input's gradient (M x N) @ (N x K) and the weight's (K x M) @ (M x N)."""
    tokens, dim, heads, kv, hd, ffn, vocab = shape[:7]
    forward = [("qkv", tokens, dim, (heads + 2 * kv) * hd), ("out", tokens, heads * hd, dim),
               ("ffn up+gate", tokens, dim, 2 * ffn), ("ffn down", tokens, ffn, dim), ("head", tokens, dim, vocab)]
    out = []
    for name, m, k, n in forward:
        out += [(f"{name} fwd", m, k, n), (f"{name} dgrad", m, n, k), (f"{name} wgrad", k, m, n)]
    return out


def measure_gemm(m: int, k: int, n: int, device: str, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of (m x k) @ (k x n)."""
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / _median_time(lambda: a @ b, device, repeats)


def measure_attention(batch: int, heads: int, kv: int, seq: int, hd: int, device: str, dtype: torch.dtype,
                      repeats: int) -> dict[str, float]:
    """FLOP/s of causal SDPA forward and forward + backward, counting causal FLOPs (half the square,
    FlashAttention's convention) and backward as 2.5 forwards (FlashAttention-2, section 4)."""
    q = torch.randn(batch, heads, seq, hd, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, heads, seq, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    fwd_flops = 4 * batch * heads * seq * seq * hd / 2
    g = torch.randn_like(q)
    fwd = _median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats)
    both = _median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g), device, repeats)
    return {"forward": fwd_flops / fwd, "forward_backward": 3.5 * fwd_flops / both}


def measure_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    x = torch.empty(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / _median_time(lambda: y.copy_(x), device, repeats)


HOST_LAYERS, HOST_TOKENS = 12, 8
"""The model whose forward and backward time the host's cost per op: bench/engine_overhead.py's (the tiny preset at
12 blocks, 8 tokens), whose arithmetic is negligible on any device, so its time is the host's."""


def measure_host(device: str, repeats: int) -> dict[str, float]:
    """The host's cost per op in the planner's unit (shoal.planner.costs: an op of a block's forward with its
    backward, OPS_PER_BLOCK of them a block): the median host time of an eager fp32 forward and backward of a deep
    tiny model over its planner ops (model_ops), and the forward's share of that time (HOST_FORWARD_SHARE's
    figure). Timing a real model rather than a chain of one op charges what a step's ops cost with the Python
    around them (module calls, autograd's graph)."""
    import statistics
    import time

    from shoal.models import PRESETS, Transformer
    from shoal.planner.costs import model_ops

    cfg = PRESETS["tiny"].replace(num_layers=HOST_LAYERS, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (1, HOST_TOKENS), device=device)
    forward, backward = [], []
    for i in range(repeats + 2):  # two warm-up passes
        start = time.perf_counter()
        loss = model(tokens).float().sum()
        _sync(device)
        middle = time.perf_counter()
        loss.backward()
        _sync(device)
        if i >= 2:
            forward.append(middle - start)
            backward.append(time.perf_counter() - middle)
    fwd, bwd = statistics.median(forward), statistics.median(backward)
    return {"op_overhead": (fwd + bwd) / model_ops(HOST_LAYERS), "forward_share": fwd / (fwd + bwd)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def calibrated_cluster(base: Cluster, *, device_name: str | None, square: tuple[tuple[int, float], ...],
                       matmul_efficiency: float, attention_efficiency: float, memory_bw: float,
                       op_overhead: float) -> Cluster:
    """`base` with its device's figures replaced by the measured ones (pure: the profile the TOML holds)."""
    device = dataclasses.replace(base.device, name=f"{base.device.name}-calibrated",
                                 matmul_efficiency=matmul_efficiency, gemm_square=square,
                                 sustained_clock=1.0,  # measured: whatever clock it held
                                 attention_efficiency=attention_efficiency, attention_table=None,  # measured here
                                 memory_bw=memory_bw, op_overhead=op_overhead,
                                 source=f"bench.gpu_check calibrate on {device_name or 'cpu (dry run)'}, "
                                        f"{datetime.date.today().isoformat()}")
    return dataclasses.replace(base, device=device, intra=device.intra, inter=device.inter)


def write_profile(out: Path, stem: str, cluster: Cluster, record: dict[str, Any]) -> tuple[Path, Path]:
    """Write the cluster TOML the planner reads (`shoal plan --cluster FILE.toml`) and the JSON record beside it."""
    from shoal.planner.cluster_file import dump_cluster

    toml_path, json_path = out / f"{stem}.toml", out / f"{stem}.json"
    out.mkdir(parents=True, exist_ok=True)
    toml_path.write_text(dump_cluster(cluster))
    json_path.write_text(json.dumps(record, indent=1))
    return toml_path, json_path


def calibrate(ctx: Context, device_name: str | None) -> dict[str, Any]:
    """Measure, write the profile (JSON record and cluster TOML) under ctx.out, return the profile."""
    from shoal.planner.cluster_file import dump_cluster, parse_cluster

    dev, repeats = ctx.device, 3 if ctx.dry else 20
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    base = parse_cluster(planner_cluster(device_name))
    peak = base.device.peak_flops["fp32" if ctx.dry else "bf16"]
    gemm_rows, attn_rows = [], []
    attn_flops = attn_time = 0.0
    # The planner's GEMM model: the largest square's rate (matmul_efficiency) scaled by the square of the
    # same work (DeviceSpec.gemm_factor); the training shapes below check that model on this device.
    square = tuple((size, measure_gemm(size, size, size, dev, dtype, repeats)) for size in SQUARES[ctx.dry])
    large = max(rate for _, rate in square)
    shaped = dataclasses.replace(base.device, gemm_square=square)
    for shape_name, shape in (DRY_SHAPES if ctx.dry else SHAPES).items():
        for name, m, k, n in gemms(shape):
            rate = measure_gemm(m, k, n, dev, dtype, repeats)
            model = large * shaped.gemm_factor(m, n, k)
            gemm_rows.append({"shape": shape_name, "gemm": name, "M": m, "K": k, "N": n, "tflops": rate / 1e12,
                              "efficiency": rate / peak, "measured / square model": rate / model})
        _, _, heads, kv, hd, _, _, batch, seq = shape
        rates = measure_attention(batch, heads, kv, seq, hd, dev, dtype, repeats)
        attn_rows.append({"shape": shape_name, "B": batch, "H": heads, "T": seq, "head_dim": hd,
                          **{f"{k} tflops": r / 1e12 for k, r in rates.items()},
                          "planner efficiency": 3 / 3.5 * rates["forward_backward"] / peak})
        # The planner prices attention as 3 forwards (shoal.planner.compute): its efficiency is that over the time.
        fwd_flops = 4 * batch * heads * seq * seq * hd / 2
        attn_flops += 3 * fwd_flops
        attn_time += 3.5 * fwd_flops / rates["forward_backward"]
    bandwidth = measure_bandwidth(dev, 2**24 if ctx.dry else 2**31, repeats)
    host = measure_host(dev, repeats)
    matmul_eff = min(1.0, large / peak)
    attention_eff = min(1.0, attn_flops / attn_time / peak)
    cluster = calibrated_cluster(base, device_name=device_name, square=square, matmul_efficiency=matmul_eff,
                                 attention_efficiency=attention_eff, memory_bw=bandwidth,
                                 op_overhead=host["op_overhead"])
    stem = safe_name(f"cuda-profile-{base.device.name}" + ("-dry-run" if ctx.dry else ""))
    profile = {"device_name": device_name, "device_kind": base.device.name, "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "dry_run": ctx.dry, "matmul_efficiency": matmul_eff, "attention_efficiency": attention_eff,
               "memory_bw_gbs": bandwidth / 1e9, "host_us_per_op": host["op_overhead"] * 1e6,
               "host_forward_share": host["forward_share"],
               "gemm_square_tflops": [[s, r / 1e12] for s, r in square],
               "gemms": gemm_rows, "attention": attn_rows}
    toml_path, _ = write_profile(ctx.out, stem, cluster, profile)
    ctx.tables["square GEMMs"] = [{"size": size, "tflops": rate / 1e12, "efficiency": rate / peak}
                                  for size, rate in square]
    ctx.tables["GEMMs of training shapes"] = gemm_rows
    ctx.tables["causal attention (SDPA)"] = attn_rows
    ctx.figures.update(matmul_efficiency=matmul_eff, attention_efficiency=attention_eff,
                       memory_bw_gbs=bandwidth / 1e9, host_us_per_op=host["op_overhead"] * 1e6,
                       host_forward_share=host["forward_share"], data_sheet={
                           "matmul_efficiency": base.device.matmul_efficiency,
                           "attention_efficiency": base.device.attention_efficiency,
                           "memory_bw_gbs": base.device.memory_bw / 1e9}, profile=toml_path.name)
    back = parse_cluster(str(toml_path))  # floats pass through TFLOP/s text: compare as the file writes them
    ctx.check("profile written and read back by the planner", dump_cluster(back) == dump_cluster(cluster),
              f"{toml_path.name}: matmul {matmul_eff:.2f}, attention {attention_eff:.2f} of peak, "
              f"{bandwidth / 1e9:.0f} GB/s")
    return {"toml": toml_path}


def part(ctx: Context, device_name: str | None) -> None:
    """Calibrate, then one-GPU predictions (data sheet and calibrated) against measured `shoal train` runs."""
    from shoal.cli.plan import price, workload
    from shoal.planner.cluster_file import parse_cluster

    toml = calibrate(ctx, device_name)["toml"]
    preset, sets, batch, seq = PLAN_MODEL
    work = workload(preset, list(sets), global_batch=batch, seq_len=seq)
    rows = []
    for plan in ("", "ac=full", "compile=off") if not ctx.dry else ("",):
        row: dict[str, Any] = {"plan": plan or "(default)"}
        for label, spec in (("data sheet", planner_cluster(device_name)), ("calibrated", str(toml))):
            predicted = price(plan or DEFAULT_PLAN, work, parse_cluster(spec), None)
            row[f"predicted tokens/s ({label})"] = predicted.tokens_per_s
        if not ctx.dry:
            got = train_plan(plan, PLAN_MODEL, "cuda", PLAN_STEPS)
            if got["status"] == "ok":
                row["measured tokens/s"] = got["tokens_per_s"]
                row["spread (iqr / median)"] = got["tokens_per_s_iqr_rel"]
                for label in ("data sheet", "calibrated"):
                    row[f"measured / predicted ({label})"] = got["tokens_per_s"] / row[f"predicted tokens/s ({label})"]
            else:
                row["error"] = got["error"]
        rows.append(row)
    ctx.tables["one-GPU predictions against measured runs (85M shape)"] = rows
    ctx.check("predictions priced from the profile", all(r["predicted tokens/s (calibrated)"] > 0 for r in rows))
    for row in rows:
        if "measured / predicted (calibrated)" in row:
            ratio = row["measured / predicted (calibrated)"]
            ctx.check(f"{row['plan']}: calibrated prediction within 20%", abs(ratio - 1) <= 0.2, f"{ratio:.2f}",
                      goal=True)


def read_profile(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
