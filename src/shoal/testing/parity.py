"""The parity harness: run a configuration on N gloo processes and compare with a single process.

The tests run the functions here on every rank of a `shoal.infra.pool.WorkerPool` (one per world
size, reused by every test that asks for it). `ParityCase` describes one configuration;
`run_reference(case)` trains it in plain PyTorch in this process (in float32, and in float64 as
the truth), `run_parallel(case)` (called on every rank) trains it through shoal's real
`parallelize` and the trainer's own `train_step`, and `check_parity(results, case)` checks
outputs, every gradient, the first optimizer step, the loss curve and the final parameters. How
its tolerances follow from the arithmetic: `check_parity`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.loss import IGNORE
from shoal.mesh import build_mesh
from shoal.models import ModelConfig, ModelShape, build_model
from shoal.moe.collect import MoECollector
from shoal.plan import Plan
from shoal.runtime import Runtime
from shoal.testing.asserts import FLOOR_ULPS, MOVED, SLACK, U32, assert_rounding_close, full_tensors
from shoal.train.step import split_micro, train_step
from shoal.train.task import task_for

SMALL = ModelConfig(num_layers=2, dim=64, num_heads=8, num_kv_heads=4, ffn_dim=128, vocab_size=128, max_seq_len=64)


_HF_BASE = ModelConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=32,
                       rope_theta=500.0)


_HF_MOE = dict(num_experts=4, top_k=2, capacity_factor=0.0, aux_loss_coef=0.0, z_loss_coef=0.0)


HF_FAMILIES: dict[str, ModelConfig] = {
    "llama3": _HF_BASE.replace(rope_type="llama3", rope_factor=8.0, rope_original_max_len=8),
    "yarn": _HF_BASE.replace(rope_type="yarn", rope_factor=4.0, rope_original_max_len=8),
    "linear": _HF_BASE.replace(rope_type="linear", rope_factor=4.0),
    "dynamic": _HF_BASE.replace(rope_type="dynamic", rope_factor=2.0),
    "mistral": _HF_BASE.replace(sliding_window=4),  # sequences of 16: four windows
    "qwen2": _HF_BASE.replace(qkv_bias=True, tie_embeddings=True),
    "qwen3": _HF_BASE.replace(qk_norm=True, head_size=32),
    "gpt2": _HF_BASE.replace(num_kv_heads=None, ffn_dim=256, norm="layernorm", activation="gelu", pos_emb="learned",
                             bias=True, tie_embeddings=True),
    "mixtral": _HF_BASE.replace(**_HF_MOE),
    "qwen2_moe": _HF_BASE.replace(**_HF_MOE, ffn_dim=32, qkv_bias=True, norm_topk=False, num_shared_experts=1,
                                  shared_ffn_dim=48, shared_gate=True),
    "qwen3_moe": _HF_BASE.replace(**{**_HF_MOE, "num_experts": 8}, ffn_dim=32, dense_ffn_dim=48, moe_dense_layers=(0,),
                                  qk_norm=True, head_size=32, num_layers=3),
    # latent attention; layer 0 dense at its own width, then 8 experts of 16 in 4 groups (top-2 groups, top-3
    # experts), sigmoid scores scaled by 1.5 with a selection bias, one shared MLP two experts wide
    "deepseek_v3": _HF_BASE.replace(**{**_HF_MOE, "num_experts": 8, "top_k": 3}, num_kv_heads=None, kv_lora_rank=16,
                                    q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, ffn_dim=16,
                                    dense_ffn_dim=96, moe_first_dense=1, num_layers=3, router_score="sigmoid",
                                    router_bias=True, router_groups=4, router_topk_groups=2, router_scale=1.5,
                                    num_shared_experts=1, shared_ffn_dim=32),
}
HF_FAMILIES["deepseek_v3-dense"] = HF_FAMILIES["deepseek_v3"].replace(num_experts=0, moe_first_dense=0, ffn_dim=96,
                                                                      dense_ffn_dim=0, num_shared_experts=0,
                                                                      shared_ffn_dim=0)
"""(DeepSeek-V3 with every layer dense, first_k_dense_replace >= num_hidden_layers: its latent attention under
context parallelism, which shoal does not run with experts.)"""
"""Tiny shapes of what shoal.from_hf makes of each Hugging Face family's config (tests/test_hf.py
checks that mapping; tests/test_hf_families.py checks each against transformers' model): the
parallel tests' and bench/hf_matrix.py's families. The rotary theta is small so that the scalings
change many angles; dynamic equals the default rotary within max_seq_len, as in transformers."""


@dataclass(frozen=True, kw_only=True)
class ParityCase:
    """One configuration to train in parallel and in a single process from the same start."""

    plan: str = "dp2"
    model: ModelShape = SMALL
    """A model family's shape (shoal.models.adapter.Family): a transformer's (random token sequences), or another
    family's (the random samples of its task: shoal.train.task.Task.random_batches)."""
    steps: int = 4
    global_batch: int = 8
    seq_len: int = 16
    num_micro: int = 1
    lr: float = 1e-3
    grad_clip: float | None = 1.0
    seed: int = 0
    adam_eps: float = 1e-8
    """AdamW's eps."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form knobs for cases that later parallelisms add."""

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The global batches of every step: seeded random samples of the model's task (token sequences for a
        transformer), the same in every process."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        return task_for(self.model).random_batches(self.model, steps=self.steps, global_batch=self.global_batch,
                                                   seq_len=self.seq_len, generator=gen)

    def build_model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        torch.manual_seed(self.seed)
        return build_model(self.model).to(dtype)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1, eps=self.adam_eps, foreach=False)

    def optimizer_for(self, source: Runtime | nn.Module) -> torch.optim.Optimizer:
        """The optimizer over a runtime's or a plain model's parameters (`optimizer` by default; a
        case whose optimizer needs the model, as CowClip its embedding tables, overrides this)."""
        return self.optimizer(source.parameters())


