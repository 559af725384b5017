"""Context parallelism: ring attention and head-scatter attention over a split sequence equal
full attention in one process (outputs and gradients), and cp plans train like one process.

Tolerances: ring attention adds the same products as full attention, in blocks and merged with
an online softmax (a rescaling by exp(lse_old - lse_new) per block), so it differs from SDPA by
float32 rounding of sums of T terms: a few units of 2^-24 times T times the largest term. With
T <= 64 and values O(1), 1e-5 absolute bounds that with ~10x room. The a2a mode runs SDPA itself on
whole sequences, so it is exact up to the same kernel's blocking: the same bound.
In bf16 each element is compared with the float64 attention of the same bf16 inputs, within
G * u * S: u = 2^-8 is bf16's unit roundoff, S the sum of the absolute values of the terms whose
rounding makes the error (out: P|V|; dv: P^T|dO|; dq, dk: scale (|dS| + P diag(d)) |K| and its
transpose with |Q|, d = rowsum(|dO| P|V|) bounding the error the bf16 output carries into
rowsum(dO * O)), and G = 4: three roundings to bf16 on each path (the kernel rounds the
probabilities or dS before its second product; a block's result; the final result), each at most
u times S since the merge is a convex combination (fp32 sums add e.g. T 2^-24, far below u), and
one more for the products of those roundings and the fp32 arithmetic. Plain SDPA in bf16 meets the
same bound (checked beside it).
Model parity uses check_parity's measured-rounding bounds (shoal/testing/parity.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shoal import rules
from shoal.mesh import build_mesh
from shoal.models.transformer import causal_attention
from shoal.parallel import context
from shoal.parallel.context import ContextSplit, _calls, a2a_attention, chunks_of, positions, ring_attention
from shoal.plan import Plan
from shoal.testing.asserts import one_line_error
from shoal.testing.parity import SMALL, case, check_parity, run_parallel

ATOL = 1e-5
BF16_ROUNDOFF = 2.0**-8
BF16_GROWTH = 4


def test_zigzag_positions_cover_the_sequence_once():
    for cp in (1, 2, 4):
        held = torch.cat([positions(16 * cp, r, cp) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(16 * cp))
        assert chunks_of(0, 4) == [0, 7] and chunks_of(3, 4) == [3, 4]
    # Zig-zag: every rank gets the same share of the causal triangle; a plain split does not.
    def work(cp: int, balanced: bool) -> list[int]:
        return [int(sum(p + 1 for p in positions(8 * cp, r, cp, balanced=balanced))) for r in range(cp)]
    assert len(set(work(4, True))) == 1
    assert max(work(4, False)) > 3 * min(work(4, False))


def _attention_vs_full(mode: str, causal: bool, seq_len: int, flash: bool = True) -> float:
    """On each rank: the distributed attention of this rank's slice vs full attention's rows."""
    context.FUSED = flash
    try:
        return _attention_error(mode, causal, seq_len)
    finally:
        context.FUSED = True  # the pool's processes serve later tests


def _attention_error(mode: str, causal: bool, seq_len: int) -> float:
    plan = rules.resolve(Plan.parse(f"cp{dist.get_world_size()}"), world_size=dist.get_world_size())
    split = ContextSplit(build_mesh(plan)["cp"])
    torch.manual_seed(0)
    q, k, v, dy = (torch.randn(2, 4, seq_len, 8, dtype=torch.float32) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    if causal:
        full = causal_attention(q, k, v)
    else:
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    full.backward(dy)
    pos = positions(seq_len, split.rank, split.cp)
    ql, kl, vl = (t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    if mode == "ring":
        out = ring_attention(ql, kl, vl, split=split, causal=causal)
    else:
        out = a2a_attention(ql, kl, vl, split=split)
    out.backward(dy[:, :, pos])
    errors = [(out - full[:, :, pos]).abs().max()]
    errors += [(local.grad - whole.grad[:, :, pos]).abs().max() for local, whole in ((ql, q), (kl, k), (vl, v))]
    return float(max(errors))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode, causal, flash", [("ring", True, True), ("ring", False, True), ("ring", True, False),
                                                 ("ring", False, False), ("a2a", True, True)],
                         ids=["ring-causal", "ring-full", "ring-causal-plain", "ring-full-plain", "a2a-causal"])
@pytest.mark.parametrize("seq_len", [16, 64])
def test_attention_equals_full_attention(pools, world, mode, causal, flash, seq_len):
    """flash: blocks through torch's CPU flash kernel; plain: the formulas GPUs use here."""
    errors = pools(world).run(_attention_vs_full, mode, causal, seq_len, flash)
    assert max(errors) < ATOL, errors


