"""The image Mixer family (dense `mixer`, `sparse-mlp`): shapes and counts, routing per image,
the image data, the plans it refuses, bad input at the command line, and a run through the trainer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shoal import rules
from shoal.experiments.mixer import MIXER_PRESETS, MixerConfig
from shoal.experiments.mixer.images import HeldOutImages, ImageBatches, correct_and_count, load_digits
from shoal.experiments.mixer.model import Mixer
from shoal.loss import IGNORE
from shoal.models import preset
from shoal.moe.layer import MoELayer
from shoal.plan import Plan
from shoal.testing.asserts import assert_user_error, one_line_error

VARIANTS = ([], ["rr_patches=0"], ["rr_channels=0", "rr_patches=0"], ["top_k=2", "num_prototypes=2"],
            ["moe_every=1", "num_experts=2"])


@pytest.mark.parametrize("name", list(MIXER_PRESETS))
@pytest.mark.parametrize("sets", VARIANTS)
def test_the_shape_counts_the_parameters_the_module_holds(name, sets):
    cfg = preset(name).with_overrides(sets)
    assert Mixer(cfg).num_params() == cfg.num_params()


def test_the_dense_baseline_has_the_flops_of_sparse_mlp():
    """The `mixer` preset is Sparse-MLP's dense baseline at equal training FLOPs per image."""
    assert MIXER_PRESETS["mixer"].flops_per_image() == MIXER_PRESETS["sparse-mlp"].flops_per_image()
    assert MIXER_PRESETS["mixer"].num_params() < MIXER_PRESETS["sparse-mlp"].num_params()


def test_flops_per_image_by_hand():
    """One dense block and one sparse block on 4x4 images in 2x2 patches (S=4), C=8, 2 classes."""
    dense = MixerConfig(image_size=4, patch_size=2, num_classes=2, num_layers=1, dim=8, token_ffn_dim=3,
                        channel_ffn_dim=5)
    # patch embed 4*4*8 = 128; token MLP 8 channels * 2*4*3 = 192; channel MLP 4 patches * 2*8*5 = 320; head 16.
    assert dense.flops_per_image() == 6 * (128 + 192 + 320 + 16)
    sparse = dense.replace(num_experts=2, top_k=1, rr_channels=2, rr_patches=6)
    # re-represent 2*4*8*2 = 128 (C -> C' and back) + 2*2*4*6 = 96 (S -> S' and back); MoE_S: 2 vectors *
    # (2*6*3 + gate 6*2) = 96; MoE_C: 4 patches * (2*8*5 + gate 8*2) = 384.
    assert sparse.flops_per_image() == 6 * (128 + 128 + 96 + 96 + 384 + 16)


