"""The parallel runtime: the one object between the trainer and the parallel layer.

`shoal.apply_plan.parallelize(model, plan, mesh)` applies a plan to an unmodified model (in
place: sharded, never wrapped) and returns a `Runtime` holding what the parallelisms built: the
data engine (shoal.parallel.data: none, DDP, shoal's ZeRO-1/2 or FSDP2, as the pure
`shoal.rules.choose_engine` picks it), and where the plan has them the pipeline executor, the
context-parallel sequence split and the expert gradients' reduction. The trainer, checkpoints,
export, sampling, benchmarks and the parity harness use the parallel layer only through the
methods below and its read-only `plan`, `mesh` and `choice` (the engine); it keeps its parts
private, and attaches nothing to the user's modules.

- The model: `parts` (the user's modules as the parallelisms left them: one, or under pp each
  stage this rank runs), `named_parameters()` / `parameters()` (what an optimizer updates, under
  the user's names; DTensor shards where the plan shards), `runtime(inputs)` (forward for
  evaluation and sampling: under cp the slices' outputs gathered, under pp the last stage's
  output on every stage), `train()` / `eval()`.
- One step: `forward_backward(micro_batches, loss_fn)` runs a rank's micro-batches (under pp on
  the schedule): gradients reduced over the data ranks on the last one only (`no_sync()` for
  loops of one's own), the gradients of tied embeddings summed over the first and last
  stages (pp), fp16 loss scaling, the vocabulary-parallel loss, the cp split
  (`local_batches`), the MoE layers' auxiliary losses (a loss pooled over the forward's tokens,
  `aux_loss_pooled`, pooled over the data ranks and the pipeline's stages; their load figures in
  `moe_stats`), then tensor parallelism's partial gradients and the expert gradients reduced
  once. `eval_loss` is its forward-only twin. `grad_norm()` (fp16: unscales first, flags an
  overflow on the device) and `clip_grads_(max_norm, norm)` work on the engine's shards; `global_mean(value)`
  averages over the data ranks; `data_rank` says which slice of each global batch is this rank's.
- State: `state_dict(optimizer)` / `load_state_dict(...)` in DCP's format, so checkpoints
  reshard; `full_weights()` / `load_full_weights(...)` for export and import; `loss_scaler`,
  fp16's dynamic loss scale (None otherwise), which the trainer saves.
- Watching and measuring: `where()` (under pp the stage and micro-batch this rank is at),
  `on_progress(callback)` (told each time that changes: the watchdog's sign of life),
  `record_timeline(on)` then `pipeline_timeline()` / `pipeline_summary(chart)` (the measured
  bubble and the Gantt chart), `describe()` (the plan, engine, stages and schedule in words).

After Megatron-Core's `get_forward_backward_func()` and torchtitan's model parts + ParallelDims,
without global state: a runtime holds its own plan and mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from shoal.loss import Batch, LossFn
from shoal.mesh import all_reduce_mean, data_rank, reduction_groups, stages_and_data_mesh
from shoal.moe.collect import MoECollector
from shoal.parallel.context import ContextSplit
from shoal.parallel.data import DataEngine, clean_name
from shoal.parallel.expert import ExpertGrads

# cross_entropy_sum and num_targets are also the trainer's, through here (the trainer imports no shoal.parallel).
from shoal.parallel.loss import cross_entropy_sum as cross_entropy_sum
from shoal.parallel.loss import local_value, vocab_parallel_loss
from shoal.parallel.loss import num_targets as num_targets
from shoal.parallel.pipeline import Pipeline
from shoal.parallel.precision import LossScaler, PrecisionPolicy
from shoal.parallel.schedules import bubble_fraction, save_gantt
from shoal.parallel.tensor import reduce_partial_grads
from shoal.parallel.tied import TiedGrads
from shoal.plan import Plan
from shoal.rules import EngineChoice


class Runtime:
    """A model trained under one plan on one mesh (or alone in one process: plan and mesh None)."""

    def __init__(self, engine: DataEngine, *, plan: Plan | None, mesh: DeviceMesh | None,
                 choice: EngineChoice | None, context: ContextSplit | None = None,
                 pipeline: Pipeline | None = None, experts: ExpertGrads | None = None,
                 tied: TiedGrads | None = None, pooled_experts: int = 0) -> None:
        """`pooled_experts` (pp): the experts per layer of a model whose MoE layers pool their
        load-balancing loss over every layer (aux_loss_pooled), 0 for none; the whole model's, since
        a stage may hold none of those layers and still takes part in pooling their counts."""
        self.plan, self.mesh = plan, mesh
        self._context = context  # cp > 1: this rank's slice of every sequence, taken from each micro-batch here
        self._pipeline = pipeline  # pp > 1: this rank's stages and schedule
        self._pp_group = mesh["pp"].get_group() if pipeline is not None and mesh is not None else None
        self._moe = MoECollector(engine.module)
        self._experts = experts
        """ep > 1: the expert weights, whose gradients the data engine leaves to us."""
        self._tied = tied  # pp with tied embeddings: the first and last stages' copies of the table
        self.part = "forward"
        """Where this rank's main thread is within a step: "forward", "backward" or "optimizer", set as it moves on
        (forward_backward; `enter` for the rest of a step); `step_words` says it to the watchdog."""
        self.moe_stats: dict[str, torch.Tensor] = {}
        """Per MoE layer, the last step's load figures (shoal.moe.collect.FIGURES, then each expert's
        share of the kept tokens), on the device; {} for a dense model."""
        self.choice = choice
        """The data-parallel engine that runs the plan (shoal.rules.choose_engine); None in one process."""
        self._engine = engine
        # The loss is averaged over every rank that sees other tokens: data ranks and cp ranks.
        self._data_groups = reduction_groups(mesh, ("dp", "fsdp", "cp")) if mesh is not None else []
        if self._data_groups:
            # A load-balancing loss pooled over the forward's tokens pools them over these ranks too.
            # Not over tp: every tp rank routes the same (gathered) tokens (shoal.parallel.expert).
            ranks = 1
            for group in self._data_groups:
                ranks *= dist.get_world_size(group)
            self._moe.pool_over(self._sum_over_data, ranks)
        self._stage_group: dist.ProcessGroup | None = None
        if pipeline is not None and mesh is not None and pooled_experts:
            # Every stage and data rank: one sum of a micro-batch's counts (not over the pp group's
            # point-to-point messages, whose order the schedule fixes). Collective: every rank.
            self._stage_group = stages_and_data_mesh(mesh).get_group()
            self._moe.pool_over_stages(self._start_sum_over_stages, pooled_experts)
        precision = (PrecisionPolicy.from_name(plan.precision or "fp32", reduce=plan.reduce) if plan
                     else PrecisionPolicy())
        self.loss_scaler: LossScaler | None = LossScaler() if precision.loss_scaling else None
        """fp16's dynamic loss scale; its state belongs in the trainer's checkpoint state."""

    # ------------------------------------------------------------------ the model
    @property
    def parts(self) -> list[nn.Module]:
        """The user's model parts, as the parallelisms left them (sharded in place, not wrapped):
        one, or under pp each stage this rank runs."""
        if self._pipeline is not None and len(self._pipeline.stages) > 1:
            return list(self._pipeline.stages.values())
        return [self._engine.module]

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """Forward (evaluation, sampling): the model's output for this rank's inputs (under cp,
        for the whole sequences: the slices' outputs are gathered; under pp on every stage)."""
        if self._pipeline is not None:
            return self._pipeline_forward(inputs)
        if self._context is not None:
            return self._context.gather(self._engine.model(self._context.split(inputs)))
        return self._engine.model(inputs)

    def train(self, mode: bool = True) -> Runtime:
        self._engine.model.train(mode)
        return self

    def eval(self) -> Runtime:
        return self.train(False)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """What an optimizer updates, under the names of the user's module (no wrapper prefixes)."""
        for name, param in self._engine.named_parameters():
            yield clean_name(name), param

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (under pp its stages'), under the names of the user's module."""
        for part in self.parts:
            for name, buffer in part.named_buffers():
                yield clean_name(name), buffer

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """For a loop of one's own: around every micro-batch's backward but the last, accumulate
        gradients without reducing them where the engine can (forward_backward does this itself)."""
        return self._engine.no_sync()

    @property
    def data_rank(self) -> tuple[int, int]:
        """(index, count): this rank takes slice `index` of `count` equal slices of every global batch."""
        return data_rank(self.mesh) if self.mesh is not None else (0, 1)

    # ------------------------------------------------------------------ one step
    def forward_backward(self, micro_batches: Sequence[Batch], loss_fn: LossFn | None = None) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; gradients accumulate and are
        reduced over the data ranks on the last one. The loss is the mean over every target of the
        global batch (`share`), so no plan, world size or micro-batch count changes it. Returns
        the rank's share of the global loss, detached, on the device (no host synchronisation):
        `global_mean` of it is the global batch's loss."""
        local = self.local_batches(micro_batches)
        share = self.share(local, loss_fn)
        if self._pipeline is not None:
            self.part = "forward"  # the schedule's own words (`where`) say more while it runs
            scale = self.loss_scaler.scale if self.loss_scaler is not None else None
            n = len(micro_batches)
            # Stages start backward from their outputs, so MoE losses ride on the layers' outputs.
            with self._moe.attached(lambda added: scale(added / n) if scale is not None else added / n):
                pp_total = self._pipeline.step(local, share, scale=scale, around=self._pooling_micro_batches())
            if self._tied is not None:
                self._tied.sync()
            self._after_backward()
            return self._pp_sum(pp_total)
        total: torch.Tensor | float = 0.0
        for i, (inputs, targets) in enumerate(local):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                self.part = "forward"
                output = self._engine.model(inputs)
                with vocab_parallel_loss(output):  # tp: vocab-sharded logits, softmax across shards
                    loss = share(output, targets)
                    del output  # its backward keeps what it needs: the logits themselves would be one copy more
                    added = self._moe.take_loss()  # MoE load-balancing and z-losses, weighted
                    if added is not None and isinstance(loss, DTensor):  # tp: the same on every tp rank
                        added = DTensor.from_local(added, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim,
                                                   run_check=False)
                    trained = loss + added / len(micro_batches) if added is not None else loss
                    self.part = "backward"
                    (self.loss_scaler.scale(trained) if self.loss_scaler is not None else trained).backward()
            total = total + local_value(loss)
        self._after_backward()
        return torch.as_tensor(total)

    def share(self, local: Sequence[Batch], loss_fn: LossFn | None = None) -> LossFn:
        """What each of this rank's micro-batches (`local`, after the cp split) contributes to the
        loss, before the engines average the gradients over the R ranks that see other tokens
        (dp x fsdp x cp). By default its summed token losses x R / N, N the global batch's count
        of targets (those not IGNORE: fine-tuning data masks prompts), found by one small
        all-reduce: then the average over ranks is the mean over every target of the global
        batch, however uneven the masks. A `loss_fn` of one's own returns a micro-batch's mean;
        it is divided by the number of micro-batches (a mean of means)."""
        if loss_fn is not None:
            return lambda output, targets: loss_fn(output, targets) / len(local)
        device = local[0][1].device if local else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int64, device=device)
        for _, targets in local:
            count = count + num_targets(targets)
        ranks = 1
        if self.mesh is not None:
            count = count.to(self.mesh.device_type)  # NCCL reduces only GPU tensors
            for group in self._data_groups:
                dist.all_reduce(count, group=group)
                ranks *= dist.get_world_size(group)
            count = count.to(device)
        factor = ranks / count.clamp(min=1).double()  # a batch without targets: loss 0, no gradient
        return lambda output, targets: cross_entropy_sum(_logits(output), targets, consume=True) * factor.float()

    def _sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (no gradient) summed over the ranks that see other tokens, on its device."""
        assert self.mesh is not None
        summed = value.to(self.mesh.device_type)  # NCCL reduces only GPU tensors
        for group in self._data_groups:
            dist.all_reduce(summed, group=group)
        return summed.to(value.device)

    def _pooling_micro_batches(self) -> Callable[[int, int], contextlib.AbstractContextManager[None]] | None:
        """pp with a pooled load-balancing loss: around each stage forward, the micro-batch it is of
        for the MoE collector; the sum of its counts starts after this rank's last stage's."""
        if self._stage_group is None:
            return None
        assert self._pipeline is not None
        last = max(self._pipeline.stages)  # this rank's last forward of each micro-batch: its last stage's
        return lambda stage, micro: self._moe.micro_batch(micro, last=stage == last)

    def _start_sum_over_stages(self, value: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing `value` (no gradient) over every stage and data rank, without waiting; the
        returned call waits for the sum (on the device: no host synchronisation) and gives it on
        `value`'s device."""
        assert self.mesh is not None and self._stage_group is not None
        summed = value.to(self.mesh.device_type)  # NCCL reduces only GPU tensors
        work = dist.all_reduce(summed, group=self._stage_group, async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            return summed.to(value.device)

        return wait

    def _after_backward(self) -> None:
        """Partial tp gradients reduced once, the expert gradients' reduction (ep, or tp on an MoE
        model) and the step's MoE figures."""
        # tp runs on no data engine ("none") or under FSDP2, which reduces its own (shoal.rules)
        if self.plan is not None and self.plan.tp > 1 and self.choice is not None and self.choice.kind == "none":
            reduce_partial_grads(self.parameters())
        if self._experts is not None:
            self._experts.sync()
        self.moe_stats = self._moe.take_stats()

    def update_router_bias(self, applied: torch.Tensor | None = None) -> None:
        """After the optimizer step: move the MoE routers' selection biases by the loads of the step's whole
        global batch (shoal.moe.collect.MoECollector.update_bias; nothing for a model without them).
        `applied`: the step's on-device flag that the update was applied (the biases stay where it was not)."""
        self._moe.update_bias(self._sum_over_data if self._data_groups else None, applied)

    @torch.no_grad()
    def eval_loss(self, micro_batches: Sequence[Batch], loss_fn: LossFn | None = None) -> torch.Tensor:
        """This rank's share of the micro-batches' loss (`share`), without gradients (on the device):
        `global_mean` of it is the loss of the whole batch."""
        local = self.local_batches(micro_batches)
        share = self.share(local, loss_fn)
        if self._pipeline is not None:
            return self._pp_sum(self._pipeline.step(local, share, train=False))
        total: torch.Tensor | float = 0.0
        for inputs, targets in local:
            output = self._engine.model(inputs)
            with vocab_parallel_loss(output):
                total = total + local_value(share(output, targets))
        return torch.as_tensor(total)

    def local_batches(self, micro_batches: Sequence[Batch]) -> Sequence[Batch]:
        """What this rank computes of each micro-batch: under cp, the tokens and targets at its
        positions; otherwise the micro-batches themselves."""
        if self._context is None:
            return micro_batches
        return [(self._context.split(x), self._context.split(y)) for x, y in micro_batches]

    def grad_norm(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(global L2 norm of the true gradients, fp16's overflow flag), on the device. Under fp16 the
        gradients are first divided by the loss scale and the flag (a 0-d bool) says whether the scaled
        ones overflowed while the scale was above 1 (the scale halves; LossScaler); None otherwise."""
        norm = self._engine.grad_norm()
        if self._pp_group is not None:  # each stage's norm over its own parameters, a tied table's once
            squares = norm.pow(2)
            if self._tied is not None:
                squares = squares - self._tied.duplicate_square(squares.device)
            norm = self._pp_sum(squares).sqrt()
        if self.loss_scaler is None:
            return norm, None
        factor, overflow = self.loss_scaler.unscale(norm)
        self._engine.scale_grads_(factor)
        return norm * factor, overflow

    def clip_grads_(self, max_norm: float | None, norm: torch.Tensor) -> None:
        """Scale the gradients so that their global norm `norm` is at most `max_norm` (torch's
        clip_grads_with_norm_ formula); None or 0: no clipping."""
        if max_norm:
            self._engine.scale_grads_((max_norm / (norm + 1e-6)).clamp(max=1.0))

    def global_mean(self, value: torch.Tensor) -> torch.Tensor:
        """`value` averaged over the data ranks (every rank gets it), on the device: no host
        synchronisation until someone reads it."""
        if self.mesh is None:
            return value.detach()
        return all_reduce_mean(value, self._data_groups, self.mesh.device_type)

    # ------------------------------------------------------------------ state
    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """{"model": ..., "optimizer": ...} in DCP's format: clean names, sharded tensors as DTensors
        with their global shapes. DCP saves it, or loads into it in place (then `load_state_dict`)."""
        model = self._engine.model_state_dict()
        left_out = set(self._aliases()) | self._frozen()
        state = {"model": {k: v for k, v in model.items() if k not in left_out}}
        if optimizer is not None:
            state["optimizer"] = self._engine.optim_state_dict(optimizer)
        return state

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
        """After DCP loaded a checkpoint into `state_dict(optimizer)`'s tensors: put it to use."""
        model = dict(state["model"])
        for alias, name in self._aliases().items():  # the engines load every name the module has
            if alias not in model and name in model:
                model[alias] = model[name]
        frozen = self._frozen()
        if frozen:  # they keep the values they were built with (loaded onto themselves)
            current = self._engine.model_state_dict()
            model.update({name: current[name] for name in frozen if name not in model and name in current})
        self._engine.load_state_dicts(model, state.get("optimizer"), optimizer)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight unsharded, on the CPU, by clean name. Collective over the mesh; the result
        is complete on rank 0."""
        aliases = self._aliases()
        if self._pp_group is None:
            return {k: v for k, v in self._engine.full_weights().items() if k not in aliases}
        # Every stage's share, gathered within the stage: the engines' full_weights keep theirs on
        # global rank 0 only, which holds the first stage alone.
        weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                   for k, v in self._engine.model_state_dict().items() if k not in aliases}
        stages: list[Any] = [None] * dist.get_world_size(self._pp_group)  # each stage's share, to all
        dist.all_gather_object(stages, weights, group=self._pp_group)
        return {k: v for share in stages for k, v in share.items()}

    def load_full_weights(self, weights: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Take full weights by name (each rank keeps its shard). strict: the names must match. A
        tied head's second name may be left out (loading the embedding loads it) or given."""
        aliases = self._aliases()
        weights = {k: v for k, v in weights.items() if k not in aliases}
        expected = set(self._engine.model_state_dict()) - set(aliases)
        if self._pp_group is not None:  # the whole model's names: every stage's
            names: list[Any] = [None] * dist.get_world_size(self._pp_group)
            dist.all_gather_object(names, expected, group=self._pp_group)
            every = set().union(*names)
            if strict and set(weights) != every:
                missing, unexpected = sorted(every - set(weights)), sorted(set(weights) - every)
                raise ValueError(f"does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
            strict = False
        if strict and set(weights) != expected:
            missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
            raise ValueError(f"does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        self._engine.load_full_weights({k: v for k, v in weights.items() if k in expected})

    def _frozen(self) -> set[str]:
        """Names of the parameters that do not train (a low-rank adapters' frozen base, shoal.models.lora): a
        checkpoint leaves them out, the model being rebuilt with them from their source (the seed or --init)."""
        return {clean_name(name) for part in self.parts for name, p in part.named_parameters() if not p.requires_grad}

    def _aliases(self) -> dict[str, str]:
        """Second names of parameters that have two (a head tied to the embedding: `output.weight`):
        state dicts and full weights hold each tensor once, under the name `named_parameters` gives
        it, so a tied table is saved and exported once under every plan (pp keeps a copy on two
        stages under one name)."""
        first: dict[int, str] = {}
        aliases = {}
        for name, param in self._engine.module.named_parameters(remove_duplicate=False):
            if id(param) in first:
                aliases[clean_name(name)] = first[id(param)]
            else:
                first[id(param)] = clean_name(name)
        return aliases

    # ------------------------------------------------------------------ the pipeline
    def _pp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Under pp, `value` summed over the stages (the loss lives on the last one), on the device."""
        if self._pp_group is None:
            return value
        value = value.detach().to(self.mesh.device_type).clone()  # type: ignore[union-attr]  # _pp_group implies a mesh
        dist.all_reduce(value, group=self._pp_group)
        return value

    def where(self) -> str | None:
        """Under pp, the stage and micro-batch this rank is at (what it waits for), in words."""
        return self._pipeline.where or None if self._pipeline is not None else None

    def enter(self, part: str) -> None:
        """The main thread enters `part` of a step outside forward and backward ("optimizer": the gradient
        norm, clipping and the update), for `step_words`."""
        self.part = part

    def step_words(self) -> str:
        """Where this rank is within a training step, in words: under pp the stage and micro-batch while its
        schedule runs (`where`), else the part it last entered (`part`). Reads two attributes: a watchdog's
        thread calls it on every beat."""
        if self.part == "optimizer":
            return self.part
        return self.where() or self.part

    def on_progress(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever this rank moves on within a step (under pp: each action and
        wait of the schedule; `where` says where), so that a watchdog sees life between the
        step's collectives. Without pp a step has no such points: never called."""
        if self._pipeline is not None:
            self._pipeline.watch(callback)

    def record_timeline(self, on: bool = True) -> None:
        """Under pp, while `on`: time every action of each training step, for `pipeline_timeline`
        and `pipeline_summary` (on a GPU this synchronises per action: turn it on for the steps
        to measure only). Without pp: nothing to record."""
        if self._pipeline is not None:
            self._pipeline.record_timeline(on)

    def pipeline_timeline(self) -> list[list[Any]]:
        """Every pp rank's timed actions of the last step it recorded ((start, end, action), wall
        clock seconds), to every rank of this pipeline. Collective over the pp group."""
        assert self._pipeline is not None and self._pp_group is not None
        timelines: list[Any] = [None] * dist.get_world_size(self._pp_group)
        dist.all_gather_object(timelines, self._pipeline.timeline, group=self._pp_group)
        return timelines

    def pipeline_summary(self, chart: Path | None = None) -> dict[str, float]:
        """Under pp, after a step run with `record_timeline` on: its measured bubble (idle share of
        the ranks' time) beside the formula (p-1)/(v*m+p-1), and, where `chart` is given, the
        step drawn there (a Gantt chart PNG). Collective over the pp group."""
        assert self._pipeline is not None and self.plan is not None and self.plan.vpp is not None
        timeline = self.pipeline_timeline()
        p, m, v = self.plan.pp, self.plan.micro_batches, self.plan.vpp
        if chart is not None:
            save_gantt(timeline, chart,
                       title=f"{self.plan.sched}, {m} micro-batches on {p} ranks: the last training step")
        return {"pipeline_bubble": bubble_fraction(timeline), "pipeline_bubble_formula": (p - 1) / (v * m + p - 1)}

    def _pipeline_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The last stage's output for `inputs` (full, not vocab-sharded), sent to every stage."""
        assert self._pipeline is not None and self._pp_group is not None and self.mesh is not None
        kept: list[torch.Tensor] = []

        def keep(output: torch.Tensor, _targets: Any) -> torch.Tensor:
            kept.append((output.full_tensor() if isinstance(output, DTensor) else output).float())
            return torch.zeros((), device=kept[-1].device)

        split = self._context.split(inputs) if self._context is not None else inputs
        self._pipeline.step([(split, split)], keep, train=False)
        last = dist.get_global_rank(self._pp_group, dist.get_world_size(self._pp_group) - 1)
        device = self.mesh.device_type
        meta = torch.tensor(list(kept[0].shape) if kept else [0, 0, 0], dtype=torch.int64, device=device)
        dist.broadcast(meta, src=last, group=self._pp_group)
        out = kept[0].contiguous() if kept else torch.empty(meta.tolist(), device=device)
        dist.broadcast(out, src=last, group=self._pp_group)
        return self._context.gather(out) if self._context is not None else out

    # ------------------------------------------------------------------ words
    def describe(self) -> str:
        """The plan in words, the engine that runs its data axes, and a pipeline's stages and schedule."""
        if self.plan is None or self.choice is None:
            return "one process, no parallelism"
        words = self.plan.describe() + f"\n  data-parallel engine: {self.choice.describe()}"
        if self._pipeline is not None:
            words += "\n" + self._pipeline.describe()
        return words


def _logits(output: Any) -> torch.Tensor:
    """What the default loss reads of a forward's output: the logits tensor, or the `.logits` of an output
    object (an unmodified transformers model returns a CausalLMOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"the default loss reads the model's logits, but its forward returned {type(output).__name__}; "
                    "valid: a forward that returns the logits (or an object with .logits), or a loss_fn of your own")
