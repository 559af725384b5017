"""Muon: torch.optim.Muon's update in one process, each expert orthogonalised on its own, the split of parameters
between Muon and AdamW, and parity with one process under dp, fsdp (ZeRO 1/2/3), tp, pp, cp and ep.

Tolerances.
- One process, whole 2-D tensors: shoal's step runs torch's own operations in torch's order on the same
  tensors, so it must equal torch.optim.Muon (and torch's fused AdamW for the rest) bit for bit.
- The first step under a plan, from the plan's own gradients (`_check_update`): every rank orthogonalises the
  bfloat16 cast of the whole update matrix, which the owner's gather rebuilds bit for bit from the slices
  (a cast is elementwise), with the same Newton-Schulz function on the same shape: the same bfloat16 result.
  The momentum and the weight update are elementwise, on the same float32 values, but on a slice rather than
  the whole tensor: a vectorised loop may then take another path (fused multiply-add or not) for an entry, one
  float32 rounding of the result: bound 2 u32 |w| per entry, plus 2 u32 of the step, lr_adj |O|.
- Losses of several steps and the final weights: the gradients of a plan differ from the single process's
  by float32 rounding (another order of sums); Newton-Schulz casts them to bfloat16, and an entry that lies
  within that rounding of a bfloat16 boundary rounds the other way, a change of 2^-8 of the entry rather than
  2^-24. The yardstick is measured: the single-process float64 run with Newton-Schulz in bfloat16 against the
  same run with Newton-Schulz in float64 (`references`), the effect of every bfloat16 rounding of every step,
  which bounds the effect of the few that flip. A parallel run may be off the float64 run by SLACK times the
  float32 run's own error plus that yardstick.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from shoal.optim.builder import build_optimizer
from shoal.optim.config import OptimConfig
from shoal.optim.muon import Muon
from shoal.testing.asserts import SLACK, U32, assert_rounding_close, assert_user_error, one_line_error
from shoal.testing.parity import ParityCase, references, run_parallel, run_reference

# ----------------------------------------------------------------------------- one process


def _pairs(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return ws, grads


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_bit_for_bit(adjust, nesterov):
    """Four steps on a tall and a wide matrix (Muon) and a vector (AdamW), one of them gated (ok=True):
    torch.optim.Muon and torch's fused AdamW give the same bits."""
    ws, grads = _pairs([(8, 5), (5, 12), (7,)], steps=4)
    mine, theirs = [nn.Parameter(w.clone()) for w in ws], [nn.Parameter(w.clone()) for w in ws]
    opt = Muon([{"params": mine[:2]}, {"params": mine[2:], "muon": False, "lr": 0.01, "weight_decay": 0.0}],
               lr=0.05, weight_decay=0.1, adjust_lr_fn=adjust, nesterov=nesterov)
    ref = torch.optim.Muon(theirs[:2], lr=0.05, weight_decay=0.1, adjust_lr_fn=adjust, nesterov=nesterov)
    ref_adamw = torch.optim.AdamW(theirs[2:], lr=0.01, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
    for step, gs in enumerate(grads):
        for a, b, g in zip(mine, theirs, gs):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step(ok=torch.tensor(True) if step == 1 else None)
        ref.step()
        ref_adamw.step()
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert opt.last_trust.numel() == 2 and bool((opt.last_trust > 0).all())


def test_experts_orthogonalised_one_by_one():
    """A stacked (E, a, b) expert weight steps as E separate matrices under torch.optim.Muon, each with the lr
    adjusted by its own (a, b); whole-tensor orthogonalisation of the stack would differ."""
    ws, grads = _pairs([(3, 6, 4)], steps=3, seed=1)
    stacked = nn.Parameter(ws[0].clone())
    experts = [nn.Parameter(ws[0][e].clone()) for e in range(3)]
    opt = Muon([stacked], lr=0.05, adjust_lr_fn="match_rms_adamw")
    ref = torch.optim.Muon(experts, lr=0.05, adjust_lr_fn="match_rms_adamw")
    for (g,) in grads:
        stacked.grad = g.clone()
        for e, p in enumerate(experts):
            p.grad = g[e].clone()
        opt.step()
        ref.step()
    assert torch.equal(stacked.detach(), torch.stack([p.detach() for p in experts]))
    assert opt.last_trust.numel() == 3  # one update RMS per expert


def test_gated_step_changes_nothing():
    ws, grads = _pairs([(4, 6), (6,)], steps=2)
    params = [nn.Parameter(w.clone()) for w in ws]
    opt = Muon([{"params": params[:1]}, {"params": params[1:], "muon": False}], lr=0.05)
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in params], {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    for p, g in zip(params, grads[1]):
        p.grad = g
    opt.step(ok=torch.tensor(False))
    assert all(torch.equal(p, b) for p, b in zip(params, before[0]))
    assert all(torch.equal(v, before[1][k]) for s in opt.state.values() for k, v in s.items())


def test_hidden_matrices_to_muon_the_rest_to_adamw():
    """The builder's split on an MoE transformer: the blocks' matrices and stacked experts to Muon; the token
    embedding, the head, the norms to AdamW at muon_adamw_lr (matrices with weight decay, vectors without);
    muon_adamw moves names to AdamW."""
    from shoal.models import build_model

    model = build_model(MOE)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(optimizer="muon", lr=0.02, muon_adamw_lr=0.004))
    groups = [(g["muon"], g["lr"], g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
              for g in opt.param_groups]
    assert [g[:3] for g in groups] == [(True, 0.02, 0.1), (False, 0.004, 0.1), (False, 0.004, 0.0)]
    assert groups[1][3] == ["output.weight", "tok_embeddings.weight"]
    assert all(n.startswith("layers.") for n in groups[0][3]) and "layers.0.feed_forward.experts.w1" in groups[0][3]
    assert all(n.endswith("norm.weight") for n in groups[2][3])
    opt = build_optimizer(model, OptimConfig(optimizer="muon", muon_adamw="router"))
    assert not any("router" in names[id(p)] for p in opt.param_groups[0]["params"])


@pytest.mark.parametrize("n, parts", [(8, 2), (5, 2), (3, 4), (7, 3), (1, 2)])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_indices_follow_dtensor_s_shard(n, parts, dim):
    """The owner's slicing follows DTensor's Shard (torch.chunk: ceil(n / parts) rows each, trailing ones
    shorter or empty), which an uneven split must match row for row."""
    from torch.distributed.tensor import Shard

    from shoal.optim.orthogonalize import shard_indices

    shape = (n, 3) if dim == 0 else (3, n)
    whole = torch.arange(3 * n).reshape(shape)
    for r in range(parts):
        got = shard_indices(shape, [Shard(dim)], [parts], [r])
        size, offset = Shard.local_shard_size_and_offset(n, parts, r)
        assert torch.equal(got, whole.narrow(dim, offset, size).reshape(-1))


@pytest.mark.parametrize("rows", [8, 10, 7])
def test_shard_indices_of_fsdp_over_tp(rows):
    """A matrix under fsdp2 over tp2 (FSDP2's _StridedShard on the fsdp dim, then tp's Shard, both of dim 0): the
    rank at (f, t) holds chunk f of tp's chunk t (FSDP2 shards each tp rank's local rows), and with a row-wise tp
    split (Shard(1)) chunk f of the rows of column chunk t; the four slices cover the matrix once."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from shoal.optim.orthogonalize import shard_indices

    whole = torch.arange(rows * 6).reshape(rows, 6)
    for placements, tp_dim in (([_StridedShard(0, split_factor=2), Shard(0)], 0), ([Shard(0), Shard(1)], 1)):
        seen = []
        for f in range(2):
            for t in range(2):
                got = shard_indices(whole.shape, placements, [2, 2], [f, t])
                want = whole.chunk(2, dim=tp_dim)[t].chunk(2, dim=0)[f].reshape(-1)
                assert torch.equal(got, want), (placements, f, t)
                seen.append(got)
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(rows * 6))


def test_a_slice_that_is_a_box_is_copied_as_one_and_any_other_by_its_indices():
    """_Layout.put/take copy a member's slice as a box of the matrix where its flat indices form one (a Shard of
    rows or columns, fsdp over tp's rows of a tp chunk), and scatter by the indices otherwise (rows interleaved by
    a _StridedShard alone, an empty slice); either way they write and read the elements shard_indices names, in
    its order (the reference: plain indexing by those indices)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from shoal.optim.orthogonalize import _Layout, shard_indices

    cases = [((8, 6), [Shard(0)], [2], [1], True), ((8, 6), [Shard(1)], [2], [0], True),
             ((7, 6), [Shard(1)], [4], [2], True), ((2, 6, 6), [Shard(1)], [2], [1], True),
             ((8, 6), [_StridedShard(0, split_factor=2), Shard(0)], [2, 2], [1, 0], True),
             ((7, 6), [Shard(1)], [4], [3], False), ((8, 6), [_StridedShard(0, split_factor=2)], [2], [0], False)]
    for shape, placements, sizes, coord, is_box in cases:
        layout = _Layout(shape=torch.Size(shape), placements=tuple(placements), sizes=tuple(sizes), coords=[coord],
                         group=None, position=0)  # type: ignore[arg-type]  # no collective runs here
        indices = shard_indices(shape, placements, sizes, coord)
        assert isinstance(layout.place(0), tuple) == is_box, (shape, placements)
        assert layout.numel(0) == indices.numel()
        whole = torch.randn(int(torch.Size(shape).numel()))
        assert torch.equal(layout.take(whole, 0), whole[indices]), (shape, placements)
        full = torch.zeros_like(whole)
        layout.put(full, 0, whole[indices])
        want = torch.zeros_like(whole)
        want[indices] = whole[indices]
        assert torch.equal(full, want), (shape, placements)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    ({"optimizer": "muon", "muon_momentum": 1.0}, "--muon-momentum 1.0"),
    ({"optimizer": "muon", "muon_ns_steps": 0}, "--muon-ns-steps 0"),
    ({"optimizer": "muon", "muon_adjust_lr": "spectral"}, "--muon-adjust-lr 'spectral' is not valid; valid: original"),
    ({"optimizer": "muon", "muon_gather": "all"}, "--muon-gather 'all' is not valid; valid: owner, naive"),
    ({"optimizer": "muon", "muon_adamw_lr": 0.0}, "--muon-adamw-lr 0.0"),
    ({"optimizer": "adamw", "muon_adamw_lr": 1e-3}, "--muon-adamw-lr 0.001 has no effect with --optimizer adamw"),
])
def test_bad_muon_config(kwargs, match):
    assert match in one_line_error(OptimConfig, **kwargs)


