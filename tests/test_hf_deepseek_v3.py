"""DeepSeek-V3 through the file paths: a folder transformers saves (a tiny random DeepseekV3ForCausalLM,
no download) loads with `--init` (read box by box), in one process and under ep2 and tp2, into exactly
the tensors `shoal.from_hf` gives, the routers' selection biases (e_score_correction_bias, buffers)
included, and the model's logits equal transformers'. The whole model against transformers (logits,
loss, gradients) and the export back are tests/test_hf_families.py's; the family under every plan,
tests/test_hf_parallel.py's.

Tolerance: the loaded tensors are the file's, copied: equal bitwise. Logits: rtol = atol = 1e-5, as
tests/test_hf_families.py derives (the same float32 arithmetic in another order, measured ~5e-7).
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import shoal  # noqa: E402
from shoal.apply_plan import parallelize  # noqa: E402
from shoal.models import Transformer  # noqa: E402
from shoal.models.hf.families import load_model_config  # noqa: E402
from shoal.models.safetensors_io import open_pretrained  # noqa: E402
from test_hf_families import FAMILIES, _hf_model  # noqa: E402

LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)


def test_init_reads_the_folder_as_from_hf_does(tmp_path):
    hf_model = _hf_model("deepseek_v3")
    hf_model.save_pretrained(str(tmp_path))
    expected = shoal.from_hf(tmp_path).eval()
    cfg = load_model_config(f"hf:{tmp_path}")
    weights = open_pretrained(tmp_path, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, weights=weights)
    got, want = model.state_dict(), expected.state_dict()
    assert set(got) == set(want)
    biases = [k for k in want if k.endswith("router.bias")]
    assert len(biases) == 2 and all(want[k].abs().max() > 0.1 for k in biases)  # the file's, not zeros
    for k in want:
        assert torch.equal(got[k], want[k]), k
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf_model(tokens).logits, **LOGIT_TOL)


def test_the_shared_mlp_and_the_dense_layers_take_their_own_widths():
    """The tiny family case is built so a width taken from the wrong field shows: the shared MLP (2 x 16)
    and the dense layer (96) differ from the experts' 16."""
    config_cls, fields = FAMILIES["deepseek_v3"]
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**fields))
    state = model.state_dict()
    assert state["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (32, 64)
    assert state["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)


def _load(path: str, plan_text: str) -> dict[str, torch.Tensor]:
    """Worker: the model built on meta under `plan_text`, filled from `path`; its full weights and the routers'
    selection biases."""
    import torch.distributed as dist

    from shoal import rules
    from shoal.mesh import build_mesh
    from shoal.plan import Plan
    from shoal.testing.asserts import full_tensors

    cfg = load_model_config(f"hf:{path}")
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size(), model=cfg)
    runtime = parallelize(model, plan, build_mesh(plan), weights=open_pretrained(path, cfg))
    out = full_tensors(runtime)
    for part in runtime.parts:
        for name, buffer in part.named_buffers():
            if name.endswith("router.bias"):
                out[name] = buffer.full_tensor() if hasattr(buffer, "full_tensor") else buffer.detach().clone()
    return out


def test_init_under_ep2_and_tp2_reads_the_same_tensors(pools, tmp_path):
    """Each rank reads its slices (the experts its ep rank holds, its tp rows) and every router's bias whole."""
    _hf_model("deepseek_v3").save_pretrained(str(tmp_path))
    want = shoal.from_hf(tmp_path).state_dict()
    for plan in ("ep2", "tp2"):
        for got in pools(2).run(_load, str(tmp_path), plan):
            assert sum(k.endswith("router.bias") for k in got) == 2, plan
            for name, value in got.items():
                assert torch.equal(value, want[name]), (plan, name)
