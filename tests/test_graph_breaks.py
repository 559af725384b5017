"""compile=on traces every dense model shoal trains into one graph: no graph break in the dense presets or the
dense Hugging Face families, whole (one process compiles the whole model) or block by block under selective
recompute (every other plan compiles each block). A graph break splits a compiled region in two, each a launch
and a round trip through Python, which is what a small model's GPU step is made of.

torch._dynamo.explain traces without compiling (no inductor), so the check is cheap and sees exactly what
torch.compile's tracer sees. The MoE layer and context parallelism break graphs on purpose; docs/plans.md
("compile") lists those breaks and why.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch._dynamo

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: pyproject [dev])

from shoal import rules  # noqa: E402
from shoal.models import Transformer  # noqa: E402
from shoal.models.config import PRESETS, ModelConfig  # noqa: E402
from shoal.models.hf.families import config_from_hf  # noqa: E402
from shoal.parallel.recompute import apply_recompute  # noqa: E402
from shoal.plan import Plan  # noqa: E402

SMALL_SHAPE = dict(num_layers=2, dim=64, num_heads=4, ffn_dim=128, vocab_size=128)
"""Every dense preset at this size: what is traced is the code, which the size does not change."""
_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64, rope_theta=500.0)
HF_DENSE = {
    "llama": (transformers.LlamaConfig, _LLAMA),
    "llama3": (transformers.LlamaConfig, dict(_LLAMA, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "yarn": (transformers.LlamaConfig, dict(_LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 16})),
    "dynamic": (transformers.LlamaConfig, dict(_LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "mistral": (transformers.MistralConfig, dict(_LLAMA, sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, dict(_LLAMA, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(_LLAMA, head_dim=32)),
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)),
}
SEQ = 32  # past mistral's sliding window (8): the banded mask traced


def _dense_presets() -> dict[str, ModelConfig]:
    return {name: cfg.replace(**{k: v for k, v in SMALL_SHAPE.items() if k != "num_kv_heads"},
                              num_kv_heads=min(cfg.num_kv_heads or 4, 4))
            for name, cfg in PRESETS.items() if not cfg.num_experts}


def _breaks(fn, *args) -> list[str]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    return [str(b.reason).splitlines()[0] for b in explained.break_reasons]


def _check_whole_and_blocks(cfg: ModelConfig) -> None:
    torch.manual_seed(0)
    model = Transformer(cfg).train()  # dropout's branches as training runs them
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ))
    assert _breaks(model, tokens) == []
    recomputed = apply_recompute(Transformer(cfg).train(), plan=rules.resolve(Plan.parse("dp2,ac=selective"),
                                                                              world_size=2))
    hidden = recomputed.tok_embeddings(tokens)
    block = next(iter(recomputed.layers.values()))
    assert _breaks(block, hidden) == []


@pytest.mark.parametrize("name", sorted(_dense_presets()))
def test_dense_preset_traces_without_a_graph_break(name):
    _check_whole_and_blocks(_dense_presets()[name])


@pytest.mark.parametrize("name", sorted(HF_DENSE))
def test_dense_hf_family_traces_without_a_graph_break(name, tmp_path):
    config_cls, fields = HF_DENSE[name]
    (tmp_path / "config.json").write_text(json.dumps(config_cls(**fields).to_dict()))
    _check_whole_and_blocks(config_from_hf(tmp_path))


def test_a_graph_break_is_seen():
    """The check itself: a model that reads a tensor's value on the host breaks its graph, and is reported."""
    model = Transformer(_dense_presets()["tiny"])
    tokens = torch.randint(0, 128, (2, SEQ))

    def forward_with_a_host_read(x: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return logits * float(logits.sum().item() > 0)

    assert len(_breaks(forward_with_a_host_read, tokens)) == 1