@pytest.mark.parametrize("argv, names", [
    (["--optimizer", "muon", "--muon-adjust-lr", "x"], ["--muon-adjust-lr 'x'", "original, match_rms_adamw"]),
    (["--optimizer", "muon", "--muon-ns-steps", "500"], ["--muon-ns-steps 500", "1..99"]),
    (["--muon-momentum", "0.9"], ["--muon-momentum 0.9", "--optimizer muon"]),
    (["--optimizer", "muon", "--muon-nesterov", "maybe"], ["'maybe'", "on, off"]),
])
def test_bad_muon_flags(capsys, tmp_path, argv, names):
    assert_user_error(capsys, ["train", "--out", str(tmp_path / "run"), "--device", "cpu", *argv], *names)
    assert not (tmp_path / "run").exists()


def test_muon_rejects_vectors():
    assert "valid: put vectors in a group with muon=False" in one_line_error(Muon, [nn.Parameter(torch.ones(3))])


# ----------------------------------------------------------------------------- under every plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonCase(ParityCase):
    """A parity case trained with Muon as the trainer builds it (from the runtime, or the plain model)."""

    lr: float = 0.01
    gather: str = "owner"

    def optimizer_for(self, source):
        return build_optimizer(source, OptimConfig(optimizer="muon", lr=self.lr, weight_decay=0.1, eps=self.adam_eps,
                                                   muon_gather=self.gather))


