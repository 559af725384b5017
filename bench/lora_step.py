"""A LoRA training step in one process: shoal's (`apply_lora`, the runtime's train_step) against peft's on the
same module (peft's get_peft_model over shoal's Transformer, a plain forward / backward / AdamW loop), and a full
fine-tune's step for scale.

Per model: the median step time of each, interleaved step by step (bench.common.measure_pair), the ratio
shoal / peft of the medians, each one's inter-quartile spread relative to its median, and the trainable
parameters of both (equal: the same adapters). A ratio inside the spreads is noise.

    python -m bench.lora_step [--models tiny small] [--r 16] [--repeats 20]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import measure_pair, report
from shoal.apply_plan import parallelize
from shoal.models import build_model, preset
from shoal.models.lora import apply_lora
from shoal.models.lora_config import LoRAConfig
from shoal.train.step import split_micro, train_step

PEFT_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w1", "up": "w3", "down": "w2"}


def _batch(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def shoal_step(name: str, lora: LoRAConfig | None, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, int]:
    torch.manual_seed(0)
    model = build_model(preset(name))
    if lora is not None:
        apply_lora(model, lora)
    runtime = parallelize(model)
    params = [p for p in runtime.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    micro = split_micro(*batch, 1)
    return (lambda: train_step(runtime, optimizer, micro, grad_clip=1.0)), sum(p.numel() for p in params)


def peft_step(name: str, lora: LoRAConfig, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, int]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(build_model(preset(name)), LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=[PEFT_NAMES[t] for t in lora.targets]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    x, y = batch

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return step, sum(p.numel() for p in params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lora = LoRAConfig(r=args.r, alpha=2.0 * args.r)
    rows = []
    for name in args.models:
        batch = _batch(preset(name).vocab_size, args.batch, args.seq_len)
        (ours, trained), (theirs, peft_trained) = shoal_step(name, lora, batch), peft_step(name, lora, batch)
        full, _ = shoal_step(name, None, batch)
        times = measure_pair({"shoal": ours, "peft": theirs, "full": full}, warmup=3, repeats=args.repeats)
        t = {k: v["time_s"] for k, v in times.items()}
        rows.append({"model": name, "r": args.r, "trainable": trained, "peft_trainable": peft_trained,
                     "shoal_ms": t["shoal"]["median"] * 1e3, "peft_ms": t["peft"]["median"] * 1e3,
                     "full_ms": t["full"]["median"] * 1e3, "ratio": t["shoal"]["median"] / t["peft"]["median"],
                     "spread_shoal": t["shoal"]["iqr_rel"], "spread_peft": t["peft"]["iqr_rel"],
                     "lora/full": t["shoal"]["median"] / t["full"]["median"]})
    report("lora_step", rows, notes="ratio: shoal / peft median step time (one CPU thread, the same module and "
           "adapters); spreads: inter-quartile range over the median; lora/full: shoal's LoRA step over its full "
           "fine-tune's")


if __name__ == "__main__":
    main()
