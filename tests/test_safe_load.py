"""Loading a checkpoint folder runs no code from it (shoal/train/safe_load.py): a crafted DCP
`.metadata` (a pickle that runs a shell command, with the manifest's size and CRC-32 updated to
match) is refused in one line naming the class by `shoal sample`, `shoal export` and `--resume`,
and the command never runs; a crafted non-tensor item in the data files is refused the same way.
Each crafted file is first shown to run its command under plain pickle / DCP's own loader, so the
test would notice if the files stopped being dangerous."""

from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shoal import cli
from shoal.train.checkpoint import latest_checkpoint
from shoal.train.safe_load import SafeLoadPlanner, SafeReader, UnsafeCheckpointError

RUN = ["--device", "cpu", "--nproc", "1", "--set", "num_layers=1", "--set", "dim=32", "--set", "num_heads=2",
       "--set", "num_kv_heads=2", "--set", "ffn_dim=64", "--global-batch", "2", "--seq-len", "16", "--eval-every", "0"]


class _Touch:
    """Unpickled, runs `touch PATH` (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("safe") / "run"
    assert cli.main(["train", "--out", str(run), "--steps", "1", *RUN]) == 0
    return run


def _craft_metadata(run: Path, marker: Path) -> None:
    """Replace the latest checkpoint's .metadata with a pickle that touches `marker`."""
    ckpt = latest_checkpoint(run)
    payload = pickle.dumps(_Touch(marker))
    (ckpt / ".metadata").write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["file_sizes"][".metadata"] = len(payload)
    manifest.setdefault("file_crc32", {})[".metadata"] = zlib.crc32(payload)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_crafted_metadata_runs_nothing(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    marker = tmp_path / "ran"
    _craft_metadata(run, marker)
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Touch(proof)))  # the same payload under plain pickle runs its command
    assert proof.exists()

    for argv in (["sample", "--run", str(run), "--max-new-tokens", "2"],
                 ["export", "--run", str(run), "--out", str(tmp_path / "w.safetensors")],
                 ["train", "--resume", str(run), "--steps", "2"]):
        capsys.readouterr()
        assert cli.main(argv) != 0, argv
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shoal: error:")]
        assert not marker.exists(), f"{argv[0]} ran the checkpoint's code"
        assert len(err) == 1 and "posix.system" in err[0] and "not one of the classes" in err[0], (argv, err)


def test_crafted_non_tensor_item_runs_nothing(tmp_path):
    """DCP writes non-tensor values (an optimizer's hyper-parameters) with torch.save; its own
    planner reads them back with weights_only=False. shoal's reads them weights-only."""
    folder = tmp_path / "ckpt"
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "hyper": _Touch(marker)}, checkpoint_id=str(folder), no_dist=True)
    state = {"w": torch.zeros(2), "hyper": None}
    with pytest.raises(CheckpointException) as info:  # DCP carries each rank's own exception
        dcp.load(state, checkpoint_id=str(folder), storage_reader=SafeReader(str(folder)),
                 planner=SafeLoadPlanner(), no_dist=True)
    inner = info.value.failures[0][0]
    assert isinstance(inner, UnsafeCheckpointError) and "item 'hyper' names posix.system" in str(inner)
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "hyper": None}, checkpoint_id=str(folder), no_dist=True)  # torch's own planner
    assert marker.exists()  # ... runs it: the crafted item is real


def test_safe_reader_reads_what_shoal_writes(trained):
    """Every class a real checkpoint's metadata names is allowed (the resume and export tests load
    through the same reader)."""
    meta = SafeReader(str(latest_checkpoint(trained))).read_metadata()
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)
    assert any(k.startswith("optimizer.") for k in meta.state_dict_metadata)
