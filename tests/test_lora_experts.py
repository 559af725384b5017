"""Low-rank adapters on Mixture-of-Experts experts' matrices (shoal.models.lora.LoRAExperts): the layer against a
per-expert formula written out here, its three compute paths, the counts, the refusals, and parity with one
process under ep, tp and fsdp.

Tolerances: the formula check evaluates one float64 sum in two orders (1e-12 relative is far above their roundings
and far below any missing term: a missing adapter changes the output by ~scale |B A x|, here ~1e-3 of it). The
paths agree to float64 rounding likewise. The parallel runs use check_parity's yardsticks
(shoal/testing/parity.py): the float32 run's own distance from the float64 run.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.models import build_model
from shoal.models.lora import LoRAExperts, apply_lora, is_adapter, merged_state, trainable_share
from shoal.models.lora_config import LoRAConfig, adapted_params, adapter_elements_per_rank, adapter_params
from shoal.testing.parity import HF_FAMILIES, SMALL, ParityCase, check_parity, run_parallel
from test_lora import exported_logits_agree

LORA = LoRAConfig(r=4, alpha=8.0, init_b_std=0.02)
MOE = SMALL.replace(num_experts=4, top_k=2, ffn_dim=64)
SHARED = HF_FAMILIES["qwen2_moe"]
"""Routed experts and a gated shared expert (Qwen2-MoE's shape): both adapted."""


def lora_model(cfg: Any = MOE, lora: LoRAConfig = LORA, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return apply_lora(build_model(cfg).to(dtype), lora)


def test_experts_are_their_formula_on_every_path():
    """Each expert e computes w2_e(silu(w1_e x) * w3_e x) with every matrix m_e replaced by m_e + scale B_e A_e:
    written out here per expert, against the loop and padded paths (and the grouped kernel where torch has one)."""
    experts = lora_model().layers["0"].feed_forward.experts
    assert isinstance(experts, LoRAExperts) and experts.matrices == ("w1", "w2", "w3")
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, MOE.dim, dtype=torch.float64)  # 10 rows in groups, 2 past them

    def matrix(m: str, e: int) -> torch.Tensor:
        return getattr(experts, m)[e] + experts.scale * getattr(experts, f"{m}_lora_B")[e] @ \
            getattr(experts, f"{m}_lora_A")[e]

    rows = []
    for e, x_e in enumerate(x[:10].split(counts.tolist())):
        rows.append(F.silu(x_e @ matrix("w1", e).T) * (x_e @ matrix("w3", e).T) @ matrix("w2", e).T)
    want = torch.cat([*rows, torch.zeros(2, MOE.dim, dtype=torch.float64)])
    for path in ("loop", "padded"):
        experts.path = path
        torch.testing.assert_close(experts(x, counts), want, rtol=1e-12, atol=1e-12, msg=path)
    from shoal.moe.experts import _grouped_mm

    if _grouped_mm is not None:  # float32 rows 16-byte aligned: D 64, F 64, r 4 -> 16 bytes
        experts32 = lora_model(dtype=torch.float32).layers["0"].feed_forward.experts
        experts32.path = "loop"
        loop = experts32(x.float(), counts)
        experts32.path = "grouped"
        try:
            grouped = experts32(x.float(), counts)
        except RuntimeError as exc:  # a CPU build whose grouped kernel takes no float32
            pytest.skip(f"grouped_mm on CPU: {exc}")
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_counts_and_frozen_experts():
    """Trainable parameters are the adapters alone, as adapter_params counts them: r 4 x (in + out), per block
    attention q, o (64 + 64), k, v (64 + 32) and 4 experts x 3 matrices (64 + 64): 2 x 4 x (448 + 1536) = 15872;
    they adapt 2 x (12288 + 4 x 3 x 64 x 64) = 122880 weights."""
    model = lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert "layers.0.feed_forward.experts.w2_lora_A" in trainable
    assert trainable_share(model)[0] == adapter_params(MOE, LORA) == 15872
    assert adapted_params(MOE, LORA) == 122880
    shared = lora_model(SHARED)
    assert isinstance(shared.layers["0"].feed_forward.shared, LoRAExperts)
    assert trainable_share(shared)[0] == adapter_params(SHARED, LORA)


def test_adapters_per_rank_under_ep_and_tp():
    """An expert's adapters split over ep by expert, over tp as its matrix: w1/w3's B (E, F/tp, r) beside A, w2's A
    (E, r, F/tp) beside B. MOE at tp2, ep2, r 4, per block: attention q, o (64 + 32), k, v (64 + 16): 4 x 352 =
    1408; 2 experts x 3 matrices x 4 x (64 + 32) = 2304; two blocks 7424."""
    assert adapter_elements_per_rank(MOE, LORA, tp=2, layers=2, ep=2) == 7424


def test_adapter_flops_count_the_experts_a_token_passes():
    """Forward FLOPs per token of MOE's adapters: 2 r (in + out) per matrix a token passes, the routed experts'
    top-k (2 of 4) times: per block attention 8 x (128 + 96 + 96 + 128) = 3584 and 2 x 3 x 8 x 128 = 6144; two
    blocks 19456."""
    from shoal.planner.compute import adapter_flops

    assert adapter_flops(MOE, LORA) == 19456


def test_merged_experts_equal_the_adapted_model():
    """merged_state folds scale B_e A_e into each expert's matrix: a model without adapters loading it gives the
    adapted model's logits (float64: 1e-10)."""
    model = lora_model()
    tokens = torch.randint(0, MOE.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = build_model(MOE).double()
    plain.load_state_dict(merged_state(model))
    torch.testing.assert_close(plain(tokens), model(tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("change", "words"), [
    ({"dropout": 0.1}, "with dropout=0.1"), ({"base": "nf4"}, "with base=nf4"),
])
def test_expert_refusals_one_line(change, words):
    with pytest.raises(ValueError, match=words) as info:
        lora_model(lora=dataclasses.replace(LORA, **change))
    assert "\n" not in str(info.value) and "q,k,v,o" in str(info.value)
    lora_model(lora=dataclasses.replace(LORA, **change, targets=("q", "k", "v", "o")))  # attention only: fine
    with pytest.raises(ValueError, match="with share_moe"):
        lora_model(MOE.replace(share_moe=True))


# ----------------------------------------------------------------------------- parity


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertCase(ParityCase):
    """A parity case whose MoE model carries adapters on attention and every expert's matrices."""

    lora: LoRAConfig = LORA
    meta: bool = False
    """Built on the meta device, as `shoal train` builds (parallelize materializes each rank's shards from the seed
    and each parameter's name); the reference is built so too, then materialized whole in one process."""

    def build_model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        torch.manual_seed(self.seed)
        if not self.meta:
            return apply_lora(build_model(self.model).to(dtype), self.lora, seed=self.seed)
        import torch.distributed as dist

        from shoal.apply_plan import parallelize

        with torch.device("meta"):
            model = apply_lora(build_model(self.model), self.lora, seed=self.seed)
        if dist.is_initialized():
            return model  # parallelize materializes it
        parallelize(model, seed=self.seed)
        return model.to(dtype)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return super().optimizer([p for p in params if p.requires_grad])


TWO = [ExpertCase(plan=p, model=MOE, steps=3) for p in ("ep2", "tp2", "fsdp2", "fsdp2,ep2")] + [
    ExpertCase(plan="tp2", model=SHARED, steps=3)] + [
    ExpertCase(plan=p, model=MOE, steps=3, meta=True) for p in ("ep2", "tp2,sp=off")]
FOUR = [ExpertCase(plan=p, model=MOE, steps=3) for p in ("fsdp4,ep2", "tp2,ep2")]


def _run(cases: list[ExpertCase]) -> list[dict[str, Any]]:
    return [run_parallel(c) for c in cases]


def _check(results: list[list[dict[str, Any]]], cases: list[ExpertCase]) -> None:
    failed = []
    for i, c in enumerate(cases):
        rank_results = [r[i] for r in results]
        names = {n for res in rank_results for n in res["grads"]}
        assert all(is_adapter(n) for n in names) and any("experts.w2_lora_A" in n for n in names), c.plan
        try:
            check_parity(rank_results, c)
        except AssertionError as exc:
            failed.append(f"{c.plan} {c.model.num_shared_experts} shared: {str(exc)[:300]}")
    assert not failed, "\n".join(failed)


def test_parity_two_processes(pools):
    """ep2 (each rank its two experts' adapters), tp2 (each expert's adapters split as its matrices, the whole
    factors' gradients summed over tp), fsdp2 (the adapters sharded like any parameter), fsdp2,ep2; tp2 with a
    gated shared expert; ep2 and tp2 without sequence parallelism on a meta-built model (as shoal train builds):
    logits, every adapter's first-step gradient, the first step, three steps' losses and the final adapters against
    one process (check_parity)."""
    _check(pools(2).run(_run, TWO), TWO)


def test_parity_four_processes(pools):
    """fsdp4,ep2 (two replicas of each expert: the adapters whole on each, their gradients summed over them) and
    tp2,ep2."""
    _check(pools(4).run(_run, FOUR), FOUR)


# ----------------------------------------------------------------------------- peft and transformers


def _hf_moe(folder: Any, family: str) -> Any:
    """A tiny Mixtral or Qwen3-MoE made here, dropless top-2 of 4."""
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=300.0, tie_word_embeddings=False,
                  num_experts_per_tok=2)
    if family == "mixtral":
        model: Any = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=48, num_local_experts=4))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=80, moe_intermediate_size=48, num_experts=4,
            norm_topk_prob=True))
    torch.manual_seed(1)
    model.apply(model._init_weights)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.mark.parametrize(("family", "targets"), [("mixtral", "q,k,v,o,gate,up,down"), ("qwen3_moe", "up,down")])
