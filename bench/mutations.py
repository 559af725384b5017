"""A mutation bench: deliberate, realistic bugs planted one at a time in a copy of the tree, each run
against the tests that exist to catch it.

Each `Mutation` is a small textual patch to a file under src/shoal (an old string, present exactly
once, and its replacement), a one-line description, and the pytest arguments (test files, node ids,
-k selections) that should fail with it. The bench copies src/, tests/, bench/, tools/, docs/ and
pyproject.toml to a temporary folder per mutation, applies the patch there, runs
`python -m pytest -x -q` on the selection with PYTHONPATH pointing at the copy and a time limit,
and prints per mutation: caught (the first FAILED or ERROR line names the test), not caught, timed
out, or stale (its old string is no longer found exactly once: the list must follow the code).
It exits 1 unless every mutation is caught.

    python -m bench.mutations [--only NAME ...] [--timeout 240] [--baseline] [--list]

--baseline runs every selection on the unpatched tree instead (each must pass: a selection that
fails without its bug proves nothing). The list grows with each feature; `make test-slow` runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("src", "tests", "bench", "tools", "docs", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    """The file, relative to src/shoal."""
    old: str
    new: str
    what: str
    tests: tuple[str, ...]
    """pytest arguments: files, node ids, -k expressions."""


def _k(files: str, expr: str) -> tuple[str, ...]:
    return (*files.split(), "-k", expr)


MUTATIONS: list[Mutation] = [
    # ---------------------------------------------------------------- averages and scales
    Mutation("zero-bf16-reduce-sums", "parallel/zero.py",
             "b.grad.copy_(out).div_(self._world)", "b.grad.copy_(out)",
             "ZeRO-2 with reduce=bf16: gradients summed over the ranks, not averaged",
             ("tests/test_precision.py::test_mixed_precision_tracks_fp32[fsdp2,zero=2,precision=bf16,reduce=bf16]",)),
    Mutation("ddp-bf16-hook-sums", "parallel/data.py",
             "sent = fp32.div(group.size()).to(dtype)", "sent = fp32.to(dtype)",
             "DDP's bf16 reduce hook (_reduce_in) does not divide by the world size",
             ("tests/test_precision.py::test_mixed_precision_tracks_fp32[dp2,precision=bf16,reduce=bf16]",)),
    Mutation("distill-micro-sum", "runtime.py",
             "return lambda output, targets: loss_fn(output, targets) / len(local)",
             "return lambda output, targets: loss_fn(output, targets)",
             "a loss function's micro-batch means summed, not averaged (distillation's loss path)",
             _k("tests/test_distill.py", "matches_one_process and fsdp2")),
    Mutation("global-mean-sums", "mesh.py",
             "    return value / count", "    return value",
             "the loss reported as the sum over data ranks, not their mean",
             ("tests/test_parity_dp.py::test_dp_matches_single_process[dp2]",)),
    Mutation("sharded-vocab-sums", "parallel/sharded_vocab.py",
             "        grad_w.div_(dist.get_world_size(self.shards))\n", "",
             "a vocabulary-sharded table's gradient summed over its shard group, not averaged",
             _k("tests/test_parity_zero.py", "test_zero_stages_match_single_process and 2")),
    Mutation("experts-sum", "parallel/expert.py",
             "            local.div_(self.data_ranks)", "            local.div_(1)",
             "expert-parallel gradients summed over the data ranks, not averaged",
             _k("tests/test_moe_parallel.py", "test_ep2_matches_single_process")),
    Mutation("clip-scales-up", "runtime.py",
             "(max_norm / (norm + 1e-6)).clamp(max=1.0)", "(max_norm / (norm + 1e-6))",
             "gradient clipping also scales small gradients up to the threshold",
             _k("tests/test_runtime.py", "one_process_is_the_plain_loop")),
    Mutation("tied-pp-not-summed", "parallel/tied.py",
             "            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)",
             "            pass",
             "a tied embedding split over pipeline stages: the two copies' gradients not summed",
             ("tests/test_pipeline_tied.py::test_tied_pp2_matches_single_process[pp2]",)),
    # ---------------------------------------------------------------- offsets, masks, orders, ties
    Mutation("data-rank-offset", "data/text.py",
             "self.windows(step * size + index * local, local)",
             "self.windows(step * size + index * local + index, local)",
             "rank i's slice of the global batch starts i samples late (a shard offset off by one)",
             _k("tests/test_data.py", "rank_slices_tile")),
    Mutation("mistral-window-wide", "models/attention.py",
             "band_TT = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)",
             "band_TT = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window)",
             "the sliding window's mask one key too wide (Mistral)",
             _k("tests/test_hf_families.py", "test_logits_loss_and_gradients_equal_transformers and mistral")),
    Mutation("zigzag-order-swapped", "parallel/context.py",
             "return [rank, 2 * cp - 1 - rank] if balanced else [rank]",
             "return [2 * cp - 1 - rank, rank] if balanced else [rank]",
             "context parallelism's balanced chunks of a rank in swapped order",
             _k("tests/test_context.py", "zigzag_positions")),
    Mutation("ring-merge-wrong", "parallel/context.py",
             "torch.sigmoid(block_lse - lse[:, :, rows])", "torch.sigmoid(lse[:, :, rows] - block_lse)",
             "ring attention merges a block with the other block's softmax weight",
             ("tests/test_context.py::test_attention_equals_full_attention[16-ring-causal-plain-2]",)),
    Mutation("router-tie-highest", "moe/router.py",
             "values_NE, indices_NE = torch.sort(probs_NE, dim=-1, descending=True, stable=True)",
             "values_NE, indices_NE = torch.sort(probs_NE.flip(-1), dim=-1, descending=True, stable=True)\n"
             "    indices_NE = probs_NE.shape[-1] - 1 - indices_NE",
             "the router breaks a tie between experts toward the highest index",
             _k("tests/test_moe.py", "ties_go_to_the_lowest_index")),
    # ---------------------------------------------------------------- config fields and defaults
    Mutation("rope-llama3-low-default", "models/rope.py",
             "factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor",
             "factor, low, high = cfg.rope_factor, 1.0, cfg.rope_high_freq_factor",
             "llama3 rope: low_freq_factor's default used instead of the value read",
             _k("tests/test_models.py", "scaled_rope")),
    Mutation("rope-yarn-beta-default", "models/rope.py",
             "low, high = dimension_at(cfg.rope_beta_fast), dimension_at(cfg.rope_beta_slow)",
             "low, high = dimension_at(32.0), dimension_at(cfg.rope_beta_slow)",
             "yarn rope: beta_fast's default used instead of the value read",
             _k("tests/test_models.py", "scaled_rope")),
    Mutation("rope-yarn-truncate-ignored", "models/rope.py",
             "    if cfg.rope_truncate:", "    if True:",
             "yarn rope: truncate ignored (always truncated)",
             _k("tests/test_models.py", "scaled_rope")),
    Mutation("hf-low-freq-dropped", "models/hf/llama.py",
             'low_freq_factor="rope_low_freq_factor", ', "",
             "the Hugging Face mapping ignores rope_scaling.low_freq_factor",
             _k("tests/test_hf.py", "rope_scaling_maps")),
    Mutation("schedule-warmup-off-by-one", "optim/schedule.py",
             "return self.lr * (step + 1) / self.warmup_steps", "return self.lr * step / self.warmup_steps",
             "the warm-up's first step has learning rate 0 (off by one)",
             _k("tests/test_optim.py", "schedule_hand_computed")),
    Mutation("held-out-mean-of-means", "train/loop.py",
             "total += torch.stack([mean_loss * mean_count, mean_count])",
             "total += torch.stack([mean_loss, torch.ones_like(mean_count)])",
             "the held-out loss a mean of the batches' means, not weighted by their targets",
             _k("tests/test_train_e2e.py", "held_out_loss_weighs")),
    # ---------------------------------------------------------------- optimizers
    Mutation("trust-ratio-inverted", "optim/sharded_norms.py",
             "num_sq.sqrt() / den_sq.sqrt().clamp(min=torch.finfo(den_sq.dtype).tiny)",
             "den_sq.sqrt() / num_sq.sqrt().clamp(min=torch.finfo(num_sq.dtype).tiny)",
             "LAMB/LARS trust ratio upside down",
             _k("tests/test_optim_large_batch.py", "hand_computed")),
    Mutation("sharded-norm-local", "optim/sharded_norms.py",
             "                dist.all_reduce(packed, group=group)\n", "",
             "a sharded tensor's squared norm not summed over its shards (trust ratio of a shard)",
             _k("tests/test_optim_large_batch.py", "norms_are_taken_over_whole_parameters")),
    Mutation("gate-state-not-restored", "optim/gate.py",
             "kept += [(_local(state[k]), old) for k, old in had[id(p)].items()]", "kept += []",
             "the non-finite gate puts the weights back but not the optimizer's moments",
             _k("tests/test_optim.py", "gate_puts_back")),
    # ---------------------------------------------------------------- mixed precision
    Mutation("scaler-counter-not-reset", "parallel/precision.py",
             "good = torch.where(finite, self._good + 1, 0)", "good = torch.where(finite, self._good + 1, self._good)",
             "the fp16 loss scaler's growth counter not reset on an overflow",
             _k("tests/test_precision.py", "scaler or overflow")),
    Mutation("scaler-no-backoff", "parallel/precision.py",
             "torch.where(finite, grown, scale / 2)", "torch.where(finite, grown, scale)",
             "the fp16 loss scale kept, not halved, after an overflow",
             _k("tests/test_precision.py", "loss_scaler_skips")),
    # ---------------------------------------------------------------- checkpoints
    Mutation("latest-names-final-first", "train/checkpoint.py",
             "        _point_latest(root, tmp.name)\n        old = final.with_name",
             "        _point_latest(root, final.name)\n        old = final.with_name",
             "a re-save points `latest` at the final name before the new data is there (a crash between the "
             "renames leaves no complete checkpoint named)",
             _k("tests/test_checkpoint.py", "resave_of_a_step_never_exposes")),
    Mutation("crc-not-compared", "train/checkpoint.py",
             "            if _crc32(path / name) != crc:", "            if False:",
             "a checkpoint file's checksum not compared (same size, different bytes loads)",
             _k("tests/test_checkpoint.py", "byte_flipped_in_the_weights")),
    Mutation("pooled-probs-doubled", "moe/layer.py",
             "shares_NE.float().sum(0), N)", "2 * shares_NE.float().sum(0), N)",
             "an MoE layer's summed router probabilities for the pooled load-balancing loss doubled (every "
             "plan's collector reads them; the one-process reference writes the loss out from the gate logits)",
             _k("tests/test_moe_parallel.py", "pooled_router_loss_in_a_pipeline and zb")),
    # ---------------------------------------------------------------- Muon
    Mutation("muon-scatter-wrong-slice", "optim/orthogonalize.py",
             "back = [[layouts[j].take(results[j], r) for j in mine] for r in range(size)]",
             "back = [[layouts[j].take(results[j], r) for j in mine] for r in reversed(range(size))]",
             "Muon's owner sends each rank another rank's slice of the orthogonalised matrix",
             _k("tests/test_muon.py", "parity_with_one_process")),
    Mutation("muon-lr-by-shard-shape", "optim/muon.py",
             '_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:])',
             '_adjust_lr(lr, group["adjust_lr_fn"], local_tensor(p).shape[-2:])',
             "Muon's lr adjusted by the local shard's shape, not the whole matrix's",
             _k("tests/test_muon.py", "parity_with_one_process")),
    # ---------------------------------------------------------------- router options (DeepSeek-V3's)
    Mutation("router-norm-no-eps", "moe/router.py",
             "weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + NORM_EPS)",
             "weights_NK / weights_NK.sum(dim=-1, keepdim=True)",
             "normalised top-k weights without transformers' 1e-20 in the denominator",
             _k("tests/test_router_options.py", "1e_20")),
    Mutation("router-groups-by-max", "moe/router.py",
             "group_NG = top_choices(scores_NGS, 2)[0].sum(dim=-1)", "group_NG = scores_NGS.amax(dim=-1)",
             "group-limited routing ranks a group by its best score, not the sum of its two best",
             _k("tests/test_router_options.py", "two_highest")),
    Mutation("router-bias-local-loads", "runtime.py",
             "self._moe.update_bias(self._sum_over_data if self._data_groups else None, applied)",
             "self._moe.update_bias(None, applied)",
             "the selection bias moves by this rank's loads only, not the global batch's",
             _k("tests/test_router_options.py", "test_bias_and_training_under_plan_equal_one_process and dp2")),
    Mutation("a2a-dedup-offset", "parallel/expert.py",
             "row_of = got_meta[:, 0] + first_in[source_R]", "row_of = got_meta[:, 0]",
             "the deduplicating all-to-all expands every source's choices from the first source's tokens",
             _k("tests/test_moe_parallel.py", "test_ep2_matches_single_process")),
    # ---------------------------------------------------------------- low-rank adapters
    Mutation("lora-tp-trains-frozen", "parallel/tensor.py",
             "        model.get_parameter(name).requires_grad_(False)", "        pass",
             "tensor parallelism makes a LoRA run's frozen norm weights trainable again (SequenceParallel's re-wrap)",
             _k("tests/test_lora.py", "parity_two")),
    Mutation("lora-peft-rows", "train/peft_io.py",
             "            tensor = llama.to_halves(tensor, llama.rotated_heads(f\"{module}.weight\", cfg), "
             "cfg.head_dim)",
             "            pass",
             "a peft export keeps B's query/key rows in shoal's interleaved order, not transformers' halves",
             _k("tests/test_lora.py", "peft")),
]


def stale(mutation: Mutation, root: Path = ROOT) -> str | None:
    """Why the mutation no longer applies to the tree at `root` (None: its old string is there exactly once)."""
    path = root / "src" / "shoal" / mutation.path
    if not path.is_file():
        return f"src/shoal/{mutation.path} is gone"
    count = path.read_text().count(mutation.old)
    return None if count == 1 else f"its old string is found {count} times in src/shoal/{mutation.path}"


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results", ".pytest_cache")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        elif source.is_file():
            shutil.copy2(source, dest / name)


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line if len(line) <= 200 else line[:197] + "..."
    match = re.search(r"^E .*$", output, re.MULTILINE)
    return match.group(0) if match else output.strip().splitlines()[-1] if output.strip() else ""


def run_one(mutation: Mutation, *, timeout: float, baseline: bool = False) -> tuple[str, str, float]:
    """(status, detail, seconds): status caught / not caught / timed out / stale / broken selection."""
    why = stale(mutation)
    if why is not None:
        return "stale", why, 0.0
    with tempfile.TemporaryDirectory(prefix="mut-") as tmp:
        copy = Path(tmp)
        _copy_tree(copy)
        if not baseline:
            path = copy / "src" / "shoal" / mutation.path
            path.write_text(path.read_text().replace(mutation.old, mutation.new, 1))
        env = {**os.environ, "PYTHONPATH": f"{copy / 'src'}{os.pathsep}{copy}", "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests]
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return "timed out", f"after {timeout:.0f} s", time.perf_counter() - start
        seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode == 0:
        return ("passed" if baseline else "not caught"), "", seconds
    if done.returncode == 1:
        return ("FAILED" if baseline else "caught"), _first_failure(output), seconds
    return "broken selection", f"pytest exit {done.returncode}: {_first_failure(output)}", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mutations", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="run only these mutations (by name)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per mutation (default 240)")
    parser.add_argument("--baseline", action="store_true", help="run each selection on the unpatched tree")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTATIONS}
    unknown = sorted(set(args.only or []) - names)
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: no such mutation; valid: {', '.join(sorted(names))}")
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:28} src/shoal/{m.path:26} {m.what}")
        return 0
    wanted = "passed" if args.baseline else "caught"
    failures, total_start = 0, time.perf_counter()
    print(f"{'mutation':28} {'status':16} {'s':>5}  first failing test / detail")
    for m in chosen:
        status, detail, seconds = run_one(m, timeout=args.timeout, baseline=args.baseline)
        failures += status != wanted
        print(f"{m.name:28} {status:16} {seconds:5.0f}  {detail}", flush=True)
    total = time.perf_counter() - total_start
    print(f"{len(chosen) - failures} of {len(chosen)} {wanted}, {total:.0f} s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
