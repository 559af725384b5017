"""Single-file safetensors export of a checkpoint or live model, and import under another layout.

Everything here is a copy of stored float32 values (no arithmetic), so every comparison is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shoal.mesh import data_rank
from shoal.parallelize import parallelize
from shoal.plan import Plan
from shoal.testing import cached_mesh, case, full_tensors
from shoal.train.checkpoint import save_checkpoint
from shoal.train.export import export_checkpoint, export_model, import_weights
from shoal.train.step import split_micro, train_step

RUN = case(steps=2)


def train_save_export(run_dir: str, plan_text: str) -> dict:
    """Worker: train 2 steps under plan_text, save a checkpoint, export the live model."""
    plan = Plan.parse(plan_text).resolve(dist.get_world_size())
    mesh = cached_mesh(plan)
    model = parallelize(RUN.build_model(), plan, mesh)
    optimizer = RUN.optimizer(model)
    index, count = data_rank(mesh)
    rows = RUN.global_batch // count
    for x, y in RUN.batches():
        micro = split_micro(x[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows], 1)
        train_step(model, optimizer, micro, mesh=mesh, grad_clip=RUN.grad_clip)
    path = save_checkpoint(run_dir, 2, model=model, optimizer=optimizer, extra={"step": 2})
    export_model(model, f"{run_dir}/live.safetensors", metadata={"plan": plan_text})
    return {"params": full_tensors(model), "checkpoint": str(path)}


def import_under(path: str, plan_text: str) -> dict:
    """Worker: build a fresh model under plan_text, import the file, return full weights and logits."""
    plan = Plan.parse(plan_text).resolve(dist.get_world_size())
    mesh = cached_mesh(plan)
    model = parallelize(RUN.build_model(), plan, mesh)
    import_weights(path, model=model)
    with torch.no_grad():
        logits = model(RUN.batches()[0][0])
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"params": full_tensors(model), "logits": logits}


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
    plain = RUN.build_model()
    import_weights(out, model=plain)
    with torch.no_grad():
        logits = plain(RUN.batches()[0][0])
    for key, value in expected.items():
        assert torch.equal(full_tensors(plain)[key], value), key
    for world, plan_text in ((2, "dp2"), (2, "fsdp2,zero=2"), (4, "fsdp2,tp2")):
        for res in pools(world).run(import_under, str(out), plan_text):
            for key, value in expected.items():
                assert torch.equal(res["params"][key], value), f"{plan_text}: {key}"
            # Same weights, reordered sums under tp: logits to fp32 rounding.
            torch.testing.assert_close(res["logits"], logits, rtol=1e-5, atol=1e-6)


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
        import_weights(tmp_path / "junk.safetensors", model=RUN.build_model())
    from safetensors.torch import save_file

    save_file({"foo": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="does not fit the model"):
        import_weights(tmp_path / "other.safetensors", model=RUN.build_model())