def test_peft_loads_the_exported_expert_adapters(tmp_path, family, targets):
    """A tiny Hugging Face MoE made here, 3 steps of `shoal train --init it --lora ...` (lr high enough that the
    adapters move the logits), `shoal export --lora-adapter DIR`: peft's PeftModel.from_pretrained(base, DIR), its
    experts' adapters on transformers' fused gate_up_proj and down_proj (target_parameters), gives the logits of
    shoal's model with the same adapters; `shoal export --hf` of the run loads in transformers alone with the same
    logits. Tolerance rtol = atol = 1e-5 in float32, as for the dense families' adapters (the same numbers in
    another order: the fused gate_up product, peft's folded B A per expert), far below the adapters' own effect,
    checked to be over 1e-3. Qwen3-MoE with up and down only: gate_up_proj's adapter is rank r, gate's rows of B
    zero."""
    import json

    from shoal import cli

    base = _hf_moe(tmp_path / "base", family)
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    settings = f"r=4,alpha=8,targets={targets}"
    assert cli.main(["train", "--init", str(base), "--lora", settings, "--out", str(run), "--steps", "3", "--lr",
                     "0.05", "--warmup-steps", "0", "--device", "cpu", "--nproc", "1", "--global-batch", "4",
                     "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1"]) == 0
    assert cli.main(["export", "--run", str(run), "--lora-adapter", str(adapter)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    both = "gate" in targets
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["rank_pattern"] == ({"mlp.experts.gate_up_proj": 8} if both else {})

    tokens, peft_logits = exported_logits_agree(base, run, adapter, settings, tmp_path / "merged")

    # `shoal train --init ADAPTER`: gate_up_proj's adapter is gate's and up's at its rank (8 with both, the other
    # targets padded to it; 4 with up alone, gate's B zero), the scale 2 kept: peft's logits again.
    lora = _init_logits_equal_peft(adapter, base, tokens, peft_logits)
    assert (lora.r, lora.scale, set(lora.targets)) == (8 if both else 4, 2.0, {*targets.split(","), "gate"})
    _continue_one_step(adapter, base, tmp_path / "again")


def _init_logits_equal_peft(adapter: Any, base: Any, tokens: torch.Tensor, peft_logits: torch.Tensor) -> LoRAConfig:
    """shoal's model as `--init ADAPTER` builds it (the folder's settings, its adapters read back onto the base) gives
    peft's logits within the export's 1e-5 float32 bound (the same products in another order); its settings."""
    from shoal.models.hf.families import config_from_hf
    from shoal.models.hf_folder import from_hf
    from shoal.train.peft_io import read_peft_adapters, read_peft_config

    lora, _ = read_peft_config(adapter)
    model = apply_lora(from_hf(base), lora)
    keys = model.load_state_dict(read_peft_adapters(adapter, config_from_hf(base)), strict=False)
    assert not keys.unexpected_keys and not [k for k in keys.missing_keys if is_adapter(k)]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), peft_logits, rtol=1e-5, atol=1e-5)
    return lora


