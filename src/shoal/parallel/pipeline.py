"""Pipeline parallelism over the mesh's pp axis: the model's layers split into stages, one stage
(or `vpp` interleaved chunks) per rank, micro-batches flowing through them on a schedule.

- Tied embeddings (GPT-2, Llama 3.2 1B/3B, small Qwen2.5): as in Megatron-LM, the last stage
  keeps its own copy of the embedding table the head shares (`tied_embeddings`; that stage is
  fed hidden states, so the table serves only its head), and shoal.parallel.tied all-reduces the
  two copies' gradients after each step's backward, so they stay equal under every schedule.
  Both copies carry the one name the whole model gives the table: checkpoints and exports hold
  it once, as one process's do.
- The split (`split_layers`): contiguous runs of transformer blocks, balanced by cost (each
  block's matmul parameters, which set its FLOPs per token; the output head counts towards the
  last stage, the embedding lookup costs no FLOPs); `split` (the plan option) overrides it with the first
  layer of every stage but the first. The first stage keeps the embeddings, the last the final
  norm and the head (the model family's adapter names them, shoal.models.adapter); a stage is the
  user's model with the other blocks removed by name (the reference Transformer takes hidden
  states when it has no embedding and returns them when it has no head), so no model code changes.
- The schedule (shoal.parallel.schedules): a pure table of F/B/W actions per rank.
- The executor (`Pipeline.step`): runs this rank's actions in order over point-to-point sends
  on the pp group. Sends are non-blocking; a receive is waited for right before the action that
  needs it, so the table alone fixes the order of messages between any two ranks (the property
  NCCL needs; `schedules.p2p_order_consistent`).

Why not `torch.distributed.pipelining`'s schedules: shoal times every action (the measured
bubble, the Gantt chart), names the stage and micro-batch when a peer fails, and drives its own
data engines' gradient sync; its executor does none of these. Its split of the backward into
input and weight gradients (`stage_backward_input` / `stage_backward_weight`) is used as is.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor.parallel import loss_parallel

from shoal.models.adapter import adapter_with
from shoal.parallel.loss import is_vocab_sharded, local_value, vocab_parallel_loss
from shoal.parallel.schedules import Action, build_schedule, format_table, split_backward, stage_rank
from shoal.rules import split_refusal

Batch = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- the split


def block_costs(model: nn.Module) -> list[float]:
    """Per block, the parameters of its matrices (2-D weights): a block's forward FLOPs per token
    are twice that, plus attention scores, which are equal for every block. The classifier's
    matrix is added to the last block's cost (it runs on the last stage)."""
    adapter = adapter_with(model, "pp")
    costs = [float(sum(p.numel() for p in b.parameters() if p.dim() == 2)) for b in adapter.blocks_of(model)]
    head = getattr(model, adapter.classifier, None) if adapter.classifier else None
    if head is not None and costs:
        costs[-1] += float(head.weight.numel())
    return costs


