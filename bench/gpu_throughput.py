"""Single-GPU training throughput: `shoal train` against the plain PyTorch loop, at two shapes.

Contestants, each in its own process (a clean peak-memory count; one GPU used in turn):
- loop-eager, loop-compiled: the ~25-line loop everyone writes (autocast bf16 around forward and
  cross-entropy, backward, clip_grad_norm_, fused AdamW, zero_grad) on shoal's Transformer, eager
  and under torch.compile(model);
- hf-eager, hf-compiled: the same loop on transformers' LlamaForCausalLM of the same shape (sdpa,
  built from its config, nothing downloaded); compiled at the 85m shape only;
- shoal, shoal-ac-selective, shoal-compile-off: the real trainer through its CLI with the plans in
  SHOAL_PLANS; figures come from its metrics.jsonl.
Shapes: 85m (tiny preset widened to 12 x 768, batch 16 x 1024) and 1.9b (llama3-8b cut to 4
layers, batch 8 x 2048). Reported: tokens/s (median and range over repeats of K steps), MFU
against the device's data-sheet peak (the trainer's own FLOPs-per-token formula for every
contestant), peak allocated memory over the timed steps (after warm-up, as the trainer counts it).
On a CPU (`--device cpu --quick`, a smoke run) the compiled contestants are skipped unless
--compile-on-cpu, and the peak is a measured fp32 matmul rate.

Goals on one H100 or H200 (989 TFLOP/s dense bf16): shoal >= 1.0x the compiled loop's tokens/s at 85m
and >= 1.05x at 1.9b; MFU >= 55% at 1.9b; shoal's peak memory <= the compiled loop's + 5%;
ac=selective >= 0.85x ac=none.

    pip install --no-deps --no-build-isolation -e .
    python bench/gpu_throughput.py [--shapes 85m,1.9b] [--only shoal,loop-compiled] [--steps 10] [--repeats 5]
    python bench/gpu_throughput.py --device cpu --quick      # smoke run on a CPU, tiny shape
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# `python bench/gpu_throughput.py` (not only `python -m bench.gpu_throughput`) must find `bench`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.common import RESULTS, environment, summarize
from shoal.models import ModelConfig, Transformer, get_preset
from shoal.train import memory
from shoal.train.metrics import METRICS, peak_flops, read_metrics

WARMUP_STEPS = 5


@dataclass(frozen=True)
class Shape:
    preset: str
    overrides: tuple[str, ...]
    """key=value model fields, exactly as `shoal train --set` takes them."""
    batch: int
    seq_len: int
    hf_compile: bool = True

    def model(self) -> ModelConfig:
        return get_preset(self.preset).with_overrides(list(self.overrides))


SHAPES = {
    "85m": Shape("tiny", ("num_layers=12", "dim=768", "num_heads=12", "num_kv_heads=12", "ffn_dim=2048",
                          "vocab_size=256", "max_seq_len=1024"), batch=16, seq_len=1024),
    "1.9b": Shape("llama3-8b", ("num_layers=4",), batch=8, seq_len=2048, hf_compile=False),
    "quick": Shape("tiny", ("num_layers=2", "dim=64", "num_heads=4", "num_kv_heads=4", "ffn_dim=128",
                            "vocab_size=256", "max_seq_len=64"), batch=4, seq_len=64),
}
LOOPS = {"loop-eager": ("shoal", False), "loop-compiled": ("shoal", True),
         "hf-eager": ("hf", False), "hf-compiled": ("hf", True)}
"""Plain-loop contestants: name -> (which model, torch.compile or not)."""
SHOAL_PLANS = {"shoal": "compile=on", "shoal-ac-selective": "compile=on,ac=selective",
               "shoal-compile-off": "compile=off"}
"""`shoal train --plan` of each trainer contestant."""
CONTESTANTS = [*LOOPS, *SHOAL_PLANS]
RATIOS = {  # key -> (numerator, denominator, quantity)
    "shoal / loop-compiled tokens/s": ("shoal", "loop-compiled", "tokens_per_s"),
    "shoal / loop-compiled peak memory": ("shoal", "loop-compiled", "peak_gib"),
    "ac=selective / ac=none tokens/s": ("shoal-ac-selective", "shoal", "tokens_per_s"),
    "compile=on / compile=off tokens/s": ("shoal", "shoal-compile-off", "tokens_per_s"),
}
GOALS = [  # (figure: a ratio key or "shoal MFU", bound, True: at least / False: at most, shapes or None: all)
    ("shoal / loop-compiled tokens/s", 1.0, True, ("85m", "quick")),
    ("shoal / loop-compiled tokens/s", 1.05, True, ("1.9b",)),
    ("shoal MFU", 0.55, True, ("1.9b",)),
    ("shoal / loop-compiled peak memory", 1.05, False, None),
    ("ac=selective / ac=none tokens/s", 0.85, True, None),
]


class Failed(Exception):
    """A contestant's process ended with an error; the message is its last line."""


