"""The named device mesh a Plan runs on. No global process groups: callers pass the mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shoal import rules
from shoal.plan import Plan


def device_type() -> str:
    """"cuda" when this process has a GPU and its process group runs NCCL, else "cpu" (gloo).

    A GPU run's group is "cpu:gloo,cuda:nccl" (NCCL for GPU tensors, gloo beside it for the CPU
    ones of offload=on), so the test is whether NCCL is among its backends. A pure gloo group on a
    GPU machine (the CPU parity tests there) stays on the CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    if not dist.is_initialized():
        return "cuda"
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


def build_mesh(plan: Plan, device: str | None = None) -> DeviceMesh:
    """A DeviceMesh with one named dimension per axis (pp, dp, fsdp, cp, tp), size-1 ones included,
    so that code can always ask for `mesh["tp"]` and get a degree-1 group when tp is off.
    `device`: "cpu" or "cuda"; None: `device_type()`."""
    device = device or device_type()
    names, sizes = rules.resolve(plan, world_size=dist.get_world_size(), device=device).mesh_shape()
    return shared_mesh(device, tuple(sizes), tuple(names))


_SHARED: dict[tuple[Any, ...], tuple[dist.ProcessGroup | None, Any]] = {}


def _once(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """`make()` once per process and default group for `key`, then the same object: every mesh and group
    makes process groups, each with gloo threads and sockets that live as long as the process, so a
    process that parallelizes many models (a test worker, a calibration) would pile them up otherwise
    (hundreds of threads). A new default group (init again) makes new ones."""
    default = dist.group.WORLD
    known = _SHARED.get(key)
    if known is None or known[0] is not default:
        _SHARED[key] = known = (default, make())
    return known[1]


def shared_mesh(device: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """`init_device_mesh(device, sizes, names)`, made once per process and default group (`_once`).
    torch itself treats meshes of one shape as interchangeable (DTensor's caches compare them by
    layout), so one shared mesh is no change."""
    mesh: DeviceMesh = _once(("mesh", device, sizes, names),
                             lambda: init_device_mesh(device, sizes, mesh_dim_names=names))
    return mesh


def shared_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """`dist.new_group(ranks)`, made once per process and default group (`_once`). Collective over the
    default group the first time, like new_group: every rank asks for the same groups in the same order."""
    group: dist.ProcessGroup = _once(("group", ranks), lambda: dist.new_group(list(ranks)))
    return group


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    return mesh[axis].size()


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank among the ranks that see different sequences (dp x fsdp)."""
    dp, fsdp = mesh["dp"], mesh["fsdp"]
    return dp.get_local_rank() * fsdp.size() + fsdp.get_local_rank(), dp.size() * fsdp.size()


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that hold the same weights and average their gradients: dp, and under context
    parallelism the cp ranks too (same weights, other tokens of the same sequences), flattened
    into one axis (`_flatten`: private in torch 2.13, as torchtitan uses it)."""
    return mesh["dp"] if mesh["cp"].size() == 1 else mesh["dp", "cp"]._flatten("dp_cp")


def stages_and_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Every pipeline stage and every rank that sees other tokens (pp x dp x fsdp x cp), flattened
    into one axis (`_flatten`, as in replica_mesh): the ranks that pool a micro-batch's MoE counts
    over all of a model's layers. Collective the first time: every rank calls it."""
    return mesh["pp", "dp", "fsdp", "cp"]._flatten("pp_data")


def reduction_groups(mesh: DeviceMesh, axes: tuple[str, ...] = ("dp", "fsdp")) -> list[dist.ProcessGroup]:
    """The process groups of the named mesh axes that have more than one rank. Slicing a mesh
    builds a sub-mesh from its rank table each time: look the groups up once, not every step."""
    return [mesh[axis].get_group() for axis in axes if mesh[axis].size() > 1]


def all_reduce_mean(value: torch.Tensor, groups: list[dist.ProcessGroup], device_type: str) -> torch.Tensor:
    """Average a local tensor over the ranks of every group in `groups` (see `reduction_groups`),
    on the device: no host synchronisation (read it with float() when it is needed)."""
    value = value.detach().to(device_type).clone()  # NCCL reduces only GPU tensors
    count = 1
    for group in groups:
        dist.all_reduce(value, group=group)
        count *= dist.get_world_size(group)
    return value / count
