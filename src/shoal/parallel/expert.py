"""Expert parallelism over the ep axis: every MoE layer's experts split over ep ranks, tokens sent
to their experts' ranks and back with all-to-all; composed with replicated or sharded data
parallelism and with tensor parallelism.

- Where: ep is carved out of the data ranks (they see different tokens). `ep_mesh` arranges a
  pipeline stage's ranks as (ep_replica, ep, tp): each row of ep consecutive data ranks holds
  all E experts, E/ep each; the rows are replicas of one another; tp is the plan's tp axis
  (size 1 without it). Under pp every stage has a mesh of its own.
- The experts' stacked weights become DTensor parameters on that mesh, Shard(0) over ep: the
  optimizer keeps their state sharded, the global gradient norm is right, and checkpoints hold
  the (E, ...) tensors in expert order, so they reload under another ep degree (or none, or
  another data layout) with every expert's identity kept. The model computes with local views
  (forward pre-hooks hand it plain tensors, through which gradients reach the parameters).
- Over the replicas: under replicated data parallelism (DDP) the experts are Replicate and
  `ExpertGrads.sync` sums their gradients over the replicas. Under sharded data parallelism
  (fsdp > 1: ZeRO-1/2/3) the dense part is sharded over all data ranks by the data engine and the
  experts over the replicas (the data ranks outside ep) here: each weight matrix is Shard over
  its model dim D across ep_replica, all-gathered in forward (a differentiable all-gather, whose
  backward reduce-scatters the gradient: the ZeRO-3 pattern for every stage, since a rank's
  experts are a small part of the model and ZeRO-1/2 would keep them whole for nothing).
- Tensor parallelism splits each expert's FFN, as it splits the dense FFN (w1/w3 by output
  columns F, w2 by input columns F); it does not spread the experts over tp. Why: the MoE layer
  keeps the dense FFN's contract. Every tp rank holds 1/tp of every FFN weight, dense or expert,
  and sees the same tokens (the sequence all-gathered, as for the dense FFN). So routing,
  capacity, dropping and the router's losses come out the same on every tp rank with no
  cross-tp reduction (every tp rank routes the same whole routing groups: a group lies within
  one sequence, and a sequence-parallel shard is gathered back before routing), and ep stays
  carved out of the data ranks (with sp=off the tp ranks see the same tokens, so experts over
  tp would first need the tokens split). The cost: the all-to-all carries each token once per
  tp rank, and the experts' outputs are all-reduced over tp (the dense FFN's row-parallel
  reduction). The router gate is a replicated DTensor on the
  tp mesh; shared experts are split like the routed ones. `MoETensorParallel` is the style the
  tensor-parallel plan gives an MoE layer. Expert biases are not split (shoal.rules refuses
  them with tp).
- The dispatcher's communication steps (shoal/moe/dispatch.py) become all-to-alls with uneven
  splits (`AllToAllDispatcher`): each token goes once to every rank that holds any of its kept
  choices, is expanded there to one row per choice, regrouped by local expert, and its weighted
  outputs come back summed, one row per rank (bench/moe_a2a_bytes.py counts the bytes against the
  minimum). Capacity and dropping
  are decided before, per routing group on the rank that holds the group's tokens, so ep changes
  no token's fate; an expert then receives up to ep times a rank's capacity (`rows_bound`).
- Gradients: an expert's gradient on its rank already sums the contributions of every token
  routed to it from the ep group; the data engine leaves these parameters alone and
  `ExpertGrads.sync` sums them over the replicas (if the backward's reduce-scatter did not) and
  divides by the number of data ranks, the average the engine takes for the dense weights.

Why not torch's pieces: torch 2.13 has no expert parallelism outside torchtitan, whose
implementation needs CUDA kernels; FSDP2 cannot shard the experts over the replicas because their
parameters are already DTensors on the ep mesh, a mesh of its own (FSDP2 composes only with
DTensors on a sub-mesh of its own mesh's root). This module is the one piece written here, over
funcol's differentiable all_to_all_single and all_gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from shoal.mesh import shared_mesh
from shoal.moe.dispatch import Dispatcher, DispatchPlan
from shoal.moe.experts import Experts
from shoal.moe.layer import MoELayer

EXPERT_WEIGHTS = ("w1", "w2", "w3", "b1", "b2", "b3", *(f"{m}_lora_{x}" for m in ("w1", "w2", "w3") for x in "AB"))
"""The experts' parameters: weights, biases, and low-rank adapters' factors where they have them
(shoal.models.lora.LoRAExperts: A (E, r, in) and B (E, out, r) per matrix)."""
_TP_DIM = {"w1": 1, "w3": 1, "b1": 1, "b3": 1, "w2": 2, "w1_lora_B": 1, "w3_lora_B": 1, "w2_lora_A": 2}
"""The dim tp splits (F: w1/w3 (E, F, D) column-parallel, w2 (E, D, F) row-parallel); b2 (E, D) is whole. An
adapter splits as its matrix: a column-parallel matrix's B by its rows F, a row-parallel one's A by its columns F."""
_TP_PARTIAL = ("w1_lora_A", "w3_lora_A", "w2_lora_B")
"""The adapters' factors that tp leaves whole but whose gradient each tp rank computes for its own features only
(A of w1 and w3 from its F rows of B; B of w2 from its F columns of A): summed over tp in backward."""
_REPLICA_DIM = {"w1": 2, "w3": 2, "w2": 1}
"""The dim the replicas shard under sharded data parallelism (D); biases stay whole (they are small)."""


def ep_mesh(world_size: int, ep: int, device_type: str, *, tp: int = 1, pp: int = 1) -> DeviceMesh:
    """This rank's pipeline stage's ranks as (ep_replica, ep, tp): within a stage, rank r holds
    expert slice (r // tp) % ep. It matches the plan's mesh (pp outermost, then the data axes,
    tp innermost; cp does not run with MoE models)."""
    names = ("pp", "ep_replica", "ep", "tp")
    mesh = shared_mesh(device_type, (pp, world_size // (pp * ep * tp), ep, tp), names)
    return mesh["ep_replica", "ep", "tp"]


def expert_placements(name: str, *, shard_replicas: bool, tp: int) -> list[Placement]:
    """Placements of expert weight `name` on `ep_mesh`: (ep_replica, ep, tp)."""
    replica = Shard(_REPLICA_DIM[name]) if shard_replicas and name in _REPLICA_DIM else Replicate()
    return [replica, Shard(0), Shard(_TP_DIM[name]) if tp > 1 and name in _TP_DIM else Replicate()]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, *, shard_replicas: bool = False) -> list[str]:
    """Split the experts of every MoE layer of `model` over `mesh` (an `ep_mesh`; in place): over
    ep by expert, over tp within each expert, and with `shard_replicas` over the replicas too.
    Returns the names of the expert parameters (which the data engine must leave alone)."""
    ep, tp = mesh["ep"].size(), mesh["tp"].size()
    names = []
    for layer_name, layer in model.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        experts = layer.experts
        assert layer.num_experts % ep == 0, f"ep={ep} does not divide num_experts={layer.num_experts} (shoal.rules)"
        for name in EXPERT_WEIGHTS:
            param = getattr(experts, name, None)
            if param is None:
                continue
            placements = expert_placements(name, shard_replicas=shard_replicas, tp=tp)
            # Every rank built the same weights (same seed): each takes its own piece, no communication.
            shard = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
            names.append(f"{layer_name}.experts.{name}")
        experts.num_experts = layer.num_experts // ep
        _register_views(experts, mesh["tp"].get_group() if tp > 1 else None)
        if ep > 1:
            layer.dispatcher = AllToAllDispatcher(mesh["ep"].get_group(), num_experts=layer.num_experts, ep=ep)
    return names


def _register_views(experts: Experts, tp_group: dist.ProcessGroup | None) -> None:
    """Hooks that let `experts` compute with local views of its DTensor weights (gathered over
    the replicas where they shard them) and, over tp, make it one column-then-row-parallel FFN:
    its input's gradient and its output summed over tp (Megatron's f and g)."""

    def before(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        _local_views(module, tp_group)
        return (_CopyToTP.apply(args[0], tp_group), *args[1:]) if tp_group is not None else args

    def after(module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        _drop_views(module)
        return _ReduceFromTP.apply(out, tp_group) if tp_group is not None else out

    experts.register_forward_pre_hook(before)
    experts.register_forward_hook(after)


def _local_views(module: nn.Module, tp_group: dist.ProcessGroup | None = None) -> None:
    """An instance attribute shadows each DTensor parameter for the length of the forward: its
    local rows, all-gathered over the replicas where they shard it (to_local and the gather are
    differentiable; the gather's backward reduce-scatters the gradient); with `tp_group`, an
    adapter's factor of _TP_PARTIAL through _CopyToTP (its gradient summed over tp)."""
    for name, param in module._parameters.items():
        if not isinstance(param, DTensor):
            continue
        local = param.to_local()
        names = param.device_mesh.mesh_dim_names or ()
        for dim_name, placement in zip(names, param.placements):
            if dim_name == "ep_replica" and isinstance(placement, Shard):
                group = param.device_mesh.get_group(dim_name)
                moved = local.movedim(placement.dim, 0).contiguous()  # funcol gathers along dim 0
                local = _all_gather(moved, 0, group).movedim(0, placement.dim)
        if tp_group is not None and name in _TP_PARTIAL:
            local = _CopyToTP.apply(local, tp_group)
        module.__dict__[name] = local


# torch 2.13 renamed funcol's differentiable all-gather; older releases in shoal's range only have the old name.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _drop_views(module: nn.Module) -> None:
    for name, param in module._parameters.items():
        if isinstance(param, DTensor):
            module.__dict__.pop(name, None)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over tp (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums over tp (the partial outputs of a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class MoETensorParallel(ParallelStyle):
    """The tensor-parallel style of an MoE layer (see the module docstring): its input gathered
    over tp (with sequence parallelism; a local full (B, T, D) tensor in any case), the router
    gate a replicated DTensor computed through a local view, shared experts split like the
    routed ones (these `apply_expert_parallel` splits, on the ep mesh), and the output, the same
    on every tp rank, handed back as the residual stream's layout (this rank's sequence shard
    with `sp`)."""

    def __init__(self, *, sp: bool) -> None:
        super().__init__()
        self.sp = sp

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, MoELayer), type(module)
        seq = [Shard(1)] if self.sp else [Replicate()]
        gate = module.router.gate
        gate.register_parameter("weight", nn.Parameter(
            DTensor.from_local(gate.weight.detach(), device_mesh, [Replicate()], run_check=False),
            requires_grad=gate.weight.requires_grad))
        module.router.register_forward_pre_hook(lambda *_: _local_views(gate))
        module.router.register_forward_hook(lambda *_: _drop_views(gate))
        if module.shared is not None:
            for name in EXPERT_WEIGHTS:
                param = getattr(module.shared, name, None)
                if param is not None:
                    placement = Shard(_TP_DIM[name]) if name in _TP_DIM else Replicate()
                    module.shared.register_parameter(name, nn.Parameter(
                        distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=None),
                        requires_grad=param.requires_grad))
            _register_views(module.shared, device_mesh.get_group())
        if module.shared_gate is not None:  # like the router's gate: it sees the shared experts' summed output
            shared_gate = module.shared_gate
            shared_gate.register_parameter("weight", nn.Parameter(
                DTensor.from_local(shared_gate.weight.detach(), device_mesh, [Replicate()], run_check=False),
                requires_grad=shared_gate.weight.requires_grad))
            shared_gate.register_forward_pre_hook(lambda *_: _local_views(shared_gate))
            shared_gate.register_forward_hook(lambda *_: _drop_views(shared_gate))

        def gather_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, seq, run_check=False)
            return (x.redistribute(device_mesh, [Replicate()]).to_local(), *args[1:])

        def shard_output(_module: nn.Module, _args: tuple[Any, ...], y: torch.Tensor) -> torch.Tensor:
            # y is the same on every tp rank (the experts' outputs were summed over tp).
            return DTensor.from_local(y, device_mesh, [Replicate()], run_check=False).redistribute(
                device_mesh, seq).to_local()

        module.register_forward_pre_hook(gather_input)
        module.register_forward_hook(shard_output)
        return module


