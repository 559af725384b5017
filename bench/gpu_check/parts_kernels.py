"""Parts that check kernels in one process: the MoE expert paths, ring and head-scatter attention,
and the GPU-fused op count per block.

Accuracy checks compare each path's error against an fp32 reference computed from the same
(bf16) inputs with the error of the plain path the check is about (the loop over experts, SDPA):
a path passes when its error is at most twice the plain path's plus bf16's unit roundoff 2^-8,
so a kernel that merely rounds in another order passes and a wrong one (error ~1) does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.gpu_check.context import Context

BF16_ROUNDOFF = 2.0**-8


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach(), ref.detach()
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_time(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- MoE experts


def moe(ctx: Context) -> None:
    """The grouped-matmul expert path against the loop (values and gradients), then one MoE layer's
    forward + backward per path and bench/moe_layer.py's naive loop, on CUDA in bf16."""
    from shoal.moe.experts import Experts

    dev = ctx.device
    E, D, Fh = (4, 32, 64) if ctx.dry else (8, 1024, 2816)
    counts = torch.tensor([0, 5, 9, 2] if ctx.dry else [0, 700, 1900, 64, 1200, 8, 3000, 1100], device=dev)
    rows = int(counts.sum()) + 3  # rows past the sum: parked, never computed
    torch.manual_seed(0)
    experts = Experts(E, D, Fh).to(dev)
    x = torch.randn(rows, D, device=dev)
    ref_mod = Experts(E, D, Fh).to(dev)
    ref_mod.load_state_dict(experts.state_dict())
    ref_mod.path = "loop"
    xr = x.clone().requires_grad_()
    ref_y = ref_mod(xr, counts)
    g = torch.randn_like(ref_y)
    ref_y.backward(g)
    refs = {"y": ref_y.detach(), "dx": xr.grad, **{f"d{n}": p.grad for n, p in ref_mod.named_parameters()}}
    experts = experts.to(torch.bfloat16)
    errs: dict[str, dict[str, float]] = {}
    for path in ("loop", "grouped", "padded"):
        experts.zero_grad()
        experts.path = path
        xb = x.to(torch.bfloat16).requires_grad_()
        y = experts(xb, counts, capacity=int(counts.max()))
        y.backward(g.to(torch.bfloat16))
        got = {"y": y, "dx": xb.grad, **{f"d{n}": p.grad for n, p in experts.named_parameters()}}
        errs[path] = {k: _rel_err(got[k], refs[k]) for k in refs}
        parked = float(y[int(counts.sum()):].abs().max())
        ctx.check(f"{path}: parked rows stay zero", parked == 0.0, f"max |y| past the counts {parked}")
    for path in ("grouped", "padded"):
        for k in refs:
            bound = 2 * errs["loop"][k] + BF16_ROUNDOFF
            ctx.check(f"{path} vs loop: {k}", errs[path][k] <= bound,
                      f"error {errs[path][k]:.2e} (loop {errs['loop'][k]:.2e}, bound {bound:.2e})")
    ctx.figures["relative error against the fp32 loop"] = errs
    _moe_layer_speed(ctx)


