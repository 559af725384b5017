"""What keeps a GPU busy: a training step that never waits for the device (the host queues the
next step while the GPU runs this one), fused AdamW on GPUs, TF32 for fp32 runs.

On CPU "waiting for the device" cannot be timed, so the tests catch its cause: every read of a
tensor's value on the host (`.item()`, `float()`, `bool()`, `.tolist()`) goes through ATen's
`_local_scalar_dense` (or a copy to the CPU), and the step must call it nowhere. torch's AdamW
reads its step counter, a CPU tensor by design (no device wait), and is exempt.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shoal.models import ModelConfig
from shoal.testing.parity import SMALL, case, parallel_setup
from shoal.train.step import split_micro, train_step


class HostReads(TorchDispatchMode):
    """Records where a tensor's value is read on the host, outside torch.optim."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()[:-1]  # without this frame
            if not any("/torch/optim/" in frame.filename for frame in stack):
                self.reads.append(" < ".join(f"{f.filename.rpartition('/')[2]}:{f.lineno}" for f in reversed(stack)
                                             if "/shoal/" in f.filename or "torch/distributed" in f.filename)[:300])
        return func(*args, **(kwargs or {}))


def host_reads_in_a_step(plan: str, model: ModelConfig = SMALL, num_micro: int = 1) -> list[str]:
    """Run two steps of `plan` on this rank; the host reads of the second (the first creates
    lazy state: optimizer moments, FSDP2's buffers)."""
    runtime, optimizer, batches = parallel_setup(case(plan=plan, model=model))
    train_step(runtime, optimizer, split_micro(*batches[0], num_micro), grad_clip=1.0)
    with HostReads() as mode:
        result = train_step(runtime, optimizer, split_micro(*batches[1], num_micro), grad_clip=1.0)
    assert torch.isfinite(result.loss) and result.applied
    return mode.reads


def test_a_step_never_reads_the_device_in_one_process():
    from shoal.apply_plan import parallelize
    from shoal.models import Transformer

    runtime = parallelize(Transformer(SMALL))
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=1e-3)
    x = torch.randint(0, SMALL.vocab_size, (2, 9))
    train_step(runtime, optimizer, [(x[:, :-1], x[:, 1:])], grad_clip=1.0)
    with HostReads() as mode:
        result = train_step(runtime, optimizer, [(x[:, :-1], x[:, 1:])], grad_clip=1.0)
    assert mode.reads == [] and isinstance(result.loss, torch.Tensor)


@pytest.mark.parametrize("plan", ["dp2", "fsdp2", "fsdp2,zero=1", "tp2", "dp2,precision=bf16", "dp2,ac=selective"])
def test_a_parallel_step_never_reads_the_device(pools, plan):
    assert pools(2).run(host_reads_in_a_step, plan) == [[], []]


def test_a_pipeline_step_with_a_pooled_router_loss_never_reads_the_device(pools):
    """Each micro-batch's expert counts are summed over the stages by an all-reduce that forward
    starts and backward waits for, on the device."""
    pooled = SMALL.replace(num_layers=4, num_experts=4, top_k=2, ffn_dim=64, capacity_factor=0.0,
                           aux_loss_pooled=True, aux_loss_coef=0.5)
    assert pools(2).run(host_reads_in_a_step, "pp2,mb=4", pooled, 4) == [[], []]


def test_fp16_never_reads_the_device(pools):
    """fp16's overflow check and loss-scale update run on the device (shoal.parallel.precision)."""
    assert pools(2).run(host_reads_in_a_step, "fsdp2,precision=fp16") == [[], []]


def test_fused_adamw_on_gpus_and_cpus(pools):
    """torch fuses AdamW on both (offloaded shards on the CPU beside the rest on a GPU included); the trainer's
    groups hold one layout each, so that a fused call never mixes plain tensors and DTensors of different meshes."""
    from shoal.optim.builder import adamw_kernel

    assert adamw_kernel({"cuda"}) == adamw_kernel({"cpu"}) == adamw_kernel({"cpu", "cuda"}) == {"fused": True}
    assert adamw_kernel({"mps"}) == {}
    for plan in ("ep2", "fsdp2,ep2"):  # experts on the ep mesh beside plain tensors or the data engine's shards
        layouts = pools(2).run(_group_layouts, plan)[0]
        assert all(len(kinds) == 1 for kinds in layouts), (plan, layouts)
        assert len({k for kinds in layouts for k in kinds}) == 2, (plan, layouts)  # both layouts are present


def _group_layouts(plan_text: str) -> list[set[str]]:
    """Worker: the layouts (plain, or DTensor on a mesh's dims) in each of the trainer's AdamW groups."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shoal import rules
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import Transformer, get_preset
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OptimConfig
    from shoal.plan import Plan

    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    cfg = get_preset("tiny-moe" if "ep" in plan_text else "tiny").replace(num_layers=2)
    runtime = parallelize(Transformer(cfg), plan, build_mesh(plan))
    optimizer = build_optimizer(runtime, OptimConfig())
    return [{str(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else "plain" for p in g["params"]}
            for g in optimizer.param_groups]


def test_tf32_is_set_for_gpus_only():
    from shoal.train.build import set_matmul_precision

    before = torch.get_float32_matmul_precision()
    try:
        set_matmul_precision(torch.device("cpu"), tf32=True)
        assert torch.get_float32_matmul_precision() == before  # CPU runs stay exact
        set_matmul_precision(torch.device("cuda"), tf32=True)  # no GPU needed to set the policy
        assert torch.get_float32_matmul_precision() == "high"
        set_matmul_precision(torch.device("cuda"), tf32=False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU; runs on the GPU machine")
def test_a_gpu_step_does_not_synchronise():
    """On a GPU, torch itself checks: sync debug mode "error" raises at any synchronising call."""
    from shoal.apply_plan import parallelize
    from shoal.models import Transformer
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OptimConfig

    runtime = parallelize(Transformer(SMALL).cuda())
    optimizer = build_optimizer(runtime.parameters(), OptimConfig())
    assert optimizer.defaults["fused"] is True
    x = torch.randint(0, SMALL.vocab_size, (2, 9), device="cuda")
    train_step(runtime, optimizer, [(x[:, :-1], x[:, 1:])], grad_clip=1.0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step(runtime, optimizer, [(x[:, :-1], x[:, 1:])], grad_clip=1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU; runs on the GPU machine")
def test_gpu_bf16_attention_runs_a_fused_kernel():
    """SDPA picks a fused attention kernel for bf16 on GPUs that have one (FlashAttention, or cuDNN's
    flash attention, which torch 2.11 prefers on an H200), not the unfused math path: the op the
    forward dispatches."""
    from shoal.models import Transformer
    from shoal.testing.parity import SMALL

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    model = Transformer(SMALL).cuda().to(torch.bfloat16)
    with Ops() as ops:
        model(torch.randint(0, SMALL.vocab_size, (2, 16), device="cuda"))
    fused = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")
    assert any(kernel in name for kernel in fused for name in ops.names), sorted(ops.names)
