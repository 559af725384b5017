"""Checkpoints: exact round trip, resharding across world sizes, corruption and crash safety.

Every comparison here is exact (torch.equal): a checkpoint stores the tensors' bytes, and
training after a load runs the same float operations in the same order as the unbroken run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import shoal.train.checkpoint as ckpt
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.models import ModelConfig, Transformer
from shoal.runtime import Runtime
from shoal.train.checkpoint import latest_checkpoint, load_checkpoint, prune, read_trainer_state, save_checkpoint

CFG = ModelConfig(num_layers=2, dim=32, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
EXTRA = {"step": 2, "scheduler": {"last_epoch": 2, "base_lrs": [0.001]}, "plan": "dp2", "note": "é"}


def _fresh(cfg: ModelConfig = CFG, seed: int = 0) -> tuple[Runtime, torch.optim.Optimizer]:
    """A plain model in this process (its runtime) and its optimizer."""
    torch.manual_seed(seed)
    runtime = parallelize(Transformer(cfg))
    return runtime, torch.optim.AdamW(runtime.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _batch(step: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(0, CFG.vocab_size, (4, 9), generator=gen)[rows]
    return seq[:, :-1], seq[:, 1:]


def _train(runtime: Runtime, opt: torch.optim.Optimizer, steps: range, rows: slice = slice(None)) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        x, y = _batch(step, rows)
        loss = runtime.forward_backward([(x, y)])
        opt.step()
        losses.append(loss.item())
    return losses


def _params(runtime: Runtime) -> dict[str, torch.Tensor]:
    """Full copies of the model's state (gathered where sharded)."""
    return _copy(runtime.state_dict()["model"])


def _optim_state(runtime: Runtime, opt: torch.optim.Optimizer) -> dict:
    """Full copies of the optimizer state keyed by clean parameter name (the same in every layout)."""
    return _copy(runtime.state_dict(opt)["optimizer"])