# ----------------------------------------------------------------------------- contestants


def _hf_model(cfg: ModelConfig) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads, num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False))


def plain_loop(name: str, shape: Shape, device: torch.device, steps: int, repeats: int) -> dict[str, Any]:
    """The loop as a user writes it: tokens/s of each window of `steps` steps, and peak memory."""
    family, compiled = LOOPS[name]
    cfg = shape.model()
    torch.manual_seed(0)
    with device:  # initialise the weights where they will live
        model = Transformer(cfg) if family == "shoal" else _hf_model(cfg)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-4, fused=True)
    forward = torch.compile(model) if compiled else model
    tokens = torch.randint(0, cfg.vocab_size, (shape.batch, shape.seq_len + 1), device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> None:
        with torch.autocast(device.type, torch.bfloat16):
            out = forward(x)
            logits_BTV = out if family == "shoal" else out.logits
            loss = F.cross_entropy(logits_BTV.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(WARMUP_STEPS):
        step()
    sync()
    memory.reset_peak()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        rates.append(shape.batch * shape.seq_len * steps / (time.perf_counter() - start))
    return {"tokens_per_s": rates, "peak_mb": memory.peak_mb()}


def trainer(name: str, shape: Shape, device: str, steps: int, repeats: int) -> dict[str, Any]:
    """`shoal train` on one process, read back from its metrics.jsonl. It reads the device every
    `steps` steps and shares a window's time equally among its steps, so whole windows are dropped
    as warm-up and each later window is one repeat, as in the plain loop."""
    warm_windows = -(-WARMUP_STEPS // steps)
    sets = [arg for pair in shape.overrides for arg in ("--set", pair)]
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as out:
        _run([sys.executable, "-m", "shoal", "train", "--nproc", "1", "--device", device, "--model", shape.preset,
              *sets, "--global-batch", str(shape.batch), "--seq-len", str(shape.seq_len),
              "--steps", str((warm_windows + repeats) * steps), "--log-every", str(steps), "--eval-every", "0",
              "--eval-batches", "1", "--ckpt-every", "0", "--final-ckpt", "off", "--out", out,
              "--plan", SHOAL_PLANS[name]])
        records = read_metrics(Path(out) / METRICS)[warm_windows * steps:]
    return {"tokens_per_s": [r["tokens_per_s"] for r in records[::steps]],
            "peak_mb": max(r["mem_peak_mb"] for r in records)}


def _run(cmd: list[str], timeout_s: float = 1800) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise Failed(f"no result after {timeout_s:.0f} s") from None
    if done.returncode:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise Failed((lines[-1] if lines else f"exit status {done.returncode}")[:200])


def run_contestant(name: str, shape_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One contestant in its own process: {"status": "ok", samples...} or a failure with its reason."""
    try:
        if name in SHOAL_PLANS:
            return {"status": "ok", **trainer(name, SHAPES[shape_name], args.device, args.steps, args.repeats)}
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            spec = {"name": name, "shape": shape_name, "device": args.device, "steps": args.steps,
                    "repeats": args.repeats, "result": str(result)}
            _run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)])
            return {"status": "ok", **json.loads(result.read_text())}
    except Failed as exc:
        return {"status": "failed", "error": str(exc)}


def worker(spec: dict[str, Any]) -> None:
    device = torch.device(spec["device"])
    result = plain_loop(spec["name"], SHAPES[spec["shape"]], device, spec["steps"], spec["repeats"])
    Path(spec["result"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the comparison


def skip_reason(name: str, shape_name: str, args: argparse.Namespace) -> str | None:
    compiled = LOOPS[name][1] if name in LOOPS else "compile=on" in SHOAL_PLANS[name].split(",")
    if name == "hf-compiled" and not SHAPES[shape_name].hf_compile:
        return "compiled at the 85m shape only"
    if compiled and args.device == "cpu" and not args.compile_on_cpu:
        return "torch.compile on CPU: pass --compile-on-cpu"
    return None


def compare(shape_name: str, args: argparse.Namespace, peak: tuple[float, str]) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    flops = shape.model().flops_per_token(shape.seq_len)
    rows: dict[str, dict[str, Any]] = {}
    for name in args.only:
        reason = skip_reason(name, shape_name, args)
        print(f"[{shape_name}] {name}: " + (f"skipped ({reason})" if reason else "running ..."), flush=True)
        row = {"status": "skipped", "reason": reason} if reason else run_contestant(name, shape_name, args)
        if row["status"] == "ok":
            row["samples"] = row["tokens_per_s"]
            row["tokens_per_s"] = summarize(row["samples"])
            row["mfu"] = flops * row["tokens_per_s"]["median"] / peak[0]
            row["peak_gib"] = row.pop("peak_mb") / 1024
        rows[name] = row
    ok = {name: row for name, row in rows.items() if row["status"] == "ok"}

    def value(name: str, quantity: str) -> float:
        return ok[name][quantity]["median"] if quantity == "tokens_per_s" else ok[name][quantity]

    ratios = {key: value(a, q) / value(b, q) for key, (a, b, q) in RATIOS.items() if a in ok and b in ok}
    figures = {**ratios, **({"shoal MFU": ok["shoal"]["mfu"]} if "shoal" in ok else {})}
    goals = []
    for figure, bound, at_least, shapes in GOALS:
        if shapes is None or shape_name in shapes:
            got = figures.get(figure)
            met = None if got is None else (got >= bound if at_least else got <= bound)
            goals.append({"figure": figure, "bound": bound, "at_least": at_least, "value": got, "met": met})
    return {"batch": shape.batch, "seq_len": shape.seq_len, "model": asdict(shape.model()), "flops_per_token": flops,
            "contestants": rows, "ratios": ratios, "goals": goals}


def print_shape(shape_name: str, res: dict[str, Any], quick: bool) -> None:
    print(f"\n== {shape_name}: batch {res['batch']} x {res['seq_len']} tokens, "
          f"{res['flops_per_token'] / 1e9:.3g} GFLOP/token")
    table = [("contestant", "tokens/s median [min-max]", "MFU %", "peak GiB")]
    for name, row in res["contestants"].items():
        if row["status"] == "ok":
            t = row["tokens_per_s"]
            table.append((name, f"{t['median']:,.0f} [{t['min']:,.0f}-{t['max']:,.0f}]", f"{100 * row['mfu']:.1f}",
                          f"{row['peak_gib']:.2f}"))
        else:
            table.append((name, f"{row['status']}: {row.get('reason') or row.get('error')}"))
    widths = [max(len(r[i]) for r in table if len(r) == 4 or i == 0) for i in range(4)]  # a failure spans columns
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for key, ratio in res["ratios"].items():
        print(f"  {key}: {ratio:.3f}")
    for goal in res["goals"]:
        bound = f"{'>=' if goal['at_least'] else '<='} {goal['bound']:g}"
        verdict = "not measured"
        if goal["met"] is not None:
            verdict = f"{goal['value']:.3f}, " + ("met" if goal["met"] else "NOT met")
        print(f"  goal {goal['figure']} {bound}: {verdict}" + (" (quick shape, not the goal's)" if quick else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shape and few steps: a smoke run")
    parser.add_argument("--shapes", default="85m,1.9b", help="comma list of: 85m, 1.9b [both]")
    parser.add_argument("--only", default=",".join(CONTESTANTS), help=f"comma list of: {', '.join(CONTESTANTS)} [all]")
    parser.add_argument("--steps", type=int, help="steps per timed window [10; 3 with --quick]")
    parser.add_argument("--repeats", type=int, help="timed windows [5; 2 with --quick]")
    parser.add_argument("--compile-on-cpu", action="store_true", help="run the compiled contestants on CPU too")
    parser.add_argument("--json", type=Path, help="where to write the results [bench/results/gpu_throughput.json]")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one plain-loop contestant, as JSON
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    shapes = ["quick"] if args.quick else args.shapes.split(",")
    args.only = args.only.split(",")
    for value, valid, flag in ((shapes, ["85m", "1.9b"], "--shapes"), (args.only, CONTESTANTS, "--only")):
        if set(value) - set(valid) and not (args.quick and flag == "--shapes"):
            parser.error(f"{flag} {','.join(sorted(set(value) - set(valid)))} is not valid; valid: {', '.join(valid)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_throughput: CUDA is not available; for a smoke run on CPU: --device cpu --quick")
    args.steps = args.steps or (3 if args.quick else 10)
    args.repeats = args.repeats or (2 if args.quick else 5)
    path = args.json or RESULTS / ("gpu_throughput_quick.json" if args.quick else "gpu_throughput.json")

    peak = peak_flops(torch.device(args.device), 1)
    print(f"peak {peak[0] / 1e12:.4g} TFLOP/s ({peak[1]}); {WARMUP_STEPS} warm-up steps, "
          f"{args.repeats} repeats of {args.steps} steps")
    results = {}
    for shape in shapes:
        results[shape] = compare(shape, args, peak)
        print_shape(shape, results[shape], args.quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": "gpu_throughput", "env": environment(), "argv": sys.argv,
                                "device": args.device, "peak_flops": peak, "warmup_steps": WARMUP_STEPS,
                                "steps": args.steps, "repeats": args.repeats, "shapes": results}, indent=2))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
