"""The world-size-1 plans and the run lifecycle (train, resume, export, sample) through the real
`shoal train` command, on every device this machine has: the CPU always, the GPU wherever torch
sees one (the CUDA variants are skipped on a machine without a GPU, such as CI; the same test
bodies run on the CPU there, so their logic is checked everywhere).

Tolerances: on the CPU a resumed run repeats the unbroken one's kernels in the same order, so its
losses are equal to the bit. A GPU's backward kernels may add with atomics in any order, run to
run, and the default GPU precision is bf16 (8 significant bits): resumed losses then agree to
2^-7 relative, twice bf16's unit roundoff.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shoal import cli

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU torch can use; the same test runs on the CPU here"))]
TINY = ["--nproc", "1", "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch", "4",
        "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1"]


def train(out: Path, device: str, *flags: str) -> list[dict]:
    assert cli.main(["train", "--out", str(out), "--device", device, *TINY, *flags]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan, precision", [
    ("precision=bf16,ac=selective", "bf16"),
    ("precision=fp16,ac=full", "fp16"),
    ("fsdp1,tp1,precision=bf16,compile=on", "bf16"),  # a GPU's defaults, through the trainer
])
def test_world_size_one_plans_train(tmp_path, device, plan, precision):
    records = train(tmp_path / "run", device, "--plan", plan, "--steps", "3")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["device"], summary["world_size"]) == (device, 1)
    assert summary["precision"].startswith(precision)


@pytest.mark.parametrize("device", DEVICES)
def test_default_plan_resumes_exports_and_samples(tmp_path, device, capsys):
    """The device's default plan (bf16 on a GPU, fp32 on a CPU): a run stopped at step 2 and
    resumed reaches the unbroken run's losses; the checkpoint exports to a Hugging Face folder
    and samples text."""
    unbroken = train(tmp_path / "unbroken", device, "--steps", "4", "--ckpt-every", "2")
    train(tmp_path / "part", device, "--steps", "2", "--decay-steps", "4")
    assert cli.main(["train", "--resume", str(tmp_path / "part"), "--steps", "4"]) == 0
    resumed = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    losses, expected = [r["loss"] for r in resumed], [r["loss"] for r in unbroken]
    if device == "cpu":
        assert losses == expected
        assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in unbroken]
    else:
        assert losses == pytest.approx(expected, rel=2.0**-7)
    summary = json.loads((tmp_path / "unbroken" / "summary.json").read_text())
    assert summary["precision"].startswith("fp32" if device == "cpu" else "bf16")

    assert cli.main(["export", "--run", str(tmp_path / "part"), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    capsys.readouterr()
    assert cli.main(["sample", "--run", str(tmp_path / "part"), "--prompt", "The ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("The ")


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_keeps_what_the_memory_model_counts(device):
    """What a block's dropouts keep in a bf16 forward, per token: the bytes autograd saves (floating and bool
    tensors, parameters left out) at dropout 0.1 less those at 0, 4 blocks less 2, against
    memory.dropout_kept_elements for the device. On a GPU torch's fused dropout keeps a bool mask a hidden-state
    element and FlashAttention its RNG state (integers, not counted); on a CPU the noise it multiplies by, in bf16,
    and SDPA's math path the probabilities, the noise and the dropped probabilities in place of a log-sum-exp a
    head. Exact: whole bytes of whole tensors."""
    from shoal.calibration.saved import saved_activation_bytes
    from shoal.models import PRESETS, Transformer
    from shoal.planner import memory

    inputs = torch.randint(0, 256, (4, 64), device=device)

    def saved_bytes(dropout: float, layers: int) -> int:
        torch.manual_seed(0)
        model = Transformer(PRESETS["tiny"].replace(num_layers=layers, max_seq_len=64, dropout=dropout))
        return saved_activation_bytes(model.to(device=device, dtype=torch.bfloat16).train(), inputs, masks=True)

    def per_block(dropout: float) -> float:
        return (saved_bytes(dropout, 4) - saved_bytes(dropout, 2)) / 2 / inputs.numel()

    cfg = PRESETS["tiny"].replace(dropout=0.1)
    masks, dropped = memory.dropout_kept_elements(cfg, seq_len=64, tp=1, sp=False, fused_attention=True,
                                                  on_cpu=device == "cpu", element_bytes=2)
    assert per_block(0.1) - per_block(0.0) == 2 * (masks + dropped)
