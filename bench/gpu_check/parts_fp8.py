"""The fp8 part: shoal's one-process step at the 1.9B shape of bench/gpu_throughput.py in bf16 and with the plan
option fp8=rowwise, both compiled, on the same batches from the same weights: tokens/s of each, and the loss
after the same steps (goal: fp8 at least 1.25x bf16's tokens/s, its loss within 1% of bf16's).

Both runs are shoal's `parallelize` and the trainer's `train_step` in this process (no `shoal train`: its
process start and the checkpoint it writes at the end, ~23 GB at this shape, would take the time the steps need).
The data is the built-in corpus as bytes (a learnable stream, so the loss falls and the comparison means something).

torchao: the GPU machine reaches no package registry, so where torchao is missing the part installs the wheel the
session carried into the repository's ignored `.whl/` folder, with `pip install --no-deps` (docs/gpu_check.md).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import math
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.common import summarize
from bench.gpu_check.context import REPO, Context, run_command

SHAPE = ("llama3-8b", ("num_layers=4",), 8, 2048)
"""(preset, overrides, global batch, sequence length): bench/gpu_throughput.py's 1.9b shape."""
DRY_SHAPE = ("tiny", ("num_layers=2", "dim=64", "num_heads=4", "num_kv_heads=4", "ffn_dim=128", "vocab_size=256",
                      "max_seq_len=64"), 4, 64)
STEPS, DRY_STEPS = 120, 30
"""Steps per run: at the 1.9B shape's bf16 step time on an H100 (docs/measurements.md: ~0.35 s), both runs' steps
take ~70 s and their compiles ~30-45 s each, inside the part's 240 s."""
WINDOW = 10
"""Steps per timing window (one device sync each); the first two windows (compile, warm-up) are not timed."""
LOSS_STEPS = 10
"""The loss compared: the mean of the last this many steps' losses (one step's is noisier than the 1% goal)."""
PLANS = {"bf16": "compile=on", "fp8": "compile=on,fp8=rowwise"}
"""The plans compared (on a dry run, compile off: the CPU side's cold compile takes longer than its steps)."""
GOAL_SPEEDUP, GOAL_LOSS_REL = 1.25, 0.01


def ensure_torchao(ctx: Context) -> bool:
    """torchao importable: already, or installed here from the carried wheel (`.whl/torchao-*.whl`)."""
    if importlib.util.find_spec("torchao") is not None:
        ctx.check("torchao installed", True, "already")
        return True
    wheels = sorted((REPO / ".whl").glob("torchao-*.whl"))
    if not wheels:
        ctx.check("torchao installed", False, f"not installed and no wheel in {REPO / '.whl'}; carry one there "
                  "(docs/gpu_check.md, the fp8 part)")
        return False
    status, text = run_command([sys.executable, "-m", "pip", "install", "--no-deps", str(wheels[-1])], timeout_s=120)
    importlib.invalidate_caches()
    ok = status == 0 and importlib.util.find_spec("torchao") is not None
    ctx.check("torchao installed", ok, f"pip install --no-deps {wheels[-1].name}: exit {status} {text[-200:]}")
    return ok