class AllToAllDispatcher(Dispatcher):
    """The dispatcher's two communication steps over an ep group (see the module docstring), each token
    sent once per rank that holds any of its kept choices, not once per choice (DeepSeek-V3's
    node-limited dispatch at rank level): a rank sends, per destination, its distinct tokens and, per
    kept choice, which of them it is, its expert and its weight (an index and a float beside a row of
    D). The destination expands the tokens to one row per choice, runs its experts, weighs each output
    and sums a token's choices into one row, which goes back once; the source adds its tokens' rows
    from every rank. A token's output is then summed rank by rank rather than choice by choice (the
    same terms, another order: float rounding only)."""

    def __init__(self, group: dist.ProcessGroup, *, num_experts: int, ep: int) -> None:
        self.group, self.num_experts, self.ep = group, num_experts, ep
        self._pre: tuple[DispatchPlan, torch.Tensor, torch.Tensor] | None = None
        self._back: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int], torch.Tensor] | None = None
        self.last_sent = (0, 0)
        """(token rows, choices) the last dispatch sent to other ranks: a row is D values, a choice an index pair
        and a weight (what bench.moe_a2a_bytes counts)."""

    def local_pre(self, x_ND: torch.Tensor, plan: DispatchPlan,
                  weights_NK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert weights_NK is not None, "the experts' ranks weigh the outputs: local_pre needs the routing weights"
        self._pre = (plan, x_ND, weights_NK)
        return x_ND, plan.tokens_per_expert  # the rows are taken in `communicate`, once per rank

    def communicate(self, tokens_MD: torch.Tensor, splits_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._pre is not None, "local_pre first"
        plan, x_ND, weights_NK = self._pre
        self._pre = None
        N, K = plan.position_NK.shape
        device, local = x_ND.device, self.num_experts // self.ep
        kept = int(splits_E.sum())  # host sync (the all-to-all sizes need the host anyway)
        # Kept rows (the first `kept`, in expert order): each one's expert, token, weight and destination.
        expert_M = torch.repeat_interleave(torch.arange(self.num_experts, device=device), splits_E, output_size=kept)
        weight_M = torch.zeros(N * K, dtype=weights_NK.dtype, device=device).scatter(
            0, plan.position_NK.reshape(-1), weights_NK.reshape(-1))[:kept]
        rank_M = expert_M // local
        # Distinct (destination rank, token) pairs, by rank then token; each kept row's pair.
        pairs, pair_M = torch.unique(rank_M * N + plan.token_M[:kept], sorted=True, return_inverse=True)
        token_U, rank_U = pairs % N, pairs // N
        counts_in = funcol.all_to_all_single(  # type: ignore[attr-defined]  # an AsyncCollectiveTensor
            _per_rank(rank_U, splits_E, self.ep), None, None, self.group).wait()
        counts_in = counts_in.view(self.ep, 1 + local)
        send_rows = splits_E.view(self.ep, local).sum(1)
        send_tokens = torch.zeros(self.ep, dtype=torch.long, device=device).index_add_(
            0, rank_U, torch.ones_like(rank_U))
        sizes = torch.stack([send_tokens, send_rows, counts_in[:, 0], counts_in[:, 1:].sum(1)]).tolist()  # host sync
        send_u, send_m, recv_u, recv_m = sizes
        me = dist.get_rank(self.group)
        self.last_sent = (sum(send_u) - send_u[me], sum(send_m) - send_m[me])
        got_x = funcol.all_to_all_single_autograd(x_ND.index_select(0, token_U), recv_u, send_u, self.group)
        # Per kept row: its token's place among the destination's distinct tokens from this rank, and its expert.
        first_U = torch.cumsum(send_tokens, 0) - send_tokens
        meta = torch.stack([pair_M - first_U[rank_M], expert_M % local], dim=1)
        got_meta = funcol.all_to_all_single(meta, recv_m, send_m, self.group).wait()  # type: ignore[attr-defined]
        got_w = funcol.all_to_all_single_autograd(weight_M.contiguous(), recv_m, send_m, self.group)
        # Received rows by source rank: offset each index by the source's first distinct token here.
        first_in = torch.cumsum(torch.tensor(recv_u, device=device), 0) - torch.tensor(recv_u, device=device)
        source_R = torch.repeat_interleave(torch.arange(self.ep, device=device), torch.tensor(recv_m, device=device),
                                           output_size=sum(recv_m))
        row_of = got_meta[:, 0] + first_in[source_R]
        order = torch.argsort(got_meta[:, 1], stable=True)  # regroup by my expert
        self._back = (row_of, order, got_w, send_u, recv_u, token_U)
        counts_E = counts_in[:, 1:].sum(0)
        return got_x.index_select(0, row_of).index_select(0, order), counts_E

    def communicate_back(self, y_MD: torch.Tensor, splits_E: torch.Tensor) -> torch.Tensor:
        assert self._back is not None, "communicate first"
        row_of, order, got_w, send_u, recv_u, token_U = self._back
        unsorted = torch.empty_like(y_MD).index_copy(0, order, y_MD)  # undo the regrouping
        weighted = unsorted * got_w.to(unsorted.dtype).unsqueeze(-1)
        summed = torch.zeros(sum(recv_u), y_MD.shape[1], dtype=y_MD.dtype, device=y_MD.device).index_add(
            0, row_of, weighted)
        return funcol.all_to_all_single_autograd(summed, send_u, recv_u, self.group)

    def local_post(self, y_MD: torch.Tensor, plan: DispatchPlan, weights_NK: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
        """A token's rows from every rank (already weighed and summed over that rank's choices), added."""
        assert self._back is not None, "communicate_back first"
        token_U = self._back[5]
        self._back = None
        return torch.zeros(num_tokens, y_MD.shape[1], dtype=y_MD.dtype, device=y_MD.device).index_add(
            0, token_U, y_MD)

    def rows_bound(self, local_bound: int | None) -> int | None:
        """An expert receives up to `local_bound` rows (its capacity summed over the sender's routing
        groups) from each of the ep ranks."""
        return None if local_bound is None else local_bound * self.ep


def _per_rank(rank_U: torch.Tensor, splits_E: torch.Tensor, ep: int) -> torch.Tensor:
    """What a rank tells each destination: its distinct tokens for it, then its rows per expert there."""
    tokens_R = torch.zeros(ep, dtype=torch.long, device=splits_E.device).index_add_(0, rank_U, torch.ones_like(rank_U))
    return torch.cat([tokens_R[:, None], splits_E.view(ep, -1)], dim=1).reshape(-1).contiguous()


class ExpertGrads:
    """The expert parameters of a model under ep (or tp), and their gradients' reduction."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh, data_ranks: int) -> None:
        self.params, self.mesh, self.data_ranks = params, mesh, data_ranks

    @torch.no_grad()
    def sync(self) -> None:
        """Each expert's gradient summed over its replicas (where backward's reduce-scatter did not
        already), divided by the number of data ranks."""
        replicas = self.mesh["ep_replica"]
        for param in self.params:
            if param.grad is None:
                continue
            local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if replicas.size() > 1 and isinstance(param.placements[0], Replicate):  # type: ignore[attr-defined]  # DTensors
                dist.all_reduce(local, group=replicas.get_group())
            local.div_(self.data_ranks)