def _continue_one_step(adapter: Any, base: Any, out: Any) -> None:
    """One step of `shoal train --init ADAPTER` at lr 1e-9 (AdamW moves an entry by at most ~1e-9): the checkpoint's
    adapters are the folder's read back, within 1e-7."""
    from shoal import cli
    from shoal.models.hf.families import config_from_hf
    from shoal.train.checkpoint import latest_checkpoint
    from shoal.train.peft_io import checkpoint_adapters, read_peft_adapters

    assert cli.main(["train", "--init", str(adapter), "--out", str(out), "--steps", "1", "--lr", "1e-9",
                     "--warmup-steps", "0", "--device", "cpu", "--nproc", "1", "--global-batch", "4", "--seq-len",
                     "16", "--eval-every", "0", "--eval-batches", "1"]) == 0
    want, got = read_peft_adapters(adapter, config_from_hf(base)), checkpoint_adapters(latest_checkpoint(out))
    assert set(want) == set(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-7)


def test_init_of_an_adapter_peft_made_on_experts(tmp_path):
    """A peft folder made by peft itself: get_peft_model on a tiny Mixtral with target_modules q_proj, v_proj and
    target_parameters the experts' gate_up_proj and down_proj, r 4, every B drawn non-zero (std 0.05, so the
    adapters move the logits by over 1e-3): `--init` of it gives peft's logits within 1e-5, and one step runs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = _hf_moe(tmp_path / "base", "mixtral")
    hf_base = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = hf_base.eval()(tokens).logits
    peft_model = get_peft_model(hf_base, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
        peft_logits = peft_model.eval()(tokens).logits
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))
    assert (peft_logits - base_logits).abs().max() > 1e-3
    lora = _init_logits_equal_peft(adapter, base, tokens, peft_logits)
    assert (lora.r, lora.scale, lora.targets) == (4, 2.0, ("q", "v", "gate", "up", "down"))
    _continue_one_step(adapter, base, tmp_path / "again")


@pytest.mark.parametrize(("family", "words"), [("qwen2_moe", "experts of a qwen2_moe model"),
                                               ("qwen3_moe", "dense MLP blocks (down_proj,gate_proj,up_proj)")])
def test_expert_adapters_peft_cannot_name_refused_one_line(family, words):
    """Qwen2-MoE's shared expert is a dense MLP in transformers (DeepSeek-V3's likewise), which shoal stacks as one
    more Experts module: not mapped. A Qwen3-MoE with dense blocks (mlp_only_layers): peft on transformers 5 reads
    target_modules gate_proj, up_proj, down_proj of this family as the experts' fused parameters, so a dense
    block's adapters cannot be named. Both refused in one line."""
    from shoal.train.peft_io import peft_state

    cfg = HF_FAMILIES[family]
    model = lora_model(cfg, dtype=torch.float32)
    adapters = {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        peft_state(adapters, cfg, LORA)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("change", "words"), [
    ({"rank_pattern": {"mlp.experts.gate_up_proj": 8}}, "scales lora_alpha / r differ"),
    ({"target_parameters": ["mlp.experts.w1"]}, "target parameters mlp.experts.w1"),
    ({"rank_pattern": {"q_proj": 8}}, "per-module ranks or target parameters q_proj")])
def test_init_of_expert_adapter_folders_shoal_cannot_hold_refused_one_line(tmp_path, change, words):
    """`shoal train --init DIR` of a peft folder whose targets' scales alpha / r differ (shoal's run has one), or
    whose parameters or per-module ranks are not the experts' gate_up_proj and down_proj: refused in one line.
    Different ranks at one scale read back (the lower padded)."""
    import json

    from shoal.train.peft_io import read_peft_config

    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            "base_model_name_or_path": str(tmp_path)}
    (tmp_path / "adapter_config.json").write_text(json.dumps({**good, **change}))
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        read_peft_config(tmp_path)
    assert "\n" not in str(info.value)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {**good, "rank_pattern": {"mlp.experts.gate_up_proj": 8}, "alpha_pattern": {"mlp.experts.gate_up_proj": 16}}))
    lora, _ = read_peft_config(tmp_path)
    assert (lora.r, lora.alpha, lora.targets) == (8, 16.0, ("q", "gate", "up", "down"))
