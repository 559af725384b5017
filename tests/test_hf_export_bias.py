"""A router's selection bias through `shoal export --hf`: a DeepSeek-V3 run whose bias training moved
(router_bias_rate > 0) exports it as transformers' `e_score_correction_bias`, so `from_pretrained` gives
shoal's logits; a family whose transformers model has no such bias (Mixtral, Qwen3-MoE) takes a model
with router_bias on only while the bias is zero everywhere (the same routing as none) and refuses a moved
one in one line, from a checkpoint and from a live model alike.

Tolerance: the written bias is the checkpoint's, copied: equal bitwise. Logits: rtol = atol = 1e-5, as
tests/test_hf_families.py derives (the same float32 arithmetic in another order, measured ~5e-7).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from shoal import cli  # noqa: E402
from shoal.apply_plan import parallelize  # noqa: E402
from shoal.models import ModelConfig, Transformer  # noqa: E402
from shoal.models.hf.families import load_model_config  # noqa: E402
from shoal.testing.asserts import one_line_error  # noqa: E402
from shoal.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from shoal.train.export import export_checkpoint, export_model  # noqa: E402
from test_hf_families import FAMILIES  # noqa: E402

LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring
BIAS_RATE = 0.01


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(4))


def test_export_of_a_trained_deepseek_v3_run_writes_its_bias(tmp_path):
    """Three steps of `shoal train` move the bias (by +-rate each step); the export writes those values."""
    config_cls, fields = FAMILIES["deepseek_v3"]
    source = tmp_path / "source"
    transformers.AutoModelForCausalLM.from_config(config_cls(**dict(fields, vocab_size=256))).save_pretrained(
        str(source))  # the byte tokenizer's 256 ids
    run = tmp_path / "run"
    assert cli.main(["train", "--model", f"hf:{source}", "--out", str(run), "--device", "cpu", "--nproc", "1",
                     "--steps", "3", "--global-batch", "4", "--seq-len", "32", "--set",
                     f"router_bias_rate={BIAS_RATE}", "--eval-every", "0", "--ckpt-every", "3"]) == 0
    out = tmp_path / "hf"
    assert cli.main(["export", "--run", str(run), "--out", str(out), "--hf"]) == 0

    model = Transformer(load_model_config(f"hf:{source}").replace(router_bias_rate=BIAS_RATE))
    load_checkpoint(latest_checkpoint(run), runtime=parallelize(model), optimizer=None)
    trained = {k: v for k, v in model.state_dict().items() if k.endswith("router.bias")}
    written = load_file(str(out / "model.safetensors"))
    assert len(trained) == 2
    for name, bias in trained.items():
        assert bias.abs().min() > 0, f"{name}: training left an expert's bias at 0: {bias}"  # moved, +-rate a step
        hf_name = "model." + name.replace("feed_forward.router.bias", "mlp.gate.e_score_correction_bias")
        assert torch.equal(written[hf_name], bias), hf_name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = _tokens(256)
    with torch.no_grad():
        got, expected = reloaded(tokens).logits, model.eval()(tokens)
    print(f"deepseek_v3 trained bias: export max |logit diff| {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, **LOGIT_TOL)


_SHAPE = dict(num_layers=2, dim=32, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32,
              num_experts=4, top_k=2, capacity_factor=0.0, router_bias=True, router_bias_rate=BIAS_RATE)
UNBIASED_FAMILIES = {"mixtral": ModelConfig(**_SHAPE), "qwen3_moe": ModelConfig(**_SHAPE, qk_norm=True)}


@pytest.mark.parametrize("family", sorted(UNBIASED_FAMILIES))
def test_a_family_without_the_bias_takes_a_zero_one_and_refuses_a_moved_one(family, tmp_path):
    cfg = UNBIASED_FAMILIES[family]
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # non-trivial norms, so a dropped one would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.rand_like(p) - 0.5)
    runtime = parallelize(model)
    tokens = _tokens(cfg.vocab_size)

    # A bias that stayed zero: the folder is the family's, without it, and computes shoal's logits.
    live = export_model(runtime, tmp_path / "live", hf=True)
    stored = export_checkpoint(save_checkpoint(tmp_path / "zero", 1, runtime=runtime, optimizer=None,
                                               extra={"step": 1}), tmp_path / "stored", hf=True, config=cfg)
    with torch.no_grad():
        expected = model.eval()(tokens)
    for folder in (live, stored):
        assert not any("bias" in k for k in load_file(str(folder / "model.safetensors"))), folder
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        assert reloaded.config.model_type == family
        with torch.no_grad():
            torch.testing.assert_close(reloaded(tokens).logits, expected, **LOGIT_TOL)

    # One expert's bias moved (one step of the sign rule): refused in one line, from either source, nothing written.
    model.layers["1"].feed_forward.router.bias[2] = -BIAS_RATE
    moved = save_checkpoint(tmp_path / "moved", 1, runtime=runtime, optimizer=None, extra={"step": 1})
    for what, fn, args, kwargs in (("live", export_model, (runtime, tmp_path / "x"), {}),
                                   ("checkpoint", export_checkpoint, (moved, tmp_path / "y"), dict(config=cfg))):
        message = one_line_error(fn, *args, hf=True, **kwargs)
        assert "router_bias=True" in message and family in message and "0.01" in message, f"{what}: {message}"
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def export_under_pp2(folder: str, moved: bool) -> str | None:
    """Worker (2 ranks, pp2: layer 1 on rank 1 only): the live export's verdict on every rank, with layer 1's bias
    zero or moved; the refusal's message, or the folder rank 0 wrote."""
    from shoal import rules
    from shoal.mesh import build_mesh
    from shoal.plan import Plan

    plan = rules.resolve(Plan.parse("pp2"), world_size=2)
    torch.manual_seed(0)
    runtime = parallelize(Transformer(UNBIASED_FAMILIES["mixtral"]), plan, build_mesh(plan))
    for part in runtime.parts:
        for name, bias in part.named_buffers():
            if moved and name.endswith("layers.1.feed_forward.router.bias"):
                bias[2] = -BIAS_RATE
    try:
        out = export_model(runtime, folder, hf=True)
    except ValueError as exc:
        return str(exc)
    return None if out is None else str(out)


@pytest.mark.slow
def test_every_pipeline_stage_refuses_alike(pools, tmp_path):
    """Under pp2 only the last stage holds layer 1's router: a bias moved there is refused on both ranks (the
    largest |bias| is reduced over the ranks before any weight is gathered), and a zero one exports on both."""
    written = pools(2).run(export_under_pp2, str(tmp_path / "zero"), False)
    assert written == [str(tmp_path / "zero"), None]
    refused = pools(2).run(export_under_pp2, str(tmp_path / "moved"), True)
    assert all(message is not None and "router_bias=True" in message for message in refused), refused
    assert not (tmp_path / "moved").exists()