def _moe_layer_speed(ctx: Context) -> None:
    from bench.moe_layer import CAP, FFN, K, NaiveMoE
    from bench.moe_layer import D as LAYER_D
    from shoal.moe.layer import MoELayer

    dev, tokens = ctx.device, 256 if ctx.dry else 16384
    rows = []
    for E in (8,) if ctx.dry else (8, 16):
        torch.manual_seed(0)
        x = torch.randn(tokens, LAYER_D, device=dev, requires_grad=True)
        layer = MoELayer(LAYER_D, FFN, num_experts=E, top_k=K, capacity_factor=CAP).to(dev)
        layers: dict[str, torch.nn.Module] = {}
        for path in ("grouped", "padded", "loop"):
            layers[f"shoal {path}"] = layer
        layers["naive loop (bench/moe_layer.py)"] = NaiveMoE(E).to(dev)
        for name, mod in layers.items():
            if name.startswith("shoal"):
                mod.experts.path = name.split()[1]

            def step(mod: torch.nn.Module = mod, x: torch.Tensor = x) -> None:
                x.grad = None
                with torch.autocast(dev, torch.bfloat16, enabled=dev == "cuda"):
                    out = mod(x[None] if isinstance(mod, MoELayer) else x)
                (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()

            try:
                seconds = _median_time(step, dev, 2 if ctx.dry else 10)
                rows.append({"E": E, "layer": name, "tokens_per_s": tokens / seconds})
            except Exception as exc:  # noqa: BLE001 -- one path failing should not hide the others' figures
                rows.append({"E": E, "layer": name, "note": f"{type(exc).__name__}: {str(exc)[:120]}"})
                ctx.check(f"MoE layer {name} runs (E={E})", False, rows[-1]["note"])
    ctx.tables[f"MoE layer forward + backward, {tokens} tokens, D={LAYER_D}, F={FFN}, top-{K}"] = rows


# ----------------------------------------------------------------------------- attention


def _init_group(backend: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend == "nccl":  # NCCL and DeviceMesh take the process's device as it is set, not a guess
        torch.cuda.set_device(0)
    from shoal.infra.launch import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def attention(ctx: Context) -> None:
    """Ring and head-scatter (a2a) attention at cp=1 (where both are SDPA itself) against SDPA and
    against torch's `context_parallel` (values and gradients); the ring's blocks at cp=2 and 4 rank by
    rank in this process (values and gradients); the blocks' time at cp=2 against SDPA's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shoal.parallel.context import ContextSplit, a2a_attention, ring_attention

    dev = ctx.device
    _init_group("gloo" if ctx.dry else "nccl")
    mesh = init_device_mesh(dev, (1,), mesh_dim_names=("cp",))
    split = ContextSplit(mesh["cp"])
    B, H, T, Eh = (1, 4, 64, 16) if ctx.dry else (4, 16, 2048, 128)
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, Eh, device=dev) for _ in range(3))
    g = torch.randn(B, H, T, Eh, device=dev)
    ref = _attend(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v, g, torch.float32)
    contenders: dict[str, Callable] = {
        "sdpa": lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
        "ring cp=1": lambda a, b, c: ring_attention(a, b, c, split=split),
        "a2a cp=1": lambda a, b, c: a2a_attention(a, b, c, split=split),
        "torch context_parallel cp=1": _torch_context_parallel(mesh),
    }
    errs: dict[str, dict[str, float]] = {}
    for name, fn in contenders.items():
        try:
            got = _attend(fn, q, k, v, g, dtype)
        except Exception as exc:  # noqa: BLE001 -- recorded as the contender's failure
            note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            ctx.figures[f"{name}: not run"] = note
            # In a dry run (gloo, CPU) one fails by design: torch's context_parallel has no CPU sharding strategy.
            expected = {"torch context_parallel cp=1": NotImplementedError}.get(name)
            ctx.check(f"{name} runs", ctx.dry and expected is not None and isinstance(exc, expected), note)
            continue
        errs[name] = {key: _rel_err(got[key], ref[key]) for key in ref}
    for name in errs:
        if name != "sdpa":
            for key in ref:
                bound = 2 * errs["sdpa"][key] + (BF16_ROUNDOFF if dtype == torch.bfloat16 else 1e-5)
                ctx.check(f"{name} vs sdpa: {key}", errs[name][key] <= bound,
                          f"error {errs[name][key]:.2e} (sdpa {errs['sdpa'][key]:.2e}, bound {bound:.2e})")
    ctx.figures["relative error against fp32 SDPA"] = errs
    roundoff = BF16_ROUNDOFF if dtype == torch.bfloat16 else 1e-5
    for cp in (2, 4):
        try:
            got = _ring_rank_by_rank(q, k, v, g, cp, dtype)
        except Exception as exc:  # noqa: BLE001 -- recorded as the check's failure
            ctx.check(f"ring blocks at cp={cp}, rank by rank, run", False, f"{type(exc).__name__}: {str(exc)[:160]}")
            continue
        for key in ref:
            err, bound = _rel_err(got[key], ref[key]), 2 * errs["sdpa"][key] + roundoff
            ctx.check(f"ring blocks at cp={cp}, rank by rank, vs sdpa: {key}", err <= bound,
                      f"error {err:.2e} (sdpa {errs['sdpa'][key]:.2e}, bound {bound:.2e})")
    _blocks_speed(ctx, (B, H, T, Eh), dtype)
    times = {}
    for name in ("sdpa", "ring cp=1", "a2a cp=1"):
        if name in errs:
            fn = contenders[name]
            qb, kb, vb = (t.to(dtype).requires_grad_() for t in (q, k, v))
            times[name] = _median_time(lambda fn=fn, qb=qb, kb=kb, vb=vb: fn(qb, kb, vb).backward(g.to(dtype)), dev,
                                       2 if ctx.dry else 10)
    ctx.figures["forward + backward seconds"] = times
    dist.destroy_process_group()


def _attend(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            dtype: torch.dtype) -> dict[str, torch.Tensor]:
    qs, ks, vs = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = fn(qs, ks, vs)
    # autograd.grad rather than backward() and .grad: on the H200 (torch 2.11) one contender left .grad
    # empty; this returns the gradients whatever wraps the inputs, or raises if they are not reached.
    dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), g.to(dtype))
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def _torch_context_parallel(mesh: Any) -> Callable:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.experimental import context_parallel

        # It reads its sequence length and device off the first buffer (torch 2.11 and 2.13 index
        # buffers[0]), so it takes one: the positions, a stand-in that nothing else reads.
        positions = torch.arange(q.shape[2], device=q.device)[None]
        with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def _ring_rank_by_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, cp: int,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The ring's output and gradients at `cp`, each rank's blocks (its zig-zag chunks against every
    rank's, forward and backward, in `dtype`) run in this process and assembled."""
    from bench.context_parallel import ring_by_rank

    return ring_by_rank(*(t.to(dtype) for t in (q, k, v, g)), cp)


def _blocks_speed(ctx: Context, shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    """bench/context_parallel.py's block timing at cp=2: the ring's blocks and a2a's local work, forward
    and backward, summed over the ranks, against SDPA over the same queries and keys."""
    from bench.context_parallel import block_compute

    B, H, T, Eh = shape
    try:
        t = block_compute(T, heads=H, head_dim=Eh, dtype=dtype, repeats=2 if ctx.dry else 10, batch=B,
                          device=ctx.device)
    except Exception as exc:  # noqa: BLE001 -- recorded as the check's failure
        ctx.check("cp=2 block timing runs", False, f"{type(exc).__name__}: {str(exc)[:160]}")
        return
    ctx.figures["cp=2 blocks, forward + backward seconds (median, summed over ranks)"] = {
        name: t[name]["median"] for name in t}
    for name in ("ring", "a2a"):
        ratio = t[name]["median"] / t["sdpa"]["median"]
        ctx.figures[f"{name} cp=2 blocks / sdpa"] = ratio
        ctx.check(f"{name} blocks at cp=2 within 1.1x of SDPA's time", ratio <= 1.1,
                  f"{ratio:.2f} (sdpa {1e3 * t['sdpa']['median']:.2f} ms, spread {100 * t[name]['iqr_rel']:.0f}%)",
                  goal=True)


# ----------------------------------------------------------------------------- data engine overhead


def engine(ctx: Context) -> None:
    """bench/engine_overhead.py on this device: the host time of one forward and backward per contender."""
    import torch.distributed as dist

    from bench.engine_overhead import run

    rows = run(ctx.device, 5 if ctx.dry else 30)
    dist.destroy_process_group()
    ctx.tables["one forward and backward of 12 tiny blocks (host-bound)"] = rows
    by_name = {r["contender"]: r for r in rows}
    ctx.check("every contender ran", len(rows) == 5, ", ".join(f"{r['contender']} {r['ms']:.2f} ms" for r in rows))
    ratio = by_name["shoal dp1 bf16"]["ms"] / by_name["autocast bf16"]["ms"]
    ctx.figures["shoal dp1 bf16 / autocast bf16"] = ratio
    ctx.check("shoal's one-process bf16 within 1.2x of autocast's host time", ratio <= 1.2, f"{ratio:.2f}", goal=True)


# ----------------------------------------------------------------------------- op count


def ops(ctx: Context) -> None:
    """Kernels one block launches under compile (GPU) or aten ops it runs eagerly (dry run), per block:
    the difference between a 3-block and a 1-block model, beside costs.OPS_PER_BLOCK."""
    from shoal.models import ModelConfig, Transformer
    from shoal.planner.costs import OPS_PER_BLOCK

    dev, compiled = ctx.device, not ctx.dry
    counts = {}
    size = 64 if ctx.dry else 256
    for layers in (1, 3):
        cfg = ModelConfig(num_layers=layers, dim=size, num_heads=4, num_kv_heads=4, ffn_dim=2 * size, vocab_size=256,
                          max_seq_len=128)
        torch.manual_seed(0)
        model = Transformer(cfg).to(dev)
        for block in model.layers.values():  # a ModuleDict: the blocks, not their names
            if compiled:
                block.compile()
        x = torch.randint(0, 256, (2, size // 2), device=dev)
        for _ in range(2 if compiled else 1):  # compile first
            with torch.autocast(dev, torch.bfloat16, enabled=compiled):
                model(x).float().mean().backward()
        counts[layers] = _count(model, x, dev, compiled)
    per_block = {phase: (counts[3][phase] - counts[1][phase]) / 2 for phase in counts[1]}
    constant = OPS_PER_BLOCK[compiled]
    ctx.figures.update(per_block=per_block, constant=constant, compiled=compiled, totals=counts)
    what = "GPU kernels" if compiled else "aten ops (eager, CPU)"
    ctx.check(f"{what} per block counted", per_block["forward"] > 0, f"forward {per_block['forward']:g}, backward "
              f"{per_block['backward']:g}; costs.OPS_PER_BLOCK[{compiled}] = {constant}")
    if compiled:
        ratio = per_block["forward"] / constant
        ctx.check("compiled kernels per block within 2x of the planner's constant", 0.5 <= ratio <= 2,
                  f"{ratio:.2f}", goal=True)


def _count(model: torch.nn.Module, x: torch.Tensor, dev: str, compiled: bool) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    result = {}
    with torch.autocast(dev, torch.bfloat16, enabled=compiled):
        for phase in ("forward", "backward"):
            out = model(x).float().mean() if phase == "backward" else None
            activities = [ProfilerActivity.CUDA] if dev == "cuda" else [ProfilerActivity.CPU]
            with profile(activities=activities) as prof:
                if phase == "forward":
                    model(x)
                else:
                    out.backward()
                _sync(dev)
            events = prof.events()
            if dev == "cuda":
                result[phase] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            else:
                result[phase] = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
    return result