def _copy(value):
    """Detached full copies of every tensor in a nested state (DTensors gathered: collective)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _assert_equal(actual, expected, what: str = "") -> None:
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{what}: keys differ"
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{what}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal(a, e, f"{what}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{what} differs"
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def _saved(tmp_path: Path, step: int = 2, seed: int = 0) -> tuple[Path, Transformer, torch.optim.Optimizer]:
    model, opt = _fresh(seed=seed)
    _train(model, opt, range(step))
    return save_checkpoint(tmp_path, step, runtime=model, optimizer=opt, extra={**EXTRA, "step": step}), model, opt


def _load_error(path: Path) -> str:
    model, opt = _fresh(seed=1)
    with pytest.raises(ValueError) as info:
        load_checkpoint(path, runtime=model, optimizer=opt)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


# ----------------------------------------------------------------------------- single process


def test_round_trip_is_exact(tmp_path):
    path, model, opt = _saved(tmp_path)
    assert path == tmp_path / "checkpoints" / "step_00000002"
    assert latest_checkpoint(tmp_path) == path
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    other, other_opt = _fresh(seed=1)
    assert not torch.equal(other.parts[0].output.weight, model.parts[0].output.weight)
    extra = load_checkpoint(path, runtime=other, optimizer=other_opt)
    assert extra == EXTRA
    _assert_equal(_params(other), _params(model), "params")
    _assert_equal(other_opt.state_dict(), opt.state_dict(), "optimizer")
    # Training on from the loaded state is the unbroken run, to the bit.
    assert _train(other, other_opt, range(2, 4)) == _train(model, opt, range(2, 4))
    _assert_equal(_params(other), _params(model), "params after more steps")


def test_weights_only_and_optimizer_checks(tmp_path):
    path, model, _ = _saved(tmp_path)
    weights_only, _ = _fresh(seed=1)
    load_checkpoint(path, runtime=weights_only, optimizer=None)
    _assert_equal(_params(weights_only), _params(model))

    bare = save_checkpoint(tmp_path / "bare", 0, runtime=model, optimizer=None, extra={})
    assert "holds no optimizer state" in _load_error(bare)


def test_missing_and_corrupt_checkpoints_give_one_line(tmp_path):
    assert "does not exist" in _load_error(tmp_path / "checkpoints" / "step_00000099")
    path, _, _ = _saved(tmp_path)

    assert read_trainer_state(path) == EXTRA
    state = path / "trainer_state.json"
    good = state.read_bytes()
    state.write_bytes(good.replace(b'"step": 2', b'"step": 3'))
    assert "trainer_state.json checksum mismatch" in _load_error(path)
    with pytest.raises(ValueError, match="checksum mismatch"):
        read_trainer_state(path)
    state.write_bytes(b"{garbled")
    message = _load_error(path)
    assert "corrupt" in message and "trainer_state.json" in message
    state.write_bytes(good)

    data = next(path.glob("*.distcp"))
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    message = _load_error(path)
    assert "corrupt" in message and data.name in message and "truncated" in message
    data.write_bytes(blob)

    metadata = path / ".metadata"
    index = metadata.read_bytes()
    metadata.unlink()
    assert ".metadata is missing" in _load_error(path)
    metadata.write_bytes(index)

    (path / "manifest.json").write_text("not json")
    assert "manifest.json is not valid JSON" in _load_error(path)
    (path / "manifest.json").unlink()
    assert "manifest.json is missing" in _load_error(path)


def test_corrupt_data_without_size_change_is_caught(tmp_path):
    """Bytes garbled in place (same size): DCP's own unpickling fails; still one line."""
    path, _, _ = _saved(tmp_path)
    data = next(path.glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[:64] = b"\xff" * 64
    data.write_bytes(bytes(blob))
    assert "could not be read" in _load_error(path)


def test_a_byte_flipped_in_the_weights_is_caught_by_its_checksum(tmp_path):
    """One byte of a tensor's data changed in place (DCP still reads the file, the weight is silently
    different): the file's CRC-32 no longer matches, so newest_good_checkpoint skips that checkpoint, in one line
    naming the file, for the previous one."""
    from shoal.train.checkpoint import newest_good_checkpoint

    older, model, opt = _saved(tmp_path, step=2)
    newer = save_checkpoint(tmp_path, 4, runtime=model, optimizer=opt, extra={**EXTRA, "step": 4})
    data = max(newer.glob("*.distcp"), key=lambda p: p.stat().st_size)
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # inside the tensors' bytes, far from any header
    data.write_bytes(bytes(blob))
    path, skipped = newest_good_checkpoint(tmp_path)
    assert path == older and len(skipped) == 1, (path, skipped)
    assert data.name in skipped[0] and "fails its checksum" in skipped[0] and "\n" not in skipped[0], skipped


def test_incompatible_model(tmp_path):
    path, _, _ = _saved(tmp_path)
    for cfg, words in ((CFG.replace(dim=64), "has shape"), (CFG.replace(num_layers=3), "lacks"),
                       (CFG.replace(num_layers=1), "this model lacks")):
        model, opt = _fresh(cfg)
        with pytest.raises(ValueError, match=words) as info:
            load_checkpoint(path, runtime=model, optimizer=opt)
        assert "\n" not in str(info.value) and "does not match this model" in str(info.value)


def test_crash_before_the_rename_keeps_previous_latest(tmp_path, monkeypatch):
    good, _, _ = _saved(tmp_path, step=2)
    model, opt = _fresh()
    real_write = ckpt._write_synced

    def crash_on_manifest(path: Path, data: bytes) -> None:
        if path.name == "manifest.json":
            raise OSError("disk full (simulated)")
        real_write(path, data)

    monkeypatch.setattr(ckpt, "_write_synced", crash_on_manifest)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 4, runtime=model, optimizer=opt, extra={"step": 4})
    monkeypatch.undo()
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and not (tmp_path / "checkpoints" / "step_00000004").exists()
    assert latest_checkpoint(tmp_path) == good
    assert load_checkpoint(good, runtime=model, optimizer=opt)["step"] == 2

    # The next save clears the leftover and moves `latest` on.
    newer = save_checkpoint(tmp_path, 6, runtime=model, optimizer=opt, extra={"step": 6})
    assert latest_checkpoint(tmp_path) == newer
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if ".tmp-" in p.name]


