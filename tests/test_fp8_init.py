"""`--init` from block-quantised fp8 weights (DeepSeek-V3's published layout, shoal.models.fp8_blocks):
a tiny Llama-layout folder written here with float8_e4m3fn weights in 128 x 128 blocks beside their
float32 `weight_scale_inv` multipliers loads, in one process and under tp2 (boxes that cross block
edges), as exactly the values a plain loop over the blocks gives: an fp8 number is exact in float32
and one product by its block's float32 multiplier rounds once, the same way on both sides, so the
comparison is bitwise. fp8 bytes without their multipliers, multipliers of the wrong shape and an
unknown quantization_config are refused in one line; the multi-token-prediction layers a config
declares are left unread with a warning.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import ModelConfig, Transformer
from shoal.models.hf.families import hf_config, hf_to_shoal, load_model_config, shoal_to_hf
from shoal.models.safetensors_io import load_hf_state, open_pretrained
from shoal.plan import Plan
from shoal.testing.asserts import full_tensors, one_line_error

# Widths off the 128 grid, so blocks are cut at the edges and tp2's row halves (80) cross a block edge.
CFG = ModelConfig(num_layers=2, dim=160, num_heads=4, num_kv_heads=2, ffn_dim=288, vocab_size=200, max_seq_len=32,
                  rope_theta=500.0)
BLOCK = 128


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 multipliers): each block scaled so its largest entry is e4m3's largest, 448."""
    rows, cols = (math.ceil(n / BLOCK) for n in w.shape)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = block.abs().max() / 448
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _by_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: each block's fp8 numbers times its multiplier, written as a plain loop."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def _write(folder, *, quantization: object = "default", mtp_layers: int = 0, drop_scale: str = "",
           extra: dict | None = None) -> dict[str, torch.Tensor]:
    """A Llama-layout folder of CFG's seeded weights, every projection fp8; returns the shoal tensors it holds."""
    torch.manual_seed(0)
    hf = shoal_to_hf(Transformer(CFG).state_dict(), CFG)
    files, dequantized = {}, {}
    for key, w in hf.items():
        if w.dim() == 2 and "embed" not in key and "lm_head" not in key:
            q, scale = _quantize(w)
            files[key], dequantized[key] = q, _by_blocks(q, scale)
            if key != drop_scale:
                files[key + "_scale_inv"] = scale
        else:
            files[key] = dequantized[key] = w
    files.update(extra or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(files, str(folder / "model.safetensors"))
    config = hf_config(CFG)
    if quantization == "default":
        quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [BLOCK, BLOCK]}
    if quantization is not None:
        config["quantization_config"] = quantization
    if mtp_layers:
        config["num_nextn_predict_layers"] = mtp_layers
    (folder / "config.json").write_text(json.dumps(config))
    return hf_to_shoal(dequantized, CFG)


def _load(path: str, plan_text: str) -> dict[str, torch.Tensor]:
    """Worker: the model built on meta under `plan_text`, filled from `path`; its full weights."""
    cfg = load_model_config(f"hf:{path}")
    weights = open_pretrained(path, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size() if dist.is_initialized() else 1)
    return full_tensors(parallelize(model, plan, build_mesh(plan), weights=weights))


def test_fp8_blocks_load_as_their_dequantised_values(tmp_path):
    want = _write(tmp_path / "fp8")
    weights = open_pretrained(tmp_path / "fp8", CFG)
    assert "fp8 weights times their 128x128 block multipliers" in weights.describe(torch.float32)
    with torch.device("meta"):
        model = Transformer(CFG)
    parallelize(model, weights=weights)
    got = dict(model.named_parameters())
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert got["layers.0.attention.wq.weight"].abs().max() > 0
    state = hf_to_shoal(load_hf_state(tmp_path / "fp8"), CFG)  # shoal.from_hf's path
    for name, value in want.items():
        assert torch.equal(state[name], value), name


def test_fp8_boxes_under_tp2_cross_block_edges(pools, tmp_path):
    want = _write(tmp_path / "fp8")
    for got in pools(2).run(_load, str(tmp_path / "fp8"), "tp2"):
        for name, value in want.items():
            assert torch.equal(got[name], value), name


@pytest.mark.parametrize("kind, named", [
    ("no-scale", "without its block multipliers model.layers.0.mlp.up_proj.weight_scale_inv"),
    ("bad-config", "quantization_config"),
    ("bad-shape", "is F32 (2, 3) for a weight of shape (160, 288); valid: float32 of shape (3, 5)"),
])
def test_bad_fp8_files_are_refused_in_one_line(tmp_path, kind, named):
    if kind == "no-scale":
        _write(tmp_path, drop_scale="model.layers.0.mlp.up_proj.weight")
    elif kind == "bad-config":
        _write(tmp_path, quantization={"quant_method": "bitsandbytes"})
    else:
        _write(tmp_path, quantization={"quant_method": "fp8", "weight_block_size": [64, 64]})
    message = one_line_error(open_pretrained, tmp_path, CFG)
    assert named in message, message
    if kind == "no-scale":
        assert named in one_line_error(load_hf_state, tmp_path)


def test_mtp_layers_are_left_unread_with_a_warning(tmp_path):
    extra = {"model.layers.2.eh_proj.weight": torch.zeros(4, 4), "model.layers.2.enorm.weight": torch.zeros(4)}
    _write(tmp_path / "mtp", mtp_layers=1, extra=extra)
    with pytest.warns(UserWarning, match=r"2 tensors of 1 multi-token-prediction layer\(s\) \(model\.layers\.2"):
        weights = open_pretrained(tmp_path / "mtp", CFG)
    assert set(weights.dropped) == set(extra)
    _write(tmp_path / "no-mtp", extra=extra)  # undeclared: unexpected tensors, as before
    assert "unexpected" in one_line_error(open_pretrained, tmp_path / "no-mtp", CFG)
