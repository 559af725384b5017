"""Single-file safetensors export of a checkpoint or live model, and import under another layout.

Weights are copies of stored float32 values (no arithmetic), so every weight comparison is exact;
logits computed from them under tensor parallelism reorder sums (assert_rounding_close).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.plan import Plan
from shoal.testing.asserts import assert_rounding_close, full_tensors
from shoal.testing.parity import case, parallel_setup
from shoal.train.checkpoint import save_checkpoint
from shoal.train.export import export_checkpoint, export_model, import_weights
from shoal.train.step import split_micro, train_step

RUN = case(steps=2)


def train_save_export(run_dir: str, plan_text: str) -> dict:
    """Worker: train 2 steps under plan_text, save a checkpoint, export the live model."""
    runtime, optimizer, batches = parallel_setup(dataclasses.replace(RUN, plan=plan_text))
    for x, y in batches:
        train_step(runtime, optimizer, split_micro(x, y, 1), grad_clip=RUN.grad_clip)
    path = save_checkpoint(run_dir, 2, runtime=runtime, optimizer=optimizer, extra={"step": 2})
    export_model(runtime, f"{run_dir}/live.safetensors", metadata={"plan": plan_text})
    return {"params": full_tensors(runtime), "checkpoint": str(path)}


def import_under(path: str, plan_text: str) -> dict:
    """Worker: build a fresh model under plan_text, import the file, return full weights and logits."""
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    runtime = parallelize(RUN.build_model(), plan, build_mesh(plan))
    import_weights(path, runtime=runtime)
    with torch.no_grad():
        logits = runtime(RUN.batches()[0][0])
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"params": full_tensors(runtime), "logits": logits}


def test_export_and_import_across_layouts(pools, tmp_path):
    trained = pools(2).run(train_save_export, str(tmp_path), "fsdp2")
    expected = trained[0]["params"]
    out = export_checkpoint(trained[0]["checkpoint"], tmp_path / "ckpt.safetensors")
    for name, weights in (("checkpoint export", load_file(str(out))),
                          ("live export", load_file(str(tmp_path / "live.safetensors")))):
        assert set(weights) == set(expected), name
        for key, value in expected.items():
            assert torch.equal(weights[key], value), f"{name}: {key} differs"

    # Back in under other layouts: a plain single-process module, DDP, and tensor x sharded.
    plain = parallelize(RUN.build_model())
    import_weights(out, runtime=plain)
    for key, value in expected.items():
        assert torch.equal(full_tensors(plain)[key], value), key
    with torch.no_grad():
        logits = plain(RUN.batches()[0][0])
        truth = copy.deepcopy(plain.parts[0]).double()(RUN.batches()[0][0])  # the same weights in float64
    for world, plan_text in ((2, "dp2"), (2, "fsdp2,zero=2"), (4, "fsdp2,tp2")):
        for res in pools(world).run(import_under, str(out), plan_text):
            for key, value in expected.items():
                assert torch.equal(res["params"][key], value), f"{plan_text}: {key}"
            # Same weights, reordered sums under tp: as close to float64 as the plain float32 model.
            assert_rounding_close(res["logits"], logits, truth, what=f"{plan_text} logits")


def test_live_export_from_zero12_engine(pools, tmp_path):
    """ZeRO-1/2 (shoal's own engine, not FSDP2): its live export equals its checkpoint's."""
    trained = pools(2).run(train_save_export, str(tmp_path), "fsdp2,zero=1")
    live = load_file(str(tmp_path / "live.safetensors"))
    exported = load_file(str(export_checkpoint(trained[0]["checkpoint"], tmp_path / "ckpt.safetensors")))
    assert set(live) == set(exported) == set(trained[0]["params"])
    for key, value in trained[0]["params"].items():
        assert torch.equal(live[key], value) and torch.equal(exported[key], value), key


def test_bad_files_give_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="metadata is unreadable"):
        export_checkpoint(tmp_path / "missing", tmp_path / "x.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        import_weights(tmp_path / "junk.safetensors", runtime=parallelize(RUN.build_model()))
    from safetensors.torch import save_file

    save_file({"foo": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="other.safetensors does not fit the model"):
        import_weights(tmp_path / "other.safetensors", runtime=parallelize(RUN.build_model()))
