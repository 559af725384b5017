"""Context (sequence) parallelism: each of the cp ranks holds a slice of every sequence, and
attention runs across the slices, as Ring Self-Attention (Li et al. 2021) or by scattering heads.

The split is zig-zag (head-tail): the sequence is cut into 2P chunks and rank r holds chunks r
and 2P-1-r, so that every rank gets the same share of the causal triangle (a plain split gives
the last rank P times the first one's work). RoPE positions follow the split; tokens and targets
are sliced by `ContextSplit.split` in the runtime, so the model and the trainer see a shorter
sequence and nothing else.

- cp_mode=ring: each rank computes its queries against the key/value block it holds, passes the
  block to the next rank and receives the previous one's, P-1 times, merging the partial results
  with an online (log-sum-exp) softmax: no rank holds the full K/V or any T x T scores. Backward
  passes K/V around the ring again, with their gradients travelling along. Chunk pairs that the
  causal mask hides are skipped, and the visible ones of a held block go to one kernel call (a
  causal one on the rank's own block, an unmasked rectangle on the others). Each call is one of
  torch's fused kernels that return the log-sum-exp the merge needs (CPU flash; CUDA flash or
  memory-efficient), forward and backward, in the inputs' dtype: the backward given the merged
  statistics is exactly the block's share. The merge and the gradient sums are fp32. torch's
  experimental `context_parallel` does not run on CPU (no sharding strategy for the CPU attention
  kernel), hence this small autograd function over point-to-point sends.
- cp_mode=a2a (DeepSpeed-Ulysses): an all-to-all turns (all heads, T/P tokens) into (H/P heads,
  all T tokens), attention runs on whole sequences, and a second all-to-all turns it back.

Shape legend: B batch, H heads, T tokens (local unless said), E head dim, C chunk length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shoal.models.adapter import adapter_with
from shoal.models.transformer import causal_attention

FUSED = True
"""The ring's blocks through torch's fused kernels (False: the plain formulas, C x C scores; tests run both)."""

aten = torch.ops.aten


def chunks_of(rank: int, cp: int, *, balanced: bool = True) -> list[int]:
    """The chunk indices rank `rank` holds: [r, 2P-1-r] of 2P chunks (zig-zag), or [r] of P."""
    return [rank, 2 * cp - 1 - rank] if balanced else [rank]


def positions(seq_len: int, rank: int, cp: int, *, balanced: bool = True) -> torch.Tensor:
    """The global token positions rank `rank` holds, in its local order."""
    chunks = chunks_of(rank, cp, balanced=balanced)
    size = seq_len // (2 * cp if balanced else cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


class ContextSplit:
    """This rank's slice of every sequence: what the runtime feeds the model, targets included."""

    def __init__(self, cp_mesh: DeviceMesh, *, balanced: bool = True) -> None:
        self.group = cp_mesh.get_group()
        self.cp, self.rank, self.balanced = cp_mesh.size(), cp_mesh.get_local_rank(), balanced
        self._indices: dict[tuple[str, int, torch.device], torch.Tensor] = {}

    def mine(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """This rank's global positions in a sequence of `seq_len` tokens, on `device`."""
        return self._cached("mine", seq_len, device)

    def rank_order(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Every rank's positions, rank after rank: the global position of each gathered token."""
        return self._cached("order", seq_len, device)

    def chunk_orders(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sequence's chunks in rank-major order, its inverse permutation), on `device`: the
        positions of a sequence one token per chunk long."""
        chunks = 2 * self.cp if self.balanced else self.cp
        return self._cached("order", chunks, device), self._cached("inverse", chunks, device)

    def _cached(self, kind: str, seq_len: int, device: torch.device) -> torch.Tensor:
        # Built once per length and device: the RoPE hook asks in every layer of every forward,
        # and a fresh host-to-device copy there would make the host wait for the GPU.
        key = (kind, seq_len, torch.device(device))
        if key not in self._indices:
            ranks = [self.rank] if kind == "mine" else range(self.cp)
            index = torch.cat([positions(seq_len, r, self.cp, balanced=self.balanced) for r in ranks])
            self._indices[key] = (torch.argsort(index) if kind == "inverse" else index).to(device)
        return self._indices[key]

    def split(self, x_BT: torch.Tensor) -> torch.Tensor:
        """Tokens or targets (B, T global) -> this rank's (B, T / cp)."""
        return x_BT.index_select(1, self.mine(x_BT.shape[1], x_BT.device))

    def gather(self, y_BT: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, T / cp, ...) output -> (B, T, ...) in position order (no gradient).
        A DTensor output (tp's vocabulary-sharded logits) is gathered shard by shard and stays one."""
        if isinstance(y_BT, DTensor):
            whole = self.gather(y_BT.to_local())
            return DTensor.from_local(whole, y_BT.device_mesh, y_BT.placements, run_check=False)
        parts = [torch.empty_like(y_BT) for _ in range(self.cp)]
        dist.all_gather(parts, y_BT.contiguous(), group=self.group)
        order = self.rank_order(y_BT.shape[1] * self.cp, y_BT.device)
        return torch.cat(parts, dim=1).index_select(1, torch.argsort(order))


def apply_context_parallel(model: nn.Module, *, mesh: DeviceMesh, mode: str = "ring",
                           balanced: bool = True) -> ContextSplit | None:
    """Swap every block's attention core (the seam its family's adapter names) for attention over
    the cp axis and make RoPE follow the split; returns the split the runtime applies to each
    micro-batch (None at cp=1, a no-op)."""
    cp_mesh = mesh["cp"]
    if cp_mesh.size() == 1:
        return None
    adapter = adapter_with(model, "cp")
    seam = adapter.attention
    assert seam is not None, f"the {adapter.family} takes cp without an attention seam"
    split = ContextSplit(cp_mesh, balanced=balanced)
    attend = ring_attention if mode == "ring" else a2a_attention
    for block in adapter.blocks_of(model):
        module = block.get_submodule(seam.module)
        # shoal.rules refuses cp with the models whose core is another (sliding window, document masks)
        assert getattr(module, seam.core) is causal_attention, f"{type(module).__name__} has another core"
        setattr(module, seam.core, functools.partial(attend, split=split))
        if seam.rope_arg is not None:
            module.register_forward_pre_hook(functools.partial(_rope_at_positions, split=split, at=seam.rope_arg))
    return split


def _rope_at_positions(module: nn.Module, args: tuple, *, split: ContextSplit, at: int) -> tuple | None:
    """(x, ..., rope tables at position `at`, ...) -> the same with the tables' rows at this rank's
    global positions."""
    x_BTD, rope = args[0], args[at]
    if rope is None:
        return None
    index = split.mine(x_BTD.shape[1] * split.cp, rope[0].device)
    return (*args[:at], (rope[0].index_select(0, index), rope[1].index_select(0, index)), *args[at + 1:])


# ----------------------------------------------------------------------------- ring attention


@torch._dynamo.disable  # point-to-point sends inside: never traced into a compiled block
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, *,
                   split: ContextSplit, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys and values, (B, H, T, E) each (values
    may be of another width, latent attention's), in their dtype (the merge of partial results in
    fp32), at softmax `scale` (None: 1/sqrt(E)); no attention dropout (shoal.rules refuses cp with
    it). At cp=1 it is SDPA itself."""
    assert not dropout_p, f"attention dropout {dropout_p} under context parallelism"
    if split.cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    width = v.shape[-1]
    if width != q.shape[-1]:
        # Values and heads of two widths (latent attention): zero columns make the narrower as wide as the other,
        # so that the fused kernels, which take one width, run the blocks. Zeros add nothing to a score or an
        # output column; the output's extra columns are zeros, cut off here.
        E = max(width, q.shape[-1])
        q, k, v = (F.pad(t, (0, E - t.shape[-1])) for t in (q, k, v))
        return _Ring.apply(q, k, v, split, causal, scale)[..., :width]
    return _Ring.apply(q, k, v, split, causal, scale)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split: ContextSplit, causal: bool, scale: float):
        mine = chunks_of(split.rank, split.cp, balanced=split.balanced)
        out = lse = None
        kv = torch.stack((k, v))  # one buffer travels the ring (latent attention's rotary keys inside k)
        for step in range(split.cp):
            pending = _pass_on(kv, split) if step < split.cp - 1 else None  # overlaps the blocks below
            theirs = chunks_of((split.rank - step) % split.cp, split.cp, balanced=split.balanced)
            out, lse = attend_blocks(q, kv[0], kv[1], mine, theirs, out, lse, causal=causal, scale=scale)
            if pending is not None:
                kv = pending()
        assert out is not None and lse is not None
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.causal, ctx.scale = split, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        split, causal, scale = ctx.split, ctx.causal, ctx.scale
        mine = chunks_of(split.rank, split.cp, balanced=split.balanced)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # K and V travel around the ring as in forward, the next block on its way while this one's
        # gradients are computed. The fp32 gradient accumulator of the block held travels one step
        # behind: it arrives from the previous rank (its share added) while this rank computes its
        # own share, is added to, and sent on; after P steps one more pass brings it home.
        kv = torch.stack((k, v))
        held = None
        for step in range(split.cp):
            kv_pending = _pass_on(kv, split) if step < split.cp - 1 else None
            theirs = chunks_of((split.rank - step) % split.cp, split.cp, balanced=split.balanced)
            parts = block_grads(grad_out, q, kv[0], kv[1], out, lse, mine, theirs, causal=causal, scale=scale)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) if held is None else held()
            add_grads(parts, dq, dkv[0], dkv[1])
            held = _pass_on(dkv, split)
            if kv_pending is not None:
                kv = kv_pending()
        assert held is not None
        dk, dv = held()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


Part = tuple[slice, slice, torch.Tensor, torch.Tensor, torch.Tensor]
"""One kernel call's gradients: (query rows, key rows, dq, dk, dv) of those rows."""


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mine: list[int], theirs: list[int],
                  out: torch.Tensor | None, lse: torch.Tensor | None, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one key/value block (chunks `theirs`) into the running output and log-sum-exp of the
    queries (chunks `mine`): (out, lse), both None before the first block, which must reach every
    query (a rank's own block does). The kernels run in the inputs' dtype; the merge is in fp32."""
    for rows, cols, diagonal in _calls(mine, theirs, causal, q.shape[2] // len(mine)):
        block_out, block_lse = _block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=diagonal,
                                              scale=scale)
        if out is None or lse is None:
            assert rows == slice(0, q.shape[2]), "the first block reaches every query"
            out, lse = block_out, block_lse.float()
            continue
        out = out.float()  # a no-op after the first merge
        # The block's weight in the merged softmax is sigmoid(block_lse - lse); logaddexp as lse - logsigmoid.
        out[:, :, rows].lerp_(block_out.float(), torch.sigmoid(block_lse - lse[:, :, rows])[..., None])
        lse[:, :, rows] -= F.logsigmoid(lse[:, :, rows] - block_lse)
    assert out is not None and lse is not None
    return out, lse


def block_grads(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, mine: list[int], theirs: list[int], *, causal: bool, scale: float) -> list[Part]:
    """The gradients of the queries (chunks `mine`) and of one key/value block (chunks `theirs`),
    given the merged output and log-sum-exp: the fused backward with the global softmax statistics
    gives exactly the block's share."""
    parts = []
    for rows, cols, diagonal in _calls(mine, theirs, causal, q.shape[2] // len(mine)):
        grads = _block_backward(do[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
                                lse[:, :, rows].contiguous(), causal=diagonal, scale=scale)
        parts.append((rows, cols, *grads))
    return parts


def add_grads(parts: list[Part], dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add `parts` into the fp32 accumulators, in place."""
    for rows, cols, gq, gk, gv in parts:
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv


def _calls(mine: list[int], theirs: list[int], causal: bool, chunk: int) -> list[tuple[slice, slice, bool]]:
    """The kernel calls one key/value block takes: (query rows, key rows, causal), in local token
    order. The chunk pairs the mask leaves visible go in one call wherever they can, as they always
    do for the zig-zag and plain splits: a causal call when both sides hold the same ascending
    chunks (the mask over their concatenation is the causal one), else one unmasked rectangle; any
    other pattern takes a call per pair."""
    def span(c: int, n: int = 1) -> slice:
        return slice(c * chunk, (c + n) * chunk)

    if causal and mine == theirs == sorted(mine):
        return [(span(0, len(mine)), span(0, len(mine)), True)]
    seen = [(a, b, _pair(ca, cb, causal)) for a, ca in enumerate(mine) for b, cb in enumerate(theirs)
            if _pair(ca, cb, causal) != "hidden"]
    if not seen:
        return []
    rows, cols = sorted({a for a, _, _ in seen}), sorted({b for _, b, _ in seen})
    rectangle = (len(seen) == len(rows) * len(cols) and all(p == "visible" for _, _, p in seen)
                 and rows == list(range(rows[0], rows[-1] + 1)) and cols == list(range(cols[0], cols[-1] + 1)))
    if rectangle:
        return [(span(rows[0], len(rows)), span(cols[0], len(cols)), False)]
    return [(span(a), span(b), p == "diagonal") for a, b, p in seen]


def _pair(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """Query chunk vs key chunk (equal lengths): "visible", "hidden" (skipped) or "diagonal" (causal)."""
    if not causal or k_chunk < q_chunk:
        return "visible"
    return "hidden" if k_chunk > q_chunk else "diagonal"


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """Which kernel a block runs: "cpu" (torch's CPU flash kernel), "flash" or "efficient" (torch's CUDA
    kernels, in SDPA's order of preference, where they take the shape and dtype), else "plain" (the
    formulas, C x C scores). cuDNN's kernel is not asked: the layout of the log-sum-exp its
    backward takes has changed between torch versions."""
    if not FUSED:
        return "plain"
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, False)
        if torch.backends.cuda.can_use_flash_attention(params):
            return "flash"
        if torch.backends.cuda.can_use_efficient_attention(params):
            return "efficient"
    return "plain"


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, fp32 log-sum-exp (B, H, Tq)) of one block; `causal` only on a square block."""
    kernel = _kernel(q, k, v, causal)
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if kernel == "efficient":  # its log-sum-exp comes padded to a multiple of 32 queries
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]]
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v.float(), lse


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, *, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv) given the merged output and log-sum-exp of its queries."""
    kernel = _kernel(q, k, v, causal)
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal,
                                                                        scale=scale)
    # No dropout: the kernels never read their random-number state.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_backward(do, q, k, v, out, lse, None, None, q.shape[2],
                                                                 k.shape[2], 0.0, causal, no_rng, no_rng,
                                                                 scale=scale)
    if kernel == "efficient":  # reads the log-sum-exp through its strides: unpadded is fine
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    s = _scores(q, k, causal, scale)
    do = do.float()
    p = torch.exp(s - lse[..., None])
    ds = p * (do @ v.float().transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, p.transpose(-1, -2) @ do


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """The plain formulas' fp32 scores of one block, the causal mask applied."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -torch.inf)
    return s


def _pass_on(x: torch.Tensor, split: ContextSplit):
    """Send `x` to the next rank of the ring and receive the previous rank's; returns a wait()
    that gives the received tensor."""
    group = split.group
    nxt = dist.get_global_rank(group, (split.rank + 1) % split.cp)
    prv = dist.get_global_rank(group, (split.rank - 1) % split.cp)
    x = x.contiguous()
    received = torch.empty_like(x)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, group),
                                    dist.P2POp(dist.irecv, received, prv, group)])

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return received
    return wait


# ----------------------------------------------------------------------------- head scatter


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, *,
                  split: ContextSplit, scale: float | None = None) -> torch.Tensor:
    """Ulysses: (all heads, local tokens) -> (heads / cp, all tokens), whole-sequence causal
    attention, and back; each all-to-all is differentiable (torch's functional collectives). cp divides
    the heads (shoal.rules refuses cp_mode=a2a otherwise). At cp=1 it is SDPA itself. It compiles
    into a block's graph (torch's functional collectives trace)."""
    if split.cp == 1:
        return causal_attention(q, k, v, dropout_p, scale=scale)
    return head_scatter_attention(q, k, v, dropout_p, cp=split.cp, orders=split.chunk_orders(q.device),
                                  exchange=functools.partial(_all_to_all, group=split.group), scale=scale)


def head_scatter_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, *, cp: int,
                           orders: tuple[torch.Tensor, torch.Tensor],
                           exchange: Callable[[torch.Tensor], torch.Tensor],
                           scale: float | None = None) -> torch.Tensor:
    """a2a attention with `exchange` as the all-to-all (over dim 0, one slice per rank) and `orders`
    ContextSplit.chunk_orders: q, k and v travel in one all-to-all, side by side on the features
    (values may be of another width, latent attention's); each side of it costs one copy, forward
    and backward."""
    B, H, T, _ = q.shape
    E = v.shape[-1]
    assert H % cp == 0, f"cp_mode=a2a scatters {H} heads over cp={cp}"
    rank_major, in_order = orders
    n = len(rank_major) // cp  # chunks per rank
    widths = [t.shape[-1] for t in (q, k, v)]
    # (B, H, T, W) -> (cp, n, B, H/cp, C, W): [r] goes to rank r (its heads), [., j] is local chunk j.
    send = torch.cat((q, k, v), dim=-1).unflatten(1, (cp, H // cp)).unflatten(3, (n, T // n)).permute(1, 3, 0, 2, 4, 5)
    got = exchange(send).flatten(0, 1)  # (cp * n, B, H/cp, C, W), chunks in rank-major order
    whole = _MoveAndReorder.apply(got, 0, 2, in_order, rank_major)  # (B, H/cp, 2P chunks, C, W)
    qh, kh, vh = whole.flatten(2, 3).split(widths, dim=-1)
    y = causal_attention(qh, kh, vh, dropout_p, scale=scale)  # (B, H/cp, T * cp, E)
    # Back: (cp * n, B, H/cp, C, E) in rank-major chunk order, [r] to rank r; from rank r come its heads.
    back = exchange(_MoveAndReorder.apply(y.unflatten(2, (cp * n, T // n)), 2, 0, rank_major, in_order))
    # (cp, n, B, H/cp, C, E) -> (B, T, H, E) in memory, returned as (B, H, T, E): the layout SDPA gives.
    return back.unflatten(0, (cp, n)).permute(2, 1, 4, 0, 3, 5).reshape(B, T, H, E).transpose(1, 2)


def _all_to_all(x: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.all_to_all_single_autograd(x, None, None, group)


class _MoveAndReorder(torch.autograd.Function):
    """x with dimension `src` moved to `dst` and its entries taken in `order`
    (y.select(dst, i) == x.select(src, order[i])), one copy forward and one backward (index_select's
    own backward adds into zeros); `inverse` is order's inverse permutation."""

    @staticmethod
    def forward(ctx, x, src: int, dst: int, order: torch.Tensor, inverse: torch.Tensor):
        ctx.src, ctx.dst, ctx.inverse = src, dst, inverse
        return x.movedim(src, dst).index_select(dst, order)

    @staticmethod
    def backward(ctx, grad):
        return grad.movedim(ctx.dst, ctx.src).index_select(ctx.src, ctx.inverse), None, None, None, None