def run_reference(case: ParityCase, dtype: torch.dtype = torch.float32,
                  after: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None) -> dict[str, Any]:
    """Train `case` in plain PyTorch in this process, in `dtype` (float64: the truth); `after(model,
    optimizer)`, when given, sees them once the last step is done. The result holds every step's loss and
    global gradient norm before clipping ("losses", "grad_norms"), the routers' selection biases after every step
    ("step_router_bias"), and the first step's gradients, norm and parameters after the update ("grads",
    "grad_norm", "params")."""
    torch.set_num_threads(1)
    model = case.build_model(dtype)
    optimizer = case.optimizer_for(model)
    # float inputs (images) in the run's dtype; token ids stay integers
    batches = [(x.to(dtype) if x.is_floating_point() else x, y) for x, y in case.batches()]
    result: dict[str, Any] = {"losses": [], "grad_norms": [], "init_params": full_tensors(model),
                              "step_router_bias": []}
    moe: MoECollector | PlainRouterLosses = (PlainRouterLosses(model) if PlainRouterLosses.wanted(model)
                                              else MoECollector(model))  # an MoE model's losses join the training loss
    micro = case.num_micro  # one process's accumulation over the whole global batch
    with torch.no_grad():
        result["logits"] = model(batches[0][0])
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        num_targets = int((targets != IGNORE).sum())  # the loss: the mean over every target of the global batch
        for x, y in zip(inputs.chunk(micro), targets.chunk(micro)):
            logits = model(x)  # (B, T, V) for text, (B, classes) for images
            logits = logits if logits.dim() == 2 else logits.flatten(0, 1)
            loss = F.cross_entropy(logits, y.flatten(), reduction="sum") / max(num_targets, 1)
            added = moe.take_loss()
            (loss + added / micro if added is not None else loss).backward()
            loss_sum += loss.item()
        if isinstance(moe, MoECollector):
            moe.take_stats()
        if step == 0:
            result["grads"] = full_tensors(model, grads=True)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.grad_clip or float("inf"))
        optimizer.step()
        moe.update_bias()  # an MoE router's selection bias, by the step's loads (none: nothing)
        result["step_router_bias"].append(router_biases(model))
        if step == 0:
            result["params"] = full_tensors(model)
            result["grad_norm"] = norm.item()
        result["losses"].append(loss_sum)
        result["grad_norms"].append(norm.item())
    result["final_params"] = full_tensors(model)
    result["router_bias"] = router_biases(model)
    if after is not None:
        after(model, optimizer)
    return result


