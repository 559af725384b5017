"""Expert parallelism over the ep axis: every MoE layer's experts split over ep ranks, tokens sent
to their experts' ranks and back with all-to-all.

- Where: ep is carved out of the data ranks (they see different tokens). `ep_mesh` arranges the
  data ranks as (replica, ep): each row of ep consecutive data ranks holds all E experts, E/ep
  each; the rows are replicas of one another.
- The experts' stacked weights become DTensor parameters, Shard(0) over ep (Replicate over the
  replicas): the optimizer keeps their state sharded, the global gradient norm is right, and
  checkpoints hold the (E, ...) tensors in expert order, so they reload under another ep degree
  or none with every expert's identity kept. The model computes with the local rows (a forward
  pre-hook hands it `to_local()` views, through which gradients reach the parameters).
- The dispatcher's communication steps (shoal/moe/dispatch.py) become two all-to-alls with
  uneven splits (`AllToAllDispatcher`): the kept rows go to the ranks of their experts, are
  regrouped there by local expert, and come back in their original order.
- Gradients: an expert's gradient on its rank already sums the contributions of every token
  routed to it from the ep group; the data engine leaves these parameters alone and
  `sync_expert_grads` sums them over the replicas and divides by the number of data ranks, the
  average the engine takes for the dense weights.

Why not torch's expert-parallel pieces: torch 2.13 has none outside torchtitan, whose
implementation needs CUDA kernels; this is the one piece written here, over funcol's
differentiable all_to_all_single.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shoal.moe.dispatch import Dispatcher
from shoal.moe.layer import MoELayer

EXPERT_WEIGHTS = ("w1", "w2", "w3", "b1", "b2", "b3")


def ep_mesh(world_size: int, ep: int, device_type: str) -> DeviceMesh:
    """The data ranks as (replica, ep): rank r holds expert slice r % ep (all ranks are data ranks
    under the plans that run MoE models)."""
    return init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("ep_replica", "ep"))


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Split the experts of every MoE layer of `model` over mesh["ep"] (in place); returns the
    names of the expert parameters (which the data engine must leave alone)."""
    ep = mesh["ep"].size()
    rank = mesh["ep"].get_local_rank()
    names = []
    for layer_name, layer in model.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        experts = layer.experts
        if layer.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide num_experts={layer.num_experts}")
        local = layer.num_experts // ep
        for name in EXPERT_WEIGHTS:
            param = getattr(experts, name, None)
            if param is None:
                continue
            rows = param.detach()[rank * local:(rank + 1) * local].clone()
            shard = DTensor.from_local(rows, mesh, [Replicate(), Shard(0)], run_check=False)
            experts.register_parameter(name, nn.Parameter(shard))
            names.append(f"{layer_name}.experts.{name}")
        experts.num_experts = local
        experts.register_forward_pre_hook(_local_views)
        experts.register_forward_hook(_drop_views)
        layer.dispatcher = AllToAllDispatcher(mesh["ep"].get_group(), num_experts=layer.num_experts, ep=ep)
    return names


def _local_views(module: nn.Module, _args: tuple) -> None:
    """The experts compute with plain local rows: an instance attribute shadows the DTensor
    parameter for the length of the forward (to_local is differentiable)."""
    for name in EXPERT_WEIGHTS:
        param = module._parameters.get(name)
        if isinstance(param, DTensor):
            module.__dict__[name] = param.to_local()


def _drop_views(module: nn.Module, _args: tuple, _out: object) -> None:
    for name in EXPERT_WEIGHTS:
        if isinstance(module._parameters.get(name), DTensor):
            module.__dict__.pop(name, None)


class AllToAllDispatcher(Dispatcher):
    """The dispatcher's two communication steps over an ep group (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, *, num_experts: int, ep: int) -> None:
        self.group, self.num_experts, self.ep = group, num_experts, ep
        self._back: tuple[torch.Tensor, list[int], list[int], int] | None = None

    def communicate(self, tokens_MD: torch.Tensor, splits_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.num_experts // self.ep
        # Counts per (destination rank, its expert) out, per (source rank, my expert) in.
        counts_in = funcol.all_to_all_single(splits_E.contiguous(), None, None, self.group).wait()
        send = splits_E.view(self.ep, local).sum(1).tolist()  # host sync: all-to-all sizes
        receive_RE = counts_in.view(self.ep, local)
        receive = receive_RE.sum(1).tolist()
        kept = sum(send)
        got = funcol.all_to_all_single_autograd(tokens_MD[:kept].contiguous(), receive, send, self.group)
        # Rows arrive by source rank, each grouped by my experts: regroup by expert (stable).
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=got.device).repeat(self.ep), receive_RE.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        self._back = (order, send, receive, tokens_MD.shape[0])
        return got.index_select(0, order), receive_RE.sum(0)

    def communicate_back(self, y_MD: torch.Tensor, splits_E: torch.Tensor) -> torch.Tensor:
        assert self._back is not None, "communicate first"
        order, send, receive, rows = self._back
        self._back = None
        unsorted = torch.empty_like(y_MD).index_copy(0, order, y_MD)  # undo the regrouping
        back = funcol.all_to_all_single_autograd(unsorted.contiguous(), send, receive, self.group)
        return torch.cat([back, back.new_zeros(rows - back.shape[0], back.shape[1])])  # the dropped rows


class ExpertGrads:
    """The expert parameters of a model under ep, and their gradients' reduction."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh, data_ranks: int) -> None:
        self.params, self.mesh, self.data_ranks = params, mesh, data_ranks

    def sync(self) -> None:
        sync_expert_grads(self.params, self.mesh, self.data_ranks)


@torch.no_grad()
def sync_expert_grads(params: list[nn.Parameter], mesh: DeviceMesh, data_ranks: int) -> None:
    """Each expert's gradient summed over its replicas, divided by the number of data ranks."""
    replicas = mesh["ep_replica"]
    for param in params:
        if param.grad is None:
            continue
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if replicas.size() > 1:
            dist.all_reduce(local, group=replicas.get_group())
        local.div_(data_ranks)
