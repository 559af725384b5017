"""The ZeRO-1/2 engine's own mechanics, beyond the parity cases in test_parity_zero.py.

- A parameter the forward does not use never reports a gradient: the bucket is still reduced
  at the end of backward (with zeros for it), and the others get the averaged gradient.
- Frozen parameters stay whole and out of the optimizer's reach.
- Gradient shards the optimizer's zero_grad(set_to_none=True) released are freed in the next
  backward (memory), and the forward after an optimizer step sees the stepped weights.
Gradients are compared with the average of every rank's own full gradient (an all-reduce of
plain tensors): the same sums in a different order, so fp32 rtol 1e-5 / atol 1e-6 as in the harness.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shoal import rules
from shoal.mesh import build_mesh
from shoal.parallel.precision import PrecisionPolicy
from shoal.parallel.zero import ZeroDataParallel
from shoal.plan import Plan


class _Toy(nn.Module):
    """Two blocks, one unused head, one frozen layer; rows that do not split evenly over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 5), nn.Linear(5, 6)])
        self.unused = nn.Linear(6, 3)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](self.frozen(x)))
        return h if skip_last else self.blocks[1](h)


def _averaged_grads(toy: _Toy, x: torch.Tensor, skip_last: bool) -> dict[str, torch.Tensor]:
    """Expected: each rank's own full gradient (zeros where unused), averaged over the ranks."""
    toy(x, skip_last).square().mean().backward()
    expected = {}
    for n, p in toy.named_parameters():
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            expected[n] = g / dist.get_world_size()
    return expected


def _engine_mechanics() -> dict:
    plan = rules.resolve(Plan.parse("fsdp2,zero=1"), world_size=2)
    mesh = build_mesh(plan)
    torch.manual_seed(0)
    toy = _Toy()
    reference = {n: p.detach().clone() for n, p in toy.named_parameters()}
    engine = ZeroDataParallel(toy, mesh=mesh, zero=1, bucket=1, precision=PrecisionPolicy(),
                              blocks=list(toy.blocks))
    names = [n for n, _ in engine.named_parameters()]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))

    plain = _Toy()
    plain.load_state_dict(reference)
    expected = _averaged_grads(plain, x, skip_last=False)
    engine(x).square().mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in engine.named_parameters()}
    for n, g in grads.items():
        torch.testing.assert_close(g, expected[n], rtol=1e-5, atol=1e-6)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with engine.no_sync():  # zero=1 accumulating: no reduction, but the cleared shards are freed
        engine(x).sum().backward()  # and the forward gathered the stepped weights
    released = [b.grad is None for b in engine.buckets]
    stepped = {n: (reference[n] - 0.1 * expected[n]) for n in expected}
    full = dict(engine.module.named_parameters())

    # A block unused on one rank only: the buckets still reduce in the same order on every rank.
    skip = dist.get_rank() == 1
    plain.zero_grad(set_to_none=True)
    expected_skip = _averaged_grads(plain, x, skip_last=skip)
    torch.manual_seed(0)
    other = ZeroDataParallel(_Toy(), mesh=mesh, zero=2, bucket=1, precision=PrecisionPolicy(), blocks=[])
    other(x, skip).square().mean().backward()
    skip_ok = all(torch.allclose(p.grad.full_tensor(), expected_skip[n], rtol=1e-5, atol=1e-6)
                  for n, p in other.named_parameters())
    return {
        "skip_ok": skip_ok,
        "names": names,
        "all_dtensor": all(isinstance(p, DTensor) for p in engine.parameters()),
        "released": released,
        "gathered_ok": all(torch.allclose(full[n], stepped[n], rtol=1e-5, atol=1e-6) for n in stepped),
        "frozen_whole": torch.equal(full["frozen.weight"], reference["frozen.weight"]),
        "unused_grad_zero": bool((grads["unused.weight"] == 0).all()),
    }


def test_unused_and_frozen_parameters_and_regather(pools):
    for result in pools(2).run(_engine_mechanics):
        assert result["names"] == ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias",
                                   "unused.weight", "unused.bias"]  # frozen: not the optimizer's
        assert result["all_dtensor"]
        assert result["released"] == [True, True, True]  # zero_grad(set_to_none) let go: memory freed
        assert result["gathered_ok"], "the forward after a step did not see the new weights"
        assert result["frozen_whole"] and result["unused_grad_zero"]
        assert result["skip_ok"], "a block unused on one rank gave wrong gradients"
