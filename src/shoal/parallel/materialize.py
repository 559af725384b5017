"""Materialize a model built on the meta device: each rank allocates and fills only what it holds.

`parallelize` applies the plan to a model whose parameters are meta tensors (shapes, no memory),
then calls `materialize` on this rank's part: the parameters become this rank's shards on the
device (`to_empty`), each filled with its slice of the full initial weights, which are a
function of the seed and the parameter's name alone (shoal/models/init.py). So every plan starts
from the same weights as one process, and no rank holds a full copy it does not keep.

The initial values come from the model family's `init_spec(name, ndim)` (shoal's Transformer
has one); a user's module without it is initialised by each submodule's `reset_parameters()`, and
refused when a submodule with parameters has none. A sharded parameter reset in place would draw
its own stream on every shard (torch's DTensor keeps shards' random draws consistent only on
CUDA), so each submodule is reset on full-size stand-ins for its own parameters, from a generator
seeded by the seed and the submodule's name, and each rank keeps its slice: the same values under
every plan as in one process, for one submodule's full parameters of memory at a time.

With `weights` (pretrained weights, shoal/models/safetensors_io.py) each parameter's slice is read from
the files instead of drawn: the same slices, from a file instead of a generator, so under every
plan a rank reads only what it holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# The one piece of DTensor's layout arithmetic shoal needs here (which global rows and columns a
# rank's shard holds, for every placement and uneven split): torch keeps it in a private module.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shoal.models.init import block_seed, fill_slice_
from shoal.parallel.data import clean_name


class WeightSource(Protocol):
    """Pretrained values by slice (shoal/models/safetensors_io.py implements it)."""

    def read(self, name: str, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor | None:
        """The `box` ((start, stop) per dim) of full parameter `name` of `shape`; None: not in the
        files (the user chose to ignore it, or a buffer the files do not hold), drawn from the
        generator (a buffer: its own initial values) instead."""
        ...


def on_meta(modules: Iterable[nn.Module]) -> bool:
    """Whether any parameter of `modules` is a meta tensor (built on the meta device)."""
    return any(p.is_meta for m in modules for p in m.parameters())


@torch.no_grad()
def materialize(module: nn.Module, *, seed: int, device: torch.device, weights: WeightSource | None = None) -> None:
    """Allocate `module`'s parameters and buffers on `device` (this rank's shards only) and fill
    them with their initial values, or with `weights`' values where it has them (parameters, and
    the persistent buffers a checkpoint holds: a router's selection bias, whole on every rank)."""
    spec = getattr(module, "init_spec", None)
    if spec is None and weights is not None:
        raise ValueError(f"pretrained weights load into a model with init_spec (shoal's models); "
                         f"{type(module).__name__} has none")
    owners = _owners(module) if spec is None else []  # refused before anything is allocated
    tied = _second_names(module)
    module.to_empty(device=device)
    for second, first in tied:  # to_empty gives each name its own new tensor: tie them again
        owner, _, leaf = second.rpartition(".")
        source = module.get_parameter(first)
        if module.get_parameter(second) is not source:
            setattr(module.get_submodule(owner), leaf, source)
    if spec is None:
        done: set[int] = set()  # a tied parameter keeps the values of the first module that owns it
        for name, sub in owners:
            _reset_whole(sub, clean_name(name), seed, done)
        return
    for name, param in module.named_parameters():
        key = clean_name(name)
        if isinstance(param, DTensor):
            local = param.to_local()
            _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        else:
            local, offset = param, (0,) * param.dim()
        shape = tuple(param.shape)
        box = tuple((o, o + n) for o, n in zip(offset, local.shape, strict=True))
        loaded = weights.read(key, shape, box) if weights is not None and local.numel() else None
        if loaded is not None:
            local.copy_(loaded)  # casts the file's dtype to the parameter's
            continue
        values = torch.empty(local.shape, dtype=torch.float32)
        fill_slice_(values, spec(key, param.dim()), seed=seed, name=key, shape=shape, offset=offset)
        local.copy_(values)
    for sub in module.modules():
        init_buffers = getattr(sub, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()
    if weights is not None:
        _load_buffers(module, weights)


def _load_buffers(module: nn.Module, weights: WeightSource) -> None:
    """The persistent buffers `weights` holds, whole (no plan shards a buffer)."""
    for name, buffer in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in module.get_submodule(owner)._non_persistent_buffers_set:
            continue
        loaded = weights.read(clean_name(name), tuple(buffer.shape), tuple((0, n) for n in buffer.shape))
        if loaded is not None:
            buffer.copy_(loaded)


def _second_names(module: nn.Module) -> list[tuple[str, str]]:
    """(second name, first name) of every parameter registered under two names (a head tied to the
    embedding), in `named_parameters` order."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return pairs


def _owners(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules that own parameters, each of which must initialise them (reset_parameters)."""
    owners = [(name, m) for name, m in module.named_modules() if any(True for _ in m.parameters(recurse=False))]
    missing = [type(m).__name__ for _, m in owners if not hasattr(m, "reset_parameters")]
    if missing:
        raise ValueError(f"a model built on the meta device needs each of its modules to initialise itself; "
                         f"{missing[0]} has no reset_parameters() (and the model no init_spec); valid: build it "
                         "on a real device, or give those modules reset_parameters()")
    return owners


def _reset_whole(module: nn.Module, name: str, seed: int, done: set[int]) -> None:
    """`module.reset_parameters()` on full-size stand-ins for its own parameters, drawn from a generator
    seeded by `seed` and the module's name; each parameter not in `done` then keeps this rank's slice of
    its stand-in (and joins `done`)."""
    own = dict(module.named_parameters(recurse=False))
    stand_ins = {}
    for key, param in own.items():
        local = param.to_local() if isinstance(param, DTensor) else param
        stand_ins[key] = nn.Parameter(torch.empty(param.shape, dtype=local.dtype, device=local.device))
    cuda = [t.device for t in stand_ins.values() if t.device.type == "cuda"][:1]  # the one this rank draws on
    try:
        for key, stand_in in stand_ins.items():
            module._parameters[key] = stand_in
        with torch.random.fork_rng(devices=cuda):  # the caller's random state is left as it was
            torch.manual_seed(block_seed(seed, name, 0))
            getattr(module, "reset_parameters")()  # noqa: B009 (typed as a Tensor-or-Module attribute otherwise)
    finally:
        for key, param in own.items():
            module._parameters[key] = param
    for key, param in own.items():
        if id(param) in done:
            continue
        done.add(id(param))
        full = stand_ins[key].detach()
        if isinstance(param, DTensor):
            local = param.to_local()
            _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            full = full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))]
        else:
            local = param
        local.detach().copy_(full)