def test_routing_groups_are_images():
    """An image's logits do not depend on the other images of its batch (capacity, dropping and
    the load-balancing loss are per image), in training mode, where vectors are dropped."""
    cfg = MIXER_PRESETS["sparse-mlp"].replace(capacity_factor=0.5)
    torch.manual_seed(0)
    model = Mixer(cfg)
    images = torch.rand(6, 1, 8, 8)
    together = model(images)
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert any(float(m.stats["dropped_fraction"]) > 0 for m in moe)
    alone = torch.cat([model(images[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_re_represent_layers_shape_what_moe_s_routes():
    """sparse-mlp's MoE_S routes C' = 32 vectors of S' = 32 per image; MoE_C the 16 patches of 64 channels."""
    model = Mixer(MIXER_PRESETS["sparse-mlp"])
    model(torch.rand(3, 1, 8, 8))
    block = model.layers["1"]
    token, channel = block.token_mixing.mlp, block.channel_mixing
    assert isinstance(token, MoELayer) and isinstance(channel, MoELayer)
    assert token.router.gate.weight.shape == (4, 32) and channel.router.gate.weight.shape == (4, 64)
    routed = lambda m: float(m.stats["tokens_per_expert"].sum()) / (1 - float(m.stats["dropped_fraction"]))  # noqa: E731
    assert round(routed(token)) == 3 * 32 and round(routed(channel)) == 3 * 16
    assert not isinstance(model.layers["0"].channel_mixing, MoELayer)  # moe_every=2: blocks 2 and 4


def test_image_batches_are_a_function_of_seed_and_step():
    images = np.random.default_rng(0).random((20, 1, 4, 4)).astype(np.float32)
    labels = np.arange(20) % 3
    batches = ImageBatches(images, labels, seed=7)
    whole_x, whole_y = batches.batch(5, 8)
    parts = [ImageBatches(images, labels, seed=7).batch(5, 8, (i, 2)) for i in range(2)]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole_x)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_y)
    held = HeldOutImages(images[:5], labels[:5])
    assert held.num_batches(4) == 2
    x, y = held.batch(1, 4)
    assert y.tolist() == [labels[4], IGNORE, IGNORE, IGNORE] and float(x[1:].abs().sum()) == 0
    logits = torch.nn.functional.one_hot(torch.tensor([labels[4], 0, 0, 0]), 3).float()
    assert [float(v) for v in correct_and_count(logits, y)] == [1.0, 1.0]


def test_digits_ship_with_scikit_learn():
    images, labels = load_digits()
    assert images.shape == (1797, 1, 8, 8) and 0 <= images.min() and images.max() == 1.0
    assert sorted(set(labels.tolist())) == list(range(10))


@pytest.mark.parametrize("axis", ["tp2", "pp2", "cp2"])
def test_plans_the_mixer_cannot_take_are_refused_in_one_line(axis, capsys):
    cfg, named = MIXER_PRESETS["sparse-mlp"], f"{axis[:2]}=2"
    assert named in one_line_error(rules.validate, rules.resolve(Plan.parse(axis), world_size=2), cfg, global_batch=8,
                                   seq_len=1)
    # shoal plan and shoal train refuse alike, before any worker starts
    line = assert_user_error(capsys, ["plan", "--model", "sparse-mlp", "--plan", axis], named, "Mixer")
    assert assert_user_error(capsys, ["train", "--model", "sparse-mlp", "--plan", axis, "--device", "cpu"]) == line


def test_expert_plans_check_the_mixer():
    dense, sparse = MIXER_PRESETS["mixer"], MIXER_PRESETS["sparse-mlp"]
    assert "num_experts=0" in one_line_error(rules.validate, rules.resolve(Plan.parse("ep2"), world_size=2), dense,
                                             global_batch=8, seq_len=1)
    assert "does not divide 4 experts" in one_line_error(rules.validate, rules.resolve(Plan.parse("ep3"),
                                                                                       world_size=3), sparse,
                                                         global_batch=6, seq_len=1)
    # fsdp6,ep2: the experts' widths (S' = 32, C = 64) over the 3 data ranks outside ep
    assert "S'" in one_line_error(rules.validate, rules.resolve(Plan.parse("fsdp6,ep2"), world_size=6), sparse,
                                  global_batch=12, seq_len=1)
    for ok in ("dp2", "fsdp2", "ep2", "fsdp2,ep2", "fsdp2,zero=1"):
        rules.validate(rules.resolve(Plan.parse(ok), world_size=2), sparse, global_batch=8, seq_len=1)


def test_bad_image_input_is_one_line(capsys, monkeypatch, tmp_path):
    base = ["train", "--model", "sparse-mlp", "--device", "cpu", "--nproc", "2", "--out", str(tmp_path / "r")]
    assert_user_error(capsys, [*base, "--set", "patch_size=3"], "patch_size=3", "image_size=8")
    assert_user_error(capsys, [*base, "--data", str(tmp_path / "none.npz")], "none.npz", "does not exist")
    assert_user_error(capsys, [*base, "--data", str(tmp_path)], str(tmp_path), "is a folder", "an .npz file")
    np.savez(tmp_path / "rgb.npz", images=np.zeros((4, 3, 8, 8)), labels=np.zeros(4, dtype=np.int64))
    assert_user_error(capsys, [*base, "--data", str(tmp_path / "rgb.npz")], "channels=3")
    assert_user_error(capsys, [*base, "--set", "num_classes=5"], "num_classes=10")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sklearn" else find_spec(name, *a))
    assert_user_error(capsys, base, "scikit-learn")


FLAGS = ["--device", "cpu", "--nproc", "2", "--global-batch", "16", "--eval-every", "3", "--log-every", "3"]


def _train_six_steps(run: Path) -> list[dict[str, Any]]:
    """`shoal train --model sparse-mlp --plan ep2` for 6 steps; checks its records and returns them."""
    from shoal import cli

    assert cli.main(["train", "--model", "sparse-mlp", "--plan", "ep2", "--steps", "6", "--ckpt-every", "3",
                     "--out", str(run), *FLAGS]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all("images_per_s" in r and "tokens_per_s" not in r for r in records)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(0 <= r["eval_accuracy"] <= 1 for r in evals)
    assert any(key.startswith("moe/layers.1.token_mixing") for key in records[0])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_eval_accuracy"] == evals[-1]["eval_accuracy"] and summary["images_per_s"] > 0
    assert (run / "loss.png").is_file() and (run / "moe_load.png").is_file()
    return records


def test_sparse_mlp_trains_through_the_trainer(tmp_path):
    """`shoal train --model sparse-mlp` records accuracy and images/s (not held-out tokens), under ep2."""
    _train_six_steps(tmp_path / "run")


@pytest.mark.slow
def test_a_sparse_mlp_run_resumes_under_another_plan(tmp_path):
    """The ep2 run resumes under dp2 from its checkpoint (the stored Mixer shape read back)."""
    from shoal import cli

    run = tmp_path / "run"
    records = _train_six_steps(run)
    assert cli.main(["train", "--resume", str(run), "--steps", "8", "--plan", "dp2", *FLAGS[:4]]) == 0
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(1, 9)) and resumed[:6] == records


def test_a_run_folder_config_keeps_the_mixer_shape():
    """config.toml stores the Mixer's shape with its family, and reads it back as a MixerConfig."""
    import tomllib

    from shoal.train.config import RunConfig, dump_toml, from_flat, to_flat
    from shoal.train.job import with_model

    shape = MIXER_PRESETS["sparse-mlp"].replace(top_k=2, norm_topk=True, capacity_factor=0.0)
    cfg = with_model(RunConfig(model="sparse-mlp"), shape)
    assert from_flat(tomllib.loads(dump_toml(to_flat(cfg)))).model_config == shape