MOE = dataclasses.replace(MuonCase().model, num_experts=4, top_k=2, ffn_dim=64)
PLANS = [MuonCase(plan=p) for p in ("dp2", "fsdp2,zero=1", "fsdp2,zero=2", "fsdp2", "tp2", "cp2")] + [
    MuonCase(plan="pp2,mb=2", num_micro=2), MuonCase(plan="ep2", model=MOE, steps=3),
    MuonCase(plan="fsdp2,ep2", model=MOE, steps=3),
    MuonCase(plan="fsdp2", model=MuonCase().model.replace(ffn_dim=81))]  # uneven slices: 41 and 40 rows


def _exact_newton_schulz(full, coefficients, steps, eps):
    """torch's Newton-Schulz in the input's dtype (float64) rather than bfloat16: the yardstick's run."""
    a, b, c = coefficients
    x = full.T if full.size(0) > full.size(1) else full
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if full.size(0) > full.size(1) else x


def bf16_yardstick(case: MuonCase) -> dict[str, Any]:
    """The float64 single-process run with Newton-Schulz in float64 (see the module's docstring)."""
    import shoal.optim.orthogonalize as orth

    real = orth._zeropower_via_newtonschulz
    orth._zeropower_via_newtonschulz = _exact_newton_schulz
    try:
        return run_reference(case, torch.float64)
    finally:
        orth._zeropower_via_newtonschulz = real


