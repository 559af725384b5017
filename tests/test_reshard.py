"""A checkpoint saved under one layout resumes under others, and the loss curve and every step's gradient
norm go on as in one unbroken single-process run.

The run's 9 steps are split into segments, each trained under a different layout and world size,
each starting from the previous segment's DCP checkpoint (model and AdamW state, resharded on load):

    fsdp4 (ZeRO-3, 4 ranks) -> dp2 (DDP, 2 ranks) -> single process (plain module, no process
    group) -> fsdp2,zero=1 (2 ranks, 2 micro-batches) -> fsdp2,tp2 (ZeRO-3 x tensor parallel,
    4 ranks) -> dp2,fsdp2 (hybrid, 4 ranks)

Tolerances are the parity harness's (shoal/testing/parity.py: losses and gradient norms as close to the
float64 run as the single float32 process is, final parameters by `assert_trained_close`). A checkpoint stores every
tensor exactly, so a resumed step differs from the unbroken one only by the reduction order of
its layout, as in the parity tests.
"""

from __future__ import annotations

from shoal.testing.asserts import assert_rounding_close
from shoal.testing.parity import assert_trained_close, case, references, train_segment

RUN = case(steps=9)
# (plan, world size or 0 for a single process without a process group, first step, end step, micro-batches)
SEGMENTS = [("fsdp4", 4, 0, 2, 1), ("dp2", 2, 2, 4, 1), ("single", 0, 4, 5, 1),
            ("fsdp2,zero=1", 2, 5, 7, 2), ("fsdp2,tp2", 4, 7, 8, 1), ("dp2,fsdp2", 4, 8, 9, 1)]


def test_resume_across_layouts_continues_the_loss_curve(pools, tmp_path):
    ref32, ref64 = references(RUN)
    losses: list[float] = []
    for plan_text, world, start, end, num_micro in SEGMENTS:
        if world == 0:
            results = [train_segment(RUN, str(tmp_path), plan_text, start, end, num_micro)]
        else:
            results = pools(world).run(train_segment, RUN, str(tmp_path), plan_text, start, end, num_micro)
        for rank, res in enumerate(results):
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{plan_text} rank {rank} losses of steps {start}..{end - 1}")
            assert_rounding_close(res["grad_norms"], ref32["grad_norms"][start:end], ref64["grad_norms"][start:end],
                                  what=f"{plan_text} rank {rank} gradient norms of steps {start}..{end - 1}")
        losses += results[0]["losses"]
    assert len(losses) == RUN.steps
    assert_trained_close(results[0]["params"], ref32, ref64)