def _reference64(q, k, v, do, causal: bool) -> tuple[dict, dict]:
    """Attention's values and gradients in float64, and the sums of absolute terms that bound their
    rounding errors (see the module's docstring): ({"out", "dq", "dk", "dv"}, the same keys)."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    scale = q.shape[-1] ** -0.5
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
    p = torch.softmax(s, dim=-1)
    out = p @ v
    ds = p * (do @ v.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    exact = {"out": out, "dq": ds @ k * scale, "dk": ds.transpose(-1, -2) @ q * scale, "dv": p.transpose(-1, -2) @ do}
    s_out = p @ v.abs()
    weight = ds.abs() + p * (do.abs() * s_out).sum(-1, keepdim=True)
    sums = {"out": s_out, "dq": weight @ k.abs() * scale, "dk": weight.transpose(-1, -2) @ q.abs() * scale,
            "dv": p.transpose(-1, -2) @ do.abs()}
    return exact, sums


def _bf16_error_over_bound(mode: str, causal: bool, seq_len: int, fused: bool) -> dict[str, float]:
    """On each rank: max |error| / bound of the bf16 distributed attention's values and gradients at
    this rank's positions, and the same for one-process bf16 SDPA (key "sdpa ...")."""
    plan = rules.resolve(Plan.parse(f"cp{dist.get_world_size()}"), world_size=dist.get_world_size())
    split = ContextSplit(build_mesh(plan)["cp"])
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, seq_len, 8).bfloat16() for _ in range(4))
    exact, sums = _reference64(q, k, v, do, causal)
    bound = {key: BF16_GROWTH * BF16_ROUNDOFF * t for key, t in sums.items()}
    pos = positions(seq_len, split.rank, split.cp)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    context.FUSED = fused
    try:
        out = (ring_attention(ql, kl, vl, split=split, causal=causal) if mode == "ring"
               else a2a_attention(ql, kl, vl, split=split))
        out.backward(do[:, :, pos])
    finally:
        context.FUSED = True  # the pool's processes serve later tests
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    sdpa.backward(do)
    got = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    whole = {"out": sdpa.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    ratios = {}
    for key in got:
        assert got[key].dtype == torch.bfloat16, (key, got[key].dtype)
        ratios[key] = float(((got[key].double() - exact[key][:, :, pos]).abs() / bound[key][:, :, pos]).max())
        ratios[f"sdpa {key}"] = float(((whole[key].double() - exact[key]).abs() / bound[key]).max())
    return ratios


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode, causal, fused", [("ring", True, True), ("ring", False, True), ("ring", True, False),
                                                 ("a2a", True, True)],
                         ids=["ring-causal", "ring-full", "ring-causal-plain", "a2a-causal"])
def test_bf16_attention_within_rounding_bound(pools, world, mode, causal, fused):
    """bf16 values and gradients against float64 attention of the same inputs, within G * u * S."""
    for ratios in pools(world).run(_bf16_error_over_bound, mode, causal, 64, fused):
        assert max(ratios.values()) <= 1.0, ratios


def test_block_calls_cover_the_visible_pairs_once():
    """The kernel calls of every (rank, block held) pair, zig-zag and plain, cp 1 to 4, causal or not:
    each query-key pair the mask leaves visible is computed exactly once, no hidden one; the zig-zag
    and plain splits take one call per held block."""
    for cp in (1, 2, 3, 4):
        for balanced in (True, False):
            seq_len = 4 * cp
            chunk = seq_len // (2 * cp if balanced else cp)
            for causal in (True, False):
                for rank in range(cp):
                    for source in range(cp):
                        mine, theirs = chunks_of(rank, cp, balanced=balanced), chunks_of(source, cp, balanced=balanced)
                        qpos = positions(seq_len, rank, cp, balanced=balanced)
                        kpos = positions(seq_len, source, cp, balanced=balanced)
                        visible = (kpos[None, :] <= qpos[:, None]) if causal else torch.ones(len(qpos), len(kpos))
                        covered = torch.zeros(len(qpos), len(kpos))
                        calls = _calls(mine, theirs, causal, chunk)
                        for rows, cols, diagonal in calls:
                            n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
                            block = torch.ones(n_rows, n_cols)
                            covered[rows, cols] += block.tril() if diagonal else block
                        assert torch.equal(covered, visible.float()), (cp, balanced, causal, rank, source, calls)
                        assert len(calls) <= 1
    # A pattern neither split makes falls back to one call per visible pair.
    assert _calls([0, 3], [3, 0], True, 2) == [(slice(0, 2), slice(2, 4), True), (slice(2, 4), slice(0, 2), True),
                                               (slice(2, 4), slice(2, 4), False)]