def split_layers(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous runs of layers, one per stage, minimising the largest stage cost (each stage
    gets at least one layer). Exact: a dynamic programme over split points, O(L^2 * S)."""
    num = len(costs)
    if not 1 <= num_stages <= num:
        raise ValueError(f"{num_stages} pipeline stages need at least as many layers; the model has {num}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (num + 1) for _ in range(num_stages + 1)]  # best[s][i]: first i layers in s stages
    cut = [[0] * (num + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, num + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], num
    for s in range(num_stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def ranges_from_points(points: Sequence[int], num_layers: int, num_stages: int) -> list[range]:
    """The user's split (`split`: the first layer of stages 1..S-1) as ranges, checked."""
    reason = split_refusal(points, num_layers=num_layers, num_stages=num_stages)
    if reason is not None:
        raise ValueError(reason)
    edges = [0, *points, num_layers]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def tied_embeddings(model: nn.Module) -> list[str]:
    """The first-stage modules (the adapter's `embeddings`) whose parameters the last stage's
    modules (its `head`) share: the input embedding tied to the classifier. The last stage keeps
    these too."""
    adapter = adapter_with(model, "pp")
    head = {id(p) for name in adapter.head if isinstance(m := getattr(model, name, None), nn.Module)
            for p in m.parameters()}
    return [name for name in adapter.embeddings if isinstance(m := getattr(model, name, None), nn.Module)
            and any(id(p) in head for p in m.parameters())]


def keep_stage(model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
    """`model` (in place) reduced to the blocks in `layers` (keys keep their global numbers, so
    parameter names stay the whole model's), with the embeddings only on the first stage (and a
    tied one on the last, for its head) and the final norm and head only on the last."""
    adapter = adapter_with(model, "pp")
    blocks = adapter.block_container(model)
    for key in list(blocks.keys()):
        if int(key) not in layers:
            del blocks[key]
    tied = tied_embeddings(model) if last else []
    for name in () if first else adapter.embeddings:
        if getattr(model, name, None) is not None and name not in tied:
            setattr(model, name, None)
    for name in () if last else adapter.head:
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    return model


def build_stages(model: nn.Module, *, rank: int, num_ranks: int, vpp: int,
                 split: Sequence[int] | None = None) -> tuple[dict[int, nn.Module], list[range]]:
    """This rank's stages {stage index: module}, and every stage's layers. With one stage per
    rank the module is `model` itself, reduced; with `vpp` chunks each is a reduced copy."""
    num_stages = num_ranks * vpp
    blocks = list(adapter_with(model, "pp").block_container(model).keys())
    assert num_stages <= len(blocks), "shoal.rules refuses more stages than blocks"
    ranges = ranges_from_points(split, len(blocks), num_stages) if split else \
        split_layers(block_costs(model), num_stages)
    mine = [s for s in range(num_stages) if stage_rank(s, num_ranks) == rank]
    stages = {}
    for s in mine:
        source = model if len(mine) == 1 else copy.deepcopy(model)
        stages[s] = keep_stage(source, ranges[s], first=s == 0, last=s == num_stages - 1)
    return stages, ranges


# ----------------------------------------------------------------------------- the executor


@dataclass
class _Slot:
    """What one (stage, micro-batch) keeps from its forward until its backward is done."""

    inputs: torch.Tensor | None = None
    """The stage's input when it needs a gradient (received activations), else None."""
    output: torch.Tensor | None = None
    """The stage output (or the loss on the last stage) that backward starts from."""
    embedded: tuple[torch.Tensor, torch.Tensor] | None = None
    """Split backward on the first stage: (the embedding's output, the leaf the blocks saw)."""
    groups: list | None = None
    """Split backward: what the B pass leaves for the W pass (torch's param groups)."""
    vocab_sharded: bool = False
    """The last stage's logits were vocabulary-sharded (tp): the loss's backward runs under loss_parallel."""


@dataclass
class Pipeline:
    """One rank's part of a pipeline: its stages, its schedule, and the pp group to talk over."""

    stages: dict[int, nn.Module]
    """Stage index -> what runs it (after the data engine wrapped it)."""
    schedule: str
    num_micro: int
    mesh: DeviceMesh
    layers: list[range]
    """Every stage's layers (the split)."""
    vpp: int = 1
    sync: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    """The data engine's no_sync: entered around every backward but a stage's last one."""
    modules: dict[int, nn.Module] | None = None
    """The stages as the user's module (before a data engine wrapped them): what the split backward
    differentiates. None: `stages` themselves."""
    reduce: Callable[[], None] | None = None
    """Split backward: the data engine's reduction of gradients that its hooks did not see (the
    weight passes assign them), run after the schedule (`DataEngine.reduce_grads`)."""
    tied: bool = False
    """The first and last stages each hold the embedding the head is tied to (for `describe`)."""
    timeline: list[tuple[float, float, Action]] = field(default_factory=list, init=False)
    """The last training step run while recording (`record_timeline`): (start, end, action), wall clock."""
    where: str = field(default="", init=False)
    """What this rank is doing or waiting for in a step, in words (the watchdog reports it)."""

    def __post_init__(self) -> None:
        self.modules = self.modules or dict(self.stages)
        self.device = next(next(iter(self.modules.values())).parameters()).device  # where activations live
        self.group = self.mesh["pp"].get_group()
        self.rank, self.num_ranks = self.mesh["pp"].get_local_rank(), self.mesh["pp"].size()
        self.num_stages = self.num_ranks * self.vpp
        self.split = split_backward(self.schedule)
        self.actions: list[Action] = build_schedule(self.schedule, num_ranks=self.num_ranks,
                                                    num_micro=self.num_micro, vpp=self.vpp)[self.rank]
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self._record = False  # time the training steps' actions (record_timeline)
        self._recording = False  # ... in the step under way
        self._progress: Callable[[], None] = lambda: None  # told when `where` changes (watch)
        self._embedded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # see _split_first_block
        last = {}
        for i, a in enumerate(self.actions):
            if a.op in ("B", "W"):
                last[a.stage] = i  # the action after which a stage's gradients are complete
        self._final = set(last.values())
        if self.split and 0 in self.stages:
            stage = self.modules[0]
            _split_first_block(adapter_with(stage, "pp").blocks_of(stage)[0], self._embedded)

    def watch(self, progress: Callable[[], None]) -> None:
        """Call `progress` whenever this rank moves on to another action or wait (`where` changes):
        a watchdog takes it as a sign of life between a step's collectives."""
        self._progress = progress

    def record_timeline(self, on: bool) -> None:
        """While `on`, time every action of each training step (the measured bubble and the Gantt
        chart): `timeline` then holds the last such step's. Synchronises a GPU per action."""
        self._record = on

    def describe(self) -> str:
        """The split and this schedule's table, for the plan's words at start-up."""
        def what(s: int, r: range) -> str:
            last = " + norm and head" + (" (and a copy of the tied embedding)" if self.tied else "")
            extra = (" + embeddings" if s == 0 else "") + (last if s == self.num_stages - 1 else "")
            return f"stage {s} (rank {stage_rank(s, self.num_ranks)}): layers {r.start}-{r.stop - 1}{extra}"
        table = build_schedule(self.schedule, num_ranks=self.num_ranks, num_micro=self.num_micro, vpp=self.vpp)
        lines = ["  pipeline stages: " + "; ".join(what(s, r) for s, r in enumerate(self.layers)),
                 f"  pipeline schedule ({self.schedule}; F forward, B backward"
                 + (", W weight gradients" if self.split else "") + "; one action per tick):"]
        return "\n".join(lines + ["    " + row for row in format_table(table).splitlines()])

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage_rank(stage, self.num_ranks))

    # ------------------------------------------------------------------ one step

    def step(self, micro_batches: Sequence[Batch], loss_fn: Callable, *, scale: Callable | None = None,
             train: bool = True,
             around: Callable[[int, int], contextlib.AbstractContextManager[None]] | None = None) -> torch.Tensor:
        """Run the schedule over the micro-batches (train: forward and backward; else forward
        only, in micro-batch order). `loss_fn` gives a micro-batch's share of the step's loss
        (Runtime.share). `around(stage, micro)`: what each training forward of a stage runs within
        (the runtime's MoE pooling). Returns the sum of the last stage's shares, zero on the other ranks."""
        assert len(micro_batches) == self.num_micro or not train, "micro-batches differ from the schedule's"
        slots: dict[tuple[int, int], _Slot] = {}
        sends: list[dist.Work] = []
        total: torch.Tensor | float = 0.0
        actions = self.actions if train else _forward_only(self.stages, len(micro_batches))
        self._recording = self._record and train  # evaluation leaves the last training step's timeline
        if self._recording:
            self.timeline = []
        for index, action in enumerate(actions):
            s, m = action.stage, action.micro
            self.where = f"pipeline stage {s}, {_WORDS[action.op]} of micro-batch {m}"
            self._progress()
            if action.op == "F":
                inputs = micro_batches[m][0] if s == 0 else self._receive("activation", s - 1, m, micro_batches)
                start = self._clock()
                slot = slots[s, m] = _Slot(inputs=inputs if s > 0 and train else None)
                if s > 0 and train:
                    inputs.requires_grad_(True)
                with around(s, m) if around is not None and train else contextlib.nullcontext():
                    with contextlib.nullcontext() if train else torch.no_grad():
                        output = self.stages[s](inputs)
                if s == self.num_stages - 1:
                    with vocab_parallel_loss(output):
                        loss = loss_fn(output, micro_batches[m][1])
                    total = total + local_value(loss)
                    slot.vocab_sharded = is_vocab_sharded(output)
                    slot.output = (scale(loss) if scale is not None else loss) if train else None
                    self._done(start, action)
                else:
                    slot.output = output
                    self._done(start, action)
                    sends += self._send(output.detach(), s + 1, m, micro_batches, header=True)
                if not train:
                    slots.pop((s, m))
                if s == 0 and self.split and train:
                    slot.embedded = self._embedded.pop(0)
            elif action.op == "B":
                slot = slots[s, m]
                grad = None if s == self.num_stages - 1 else self._receive("gradient", s + 1, m, slot.output)
                start = self._clock()
                with contextlib.nullcontext() if index in self._final else self.sync():
                    with loss_parallel() if slot.vocab_sharded else contextlib.nullcontext():
                        self._backward(slot, grad, s)
                self._done(start, action)
                if s > 0:
                    assert slot.inputs is not None and slot.inputs.grad is not None
                    sends += self._send(slot.inputs.grad, s - 1, m, micro_batches)
                    slot.inputs = None
                if not self.split:
                    slots.pop((s, m))
            else:  # W
                slot = slots.pop((s, m))
                start = self._clock()
                with contextlib.nullcontext() if index in self._final else self.sync():
                    self._weights(slot, s)
                self._done(start, action)
        for work in sends:
            work.wait()
        if train and self.split and self.reduce is not None:
            self.reduce()
        self.where = ""
        return torch.as_tensor(total)

    def _backward(self, slot: _Slot, grad: torch.Tensor | None, stage: int) -> None:
        assert slot.output is not None
        if not self.split:
            torch.autograd.backward(slot.output, grad)
            return
        assert self.modules is not None
        params = self.modules[stage].parameters()
        if stage == 0:  # the blocks' input stands in for the stage input (see _split_first_block)
            assert slot.embedded is not None
            _, slot.groups = stage_backward_input([slot.output], None if grad is None else [grad],
                                                  [slot.embedded[1]], params)
        else:
            _, slot.groups = stage_backward_input([slot.output], None if grad is None else [grad],
                                                  [slot.inputs], params)
        slot.output = None

    def _weights(self, slot: _Slot, stage: int) -> None:
        assert self.modules is not None
        stage_backward_weight(self.modules[stage].parameters(), slot.groups or [])
        if slot.embedded is not None:  # then the embedding's own weights, from the blocks' input gradient
            embedded, leaf = slot.embedded
            params = [p for p in self.modules[stage].parameters() if p.requires_grad]
            if leaf.grad is not None:  # assigned like the weight pass's, not accumulated through hooks
                grads = torch.autograd.grad(embedded, params, leaf.grad, allow_unused=True)
                for param, grad in zip(params, grads):
                    if grad is not None:
                        param.grad = grad if param.grad is None else param.grad + grad

    # ------------------------------------------------------------------ messages

    def _send(self, tensor: torch.Tensor, stage: int, micro: int, micro_batches: Sequence[Batch], *,
              header: bool = False) -> list[dist.Work]:
        """Start sending `tensor` to `stage` (an activation with `header`, else a gradient)."""
        peer, works = self._peer(stage), []
        tensor = tensor.contiguous()
        if header:  # the first time this shape travels: the receiver learns it
            key = ("activation", stage, tuple(micro_batches[micro][0].shape))
            if key not in self._shapes:
                self._shapes[key] = (tensor.shape, tensor.dtype)
                meta = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], dtype=torch.int64)
                works.append(dist.isend(_pad(meta).to(tensor.device), dst=peer, group=self.group,
                                        tag=_tag("header", stage, micro)))
        works.append(dist.isend(tensor, dst=peer, group=self.group, tag=_tag("data", stage, micro, header)))
        return works  # type: ignore[return-value]  # isend gives None only to a rank outside the group

    def _receive(self, what: str, source_stage: int, micro: int, context) -> torch.Tensor:
        """The activation of stage `source_stage` (context: the micro-batches) or the gradient
        for our output (context: that output, whose shape it has)."""
        stage = source_stage + 1 if what == "activation" else source_stage - 1
        peer = self._peer(source_stage)
        self.where = (f"pipeline stage {stage}, waiting for the {what} of micro-batch {micro} from stage "
                      f"{source_stage} (rank {peer})")
        device = self.device
        if what == "activation":
            key = ("activation", stage, tuple(context[micro][0].shape))
            if key not in self._shapes:
                meta = torch.empty(_HEADER, dtype=torch.int64, device=device)
                header = dist.irecv(meta, src=peer, group=self.group, tag=_tag("header", stage, micro))
                self._wait(header, stage, micro, what)
                dtype, ndim, *dims = meta.tolist()
                self._shapes[key] = (torch.Size(dims[:ndim]), _DTYPES[dtype])
            shape, dtype = self._shapes[key]
        else:
            shape, dtype = context.shape, context.dtype
        buffer = torch.empty(shape, dtype=dtype, device=device)
        self._wait(dist.irecv(buffer, src=peer, group=self.group, tag=_tag("data", stage, micro, what == "activation")),
                   stage, micro, what)
        direction = "forward" if what == "activation" else "backward"
        self.where = f"pipeline stage {stage}, {direction} of micro-batch {micro}"
        return buffer

    def _wait(self, work: dist.Work | None, stage: int, micro: int, what: str) -> None:
        try:
            work.wait(_timeout(self.group, self.device))  # type: ignore[union-attr]  # None only outside the group
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(f"{self.where} failed: {first}") from exc

    # ------------------------------------------------------------------ timing

    def _clock(self) -> float:
        if self._recording and torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.time()

    def _done(self, start: float, action: Action) -> None:
        if self._recording:
            self.timeline.append((start, self._clock(), action))