def test_resave_of_a_step_never_exposes_a_half_written_folder(tmp_path, monkeypatch):
    first, first_model, _ = _saved(tmp_path, step=2, seed=0)
    second_model, second_opt = _fresh(seed=5)
    real_rename = os.rename

    def crash_between_renames(src, dst):
        if Path(dst).name == "step_00000002" and ".tmp-" in Path(src).name:
            raise OSError("killed (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash_between_renames)
    with pytest.raises(RuntimeError, match="killed"):
        save_checkpoint(tmp_path, 2, runtime=second_model, optimizer=second_opt, extra={"step": 2, "v": 2})
    monkeypatch.undo()
    # The old folder was moved aside and `latest` names the new, complete temporary folder.
    latest = latest_checkpoint(tmp_path)
    model, opt = _fresh(seed=1)
    assert load_checkpoint(latest, runtime=model, optimizer=opt)["v"] == 2
    _assert_equal(_params(model), _params(second_model))

    # Without the crash a resave swaps the folders and leaves nothing else behind.
    save_checkpoint(tmp_path, 2, runtime=first_model, optimizer=None, extra={"step": 2, "v": 3})
    assert latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000002"]
    assert json.loads((first / "trainer_state.json").read_text())["v"] == 3


def test_latest_without_pointer_and_prune(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    model, opt = _fresh()
    paths = [save_checkpoint(tmp_path, s, runtime=model, optimizer=opt, extra={"step": s}) for s in (1, 2, 3)]
    (tmp_path / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(tmp_path) == paths[-1]
    assert prune(tmp_path, keep=2) == [paths[0]]
    assert latest_checkpoint(tmp_path) == paths[-1] and paths[1].exists() and not paths[0].exists()
    with pytest.raises(ValueError, match="keep=0"):
        prune(tmp_path, keep=0)
    with pytest.raises(TypeError):  # not JSON: refused before anything is written
        save_checkpoint(tmp_path, 9, runtime=model, optimizer=opt, extra={"bad": object()})
    assert not (tmp_path / "checkpoints" / "step_00000009").exists()


# ----------------------------------------------------------------------------- across world sizes


def _ddp(world_plan: str, seed: int):
    import torch.distributed as dist

    from shoal.mesh import build_mesh
    from shoal.plan import Plan

    plan = rules.resolve(Plan.parse(world_plan), world_size=dist.get_world_size())
    torch.manual_seed(seed)
    runtime = parallelize(Transformer(CFG), plan, build_mesh(plan))
    opt = torch.optim.AdamW(runtime.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    rows_per_rank = 4 // dist.get_world_size()
    rank = dist.get_rank()
    return runtime, opt, slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)


def _save_under_dp2(run_dir: str) -> dict:
    """On 2 ranks: train 2 steps, save, train 2 more; then a fresh model loads and trains the same 2."""
    model, opt, rows = _ddp("dp2", seed=0)
    _train(model, opt, range(2), rows)
    save_checkpoint(Path(run_dir), 2, runtime=model, optimizer=opt, extra=EXTRA)
    saved = {"params": _params(model), "optim": _optim_state(model, opt)}
    unbroken = _train(model, opt, range(2, 4), rows)
    resumed_model, resumed_opt, _ = _ddp("dp2", seed=7)
    extra = load_checkpoint(latest_checkpoint(Path(run_dir)), runtime=resumed_model, optimizer=resumed_opt)
    resumed = _train(resumed_model, resumed_opt, range(2, 4), rows)
    return {**saved, "extra": extra, "unbroken": unbroken, "resumed": resumed}


def _load_here(run_dir: str) -> dict:
    model, opt, _ = _ddp("dp4", seed=3)
    extra = load_checkpoint(latest_checkpoint(Path(run_dir)), runtime=model, optimizer=opt)
    return {"params": _params(model), "optim": _optim_state(model, opt), "extra": extra}


def test_save_dp2_load_single_process_and_dp4(pools, tmp_path):
    ranks = pools(2).run(_save_under_dp2, str(tmp_path))
    saved = ranks[0]
    for res in ranks:
        assert res["extra"] == EXTRA
        assert res["resumed"] == res["unbroken"]  # exact: same ops in the same order
        _assert_equal(res["params"], saved["params"], "replica params")

    model, opt = _fresh(seed=9)
    assert load_checkpoint(latest_checkpoint(tmp_path), runtime=model, optimizer=opt) == EXTRA
    _assert_equal(_params(model), saved["params"], "single-process params")
    _assert_equal(_optim_state(model, opt), saved["optim"], "single-process optimizer")

    for rank, res in enumerate(pools(4).run(_load_here, str(tmp_path))):
        assert res["extra"] == EXTRA
        _assert_equal(res["params"], saved["params"], f"dp4 rank {rank} params")
        _assert_equal(res["optim"], saved["optim"], f"dp4 rank {rank} optimizer")


def _full(runtime: Runtime, opt: torch.optim.Optimizer) -> dict:
    """Params and optimizer state as full (gathered) tensors: comparable across layouts."""
    return {"params": _params(runtime), "optim": _optim_state(runtime, opt)}


def _save_under(plan: str, run_dir: str) -> dict:
    model, opt, rows = _ddp(plan, seed=0)
    _train(model, opt, range(2), rows)
    save_checkpoint(Path(run_dir), 2, runtime=model, optimizer=opt, extra=EXTRA)
    return _full(model, opt)


def _load_under(plan: str, run_dir: str) -> dict:
    model, opt, _ = _ddp(plan, seed=4)
    assert load_checkpoint(latest_checkpoint(Path(run_dir)), runtime=model, optimizer=opt) == EXTRA
    return _full(model, opt)


def test_reshard_fsdp2_to_single_process_and_hybrid(pools, tmp_path):
    """Saved sharded (fsdp2: each rank writes half of every tensor), loaded whole in one process,
    sharded 2 ways and replicated 2 ways (dp2,fsdp2 on 4 ranks), and sharded 4 ways (fsdp4)."""
    saved = pools(2).run(_save_under, "fsdp2", str(tmp_path))[0]
    model, opt = _fresh(seed=9)
    load_checkpoint(latest_checkpoint(tmp_path), runtime=model, optimizer=opt)
    _assert_equal(_params(model), saved["params"], "single-process params")
    _assert_equal(_optim_state(model, opt), saved["optim"], "single-process optimizer")
    for plan in ("dp2,fsdp2", "fsdp4"):
        for rank, res in enumerate(pools(4).run(_load_under, plan, str(tmp_path))):
            _assert_equal(res, saved, f"{plan} rank {rank}")


def _load_incompatible(path: str) -> str:
    import torch.distributed as dist

    cfg = CFG.replace(dim=64) if dist.get_rank() == 1 else CFG  # only rank 1's model differs
    model, opt = _fresh(cfg)
    try:
        load_checkpoint(Path(path), runtime=model, optimizer=opt)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def _save_into_a_file(path: str) -> str:
    model, opt = _fresh()
    try:
        save_checkpoint(Path(path), 1, runtime=model, optimizer=opt, extra={})
    except RuntimeError as exc:
        return str(exc)
    return "saved"


def test_an_error_on_one_rank_raises_on_every_rank(pools, tmp_path):
    path, _, _ = _saved(tmp_path)
    messages = pools(2).run(_load_incompatible, str(path))
    assert messages[0] == messages[1] and "does not match this model" in messages[0]
    (tmp_path / "a-file").write_text("")  # rank 0 cannot create checkpoints/ under it
    messages = pools(2).run(_save_into_a_file, str(tmp_path / "a-file"))
    assert messages[0] == messages[1] and "saving checkpoint" in messages[0] and "\n" not in messages[0]
