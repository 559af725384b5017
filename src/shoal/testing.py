"""The parity harness: run a function on N gloo processes and compare with a single process.

`WorkerPool(n)` starts n worker processes once (one process group, reused by every test that
asks for that world size), runs picklable functions on all ranks and returns each rank's
result. A failure on any rank, or a hang past the timeout, tears the pool down and raises an
error naming the rank, so one broken test cannot wedge the next.

`ParityCase` describes one configuration; `run_reference(case)` trains it in plain PyTorch in
this process, `run_parallel(case)` (called on every rank) trains it through shoal's real
`parallelize` + `train_step`, and `compare(...)` checks outputs, every gradient, parameters
after the first optimizer step and the loss curve.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shoal.mesh import all_reduce_mean, build_mesh, data_rank
from shoal.models import ModelConfig, Transformer
from shoal.parallelize import parallelize
from shoal.plan import Plan
from shoal.train.step import clip_grad_norm, forward_backward, split_micro, train_step

# ----------------------------------------------------------------------------- the worker pool


def _worker_main(rank: int, world_size: int, store_path: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, the parent decides
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """n long-lived gloo processes that run functions on every rank."""

    def __init__(self, world_size: int, *, timeout_s: float = 300.0) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = torch.multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="shoal-pool-")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        store = os.path.join(self._dir, "store")
        self._procs = [
            ctx.Process(target=_worker_main, args=(r, world_size, store, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """fn(*args, **kwargs) on every rank; the results in rank order."""
        if not self.alive:
            raise RuntimeError(f"the {self.world_size}-process worker pool is not running (an earlier task broke it)")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            try:
                rank, ok, payload = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(out))
                self.close()
                raise TimeoutError(f"{fn.__name__}: rank(s) {missing} gave no answer in {self.timeout_s:.0f} s") from None
            if not ok:
                self.close()
                raise RuntimeError(f"{fn.__name__} failed on rank {rank} of {self.world_size}:\n{payload}")
            out[rank] = payload
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


# ----------------------------------------------------------------------------- comparisons


def assert_close(actual: Any, expected: Any, *, rtol: float, atol: float, what: str = "value") -> None:
    """Recursive allclose over dicts/lists of tensors and floats, naming the first key that differs."""
    if isinstance(expected, Mapping):
        assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
        for key in expected:
            assert_close(actual[key], expected[key], rtol=rtol, atol=atol, what=f"{what}[{key}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, rtol=rtol, atol=atol, what=f"{what}[{i}]")
    else:
        a, e = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
        assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        if not torch.allclose(a, e, rtol=rtol, atol=atol):
            diff = (a - e).abs()
            raise AssertionError(
                f"{what}: max abs diff {diff.max().item():.3g} (rtol={rtol}, atol={atol}); "
                f"max |expected| {e.abs().max().item():.3g}"
            )


# Longest first: "module." is a suffix of the checkpoint/FSDP wrappers' prefixes.
def one_line_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The message of the ValueError that fn(*args, **kwargs) raises, checked to be one line."""
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message, message
        return message
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised no ValueError")


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.", "module.")


def clean_name(name: str) -> str:
    """A parameter name without the prefixes that parallel wrappers insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensors(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) as a full, unsharded CPU tensor, keyed by clean name."""
    out = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[clean_name(name)] = tensor.detach().float().cpu().clone()
    return out


# ----------------------------------------------------------------------------- parity cases

SMALL = ModelConfig(num_layers=2, dim=64, num_heads=8, num_kv_heads=4, ffn_dim=128, vocab_size=128, max_seq_len=64)


@dataclass(frozen=True, kw_only=True)
class ParityCase:
    """One configuration to train in parallel and in a single process from the same start."""

    plan: str = "dp2"
    model: ModelConfig = SMALL
    steps: int = 4
    global_batch: int = 8
    seq_len: int = 16
    num_micro: int = 1
    lr: float = 1e-3
    grad_clip: float | None = 1.0
    seed: int = 0
    adam_eps: float = 1e-8
    """AdamW's eps. Its first step moves an entry by lr * g / (|g| + eps): for |g| near eps a
    rounding difference in g (1e-9 from a different summation order) moves it by up to lr/10,
    so cases whose sums are reordered inside a layer (tensor parallel) use 1e-6."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form knobs for cases that later parallelisms add."""

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The global batches of every step: seeded random tokens, the same in every process."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        seq = torch.randint(0, self.model.vocab_size, (self.steps, self.global_batch, self.seq_len + 1), generator=gen)
        return [(s[:, :-1], s[:, 1:]) for s in seq]

    def build_model(self) -> Transformer:
        torch.manual_seed(self.seed)
        return Transformer(self.model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.1, eps=self.adam_eps, foreach=False)