_YARDSTICKS: dict[str, dict[str, Any]] = {}


def _yardstick(case: MuonCase) -> dict[str, Any]:
    if repr(case) not in _YARDSTICKS:
        _YARDSTICKS[repr(case)] = bf16_yardstick(case)
    return _YARDSTICKS[repr(case)]


def _check_update(case: MuonCase, res: dict[str, Any], every: dict[str, torch.Tensor], what: str) -> None:
    """This rank's weights after the first step against the single process's Muon applied to the plan's own
    gradients (clipped with the plan's own coefficient): equal up to one float32 rounding (module docstring)."""
    model = case.build_model()
    optimizer = case.optimizer_for(model)
    coef = (case.grad_clip / (torch.tensor(res["grad_norm"], dtype=torch.float32) + 1e-6)).clamp(max=1.0)
    for name, param in model.named_parameters():
        param.grad = every[name].clone() * coef
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    exact = 0
    for name, param in model.named_parameters():
        if name not in res["params"]:
            continue
        step = (param.detach() - before[name]).abs()
        bound = 2 * U32 * (param.detach().abs() + step)
        diff = (res["params"][name] - param.detach()).abs()
        assert bool((diff <= bound).all()), f"{what} params[{name}] after step 1: off by {diff.max().item():.3g}"
        exact += int(torch.equal(res["params"][name], param.detach()))
    res["exact"] = exact


def _check(results: list[list[dict[str, Any]]], cases: list[MuonCase]) -> dict[str, tuple[int, int]]:
    """Gradients, first-step update, losses and final weights of every case on every rank; returns, per plan, how
    many tensors came out of the first step bit-equal to the single process's (and of how many)."""
    exact: dict[str, tuple[int, int]] = {}
    for i, c in enumerate(cases):
        ref32, ref64 = references(c)
        exact_ns = _yardstick(c)
        every: dict[str, torch.Tensor] = {}
        for r in results:
            every.update(r[i]["grads"])
        for rank, res in enumerate(r[i] for r in results):
            what = f"muon {c.plan} rank {rank}"
            mine = set(res["grads"])
            assert_rounding_close(res["grads"], {k: ref32["grads"][k] for k in mine},
                                  {k: ref64["grads"][k] for k in mine}, what=f"{what} first-step grads")
            _check_update(c, res, every, what)
            exact[f"{c.plan} #{i} rank {rank}"] = (res["exact"], len(res["params"]))
            bf16 = torch.tensor(exact_ns["losses"]) - torch.tensor(ref64["losses"])
            off = (torch.tensor(res["losses"], dtype=torch.float64) - torch.tensor(ref64["losses"])).abs().max()
            single = (torch.tensor(ref32["losses"], dtype=torch.float64) - torch.tensor(ref64["losses"])).abs().max()
            bound = SLACK * single + bf16.abs().max()
            assert off <= bound, f"{what} losses: {off:.3g} off the float64 run > {bound:.3g}"
            for name, final in res["final_params"].items():
                truth = ref64["final_params"][name]
                single = (ref32["final_params"][name].double() - truth).norm()
                yard = (exact_ns["final_params"][name] - truth).norm()
                off = (final.double() - truth).norm()
                assert off <= SLACK * single + yard, f"{what} final {name}: {off:.3g} > {SLACK * single + yard:.3g}"
    return exact


