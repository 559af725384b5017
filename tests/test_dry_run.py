"""`shoal train --dry-run`: set-up and one real step on throwaway state, each rank's memory beside
the planner's prediction, nothing saved."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from shoal import cli
from shoal.calibration.saved import saved_activation_elements
from shoal.models import Transformer
from shoal.models.config import get_preset
from shoal.planner import memory
from shoal.train import memory as memory_stats


def test_dry_run_prints_each_rank_beside_the_prediction_and_saves_nothing(tmp_path, capfd):
    out = tmp_path / "run"
    argv = ["train", "--dry-run", "--nproc", "2", "--plan", "fsdp2", "--device", "cpu", "--set", "num_layers=2",
            "--global-batch", "4", "--seq-len", "32", "--out", str(out)]
    assert cli.main(argv) == 0
    text = capfd.readouterr().out
    assert "dry run: set-up and three steps of plan fsdp2" in text and "nothing saved" in text
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+[01]\s+\d", line)]
    assert [r[0] for r in rows] == ["0", "1"]
    states = text.split("planner, busiest")[1].split("the step's peak")[0]  # the states, then what each adds
    predicted = dict(re.findall(r"(parameters|gradients|optimizer) ([\d.]+)", states))
    for row in rows:  # fp32 ZeRO-3 over 2 ranks: the live shards are the formula's bytes (to the 0.1 MB printed)
        params, grads, optim = map(float, row[1:4])
        assert abs(params - float(predicted["parameters"])) <= 0.1
        assert abs(grads - float(predicted["gradients"])) <= 0.1
        assert abs(optim - float(predicted["optimizer"])) <= 0.1
        baseline, setup, step = map(float, row[4:7])
        assert 0 < baseline <= setup and 0 < step
    assert re.search(r"step peak above the baseline, busiest rank: \d+ MB; the planner's \d+ MB is [+-]\d+% off", text)
    # the live-tensor peak (torch's MemTracker on CPU) holds at least this rank's parameters,
    # gradients and optimizer state, which stay alive through the measured step
    for row in rows:
        assert float(row[7]) >= sum(map(float, row[1:4])) - 0.3  # three figures printed to 0.1 MB
    # The planner's terms against that peak: the step's backward holds its activations and logits with only the
    # classifier's gradient (one micro-batch), the optimizer step every gradient; what the terms leave out
    # (the rotary tables, per-tensor step counts) is under 10% of this 7 MB step (3% measured).
    assert abs(_terms_error(text)) <= 10
    if memory_stats.allocator_held_mb() is not None:  # glibc: the freed memory it keeps, per rank
        for row in rows:
            assert float(row[8]) >= 0
        assert re.search(r"freed memory the allocator kept for reuse after the step: \d+ to \d+ MB a rank", text)
    assert not (out / "checkpoints").exists()


def test_dry_run_of_muon_prices_one_moment_on_the_matrices(tmp_path, capfd):
    """--optimizer muon under fsdp2: the live optimizer state (one fp32 momentum on the blocks' matrices, AdamW's
    two on the tables and norms) is the planner's to the 0.1 MB printed, as AdamW's is above, and about half
    AdamW's; the step's temporaries (the owner design's gathers, peak.MUON_OWNER_STEP_BYTES) are priced: the
    terms within 10% of the live tensors, as above."""
    argv = ["train", "--dry-run", "--nproc", "2", "--plan", "fsdp2", "--device", "cpu", "--set", "num_layers=2",
            "--global-batch", "4", "--seq-len", "32", "--optimizer", "muon", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    text = capfd.readouterr().out
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+[01]\s+\d", line)]
    states = text.split("planner, busiest")[1].split("the step's peak")[0]
    predicted = dict(re.findall(r"(parameters|gradients|optimizer) ([\d.]+)", states))
    for row in rows:
        params, optim = float(row[1]), float(row[3])
        assert abs(optim - float(predicted["optimizer"])) <= 0.1
        assert optim < 1.5 * params  # AdamW's would be twice the parameters
    assert "optimizer_step" in text.split("the step's peak: ")[1].splitlines()[0]
    assert abs(_terms_error(text)) <= 10


def test_the_allocator_s_kept_memory_counts_freed_blocks():
    """glibc keeps freed blocks below its mmap threshold (128 KiB at first) in the heap: freeing 100
    blocks of 64 KiB, each between two that stay, cannot coalesce them or hand them back, so the
    count rises by their 6.25 MiB (less whatever a later allocation reuses: half at most)."""
    if memory_stats.allocator_held_mb() is None:
        pytest.skip("glibc is not this process's malloc (another C library, or an allocator preloaded): no mallinfo2")
    blocks = [torch.empty(16384) for _ in range(201)]
    before = memory_stats.allocator_held_mb()
    del blocks[1::2]
    assert memory_stats.allocator_held_mb() - before >= 0.5 * 100 * 64 / 1024


def test_kept_memory_is_blank_where_glibc_is_not_the_allocator(monkeypatch):
    """With another allocator preloaded (LD_PRELOAD puts its malloc first in the search order) glibc's arenas
    hold nothing and mallinfo2 reads zeros: the kept figure is left out, not printed as 0, unless that allocator
    is jemalloc, which says (tests/test_host_memory.py). Simulated by a process whose `malloc` resolves elsewhere
    than libc's and which has no `mallctl` (without glibc's malloc it is None already)."""
    glibc = memory_stats.allocator_held_mb() is not None
    real = ctypes.CDLL

    class Preloaded:
        def __init__(self, name: str | None) -> None:
            self.lib, self.process = real(name), name is None

        def __getattr__(self, attr: str):
            return self.lib.calloc if attr == "malloc" and self.process else getattr(self.lib, attr)

    monkeypatch.setattr(memory_stats.ctypes, "CDLL", Preloaded)
    memory_stats._mallinfo2.cache_clear()
    memory_stats._jemalloc_stat.cache_clear()
    try:
        assert memory_stats.allocator_held_mb() is None
    finally:
        monkeypatch.undo()
        memory_stats._mallinfo2.cache_clear()
        memory_stats._jemalloc_stat.cache_clear()
    assert (memory_stats.allocator_held_mb() is not None) == glibc  # the real process's answer is back


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_the_activation_count_is_what_autograd_saves(preset):
    """The planner's activations per block and the head's norm (shoal.planner.memory) against the
    bytes autograd saves for backward in one process, counted by storage (parameters, buffers and
    the token ids left out). Exact but for the embedding and loss, which the planner prices apart:
    the count is of elements, so no rounding enters."""
    cfg = get_preset(preset).replace(num_layers=2, vocab_size=64)
    B, T = 2, 32
    saved = saved_activation_elements(Transformer(cfg), torch.randint(0, 64, (B, T)))
    per_block = memory.activation_elements(cfg, 0, seq_len=T, tp=1, sp=False, ac="none", fused_attention=True)
    head = memory.head_norm_elements(cfg, tp=1, sp=False)
    assert saved == (cfg.num_layers * per_block + head) * B * T


def test_dry_run_with_accumulation_under_fsdp2(tmp_path, capfd):
    """Two micro-batches a step under FSDP2 at ZeRO-3, which reduce-scatters each one's gradients into the
    shards: the planner's terms (the shards, the last micro-batch's activations) against the step's live tensors.
    Within 10%: what the terms leave out (rotary tables, step counts, the reduce-scatter's small buffers) is
    6% of this 37 MB step; before the planner knew the sync stays on it priced 8 MB of unsharded gradients more."""
    argv = ["train", "--dry-run", "--nproc", "2", "--plan", "fsdp2", "--device", "cpu", "--set", "num_layers=4",
            "--set", "dim=256", "--global-batch", "8", "--seq-len", "128", "--micro-batch", "2",
            "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    assert abs(_terms_error(capfd.readouterr().out)) <= 10


@pytest.mark.parametrize("zero, micro", [(1, 2), (2, 1)])
def test_dry_run_of_the_zero_engine_on_a_shallow_model(tmp_path, capfd, zero, micro):
    """shoal's ZeRO-1/2 engine reduces a bucket of blocks (two, here the whole model) once their backward is
    done: the gradients packed rank-major, gloo's all_to_all output (a whole bucket) and the gradient shard
    (peak.zero_bucket_bytes), on a model whose parameters outweigh its activations. ZeRO-1 over two
    micro-batches accumulates full gradients first (priced), ZeRO-1 over one would reduce them at once. The
    terms were 33% and 40% under this step's live tensors before the planner priced the reduction, and the
    engine then held the packed bucket's gradients a moment longer (its peak fell from 22.3 to 19.0 MB when it
    let go of them); within 10%, as for FSDP2 above."""
    argv = ["train", "--dry-run", "--nproc", "2", "--plan", f"fsdp2,zero={zero}", "--device", "cpu",
            "--set", "num_layers=2", "--set", "dim=256", "--global-batch", "4", "--seq-len", "64",
            "--micro-batch", str(2 // micro), "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    assert abs(_terms_error(capfd.readouterr().out)) <= 10


@pytest.mark.parametrize("ac", ["none", "full"])
def test_dry_run_with_dropout(tmp_path, capfd, ac):
    """At dropout 0.1 a CPU step keeps each dropout's noise and runs attention in SDPA's math path
    (memory.dropout_kept_elements), the embedding's noise whatever `ac` is: the planner's terms against the
    step's live tensors within 10%, as above (+0% and -4% measured; 32-34% under them before it counted the
    dropouts: `small` under dp1, tp2 and fsdp2)."""
    argv = ["train", "--dry-run", "--nproc", "1", "--plan", f"dp1,ac={ac}", "--device", "cpu", "--set", "num_layers=4",
            "--set", "dim=256", "--set", "dropout=0.1", "--global-batch", "4", "--seq-len", "128",
            "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    assert abs(_terms_error(capfd.readouterr().out)) <= 10


def test_dry_run_of_a_compiled_step_on_cpu_prices_what_memtracker_runs(tmp_path, capfd):
    """torch's MemTracker, which counts a CPU step's live tensors, is a dispatch mode, under which compiled blocks
    run op by op: the dry run compares that count with the eager terms and says so (the compiled terms, which
    the memory check uses, read 11% under it at 4 layers of dim 256; tests/test_planner_counts.py recounts them on
    compiled code)."""
    argv = ["train", "--dry-run", "--nproc", "1", "--plan", "dp1,compile=on", "--device", "cpu", "--set",
            "num_layers=2", "--set", "dim=128", "--global-batch", "2", "--seq-len", "64",
            "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    out = capfd.readouterr().out
    assert "runs compiled blocks op by op: priced so" in out
    assert abs(_terms_error(out)) <= 10


def _terms_error(text: str) -> int:
    """The dry run's printed error of the planner's terms against the step's live tensors, in percent."""
    found = re.search(r"step peak of live tensors, busiest rank: \d+ MB; the planner's terms, \d+ MB, "
                      r"are ([+-]\d+)% off", text)
    assert found, text
    return int(found.group(1))
