"""Activation memory per layer under recompute none / selective / full vs Korthikanti et al. 2022.

The paper ("Reducing Activation Recomputation in Large Transformer Models", section 4) counts the
bytes a GPT layer keeps for backward with 16-bit activations and 1-byte dropout masks:
sbh(34 + 5as/h) with no recompute (5as/h: attention scores, softmax, its dropout), 34sbh with
selective recompute (attention core recomputed), 2sbh with full recompute (the layer input).
s sequence, b batch, h hidden size, a heads.

This run differs in three ways, so the table also gives the formula adapted to it:
- float32 activations: every value term doubles;
- no dropout (the parity setting): the masks (2sbh + as^2b bytes) and the attention-dropout output
  (2as^2b) are not there: 16-bit none = 32sbh + 2as^2b, selective = 32sbh;
- PyTorch's fused CPU attention ("flash", the default) never stores the scores either: none = 32sbh.
So, in float32: none 64sbh (+4as^2b with the math attention kernel), selective 64sbh, full 4sbh.
shoal's selective keeps only matmul and attention outputs and also recomputes norms and GELU,
so it should land *below* the paper's selective figure.

Measured: bytes the forward keeps alive for backward (shoal.parallel.recompute.kept_activation_bytes,
exact tensor bytes), per layer = (kept at 4 layers - kept at 2 layers) / 2, which cancels the
embedding, final norm and logits. Single process; the GPT-style preset (LayerNorm, GELU, 4h MLP,
the paper's architecture).

    python -m bench.activation_memory [--seq-len 128] [--batch 4]
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import report
from shoal.models import Transformer, get_preset
from shoal.parallel.recompute import apply_recompute, kept_activation_bytes
from shoal.plan import Plan


def paper_bytes(ac: str, *, s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022, per layer, 16-bit activations with dropout."""
    return {"none": s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h, "full": 2 * s * b * h}[ac]


def adapted_bytes(ac: str, kernel: str, *, s: int, b: int, h: int, a: int) -> float:
    """The same count for float32 activations, no dropout, and the given attention kernel."""
    scores = 4 * a * s * s * b if (ac == "none" and kernel == "math") else 0
    return {"none": 64 * s * b * h + scores, "selective": 64 * s * b * h, "full": 4 * s * b * h}[ac]


def kept_per_layer(ac: str, kernel: str, *, seq_len: int, batch: int) -> float:
    kept = {}
    for layers in (2, 4):
        cfg = get_preset("tiny-gpt").replace(num_layers=layers, max_seq_len=seq_len, dropout=0.0)
        torch.manual_seed(0)
        model = apply_recompute(Transformer(cfg), plan=Plan.parse(f"dp1,ac={ac}"))
        x = torch.randint(0, cfg.vocab_size, (batch, seq_len))
        backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel(backend):
            # The lambda runs within this iteration, on this iteration's model and x.
            kept[layers], logits = kept_activation_bytes(lambda: model(x))  # noqa: B023
            logits.float().sum().backward()  # recompute must also run (and fit) in backward
    return (kept[4] - kept[2]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = get_preset("tiny-gpt")
    dims = dict(s=args.seq_len, b=args.batch, h=cfg.dim, a=cfg.num_heads)
    sbh = args.seq_len * args.batch * cfg.dim
    rows = []
    for kernel in ("flash", "math"):
        for ac in ("none", "selective", "full"):
            measured = kept_per_layer(ac, kernel, seq_len=args.seq_len, batch=args.batch)
            adapted = adapted_bytes(ac, kernel, **dims)
            rows.append({"attention": kernel, "ac": ac, "measured_kib": measured / 1024, "measured_sbh": measured / sbh,
                         "paper16_kib": paper_bytes(ac, **dims) / 1024, "adapted_kib": adapted / 1024,
                         "measured/adapted": measured / adapted})
    report("activation_memory", rows, notes=(
        f"per layer, tiny-gpt (h={cfg.dim}, a={cfg.num_heads}, 4h GELU MLP, LayerNorm), s={args.seq_len}, "
        f"b={args.batch}, fp32, no dropout; paper16 = sbh(34+5as/h) / 34sbh / 2sbh (16-bit, with dropout); "
        "adapted = fp32, no dropout, per kernel (see the module docstring); measured_sbh = bytes / sbh"))


if __name__ == "__main__":
    main()
