"""LAMB, LARS and CowClip: their steps against the papers' equations, their norms under sharding,
parity with one process under dp, fsdp (ZeRO 1/2/3) and tp, a fixed number of collectives per
step, and the batch scaling rules against hand-computed values.

Tolerances: the single-process checks compare the same float64 formulas evaluated in another
order (a few roundings of 2^-53: 1e-12 relative is far above them and far below any formula
error). The parallel runs use check_parity's yardsticks (shoal/testing/parity.py): the float32 run's
own distance from the float64 run, measured in the test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from shoal.optim.builder import build_optimizer
from shoal.optim.config import OptimConfig
from shoal.optim.cowclip import CowClip
from shoal.optim.lamb_lars import LAMB, LARS
from shoal.optim.schedule import Schedule, build_scheduler, scale_for_batch
from shoal.testing.asserts import assert_rounding_close, assert_user_error, one_line_error
from shoal.testing.parity import ParityCase, assert_trained_close, references, run_parallel, run_reference

F64 = {"rtol": 1e-12, "atol": 1e-14}

# ----------------------------------------------------------------------------- references from the papers


def lamb_reference(ws, grads, *, lr, b1, b2, eps, wd, rows):
    """You et al. 2020, Algorithm 2, written out per tensor (and per expert where `rows`)."""
    ws = [w.clone() for w in ws]
    ms, vs = [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws]
    for t, gs in enumerate(grads, start=1):
        for i, (w, g) in enumerate(zip(ws, gs)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            r = (ms[i] / (1 - b1**t)) / ((vs[i] / (1 - b2**t)).sqrt() + eps) + wd * w
            pieces = list(range(w.shape[0])) if rows[i] else [slice(None)]
            for k in pieces:
                wn, rn = w[k].norm(), r[k].norm()
                trust = wn / rn if wn > 0 and rn > 0 else 1.0
                w[k] -= lr * trust * r[k]
    return ws


def lars_reference(ws, grads, *, lr, momentum, eta, wd):
    """You et al. 2017, Algorithm 1: local lr eta ||w|| / (||g|| + wd ||w||), momentum SGD."""
    ws = [w.clone() for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for gs in grads:
        for i, (w, g) in enumerate(zip(ws, gs)):
            wn, gn = w.norm(), g.norm()
            local = eta * wn / (gn + wd * wn) if wn > 0 and gn > 0 else 1.0
            vs[i] = momentum * vs[i] + lr * local * (g + wd * w)
            w -= vs[i]
    return ws


def _run(opt_cls, ws, grads, **kwargs):
    params = [nn.Parameter(w.clone()) for w in ws]
    opt = opt_cls(params, **kwargs)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


def _tiny(seed=0):
    """A matrix, a stacked expert weight (2 experts whose norms differ 100x) and a second matrix."""
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(3, 4, generator=gen, dtype=torch.float64),
          torch.randn(2, 3, 2, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 100.0]).view(2, 1, 1),
          torch.randn(2, 5, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in ws] for _ in range(3)]
    return ws, grads


def test_lamb_hand_computed():
    # w = (3, 4): ||w|| = 5. First step: m^ = g, v^ = g^2, so r = g / (|g| + eps) = (1, -1) up to
    # eps = 1e-12; ||r|| = sqrt(2); w -= lr * 5 / sqrt(2) * r, lr = 0.1: a move of 0.5 / sqrt(2).
    w0, g = torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([2.0, -0.5], dtype=torch.float64)
    (w,), _ = _run(LAMB, [w0], [[g]], lr=0.1, eps=1e-12)
    move = 0.3535533905932738
    assert torch.allclose(w, torch.tensor([3 - move, 4 + move], dtype=torch.float64), rtol=1e-11)


def test_lars_hand_computed():
    # w = (3, 4), g = (0.6, 0.8): ||w|| = 5, ||g|| = 1; eta = 1e-3, lr = 1, momentum 0.9, no decay.
    # step 1: local lr 0.005, v = (0.003, 0.004), w = (2.997, 3.996)
    # step 2: ||w|| = 4.995, local lr 0.004995, v = 0.9 v + 0.004995 g = (0.005697, 0.007596)
    g = torch.tensor([0.6, 0.8], dtype=torch.float64)
    (w,), _ = _run(LARS, [torch.tensor([3.0, 4.0], dtype=torch.float64)], [[g], [g]], lr=1.0, eta=1e-3)
    assert torch.allclose(w, torch.tensor([2.997 - 0.005697, 3.996 - 0.007596], dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_matches_paper(wd):
    ws, grads = _tiny()
    got, opt = _run(LAMB, ws, grads, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd)
    want = lamb_reference(ws, grads, lr=0.01, b1=0.9, b2=0.99, eps=1e-6, wd=wd, rows=[False, True, False])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, **F64)
    assert opt.last_trust.numel() == 1 + 2 + 1  # one per matrix, one per expert


def test_lars_matches_paper():
    ws, grads = _tiny(1)
    ws = [ws[0], ws[2]]
    grads = [[gs[0], gs[2]] for gs in grads]
    got, _ = _run(LARS, ws, grads, lr=0.5, momentum=0.9, eta=0.02, weight_decay=1e-3)
    want = lars_reference(ws, grads, lr=0.5, momentum=0.9, eta=0.02, wd=1e-3)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, **F64)


def test_cowclip_clips_rows_hand_computed():
    # rows of width d = 4; the batch holds ids 0, 0, 2 (counts 2, 0, 1); r = 1, zeta = 0.1.
    # row 0: ||w|| = 1, clip_t = 1 * 2 * max(1, 1 * 2 * 0.1) = 2; ||g|| = 5 -> g * 2 / 5
    # row 1: not in the batch -> left as it is
    # row 2: ||w|| = 0, clip_t = 1 * 1 * max(0, 0.2) = 0.2; ||g|| = 1 -> g * 0.2
    emb = nn.Embedding(3, 4).double()
    with torch.no_grad():
        emb.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]))
    opt = CowClip([{"params": [emb.weight], "lr": 0.1}], embeddings=[emb], ratio=1.0, zeta=0.1, eps=1e-12)
    emb(torch.tensor([[0, 0, 2]]))
    emb.weight.grad = torch.tensor([[3.0, 4, 0, 0], [1, 1, 1, 1], [0, 0, 0.6, 0.8]], dtype=torch.float64)
    opt.step()
    want = torch.tensor([[1.2, 1.6, 0, 0], [1, 1, 1, 1], [0, 0, 0.12, 0.16]], dtype=torch.float64)
    assert torch.allclose(emb.weight.grad, want, rtol=1e-12)
    assert float(opt.clipped_fraction) == 1.0  # rows 0 and 2 were in the batch, both clipped
    emb.eval()  # evaluation forwards do not count
    emb(torch.tensor([[1]]))
    emb.train()
    with torch.no_grad():
        emb(torch.tensor([[1]]))
    assert opt._tables[0][1].sum() == 0  # and a step starts the next one's counts from zero


def test_cowclip_adam_on_clipped_rows():
    """Two steps: the table's update is Adam (L2 decay added to the gradient) on the clipped rows;
    the dense weight's is AdamW's (LAMB's step with adapt=False): torch's AdamW is the reference."""
    torch.manual_seed(0)
    emb, dense = nn.Embedding(5, 3).double(), nn.Linear(3, 2, bias=False).double()
    ids = torch.tensor([0, 1, 1, 4])
    ref_e, ref_d = nn.Parameter(emb.weight.detach().clone()), nn.Parameter(dense.weight.detach().clone())
    opt = CowClip([{"params": [dense.weight], "weight_decay": 0.1},
                   {"params": [emb.weight], "lr": 0.05, "l2": 0.01}], embeddings=[emb], lr=0.01, eps=1e-8,
                  ratio=0.5, zeta=1e-3, betas=(0.9, 0.999))
    ref = torch.optim.AdamW([{"params": [ref_d], "weight_decay": 0.1},
                             {"params": [ref_e], "lr": 0.05, "weight_decay": 0}], lr=0.01, eps=1e-8, betas=(0.9, 0.999))
    for step in range(2):
        opt.zero_grad()
        dense(emb(ids)).square().sum().backward()
        g = emb.weight.grad.clone()
        counts = torch.bincount(ids, minlength=5).double()
        w_norm, g_norm = ref_e.detach().norm(dim=1), g.norm(dim=1)
        clip = 0.5 * counts * torch.clamp(w_norm, min=0.5 * math.sqrt(3) * 1e-3)
        factor = torch.where((counts > 0) & (g_norm > clip), clip / g_norm, torch.ones_like(g_norm))
        ref_e.grad = g * factor[:, None] + 0.01 * ref_e.detach()
        ref_d.grad = dense.weight.grad.clone()
        opt.step()
        ref.step()
        assert torch.allclose(emb.weight, ref_e, **F64) and torch.allclose(dense.weight, ref_d, **F64), step


def test_vectors_excluded_and_experts_per_row_by_default():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model.parameters(), OptimConfig(optimizer="lamb", weight_decay=0.1))
    groups = [(g["adapt"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
    assert groups == [(True, 0.1, 1), (False, 0.0, 3)]
    opt = build_optimizer(model.parameters(), OptimConfig(optimizer="lars", adapt_vectors=True, weight_decay=0.1))
    assert [(g["adapt"], g["weight_decay"]) for g in opt.param_groups] == [(True, 0.1), (True, 0.1)]


# ----------------------------------------------------------------------------- scaling rules


def test_scaling_rules_hand_computed():
    base = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=80, base_batch=16, lr_scaling="linear",
                       embed_weight_decay=1e-5, optimizer="cowclip")
    lin = scale_for_batch(base, 128)  # k = 8
    assert (lin.lr, lin.min_lr, lin.warmup_steps) == (pytest.approx(8e-3), pytest.approx(8e-4), 10)
    assert (lin.embed_lr, lin.embed_weight_decay) == (1e-3, pytest.approx(8e-5))  # CowClip: fixed, linear
    sq = scale_for_batch(dataclasses.replace(base, lr_scaling="sqrt"), 64)  # k = 4: lr x 2, warm-up / 4
    assert (sq.lr, sq.min_lr, sq.warmup_steps) == (pytest.approx(2e-3), pytest.approx(2e-4), 20)
    assert scale_for_batch(OptimConfig(), 1024) == OptimConfig()
    # the schedule of the scaled config: warm-up 10 steps to 8e-3
    s = Schedule.from_config(lin, total_steps=100)
    assert (s.lr_at(0), s.lr_at(9)) == (pytest.approx(8e-4), pytest.approx(8e-3))


def test_scheduler_scales_embedding_group():
    emb = nn.Embedding(4, 2)
    cfg = OptimConfig(optimizer="cowclip", lr=1e-2, embed_lr=1e-3, warmup_steps=2, decay_steps=10, min_lr=0.0)
    opt = CowClip([{"params": [emb.weight], "lr": 1e-3, "lr_scale": 0.1}], embeddings=[emb], lr=1e-2)
    build_scheduler(opt, cfg, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 * 0.1)  # warm-up step 0 of 2, times 0.1


@pytest.mark.parametrize("kwargs, match", [
    ({"optimizer": "adam"}, "--optimizer 'adam' is not valid; valid: adamw, lamb, lars, cowclip"),
    ({"lr": -1.0}, "--lr -1.0"), ({"lars_eta": 0.0}, "--lars-eta 0.0"), ({"embed_lr": -1.0}, "--embed-lr -1.0"),
    ({"lr_scaling": "cubic"}, "--lr-scaling 'cubic'"), ({"lr_scaling": "linear"}, "needs --base-batch"),
    ({"momentum": 1.0}, "--momentum 1.0"), ({"base_batch": 8}, "--base-batch 8 has no effect without --lr-scaling"),
])
def test_bad_optimizer_config(kwargs, match):
    assert match in one_line_error(OptimConfig, **kwargs)


# ----------------------------------------------------------------------------- sharded


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptCase(ParityCase):
    """A parity case trained with one of the large-batch optimizers."""

    opt: str = "lamb"

    def optimizer(self, params):
        return build_optimizer(params, OptimConfig(optimizer=self.opt, lr=self.lr, weight_decay=0.1,
                                                   eps=self.adam_eps, lars_eta=0.02, adapt_vectors=True))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CowClipCase(ParityCase):
    """CowClip over the token embedding: ids counted in every rank's forward, summed over the data
    ranks; in parallel built as the trainer builds it, from the runtime."""

    def optimizer_for(self, source):
        # ratio 0.05: rows' gradients are clipped (the test would not see the counts otherwise)
        cfg = OptimConfig(optimizer="cowclip", lr=self.lr, weight_decay=0.1, eps=self.adam_eps, embed_lr=self.lr / 2,
                          embed_weight_decay=1e-3, cowclip_ratio=0.05)
        if isinstance(source, nn.Module):  # the single-process reference
            return build_optimizer(source.parameters(), cfg, embeddings=[source.tok_embeddings])
        return build_optimizer(source, cfg)


PARITY = [OptCase(plan=p, opt=o, lr=0.01 if o == "lamb" else 0.5) for o in ("lamb", "lars")
          for p in ("dp2", "fsdp2,zero=1", "fsdp2,zero=2", "fsdp2", "tp2")] + [
    CowClipCase(plan=p, lr=0.01) for p in ("dp2", "fsdp2,zero=2", "fsdp2", "tp2")]


def run_cases(cases):
    return [run_parallel(c) for c in cases]


def _check(results, cases):
    """Every rank's first-step gradients (those it holds) and their global norm, its losses and final parameters
    of each case against its single-process runs. The gradients come first: LAMB, LARS and clipped Adam are
    nearly blind to a constant scale of the gradient, so a sum in place of an average moves the losses and the
    weights by little, the gradients by 100%."""
    for i, c in enumerate(cases):
        ref32, ref64 = references(c)
        for rank, res in enumerate(r[i] for r in results):
            what = f"{getattr(c, 'opt', 'cowclip')} {c.plan} rank {rank}"
            mine = set(res["grads"])
            assert_rounding_close(res["grads"], {k: ref32["grads"][k] for k in mine},
                                  {k: ref64["grads"][k] for k in mine}, what=f"{what} first-step grads")
            assert_rounding_close(res["grad_norm"], ref32["grad_norm"], ref64["grad_norm"], what=f"{what} grad norm")
            assert_rounding_close(res["losses"], ref32["losses"], ref64["losses"], what=f"{what} losses")
            assert_trained_close(res["final_params"], ref32, ref64, what=f"{what} final params")


def test_parity_with_one_process(pools):
    """LAMB and LARS (and CowClip) under dp2, fsdp2 at zero 1/2/3 and tp2: first-step gradients and their
    norm, losses and final parameters against the single process (`_check`)."""
    _check(pools(2).run(run_cases, PARITY), PARITY)
    for c in PARITY:
        ref64 = references(c)[1]
        # the steps moved every weight (the check measures against the distance moved)
        assert all(not torch.equal(ref64["final_params"][k], ref64["init_params"][k]) for k in ref64["init_params"])


def _halves_step(opt_name):
    """A (4, 3) weight whose row halves' norms differ 1000x, sharded Shard(0) over 2 ranks, one step,
    against the same step on the full tensor in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=gen, dtype=torch.float64) * torch.tensor([1000.0, 1000, 1, 1]).view(4, 1)
    g = torch.randn(4, 3, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 1, 50, 50]).view(4, 1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kwargs = {"lamb": {"lr": 0.01}, "lars": {"lr": 1.0, "eta": 0.01}}[opt_name]
    cls = {"lamb": LAMB, "lars": LARS}[opt_name]
    full = nn.Parameter(w.clone())
    full.grad = g.clone()
    cls([full], **kwargs).step()
    sharded = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
    opt = cls([sharded], **kwargs)
    opt.step()
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    local = nn.Parameter(w[mine].clone())
    local.grad = g[mine].clone()
    lone = cls([local], **kwargs)  # what an optimizer blind to the sharding computes on this rank
    lone.step()
    with torch.no_grad():
        gathered = sharded.full_tensor()
    return {"sharded": gathered, "full": full.detach(), "trust": opt.last_trust,
            "local_trust": lone.last_trust, "collectives": opt.collectives}


@pytest.mark.parametrize("opt_name", ["lamb", "lars"])
def test_norms_are_taken_over_whole_parameters(pools, opt_name):
    for rank, res in enumerate(pools(2).run(_halves_step, opt_name)):
        assert torch.allclose(res["sharded"], res["full"], rtol=1e-12, atol=1e-12), rank
        assert res["collectives"] == 1
        # a norm over the shard alone would be far off: the test can tell
        assert not torch.allclose(res["local_trust"], res["trust"], rtol=0.1), (rank, res["local_trust"], res["trust"])


def _count_collectives(plan_text, num_layers, opt_name):
    """All-reduces one optimizer step issues, counted at torch.distributed.all_reduce."""
    import torch.distributed as dist

    from shoal.testing.parity import parallel_setup
    from shoal.train.step import split_micro

    c = OptCase(plan=plan_text, opt=opt_name, model=OptCase().model.replace(num_layers=num_layers), steps=1)
    runtime, optimizer, batches = parallel_setup(c)
    optimizer.zero_grad()
    runtime.forward_backward(split_micro(*batches[0], 1))
    calls, real = [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        optimizer.step()
    finally:
        dist.all_reduce = real
    return len(calls), sum(1 for _ in runtime.parameters())


@pytest.mark.parametrize("plan_text, expected", [("fsdp2", 1), ("tp2", 1), ("dp2", 0)])
def test_collectives_per_step_do_not_grow_with_parameters(pools, plan_text, expected):
    pool = pools(2)
    counts = [pool.run(_count_collectives, plan_text, n, o)[0] for n in (1, 3) for o in ("lamb", "lars")]
    assert all(count == (expected, count[1]) for count in counts), counts
    assert counts[0][1] < counts[2][1]  # three layers: more parameters, the same collectives


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("argv, names", [
    (["--optimizer", "adam"], ["--optimizer 'adam'", "adamw, lamb, lars, cowclip"]),
    (["--lr", "0"], ["--lr 0.0", "> 0"]),
    (["--optimizer", "lars", "--lars-eta", "-1"], ["--lars-eta -1.0"]),
    (["--lr-scaling", "sqrt"], ["--lr-scaling sqrt", "--base-batch"]),
    (["--adapt-vectors", "yes"], ["'yes'", "on, off"]),
])
def test_bad_optimizer_flags(capsys, tmp_path, argv, names):
    assert_user_error(capsys, ["train", "--out", str(tmp_path / "run"), "--device", "cpu", *argv], *names)
    assert not (tmp_path / "run").exists()


def test_train_with_lamb_then_resume_with_another_optimizer_is_refused(capsys, tmp_path):
    """`shoal train --optimizer lamb` runs (one process, 2 steps) and records its optimizer; a resume
    naming another is refused in one line, its checkpoint untouched."""
    import json

    from shoal import cli

    run = tmp_path / "run"
    small = ["--device", "cpu", "--nproc", "1", "--set", "num_layers=1", "--set", "dim=32", "--set", "ffn_dim=64",
             "--global-batch", "4", "--seq-len", "16", "--eval-batches", "1"]
    assert cli.main(["train", "--out", str(run), "--steps", "2", "--optimizer", "lamb", "--lr-scaling", "sqrt",
                     "--base-batch", "1", *small]) == 0
    assert 'optimizer = "lamb"' in (run / "config.toml").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["lr"] == pytest.approx(3e-3 * 2, rel=1e-6)  # sqrt(4 / 1) x the default lr; no warm-up in 2 steps
    last = records[-1]  # a logging step: the trust ratios' spread (every tensor of the model has one)
    assert 0 < last["trust_min"] <= last["trust_median"] <= last["trust_max"], last
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert_user_error(capsys, ["train", "--resume", str(run), "--steps", "3", "--optimizer", "lars"],
                "--optimizer", "cannot change")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


MOE = dataclasses.replace(OptCase().model, num_experts=4, top_k=2, ffn_dim=64)
MORE = [OptCase(plan="ep2", opt=o, model=MOE, steps=3, lr=0.01 if o == "lamb" else 0.5)
        for o in ("lamb", "lars")] + [OptCase(plan="pp2,mb=2", opt="lamb", lr=0.01, num_micro=2),
                                      OptCase(plan="cp2", opt="lamb", lr=0.01)] + [
    CowClipCase(plan="pp2,mb=2", lr=0.01, num_micro=2), CowClipCase(plan="cp2", lr=0.01),
    CowClipCase(plan="ep2", model=MOE, steps=3, lr=0.01)]


def test_parity_ep_pp_cp(pools):
    """ep2 (an MoE model: one trust ratio per expert, the experts split over the ranks), pp2 and cp2;
    CowClip under the same three (pp2: the table on the first stage only; cp2: each rank counts the
    ids of its part of the sequence, summed over cp; ep2: the ids counted over the dense part's data
    ranks)."""
    _check(pools(2).run(run_cases, MORE), MORE)


@pytest.mark.parametrize("opt_name", ["lamb", "lars"])
def test_state_resumes_and_reshards(pools, tmp_path, opt_name):
    """Steps 0-1 under fsdp2, 2-3 under dp2, 4 in one process, each resumed from the last one's
    checkpoint: the losses, gradient norms and final weights of an unbroken single-process run."""
    from shoal.testing.parity import train_segments

    run = OptCase(opt=opt_name, steps=5, lr=0.01 if opt_name == "lamb" else 0.5)
    ref32, ref64 = references(run)
    segments = (("fsdp2", 0, 2), ("dp2", 2, 4), ("single", 4, 5))
    for plan_text, start, end, results in train_segments(pools, run, str(tmp_path), segments):
        for rank, res in enumerate(results):
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{opt_name} {plan_text} rank {rank} losses of steps {start}..{end - 1}")
            assert_rounding_close(res["grad_norms"], ref32["grad_norms"][start:end], ref64["grad_norms"][start:end],
                                  what=f"{opt_name} {plan_text} rank {rank} gradient norms of steps {start}..{end - 1}")
    assert_trained_close(results[0]["params"], ref32, ref64)


FOUR = [OptCase(plan="fsdp2,tp2", opt=o, lr=0.01 if o == "lamb" else 0.5) for o in ("lamb", "lars")]


def test_parity_fsdp_over_tp(pools):
    """fsdp2,tp2 on 4 processes: weights sharded over both axes (FSDP2's _StridedShard over tp's
    Shard), their squared norms summed over the fsdp group, then the tp group."""
    _check(pools(4).run(run_cases, FOUR), FOUR)


# ----------------------------------------------------------------------------- trust ratios in the metrics


def _trust_after_steps(case):
    """The case trained through parallelize and train_step on this rank, then every trust ratio of its last
    step, gathered."""
    from shoal.optim.lamb_lars import gather_trust
    from shoal.testing.parity import parallel_setup
    from shoal.train.step import split_micro, train_step

    runtime, optimizer, batches = parallel_setup(case)
    for inputs, targets in batches:
        train_step(runtime, optimizer, split_micro(inputs, targets, case.num_micro), grad_clip=case.grad_clip)
    return gather_trust(optimizer, runtime.named_parameters())


def _reference_trust(case, dtype):
    """The reference: the case trained in plain PyTorch in this process (run_reference: no parallelize, no
    train_step), then its optimizer's trust ratios of the last step, read off the plain model's parameters."""
    from shoal.optim.lamb_lars import gather_trust

    out = {}
    run_reference(case, dtype, after=lambda model, opt: out.update(gather_trust(opt, model.named_parameters())))
    return out


def _trust_cases(cases):
    return [_trust_after_steps(c) for c in cases]


TRUST = [OptCase(plan="dp2", opt="lamb", lr=0.01, steps=2), OptCase(plan="fsdp2", opt="lars", lr=0.5, steps=2),
         OptCase(plan="tp2", opt="lamb", lr=0.01, steps=2), OptCase(plan="pp2,mb=2", opt="lamb", lr=0.01, steps=2,
                                                                    num_micro=2),
         OptCase(plan="ep2", opt="lars", model=MOE, lr=0.5, steps=2)]


def test_trust_ratios_gathered_over_every_plan(pools):
    """Every trust ratio of the last step, gathered over the ranks (each tensor, each expert once),
    equals the single-process run's, tensor by tensor: under dp2 and fsdp2 (one copy each, global
    norms), tp2, pp2 (each stage's own tensors) and ep2 (each rank's own experts). Tolerance: the
    float32 single-process run's own distance from float64 (assert_rounding_close)."""
    from shoal.optim.lamb_lars import trust_summary

    results = pools(2).run(_trust_cases, TRUST)
    for c in TRUST:
        ref32, ref64 = _reference_trust(c, torch.float32), _reference_trust(c, torch.float64)
        assert len(ref64) > 5 and len({v for v in ref64.values()}) > 1, ref64  # several distinct ratios
        if c.plan == "ep2":
            assert any(row >= 0 for _, row in ref64), "per-expert ratios expected"
        for rank, res in enumerate(r[TRUST.index(c)] for r in results):
            assert sorted(res) == sorted(ref64), (c.plan, rank, sorted(set(res) ^ set(ref64)))
            keys = sorted(ref64)
            assert_rounding_close(torch.tensor([res[k] for k in keys], dtype=torch.float64),
                                  torch.tensor([ref32[k] for k in keys], dtype=torch.float64),
                                  torch.tensor([ref64[k] for k in keys]), what=f"{c.opt} {c.plan} rank {rank} trust")
            assert trust_summary(res).keys() == {"trust_min", "trust_median", "trust_max"}


def test_trust_summary_hand_computed():
    from shoal.optim.lamb_lars import trust_summary

    assert trust_summary({}) == {}
    stats = trust_summary({("a", -1): 0.5, ("b", 0): 2.0, ("b", 1): 1.0, ("c", -1): 4.0})
    assert stats == {"trust_min": 0.5, "trust_median": 1.0, "trust_max": 4.0}  # the lower median of 4