def _timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta:
    """The group's current operation timeout (the watchdog changes it as a run goes). gloo's
    receives otherwise wait for the timeout the group had when it was created, whatever
    `_set_pg_timeout` said since; the backend's options are private API (torch 2.13)."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return timedelta(minutes=30)  # torch's default for gloo


_HEADER = 8
_WORDS = {"F": "forward", "B": "backward", "W": "weight gradients"}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _pad(meta: torch.Tensor) -> torch.Tensor:
    assert meta.numel() <= _HEADER, "activations of more than 6 dims"
    return torch.cat([meta, meta.new_zeros(_HEADER - meta.numel())])


def _tag(kind: str, stage: int, micro: int, forward: bool = True) -> int:
    """A message's tag (gloo matches on it; NCCL ignores it and relies on the order)."""
    return ((micro * 1024 + stage) * 3 + ("header", "data").index(kind) + (0 if forward else 1)) % (2 ** 31)


def _forward_only(stages: dict[int, nn.Module], num_micro: int) -> list[Action]:
    """Evaluation: this rank's forwards, stage by stage, each in micro-batch order (GPipe's
    forward: every receive has its send already under way, whatever the number of chunks)."""
    return [Action("F", s, m) for s in sorted(stages) for m in range(num_micro)]


def _split_first_block(first: nn.Module, embedded: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Split backward on the first stage: its input is token ids, so the input-gradient pass
    stops at the input of its first block, `first`, instead. A pre-hook hands that block a leaf
    copy of the embedding output, and leaves (embedding output, leaf) in `embedded[0]` for the
    step to take; the W pass then carries the leaf's gradient through the embedding."""

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        if not torch.is_grad_enabled() or not args[0].requires_grad:
            return None
        leaf = args[0].detach().requires_grad_(True)
        embedded[0] = (args[0], leaf)
        return (leaf, *args[1:])

    first.register_forward_pre_hook(hook)


def merged_view(stages: dict[int, nn.Module]) -> nn.Module:
    """One module holding all of this rank's stages' submodules under the whole model's names
    (shared, not copied): what the optimizer, state dicts and checkpoints see when a rank runs
    several chunks (vpp > 1)."""
    blocks = adapter_with(next(iter(stages.values())), "pp").blocks
    view, layers = nn.Module(), nn.ModuleDict()
    for s in sorted(stages):
        for name, child in stages[s].named_children():
            if name == blocks:
                layers.update(child)  # type: ignore[arg-type]  # the adapter's ModuleDict of blocks, which update takes
            elif name not in view._modules:
                view.add_module(name, child)
    view.add_module(blocks, layers)
    return view
