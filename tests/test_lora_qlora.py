"""A frozen low-bit base under low-rank adapters (QLoRA-style, `--lora base=nf4|int8`): the layer against the same
adapters on the dequantised base, the bytes it stores, its refusals, and parity with one process under dp, fsdp
and pp, and across a checkpoint.

Tolerances: one process against the dequantised base is exact (rtol=atol=0): both compute F.linear with the same
float32 weight (the quantised layer dequantises to exactly the tensor the reference holds) and the same adapters,
in the same order. The parallel runs use check_parity's yardsticks (shoal/testing/parity.py): the float32 run's own
distance from the float64 run of the same quantised model (whose layers dequantise to the same float32 weights,
then widened exactly to float64).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shoal.apply_plan import parallelize
from shoal.models import build_model
from shoal.models.lora import LoRALinear, apply_lora, is_adapter
from shoal.models.lora_config import LoRAConfig, base_bytes, check_plan
from shoal.testing.parity import SMALL, ParityCase, check_parity, references, run_parallel

NF4 = LoRAConfig(r=4, alpha=8.0, init_b_std=0.02, base="nf4")
INT8 = dataclasses.replace(NF4, base="int8")


def dequantised(w: torch.Tensor, base: str) -> torch.Tensor:
    """The reference's base: `w` quantised and dequantised with torchao directly (QLoRA's block of 64 weights per
    NF4 scale; one symmetric int8 scale per row), written out here apart from shoal.models.quantized_base."""
    if base == "nf4":
        from torchao.quantization import to_nf4

        return to_nf4(w, 64, min(256, w.numel() // 64)).get_original_weight()
    from torchao.quantization.quant_primitives import (
        MappingType,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )

    block = (1, w.shape[1])
    scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, eps=torch.finfo(w.dtype).eps,
                                       scale_dtype=torch.float32, zero_point_dtype=torch.int8)
    return dequantize_affine(quantize_affine(w, block, scale, zero, torch.int8), block, scale, zero, torch.int8)


def pair(lora: LoRAConfig) -> tuple[nn.Module, nn.Module]:
    """(the model with a quantised base, the same adapters on the dequantised base as plain float32 weights)."""
    torch.manual_seed(0)
    plain = apply_lora(build_model(SMALL), dataclasses.replace(lora, base="none"))
    for m in plain.modules():
        if isinstance(m, LoRALinear):
            with torch.no_grad():
                m.weight.copy_(dequantised(m.weight.detach().clone(), lora.base))
    torch.manual_seed(0)
    return apply_lora(build_model(SMALL), lora), plain


@pytest.mark.parametrize("lora", [NF4, INT8], ids=["nf4", "int8"])
def test_equals_the_same_adapters_on_the_dequantised_base(lora):
    """Logits, loss, every adapter's gradient and three AdamW steps' losses and adapters: exactly equal."""
    quant, plain = pair(lora)
    assert {n for n, p in quant.named_parameters() if p.requires_grad} == \
        {n for n, p in plain.named_parameters() if p.requires_grad}
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (quant, plain)]
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        seq = torch.randint(0, SMALL.vocab_size, (4, 17), generator=gen)
        losses = []
        for model, opt in zip((quant, plain), opts, strict=True):
            opt.zero_grad()
            logits = model(seq[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
            loss.backward()
            losses.append(loss)
            if step == 0:
                grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
                if model is quant:
                    first = grads
                else:
                    for n, g in grads.items():
                        torch.testing.assert_close(first[n], g, rtol=0, atol=0, msg=n)
            opt.step()
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    trained = dict(plain.named_parameters())
    for n, p in quant.named_parameters():
        torch.testing.assert_close(p, trained[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("lora", [NF4, INT8], ids=["nf4", "int8"])
def test_base_is_stored_low_bit_and_adapters_are_not(lora):
    """Every adapted layer holds its base in low-bit form (no float weight parameter left) of the bytes
    base_bytes counts; its adapters stay float32 parameters that train. Hand-computed for wq (64, 64): NF4 2048
    bytes of codes + 64 int8 scales + one float32 factor for the 64 scales (4) + their float32 mean (4) = 2120;
    int8 4096 codes + 64 rows x (float32 scale + int8 zero point) = 4416."""
    quant, plain = pair(lora)
    layer = quant.layers["0"].attention.wq
    assert isinstance(layer, LoRALinear) and layer.quantized is not None and "weight" not in layer._parameters
    assert layer.quantized.nbytes() == {"nf4": 2120, "int8": 4416}[lora.base] == base_bytes(64, 64, lora.base)
    for m in quant.modules():
        if isinstance(m, LoRALinear):
            assert m.quantized is not None and m.quantized.nbytes() == base_bytes(m.in_features, m.out_features,
                                                                                  lora.base)
            assert m.lora_A.dtype == m.lora_B.dtype == torch.float32 and m.lora_A.requires_grad
    floats = sum(p.numel() for n, p in plain.named_parameters() if n.endswith("weight") and not p.requires_grad)
    assert floats > sum(p.numel() for n, p in quant.named_parameters() if n.endswith("weight"))
    w = plain.layers["0"].attention.wq.weight
    torch.testing.assert_close(layer.base_weight(), w, rtol=0, atol=0)


@pytest.mark.parametrize(("text", "match"), [
    ("r=4,base=fp4", "base=fp4 is not valid; valid: none, nf4, int8"), ("r=4,base=", "base= is not valid"),
])
def test_bad_base_one_line(text, match):
    with pytest.raises(ValueError, match=match) as info:
        LoRAConfig.parse(text)
    assert "\n" not in str(info.value)


def test_base_round_trips_and_refusals_one_line():
    assert LoRAConfig.parse("r=8,base=nf4,targets=q,v") == LoRAConfig(r=8, base="nf4", targets=("q", "v"))
    assert LoRAConfig.parse(NF4.text()) == dataclasses.replace(NF4, init_b_std=0.0)
    assert "base" not in LoRAConfig(r=8).text()
    with pytest.raises(ValueError, match="base=nf4 under tp=2 is not available") as info:
        check_plan(NF4, tp=2, cp=1)
    assert "\n" not in str(info.value)
    check_plan(NF4, tp=1, cp=1)
    odd = SMALL.replace(dim=33, num_heads=4, num_kv_heads=4, head_size=8)  # wq (32, 33): 16.5 blocks of 64
    with pytest.raises(ValueError, match=r"base=nf4: attention.wq \(32, 33\) has 1056 weights") as info:
        apply_lora(build_model(odd), NF4)
    assert "\n" not in str(info.value)
    apply_lora(build_model(odd), INT8)


# ----------------------------------------------------------------------------- parity


@dataclasses.dataclass(frozen=True, kw_only=True)
class QLoRACase(ParityCase):
    """A parity case whose model carries adapters on a low-bit base: what every plan trains is the adapters.
    `meta`: built on the meta device, as `shoal train` builds (the base quantised once materialized, and left
    whole by FSDP2); the one-process references are then the same adapters on the dequantised base, built the same
    way (meta-built weights are drawn per name, not as a real-device build draws them)."""

    lora: LoRAConfig = NF4
    meta: bool = False

    def build_model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        torch.manual_seed(self.seed)
        if self.meta and dist.is_initialized():
            with torch.device("meta"):
                return apply_lora(build_model(self.model), self.lora, seed=self.seed)  # parallelize materializes it
        if self.meta:  # the reference: the same adapters on the dequantised base, as plain float weights
            with torch.device("meta"):
                model = apply_lora(build_model(self.model), dataclasses.replace(self.lora, base="none"), seed=self.seed)
            parallelize(model, seed=self.seed)
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    with torch.no_grad():
                        m.weight.copy_(dequantised(m.weight.detach().clone(), self.lora.base))
            return model.to(dtype)
        return apply_lora(build_model(self.model), self.lora, seed=self.seed).to(dtype)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return super().optimizer([p for p in params if p.requires_grad])


CASES = [QLoRACase(plan=p) for p in ("dp2", "fsdp2", "fsdp2,zero=2")] + [
    QLoRACase(plan="pp2,mb=2", num_micro=2), QLoRACase(plan="fsdp2", meta=True), QLoRACase(plan="dp2", meta=True),
    QLoRACase(plan="fsdp2", lora=INT8), QLoRACase(plan="pp2,mb=2", num_micro=2, lora=INT8, meta=True)]


def _run_cases(cases: list[QLoRACase]) -> list[dict[str, Any]]:
    return [run_parallel(c) for c in cases]


def test_parity_under_dp_fsdp_pp(pools):
    """dp2, fsdp2 (zero 3 and 2), pp2 with NF4, built on a real device and on the meta device (fsdp2, dp2); int8
    under fsdp2 and pp2: logits, every adapter's first-step gradient, the first step, the losses of every step and
    the final adapters against one process (check_parity)."""
    results = pools(2).run(_run_cases, CASES)
    failed: list[str] = []
    for i, c in enumerate(CASES):
        rank_results = [r[i] for r in results]
        assert all(is_adapter(n) for res in rank_results for n in res["grads"]), c
        try:
            check_parity(rank_results, c)
        except AssertionError as e:
            failed.append(f"{c.plan} {c.lora.base} meta={c.meta}: {str(e)[:200]}")
    assert not failed, "\n".join(failed)


MOE = SMALL.replace(num_experts=4, top_k=2, ffn_dim=64)
SPLIT = [QLoRACase(plan="cp2"), QLoRACase(plan="cp2,cp_mode=a2a", lora=INT8),
         QLoRACase(plan="ep2", model=MOE, lora=dataclasses.replace(NF4, targets=("q", "k", "v", "o")), steps=3,
                   meta=True)]
COMPILED = [QLoRACase(plan="dp2,compile=on", steps=2), QLoRACase(plan="fsdp2,compile=on", steps=2, lora=INT8,
                                                                  meta=True)]


def _check_cases(results: list[list[dict[str, Any]]], cases: list[QLoRACase]) -> None:
    failed: list[str] = []
    for i, c in enumerate(cases):
        try:
            check_parity([r[i] for r in results], c)
        except AssertionError as e:
            failed.append(f"{c.plan} {c.lora.base} meta={c.meta}: {str(e)[:200]}")
    assert not failed, "\n".join(failed)


def test_parity_under_cp_and_ep(pools):
    """cp2 (ring with NF4, all-to-all with int8) and ep2 (an MoE model built on the meta device, NF4 attention
    projections beside the frozen experts): the same checks as above."""
    _check_cases(pools(2).run(_run_cases, SPLIT), SPLIT)


def test_parity_compiled(pools):
    """compile=on under dp2 (NF4) and a meta-built fsdp2 (int8): the same checks as above."""
    _check_cases(pools(2).run(_run_cases, COMPILED), COMPILED)


def test_checkpoint_requantizes_the_base_on_resume(pools, tmp_path):
    """Steps 0-1 under fsdp2 (meta-built), 2-3 under dp2, 4 in one process, each resumed from the last one's
    checkpoint, which holds the adapters only: the base quantised again from its source gives the losses and
    gradient norms of an unbroken single-process run."""
    from torch.distributed.checkpoint import FileSystemReader

    from shoal.testing.asserts import assert_rounding_close
    from shoal.testing.parity import assert_trained_close, train_segments
    from shoal.train.checkpoint import latest_checkpoint

    run = QLoRACase(steps=5, meta=True)
    ref32, ref64 = references(run)
    segments = (("fsdp2", 0, 2), ("dp2", 2, 4), ("single", 4, 5))
    for plan_text, start, end, results in train_segments(pools, run, str(tmp_path), segments):
        for rank, res in enumerate(results):
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{plan_text} rank {rank} losses of steps {start}..{end - 1}")
        saved = FileSystemReader(str(latest_checkpoint(tmp_path))).read_metadata().state_dict_metadata
        models = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
        assert models and all(is_adapter(k) for k in models), [k for k in models if not is_adapter(k)][:3]
    assert_trained_close(results[0]["params"], ref32, ref64)


@pytest.mark.parametrize("lora", [NF4, INT8], ids=["nf4", "int8"])
def test_backward_keeps_the_low_bit_weight_not_its_float_copy(lora):
    """Between forward and backward autograd holds no float (out, in) weight of a low-bit layer (it dequantises
    again in backward), and the input's gradient is the dequantised base's (exact, as above)."""
    quant, plain = pair(lora)
    layer, ref = quant.layers["0"].feed_forward.w1, plain.layers["0"].feed_forward.w1
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    assert not {(layer.out_features, layer.in_features), (layer.in_features, layer.out_features)} & set(saved), saved
    out.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("plan_text", ["fsdp8", "dp8"])
def test_planner_prices_the_base_at_its_low_bit_bytes(plan_text):
    """`shoal plan` for llama3-8b QLoRA r=16 nf4: the parameters term trades the adapted projections' fp32 bytes
    (sharded as the plan shards parameters) for their NF4 bytes, whole on every rank; gradients and optimizer state
    are unchanged. Hand count per block: q, o (4096, 4096), k, v (1024, 4096), gate, up, down (14336, 4096): 218.1M
    weights; NF4 stores 1/2 byte each + an int8 scale per 64 + a float32 factor per 256 scales + a float32 mean."""
    from shoal import rules
    from shoal.models.config import get_preset
    from shoal.plan import Plan
    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.estimate import Workload, estimate

    cfg = get_preset("llama3-8b")
    cluster = parse_cluster("8xH100")
    plan = rules.resolve(Plan.parse(plan_text + ",precision=fp32"), world_size=8, device="cuda")
    work = Workload(model=cfg, global_batch=64, seq_len=2048, lora=LoRAConfig(r=16))
    plain = estimate(plan, work, cluster)
    quant = estimate(plan, dataclasses.replace(work, lora=LoRAConfig(r=16, base="nf4")), cluster)
    shapes = [(4096, 4096)] * 2 + [(4096, 1024)] * 2 + [(4096, 14336)] * 3
    weights = sum(i * o for i, o in shapes)
    assert weights == 218_103_808
    nf4 = sum(i * o / 2 + i * o / 64 + 4 * i * o / 64 / 256 + 4 for i, o in shapes)
    layers = cfg.num_layers
    shards = 8 if plan.fsdp > 1 and plan.zero >= 3 else 1
    want = plain.memory["parameters"] - layers * (4 * weights / shards - nf4)
    assert quant.memory["parameters"] == pytest.approx(want, rel=1e-9)
    assert quant.memory["optimizer"] == plain.memory["optimizer"]


SMALL_RUN = ["--device", "cpu", "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch",
             "4", "--seq-len", "16", "--eval-batches", "1", "--eval-every", "0"]


@pytest.mark.parametrize(("argv", "names"), [
    (["--lora", "r=4,base=fp4"], ["--lora base=fp4", "none, nf4, int8"]),
    (["--lora", "r=4,base=nf4", "--plan", "tp2"], ["--lora base=nf4 under tp=2", "dp, fsdp, pp"]),
])
def test_bad_base_flags_one_line(capsys, tmp_path, argv, names):
    from shoal.testing.asserts import assert_user_error

    assert_user_error(capsys, ["train", "--out", str(tmp_path / "run"), *SMALL_RUN, *argv], *names)
    assert not (tmp_path / "run").exists()


def test_train_and_resume_with_an_nf4_base(tmp_path):
    """`shoal train --lora r=4,base=nf4` (one process): 2 steps, then --resume to 3; the resumed run quantises its
    base again from the seed and its third loss equals an unbroken 3-step run's (exactly: the same arithmetic)."""
    import json

    from shoal import cli

    def losses(run, steps):
        assert cli.main(["train", "--out", str(run), "--steps", str(steps), "--nproc", "1", "--lora", "r=4,base=nf4",
                         "--ckpt-every", "2", "--decay-steps", "3", *SMALL_RUN]) == 0
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    whole = losses(tmp_path / "whole", 3)
    losses(tmp_path / "parts", 2)
    assert cli.main(["train", "--resume", str(tmp_path / "parts"), "--steps", "3"]) == 0
    resumed = [json.loads(line)["loss"] for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    assert len(whole) == 3 and resumed[-1] == whole[-1], (whole, resumed)
    assert cli.main(["sample", "--run", str(tmp_path / "parts"), "--prompt", "def", "--max-new-tokens", "4"]) == 0
