"""A checkpoint saved under one layout resumes under others, and the loss curve goes on exactly as
in one unbroken single-process run.

The run's 9 steps are split into segments, each trained under a different layout and world size,
each starting from the previous segment's DCP checkpoint (model and AdamW state, resharded on load):

    fsdp4 (ZeRO-3, 4 ranks) -> dp2 (DDP, 2 ranks) -> single process (plain module, no process
    group) -> fsdp2,zero=1 (2 ranks, 2 micro-batches) -> fsdp2,tp2 (ZeRO-3 x tensor parallel,
    4 ranks) -> dp2,fsdp2 (hybrid, 4 ranks)

Tolerance: check_parity's fp32 values (rtol 1e-5 on losses, atol 1e-5 on parameters). A checkpoint
stores every tensor exactly, so a resumed step differs from the unbroken one only by the
reduction order of its layout, as in the parity tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shoal.mesh import data_rank
from shoal.parallelize import parallelize
from shoal.plan import Plan
from shoal.testing import assert_close, cached_mesh, case, full_tensors, run_reference
from shoal.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from shoal.train.step import split_micro, train_step

RUN = case(steps=9, adam_eps=1e-6)  # eps: see ParityCase.adam_eps (the tp segment reorders sums)
# (plan, world size or 0 for a plain single process, first step, end step, micro-batches)
SEGMENTS = [("fsdp4", 4, 0, 2, 1), ("dp2", 2, 2, 4, 1), ("single", 0, 4, 5, 1),
            ("fsdp2,zero=1", 2, 5, 7, 2), ("fsdp2,tp2", 4, 7, 8, 1), ("dp2,fsdp2", 4, 8, 9, 1)]


def train_segment(run_dir: str, plan_text: str, start: int, end: int, num_micro: int) -> dict:
    """Worker (or the test process for plan 'single'): resume from the latest checkpoint in
    run_dir if start > 0, train steps start..end-1 under plan_text, save, return losses and params."""
    if plan_text == "single":
        model, mesh, part = RUN.build_model(), None, (0, 1)
    else:
        plan = Plan.parse(plan_text).resolve(dist.get_world_size())
        mesh = cached_mesh(plan)
        model, part = parallelize(RUN.build_model(), plan, mesh), data_rank(mesh)
    optimizer = RUN.optimizer(model)
    if start > 0:
        extra = load_checkpoint(latest_checkpoint(run_dir), model=model, optimizer=optimizer)
        assert extra["step"] == start, extra
    rows = RUN.global_batch // part[1]
    losses = []
    for x, y in RUN.batches()[start:end]:
        x, y = x[part[0] * rows:(part[0] + 1) * rows], y[part[0] * rows:(part[0] + 1) * rows]
        if mesh is None:
            losses.append(_plain_step(model, optimizer, x, y))
        else:
            losses.append(train_step(model, optimizer, split_micro(x, y, num_micro), mesh=mesh, grad_clip=RUN.grad_clip)[0])
    save_checkpoint(run_dir, end, model=model, optimizer=optimizer, extra={"step": end, "plan": plan_text})
    return {"losses": losses, "params": full_tensors(model)}


def _plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step of the plain PyTorch loop the reference uses (no shoal wrapper at all)."""
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), RUN.grad_clip)
    optimizer.step()
    return loss.item()


def test_resume_across_layouts_continues_the_loss_curve(pools, tmp_path):
    reference = run_reference(RUN)
    losses: list[float] = []
    for plan_text, world, start, end, num_micro in SEGMENTS:
        if world == 0:
            results = [train_segment(str(tmp_path), plan_text, start, end, num_micro)]
        else:
            results = pools(world).run(train_segment, str(tmp_path), plan_text, start, end, num_micro)
        for rank, res in enumerate(results):
            assert_close(res["losses"], reference["losses"][start:end], rtol=1e-5, atol=1e-6,
                         what=f"{plan_text} rank {rank} losses of steps {start}..{end - 1}")
        losses += results[0]["losses"]
    assert len(losses) == RUN.steps
    assert_close(results[0]["params"], reference["final_params"], rtol=1e-4, atol=1e-5, what="final params")