def run_reference(case: ParityCase) -> dict[str, Any]:
    """Train `case` in plain PyTorch in this process: the ground truth."""
    torch.set_num_threads(1)
    model = case.build_model()
    optimizer = case.optimizer(model)
    batches = case.batches()
    result: dict[str, Any] = {"losses": []}
    with torch.no_grad():
        result["logits"] = model(batches[0][0]).float()
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        micro = zip(inputs.chunk(case.num_micro), targets.chunk(case.num_micro))
        loss_sum = 0.0
        for x, y in micro:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / case.num_micro
            loss.backward()
            loss_sum += loss.item()
        if step == 0:
            result["grads"] = full_tensors(model, grads=True)
        if case.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.grad_clip)
        optimizer.step()
        if step == 0:
            result["params"] = full_tensors(model)
        result["losses"].append(loss_sum)
    result["final_params"] = full_tensors(model)
    return result


_MESHES: dict[tuple[int, ...], Any] = {}


def cached_mesh(plan: Plan) -> Any:
    """One DeviceMesh per mesh shape per worker: creating process groups is slow on gloo."""
    key = plan.resolve(dist.get_world_size()).mesh_shape()[1]
    if key not in _MESHES:
        _MESHES[key] = build_mesh(plan)
    return _MESHES[key]


def run_parallel(case: ParityCase) -> dict[str, Any]:
    """Train `case` through shoal's parallelize + train_step on this rank (call on every rank)."""
    plan = Plan.parse(case.plan).resolve(dist.get_world_size())
    plan.validate(case.model, global_batch=case.global_batch, seq_len=case.seq_len)
    mesh = cached_mesh(plan)
    model = parallelize(case.build_model(), plan, mesh)
    optimizer = case.optimizer(model)
    part = data_rank(mesh)
    local = case.global_batch // part[1]
    batches = [(x[part[0] * local:(part[0] + 1) * local], y[part[0] * local:(part[0] + 1) * local])
               for x, y in case.batches()]
    result: dict[str, Any] = {"part": part, "losses": []}
    with torch.no_grad():
        logits = model(batches[0][0])
        result["logits"] = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()
    for step, (inputs, targets) in enumerate(batches):
        micro = split_micro(inputs, targets, case.num_micro)
        if step == 0:  # step by hand to look at the gradients before the update
            optimizer.zero_grad(set_to_none=True)
            loss = float(all_reduce_mean(forward_backward(model, micro), mesh))
            scaler = getattr(model, "loss_scaler", None)  # fp16: unscale, clip, skip on overflow (as train_step)
            scale = scaler.scale_value if scaler is not None else 1.0
            result["grads"] = {k: g / scale for k, g in full_tensors(model, grads=True).items()}
            grad_norm = clip_grad_norm(model, case.grad_clip if scaler is None else None)
            if scaler is None or scaler.unscale_and_clip_(model, grad_norm, case.grad_clip)[0]:
                optimizer.step()
            result["params"] = full_tensors(model)
        else:
            loss, _ = train_step(model, optimizer, micro, mesh=mesh, grad_clip=case.grad_clip)
        result["losses"].append(loss)
    result["final_params"] = full_tensors(model)
    return result


def check_parity(
    results: list[dict[str, Any]], reference: dict[str, Any], *, rtol: float = 1e-5, atol: float = 1e-6,
    param_atol: float = 1e-5,
) -> None:
    """Compare every rank's run with the reference.

    Default tolerances (fp32): outputs and gradients differ from the single process only by the
    order of floating-point sums (a data-parallel all-reduce, a matmul over a smaller batch),
    a few ulps, so rtol 1e-5 / atol 1e-6. Parameters after Adam steps get atol 1e-5: Adam divides
    by sqrt(v), so an entry whose gradient is near zero can move by a larger share of lr.
    """
    for rank, res in enumerate(results):
        index, count = res["part"]
        rows = reference["logits"].shape[0] // count
        assert_close(res["logits"], reference["logits"][index * rows:(index + 1) * rows],
                     rtol=rtol, atol=atol, what=f"rank {rank} logits")
        assert_close(res["grads"], reference["grads"], rtol=rtol, atol=atol, what=f"rank {rank} grads")
        assert_close(res["params"], reference["params"], rtol=rtol, atol=param_atol, what=f"rank {rank} params")
        assert_close(res["losses"], reference["losses"], rtol=rtol, atol=atol, what=f"rank {rank} losses")
        assert_close(res["final_params"], reference["final_params"], rtol=1e-4, atol=param_atol * 10,
                     what=f"rank {rank} final params")


def case(**kwargs: Any) -> ParityCase:
    """A ParityCase with overrides (a short name for tests)."""
    return dataclasses.replace(ParityCase(), **kwargs)