def run_cases(cases):
    return [run_parallel(c) for c in cases]


def test_parity_with_one_process(pools):
    """dp2, fsdp2 at zero 1/2/3, tp2 (row and column splits), cp2, pp2, ep2 (an MoE model: each rank's
    experts whole), fsdp2,ep2 (the dense part sharded, the experts split over ep) and fsdp2 with uneven slices
    on 2 processes against the single process (`_check`); and the single-process runs moved every weight."""
    exact = _check(pools(2).run(run_cases, PLANS), PLANS)
    print("tensors bit-equal after the first step:", exact)
    for c in PLANS:
        ref64 = references(c)[1]
        assert all(not torch.equal(ref64["final_params"][k], ref64["init_params"][k]) for k in ref64["init_params"])


FOUR = [MuonCase(plan="fsdp2,tp2")]


def test_parity_fsdp_over_tp(pools):
    """fsdp2,tp2 on 4 processes: the matrices split over two mesh dims (FSDP2's strided rows over tp's rows or
    columns), each gathered to one owner among the 4 holders, against the single process (`_check`)."""
    exact = _check(pools(4).run(run_cases, FOUR), FOUR)
    print("tensors bit-equal after the first step:", exact)


# ----------------------------------------------------------------------------- the owner design's communication


def _step_counts(plan_text: str, gather: str, num_layers: int, batch_elems: int = 1 << 24) -> dict[str, Any]:
    """One Muon step under `plan_text`: what the orthogonaliser sent and the weights after it."""
    from shoal.testing.asserts import full_tensors
    from shoal.testing.parity import parallel_setup
    from shoal.train.step import split_micro, train_step

    c = MuonCase(plan=plan_text, gather=gather, model=MuonCase().model.replace(num_layers=num_layers), steps=1)
    runtime, optimizer, batches = parallel_setup(c)
    orth = optimizer.orthogonalize
    orth.batch_elems = batch_elems
    train_step(runtime, optimizer, split_micro(*batches[0], 1), grad_clip=c.grad_clip)
    split = sum(1 for g in optimizer.param_groups if g["muon"] for p in g["params"] if not torch.equal(
        torch.tensor(p.shape), torch.tensor(p.to_local().shape)))
    return {"bytes": orth.bytes_sent, "min": orth.min_bytes, "collectives": orth.collectives,
            "owned": orth.min_bytes > 0, "params": full_tensors(runtime), "split": split}