def corpus_batches(steps: int, batch: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of (inputs, targets) drawn from the built-in corpus's bytes, the same on every call."""
    from shoal.data.text import default_corpus

    data = torch.from_numpy(np.frombuffer(default_corpus().encode(), dtype=np.uint8).astype(np.int64))
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
        rows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out


def train(plan_text: str, shape: tuple, steps: int, device: str) -> dict[str, Any]:
    """One run of `plan_text` on one process: losses, tokens/s per timed window, float8 modules."""
    from shoal import rules
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import Transformer, get_preset
    from shoal.parallel.float8 import is_float8
    from shoal.plan import Plan
    from shoal.train.step import split_micro, train_step

    preset, sets, batch, seq_len = shape
    cfg = get_preset(preset).with_overrides(list(sets))
    plan = rules.resolve(Plan.parse(plan_text), world_size=1, device=device)
    with torch.device("meta"):
        model = Transformer(cfg)
    runtime = parallelize(model, plan, build_mesh(plan, device), seed=0)
    optimizer = torch.optim.AdamW(list(runtime.parameters()), lr=3e-4, fused=device == "cuda")
    batches = [(x.to(device), y.to(device)) for x, y in corpus_batches(steps, batch, seq_len)]
    losses: list[torch.Tensor] = []
    rates: list[float] = []
    start = time.perf_counter()
    for i, (x, y) in enumerate(batches, 1):
        losses.append(train_step(runtime, optimizer, split_micro(x, y, 1), grad_clip=1.0).loss.detach())
        if i % WINDOW == 0:
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if i > 2 * WINDOW:
                rates.append(batch * seq_len * WINDOW / (now - start))
            start = now
    float8 = sum(is_float8(m) for part in runtime.parts for m in part.modules())
    del runtime, optimizer, model
    torch._dynamo.reset()  # its caches hold the compiled model, and with it the first run's ~30 GB of state
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"losses": [float(v) for v in losses], "rates": rates, "float8_modules": float8, "layers": cfg.num_layers}


def fp8(ctx: Context) -> None:
    """bf16 against fp8=rowwise at the 1.9B shape (dry run: a tiny shape on the CPU, compile off)."""
    import torch.distributed as dist

    from shoal.infra.launch import free_port

    if not ensure_torchao(ctx):
        return
    shape, steps = (DRY_SHAPE, DRY_STEPS) if ctx.dry else (SHAPE, STEPS)
    if not dist.is_initialized():
        if not ctx.dry:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if ctx.dry else "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    runs = {}
    for name, plan in PLANS.items():
        plan = plan.replace("compile=on", "compile=off") if ctx.dry else plan
        runs[name] = run = {"plan": plan, **train(plan, shape, steps, ctx.device)}
        ctx.check(f"{name} ({plan}) trained {steps} steps", all(math.isfinite(v) for v in run["losses"]),
                  f"last loss {run['losses'][-1]:.4f}")
    dist.destroy_process_group()
    figures = compare(runs, steps)
    ctx.figures.update(figures)
    ctx.tables["bf16 against fp8=rowwise (1.9B shape, 8 x 2048, one GPU)"] = [
        {"plan": runs[n]["plan"], "tokens_per_s": figures[f"{n} tokens/s"], "iqr_rel": figures[f"{n} tokens/s iqr_rel"],
         "loss": figures[f"{n} loss"]} for n in runs]
    converted = runs["fp8"]["float8_modules"]
    ctx.check("fp8 converts the blocks' linear layers (7 a block) and nothing else",
              converted == 7 * runs["fp8"]["layers"] and runs["bf16"]["float8_modules"] == 0,
              f"{converted} Float8Linear")
    if not ctx.dry:
        speedup, loss_rel = figures["fp8 / bf16 tokens/s"], figures["fp8 loss / bf16 loss - 1"]
        ctx.check(f"fp8 / bf16 tokens/s >= {GOAL_SPEEDUP}", speedup >= GOAL_SPEEDUP, f"{speedup:.3f}", goal=True)
        ctx.check(f"fp8 loss within {GOAL_LOSS_REL:.0%} of bf16's after {steps} steps", abs(loss_rel) <= GOAL_LOSS_REL,
                  f"{loss_rel:+.4f}", goal=True)


def compare(runs: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """The part's figures: each run's median tokens/s and spread, the loss of its last LOSS_STEPS steps, ratios."""
    figures: dict[str, Any] = {"steps": steps}
    for name, run in runs.items():
        rate = summarize(run["rates"])
        figures[f"{name} tokens/s"], figures[f"{name} tokens/s iqr_rel"] = rate["median"], rate["iqr_rel"]
        figures[f"{name} loss"] = sum(run["losses"][-LOSS_STEPS:]) / len(run["losses"][-LOSS_STEPS:])
    figures["fp8 / bf16 tokens/s"] = figures["fp8 tokens/s"] / figures["bf16 tokens/s"]
    figures["fp8 loss / bf16 loss - 1"] = figures["fp8 loss"] / figures["bf16 loss"] - 1
    return figures