def test_blocks_run_in_the_inputs_dtype(monkeypatch):
    """No upcast before the kernels: a bf16 ring's blocks see bf16 queries, keys and values (their
    results are merged in fp32)."""
    seen = []
    forward = context._block_forward
    monkeypatch.setattr(context, "_block_forward",
                        lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or forward(q, k, v, **kw))
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.bfloat16) for _ in range(3))
    out, lse = context.attend_blocks(q, k, v, [0, 3], [0, 3], None, None, causal=True, scale=0.5)
    out, lse = context.attend_blocks(q, k, v, [0, 3], [1, 2], out, lse, causal=True, scale=0.5)
    assert seen == [(torch.bfloat16,) * 3] * 2 and out.dtype == lse.dtype == torch.float32


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_kernel_calls_on_the_meta_device(monkeypatch, kernel):
    """The CUDA branch's calls of torch's fused attention ops (argument order, the log-sum-exp's
    shape and dtype, the gradients' shapes), checked against torch's meta kernels: no GPU here, and
    the values come from the GPU check."""
    monkeypatch.setattr(context, "_kernel", lambda *args: kernel)
    B, H, T, E = 2, 4, 128, 64  # two zig-zag chunks of 64 on each side
    q, k, v, do = (torch.empty(B, H, T, E, dtype=torch.bfloat16, device="meta") for _ in range(4))
    out, lse = context.attend_blocks(q, k, v, [0, 3], [0, 3], None, None, causal=True, scale=E ** -0.5)
    out, lse = context.attend_blocks(q, k, v, [0, 3], [1, 2], out, lse, causal=True, scale=E ** -0.5)
    assert out.shape == (B, H, T, E) and out.dtype == torch.float32
    assert lse.shape == (B, H, T) and lse.dtype == torch.float32
    for theirs in ([0, 3], [1, 2]):
        parts = context.block_grads(do, q, k, v, out.bfloat16(), lse, [0, 3], theirs, causal=True, scale=E ** -0.5)
        for rows, cols, dq, dk, dv in parts:
            assert dq.shape == (B, H, rows.stop - rows.start, E) and dq.dtype == torch.bfloat16
            assert dk.shape == dv.shape == (B, H, cols.stop - cols.start, E)


@pytest.mark.parametrize("world, plan", [(2, "cp2"), (4, "cp4"), (2, "cp2,cp_mode=a2a"), (4, "dp2,cp2"),
                                         (4, "fsdp2,cp2"), (4, "cp4,cp_mode=a2a"), (4, "tp2,cp2"),
                                         (4, "tp2,cp2,sp=off"), (4, "fsdp2,cp2,zero=1"), (4, "fsdp2,cp2,zero=2"),
                                         (2, "cp2,cp_mode=a2a,compile=on")])
def test_cp_matches_single_process(pools, world, plan):
    c = case(plan=plan, model=SMALL)
    check_parity(pools(world).run(run_parallel, c), c)


def _a2a_compiled_vs_eager() -> float:
    """On each rank: a2a attention compiled as one graph (fullgraph: a graph break raises) against eager."""
    import torch._dynamo

    plan = rules.resolve(Plan.parse(f"cp{dist.get_world_size()}"), world_size=dist.get_world_size())
    split = ContextSplit(build_mesh(plan)["cp"])
    torch.manual_seed(0)
    q, k, v, dy = (torch.randn(2, 4, 32, 8) for _ in range(4))
    pos = positions(32, split.rank, split.cp)
    torch._dynamo.reset()

    def attend(a, b, c):
        return a2a_attention(a, b, c, split=split)

    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
        out = fn(ql, kl, vl)
        out.backward(dy[:, :, pos])
        results.append(torch.cat([out.detach(), ql.grad, kl.grad, vl.grad]))
    return float((results[0] - results[1]).abs().max())


def test_a2a_compiles_without_a_graph_break(pools):
    """The head scatter traces into one graph (torch's functional all-to-all); the compiled graph moves
    the same values as eager and runs SDPA's kernel: ATOL's bound."""
    assert max(pools(2).run(_a2a_compiled_vs_eager)) < ATOL


def test_cp_errors_are_one_line():
    plan = rules.resolve(Plan.parse("cp4"), world_size=4)
    assert "multiple of 8" in one_line_error(rules.validate, plan, SMALL, global_batch=8, seq_len=12)
    a2a = rules.resolve(Plan.parse("cp4,cp_mode=a2a"), world_size=4)
    narrow = SMALL.replace(dim=48, num_heads=6, num_kv_heads=6)
    assert "scatters the" in one_line_error(rules.validate, a2a, narrow, global_batch=8,
                                            seq_len=16)
    rules.resolve(Plan.parse("fsdp2,cp2"), world_size=4)  # resolving asks every rule: fsdp with cp runs


def test_cp_through_the_trainer(tmp_path):
    """`shoal train --plan cp2` (the runtime slices tokens and targets, averages the loss over the
    cp ranks) tracks the one-process run, evaluation included, and resumes under dp2."""
    import json

    from shoal import cli

    flags = ["--device", "cpu", "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch",
             "4", "--seq-len", "32", "--eval-every", "2", "--eval-batches", "1", "--steps", "4", "--ckpt-every", "2"]

    def records(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert cli.main(["train", "--out", str(tmp_path / "cp"), "--nproc", "2", "--plan", "cp2", *flags]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "one"), "--nproc", "1", *flags]) == 0
    cp, one = records(tmp_path / "cp"), records(tmp_path / "one")
    # Other sums in other orders (see test_train_e2e.LOSS_REL for the bound's derivation).
    assert [r["loss"] for r in cp] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    evals = [[r["eval_loss"] for r in run if "eval_loss" in r] for run in (cp, one)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], rel=1e-4)
    assert cli.main(["train", "--resume", str(tmp_path / "cp"), "--steps", "6", "--plan", "dp2"]) == 0
    assert [r["step"] for r in records(tmp_path / "cp")] == [1, 2, 3, 4, 5, 6]