@pytest.mark.parametrize("plan_text", ["fsdp2", "tp2"])
def test_owner_sends_the_minimum_in_two_collectives(pools, plan_text):
    """Under fsdp2 and tp2: the bytes every rank sent, summed, equal the owner design's minimum (2 (n - the
    owner's slice) bfloat16 elements per matrix); two all-to-alls per step, whatever the number of layers; both
    ranks own matrices; the weights equal the naive design's bit for bit (the same bfloat16 matrices go
    through the same Newton-Schulz)."""
    pool = pools(2)
    for layers in (1, 3):
        owner = pool.run(_step_counts, plan_text, "owner", layers)
        naive = pool.run(_step_counts, plan_text, "naive", layers)
        assert sum(r["bytes"] for r in owner) == sum(r["min"] for r in owner) > 0
        assert all(r["collectives"] == 2 and r["owned"] for r in owner), owner
        assert all(r["collectives"] > 2 for r in naive)
        for a, b in zip(owner, naive):
            assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_owner_over_two_axes_sends_the_minimum(pools):
    """fsdp2,tp2 on 4 processes: every matrix (split over both axes) goes to one owner among its 4 holders in the
    two all-to-alls of a step, every rank owning some; the bytes sent, summed, equal the owner design's minimum,
    2 (W - 1) / W x n x 2 bytes for even slices (here 3/4 x n x 4); the weights equal the naive design's (DTensor's
    own full_tensor and distribute_tensor) bit for bit."""
    pool = pools(4)
    owner = pool.run(_step_counts, "fsdp2,tp2", "owner", 2)
    naive = pool.run(_step_counts, "fsdp2,tp2", "naive", 2)
    assert sum(r["bytes"] for r in owner) == sum(r["min"] for r in owner) > 0
    assert all(r["collectives"] == 2 and r["owned"] for r in owner), owner
    for a, b in zip(owner, naive):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_batches_of_one_matrix_keep_the_round_robin(pools):
    """Batches cut to one matrix each (batch_elems 1): two all-to-alls per matrix, the owners still alternate
    over the steps' matrices (both ranks own some), the bytes still the minimum and the weights those of one
    batch, bit for bit."""
    pool = pools(2)
    one = pool.run(_step_counts, "fsdp2", "owner", 1, 1)
    whole = pool.run(_step_counts, "fsdp2", "owner", 1)
    assert all(r["collectives"] == 2 * r["split"] and r["owned"] for r in one), one
    assert sum(r["bytes"] for r in one) == sum(r["min"] for r in one) == sum(r["min"] for r in whole)
    for a, b in zip(one, whole):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


# ----------------------------------------------------------------------------- checkpoints


def test_state_resumes_and_reshards(pools, tmp_path):
    """Steps 0-1 under fsdp2, 2-3 under tp2, 4 in one process, each resumed from the last one's checkpoint: the
    momentum buffers and AdamW moments reshard, so the losses are those of an unbroken single-process run (the
    bounds of `_check`)."""
    from shoal.testing.parity import train_segments

    run = MuonCase(steps=5)
    ref32, ref64 = references(run)
    yard = _yardstick(run)
    segments = (("fsdp2", 0, 2), ("tp2", 2, 4), ("single", 4, 5))
    for plan_text, start, end, results in train_segments(pools, run, str(tmp_path), segments):
        for rank, res in enumerate(results):
            got = torch.tensor(res["losses"], dtype=torch.float64)
            truth = torch.tensor(ref64["losses"][start:end])
            single = (torch.tensor(ref32["losses"][start:end], dtype=torch.float64) - truth).abs().max()
            bound = SLACK * single + (torch.tensor(yard["losses"][start:end]) - truth).abs().max()
            assert (got - truth).abs().max() <= bound, (plan_text, rank, got, truth, bound)


# ----------------------------------------------------------------------------- the command line


def test_train_with_muon_logs_update_rms(tmp_path):
    """`shoal train --optimizer muon` runs (one process, 2 steps), records its optimizer and the update RMS
    spread of its last step."""
    import json

    from shoal import cli

    run = tmp_path / "run"
    small = ["--device", "cpu", "--nproc", "1", "--set", "num_layers=1", "--set", "dim=32", "--set", "ffn_dim=64",
             "--global-batch", "4", "--seq-len", "16", "--eval-batches", "1"]
    assert cli.main(["train", "--out", str(run), "--steps", "2", "--optimizer", "muon", "--muon-adamw-lr", "1e-3",
                     *small]) == 0
    assert 'optimizer = "muon"' in (run / "config.toml").read_text()
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert 0 < last["update_rms_min"] <= last["update_rms_median"] <= last["update_rms_max"], last