def pooled_router_loss(logits: list[torch.Tensor], coef: float, top_k: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` as it reads (Mixtral, Qwen2-MoE): every MoE layer's gate logits of
    one forward concatenated, a softmax, the top_k experts of each row one-hot, and num_experts x the sum over
    experts of (the rows' mean one-hot, summed over the k choices) x (the mean probability), times `coef`."""
    probs = torch.cat(logits).softmax(dim=-1)
    num_experts = probs.shape[-1]
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).float()  # (rows, k, E), no gradient
    tokens_per_expert = chosen.mean(dim=0)  # (k, E)
    prob_per_expert = probs.mean(dim=0)  # (E,)
    return coef * num_experts * (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum()


class PlainRouterLosses:
    """The one-process reference's router losses for a model whose MoE layers pool the load-balancing
    loss (`aux_loss_pooled`), written out plainly rather than through shoal.moe.collect: each layer's
    gate logits recomputed from its input (x @ W_gate^T in float32), then per forward `pooled_router_loss`
    over every layer's logits plus each layer's z-loss (z_loss_coef x the mean of logsumexp^2). The parallel
    runs' collector (pooling over ranks, stages and micro-batches) is held against this."""

    def __init__(self, model: nn.Module) -> None:
        self._logits: list[tuple[Any, torch.Tensor]] = []
        for module in model.modules():
            if getattr(module, "aux_loss_pooled", False):
                module.register_forward_hook(self._called)

    @staticmethod
    def wanted(model: nn.Module) -> bool:
        """The model's layers pool the load-balancing loss and no router moves a selection bias (whose update
        the collector's reference, tests/test_router_options.py, checks against the paper's formula)."""
        modules = list(model.modules())
        return (any(getattr(m, "aux_loss_pooled", False) for m in modules)
                and not any(getattr(m, "bias_rate", 0) for m in modules))

    def update_bias(self) -> None:
        """No router here moves a bias (`wanted`)."""

    def _called(self, module: nn.Module, args: Any, _out: Any) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation forward adds no loss
        x = args[0]
        gate: torch.Tensor = module.router.gate.weight  # type: ignore[union-attr,assignment]
        self._logits.append((module, F.linear(x.reshape(-1, x.shape[-1]).float(), gate.float())))

    def take_loss(self) -> torch.Tensor | None:
        calls, self._logits = self._logits, []
        if not calls:
            return None
        layer = calls[0][0]
        z = sum(m.z_loss_coef * torch.logsumexp(lg, dim=-1).square().mean() for m, lg in calls)
        return pooled_router_loss([lg for _, lg in calls], layer.aux_loss_coef, layer.top_k) + z


def reference_update(case: ParityCase, grads: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """The first optimizer step of plain PyTorch (clip, AdamW) applied to the given gradients:
    (parameters after it, the clip coefficient used)."""
    model = case.build_model()
    optimizer = case.optimizer_for(model)
    for name, param in model.named_parameters():
        if param.requires_grad:  # a frozen one (a low-rank adapter's base) has no gradient
            param.grad = grads[name].to(param.dtype).clone()
    coef = 1.0
    if case.grad_clip:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.grad_clip))
        coef = min(1.0, case.grad_clip / (norm + 1e-6))
    optimizer.step()
    return full_tensors(model), coef


def parallel_setup(case: ParityCase) -> tuple[Runtime, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    """On this rank: the case's model parallelized by its plan, its optimizer, and this rank's
    slice of every global batch."""
    plan = rules.resolve(Plan.parse(case.plan), world_size=dist.get_world_size())
    rules.validate(plan, case.model, global_batch=case.global_batch, seq_len=case.seq_len)
    runtime = parallelize(case.build_model(), plan, build_mesh(plan))
    optimizer = case.optimizer_for(runtime)
    index, count = runtime.data_rank
    rows = case.global_batch // count
    batches = [(x[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows]) for x, y in case.batches()]
    return runtime, optimizer, batches


def run_parallel(case: ParityCase) -> dict[str, Any]:
    """Train `case` through shoal's parallelize and the trainer's train_step on this rank (call
    on every rank)."""
    runtime, optimizer, batches = parallel_setup(case)
    result: dict[str, Any] = {"part": runtime.data_rank, "losses": [], "grad_norms": []}
    with torch.no_grad():
        logits = runtime(batches[0][0])
        result["logits"] = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()
    for step, (inputs, targets) in enumerate(batches):
        seen = (lambda rt: result.update(grads=full_tensors(rt, grads=True))) if step == 0 else None
        out = train_step(runtime, optimizer, split_micro(inputs, targets, case.num_micro),
                         grad_clip=case.grad_clip, before_update=seen)
        if step == 0:
            result["params"] = full_tensors(runtime)
            result["grad_norm"] = float(out.grad_norm)
        result["losses"].append(float(out.loss))
        result["grad_norms"].append(float(out.grad_norm))
    result["final_params"] = full_tensors(runtime)
    result["router_bias"] = router_biases(runtime)
    return result


def router_biases(source: Runtime | nn.Module) -> dict[str, torch.Tensor]:
    """The MoE routers' selection biases a model or a runtime's rank holds (a pipeline stage: its own layers'),
    by name."""
    return {name: buf.detach().cpu().clone() for name, buf in source.named_buffers()
            if name.endswith("router.bias")}


_REFERENCES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}


def references(case: ParityCase) -> tuple[dict[str, Any], dict[str, Any]]:
    """(float32, float64) single-process runs of `case`, computed once per test session."""
    key = repr(case)  # the case's dict field does not hash
    if key not in _REFERENCES:
        _REFERENCES[key] = run_reference(case), run_reference(case, torch.float64)
    return _REFERENCES[key]


def check_parity(results: list[dict[str, Any]], case: ParityCase) -> None:
    """Compare every rank's run of `case` with the single-process references.

    - logits, every gradient of step 1 and their global norm, the loss of every step:
      `assert_rounding_close` against the float64 run, with the float32 run's own error as the
      yardstick.
    - the first optimizer step: plain PyTorch's clip + AdamW applied to this rank's own
      gradients (`reference_update`) must give this rank's parameters. Both apply the same
      elementwise formulas to the same numbers; only the clip coefficient c differs, by the
      rounding of the global norm's sum (both norms are known, and the rank's was checked above,
      so their difference dc is a rounding difference).
      An AdamW first step moves an entry by lr * c g / (c |g| + eps); a change dc in c changes
      that move by at most lr |dc| / (4c): bound lr (|dc| / (4c) + 8u) + 4u |p|.
      Comparing this step with the reference run's instead would be ill-posed: for a gradient
      entry near eps, lr / eps turns a rounding difference in g into a visible move.
    - final parameters, after several AdamW steps: for the reason just given, an entry whose
      gradient is near zero may move differently by up to ~lr per step, so no elementwise
      rounding bound exists (a key projection's bias has an exactly zero true gradient: float32
      noise alone moves it). Per tensor (L2 norms), the distance from the float64 run must stay
      under MOVED (1%) of the distance training moved it plus SLACK times the single-process
      float32 run's own distance (a wrong shard or a missing average is off by ~100% of the
      movement).
    """
    ref32, ref64 = references(case)
    every: dict[str, torch.Tensor] = {}  # under pp each rank holds its stages' parameters: the union
    for res in results:
        every.update(res["grads"])
    assert set(every) == set(ref64["grads"]), f"parameters differ: {sorted(set(every) ^ set(ref64['grads']))}"
    for rank, res in enumerate(results):
        index, count = res["part"]
        rows = ref64["logits"].shape[0] // count
        part = slice(index * rows, (index + 1) * rows)
        mine = set(res["grads"])
        assert_rounding_close(res["logits"], ref32["logits"][part], ref64["logits"][part], what=f"rank {rank} logits")
        assert_rounding_close(res["grads"], _only(ref32["grads"], mine), _only(ref64["grads"], mine),
                              what=f"rank {rank} grads")
        assert_rounding_close(res["losses"], ref32["losses"], ref64["losses"], what=f"rank {rank} losses")
        assert_rounding_close(res["grad_norm"], ref32["grad_norm"], ref64["grad_norm"], what=f"rank {rank} grad norm")
        expected, coef = reference_update(case, {**every, **res["grads"]})
        par_coef = min(1.0, case.grad_clip / (res["grad_norm"] + 1e-6)) if case.grad_clip else 1.0
        for name, value in _only(expected, mine).items():
            atol = case.lr * (abs(par_coef - coef) / (4 * coef) + 8 * U32) + 4 * U32 * value.abs()
            diff = (res["params"][name] - value).abs()
            assert bool((diff <= atol).all()), (f"rank {rank} params[{name}] after step 1: off plain AdamW on the "
                                                f"same gradients by {diff.max().item():.3g}")
        assert_trained_close(res["final_params"], ref32, ref64, what=f"rank {rank} final params")


def parity_diffs(results: list[dict[str, Any]], case: ParityCase) -> dict[str, float]:
    """The largest absolute differences of `results` (every rank's run_parallel) from the
    single-process float32 run of `case`: the losses of every step and the gradients of the first
    (a report's figures; `check_parity` is the test); and, for scale, the largest gradient entry."""
    ref32, _ = references(case)
    loss = grad = 0.0
    for res in results:
        loss = max(loss, max(abs(a - b) for a, b in zip(res["losses"], ref32["losses"], strict=True)))
        for name, g in res["grads"].items():
            grad = max(grad, (g.double() - ref32["grads"][name].double()).abs().max().item())
    largest = max(g.abs().max().item() for g in ref32["grads"].values())
    return {"loss": loss, "grad": grad, "largest_grad": largest}


def assert_trained_close(final: dict[str, torch.Tensor], ref32: dict[str, Any], ref64: dict[str, Any], *,
                         what: str = "final params") -> None:
    """Parameters after several AdamW steps against the references' `final_params` (see
    `check_parity`): per tensor, within MOVED of the distance the float64 run moved them from
    `init_params`, plus SLACK times the single-process float32 run's own distance."""
    unknown = sorted(set(final) - set(ref64["final_params"]))
    assert not unknown, f"{what}: unknown names {unknown}"
    for name in final:  # a pipeline stage's own
        truth = ref64["final_params"][name]
        moved = (truth - ref64["init_params"][name]).norm().item()
        single = (ref32["final_params"][name].double() - truth).norm().item()
        off = (final[name].double() - truth).norm().item()
        bound = MOVED * moved + SLACK * single + FLOOR_ULPS * U32 * truth.abs().max().item()
        assert off <= bound, (f"{what}[{name}]: {off:.3g} from the float64 run > {bound:.3g} ({MOVED:.0%} of the "
                              f"{moved:.3g} training moved them + {SLACK:g} x the single-process float32 "
                              f"run's {single:.3g})")


def train_segments(pools: Callable[[int], Any], case: ParityCase, run_dir: str,
                   segments: tuple[tuple[str, int, int], ...]) -> Iterator[tuple[str, int, int, list[dict[str, Any]]]]:
    """Each (plan, start, end) of `segments` in turn through `train_segment`, each resuming from the last one's
    checkpoint in `run_dir`: "single" in this process, any other plan on every rank of `pools(2)` (the tests'
    worker pools). Yields the segment with every rank's result."""
    for plan_text, start, end in segments:
        if plan_text == "single":
            results = [train_segment(case, run_dir, plan_text, start, end)]
        else:
            results = pools(2).run(train_segment, case, run_dir, plan_text, start, end)
        yield plan_text, start, end, results


def train_segment(case: ParityCase, run_dir: str, plan_text: str, start: int, end: int,
                  num_micro: int = 1) -> dict[str, Any]:
    """Steps start..end-1 of `case` under `plan_text` ("single": one process, no process group),
    resumed from the latest checkpoint in `run_dir` when start > 0 and saved there at the end:
    the checkpoint-resharding tests' segment. Returns the losses, the gradient norms before clipping and the
    final parameters and the routers' selection biases this rank holds."""
    from shoal.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    if plan_text == "single":
        runtime = parallelize(case.build_model())
    else:
        plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
        runtime = parallelize(case.build_model(), plan, build_mesh(plan))
    optimizer = case.optimizer_for(runtime)
    if start > 0:
        path = latest_checkpoint(run_dir)
        assert path is not None, run_dir
        extra = load_checkpoint(path, runtime=runtime, optimizer=optimizer)
        assert extra["step"] == start, extra
    index, count = runtime.data_rank
    rows = case.global_batch // count
    losses, norms = [], []
    for x, y in case.batches()[start:end]:
        x, y = x[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows]
        out = train_step(runtime, optimizer, split_micro(x, y, num_micro), grad_clip=case.grad_clip)
        losses.append(float(out.loss))
        norms.append(float(out.grad_norm))
    save_checkpoint(run_dir, end, runtime=runtime, optimizer=optimizer, extra={"step": end, "plan": plan_text})
    return {"losses": losses, "grad_norms": norms, "params": full_tensors(runtime),
            "router_bias": router_biases(runtime)}


def _only(values: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k in names}


def case(**kwargs: Any) -> ParityCase:
    """A ParityCase with overrides (a short name for tests)."""
    return dataclasses.replace(ParityCase(), **kwargs)


HF_PLANS: dict[str, int] = {
    "tp2": 2, "pp2": 2, "pp2,sched=zb": 2, "fsdp2,zero=1": 2, "fsdp2,zero=2": 2, "fsdp2": 2, "cp2": 2,
    "cp2,cp_mode=a2a": 2, "ep2": 2, "fsdp2,tp2": 4, "tp2,pp2": 4, "fsdp2,ep2": 2, "tp2,ep2": 4, "pp2,ep2": 4,
}
"""The plans every Hugging Face family is asked to take (issue 25), each with its process count:
every axis alone (pp2 runs 1f1b; fsdp2 is ZeRO-3; cp2 is ring attention) and three two-axis plans."""


def hf_case(family: str, plan: str, *, world_size: int | None = None) -> ParityCase:
    """The parity case of one of HF_FAMILIES under `plan` (two steps; under pp the reference
    accumulates over the plan's micro-batches, as the pipeline does); the one-line ValueError of
    shoal.rules if the family cannot take the plan."""
    c = case(plan=plan, model=HF_FAMILIES[family], steps=2)
    resolved = rules.resolve(Plan.parse(plan), world_size=world_size or HF_PLANS[plan], model=c.model,
                             global_batch=c.global_batch, seq_len=c.seq_len)
    return dataclasses.replace(c, num_micro=resolved.micro_batches if resolved.pp > 1 else 1)
