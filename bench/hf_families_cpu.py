"""CPU step time of each Hugging Face family: shoal's one-process model (`shoal.from_hf`) against
transformers' own model of the same config and weights, forward + backward of the causal LM loss
in float32, dropout off. The two run interleaved repeat by repeat; medians over repeats with the
spread (a ratio inside the spread is noise).

    python -m bench.hf_families_cpu [--dim 256] [--layers 4] [--seq 256] [--batch 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import shoal  # noqa: E402
from bench.common import measure_pair, report  # noqa: E402


def configs(dim: int, layers: int, seq: int) -> dict[str, transformers.PretrainedConfig]:
    llama = dict(hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers, num_attention_heads=dim // 32,
                 num_key_value_heads=dim // 64, vocab_size=8192, max_position_embeddings=2 * seq)
    moe = dict(llama, intermediate_size=dim, num_experts_per_tok=2)
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": seq // 2}
    return {
        "llama3": transformers.LlamaConfig(**llama, rope_parameters=rope),
        "mistral": transformers.MistralConfig(**llama, sliding_window=seq // 4),
        "qwen2": transformers.Qwen2Config(**llama),
        "qwen3": transformers.Qwen3Config(**llama, head_dim=64),
        "mixtral": transformers.MixtralConfig(**moe, num_local_experts=8),
        "qwen2_moe": transformers.Qwen2MoeConfig(**moe, num_experts=8, moe_intermediate_size=dim,
                                                 shared_expert_intermediate_size=2 * dim),
        "gpt2": transformers.GPT2Config(n_embd=dim, n_layer=layers, n_head=dim // 32, vocab_size=8192,
                                        n_positions=2 * seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    }


def steps(hf_model: torch.nn.Module, model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Callable[[], None]]:
    def hf_step() -> None:
        hf_model.zero_grad(set_to_none=True)
        hf_model(tokens, labels=tokens).loss.backward()

    # As transformers' loss (and shoal's trainer, which is given them): the next tokens, the last
    # position's target ignored, so that the logits are not sliced (a copy of B x T x V floats).
    targets = torch.cat((tokens[:, 1:], torch.full_like(tokens[:, :1], -100)), dim=1)

    def shoal_step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()

    return {"transformers": hf_step, "shoal": shoal_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--families", default="")
    args = parser.parse_args()
    rows = []
    for name, config in configs(args.dim, args.layers, args.seq).items():
        if args.families and name not in args.families.split(","):
            continue
        torch.manual_seed(0)
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
        with tempfile.TemporaryDirectory() as folder:
            hf_model.save_pretrained(folder)
            model = shoal.from_hf(folder).train()
        tokens = torch.randint(0, 8192, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        result = measure_pair(steps(hf_model, model, tokens), warmup=2, repeats=args.repeats)
        hf_t, shoal_t = result["transformers"]["time_s"], result["shoal"]["time_s"]
        rows.append({"family": name, "transformers_s": hf_t["median"], "shoal_s": shoal_t["median"],
                     "shoal/transformers": shoal_t["median"] / hf_t["median"],
                     "spread": max(hf_t["iqr_rel"], shoal_t["iqr_rel"])})
    report("hf_families_cpu", rows, notes=f"forward+backward, fp32, batch {args.batch} x {args.seq} tokens, "
           f"dim {args.dim}, {args.layers} layers, {torch.get_num_threads()} threads; median of {args.repeats}")


if __name__ == "__main__":
    main()
