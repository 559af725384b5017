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
  causal mask hides entirely are skipped. On CPU each block runs torch's flash kernel (which
  returns the log-sum-exp the merge needs, and whose backward given the merged statistics is
  exactly the block's share); elsewhere the plain formulas, with C x C scores per block. torch's
  experimental `context_parallel` does not run
  on CPU (no sharding strategy for the CPU attention kernel), hence this small autograd function
  over point-to-point sends.
- cp_mode=a2a (DeepSpeed-Ulysses): an all-to-all turns (all heads, T/P tokens) into (H/P heads,
  all T tokens), attention runs on whole sequences, and a second all-to-all turns it back.

Shape legend: B batch, H heads, T tokens (local unless said), E head dim, C chunk length.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shoal.models.adapter import adapter_with
from shoal.models.transformer import causal_attention

CPU_FLASH = True
"""Blocks on CPU through torch's flash kernel (False: the plain formulas GPUs use here; tests run both)."""


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

    def _cached(self, kind: str, seq_len: int, device: torch.device) -> torch.Tensor:
        # Built once per length and device: the RoPE hook asks in every layer of every forward,
        # and a fresh host-to-device copy there would make the host wait for the GPU.
        key = (kind, seq_len, torch.device(device))
        if key not in self._indices:
            ranks = [self.rank] if kind == "mine" else range(self.cp)
            index = torch.cat([positions(seq_len, r, self.cp, balanced=self.balanced) for r in ranks])
            self._indices[key] = index.to(device)
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
                   split: ContextSplit, causal: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys and values, (B, H, T, E) each; no
    attention dropout (shoal.rules refuses cp with it)."""
    assert not dropout_p, f"attention dropout {dropout_p} under context parallelism"
    return _Ring.apply(q, k, v, split, causal)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split: ContextSplit, causal: bool):
        scale = q.shape[-1] ** -0.5
        mine = chunks_of(split.rank, split.cp, balanced=split.balanced)
        qs = _chunks(q.float(), len(mine))
        out = [torch.zeros_like(c) for c in qs]
        lse = [torch.full(c.shape[:-1], -torch.inf, dtype=c.dtype, device=c.device) for c in qs]
        kv = torch.stack((k, v))
        for step in range(split.cp):
            source = (split.rank - step) % split.cp
            pending = _pass_on(kv, split) if step < split.cp - 1 else None  # overlaps the blocks below
            ks, vs = _chunks(kv[0].float(), len(mine)), _chunks(kv[1].float(), len(mine))
            theirs = chunks_of(source, split.cp, balanced=split.balanced)
            attend_blocks(qs, ks, vs, mine, theirs, out, lse, causal=causal, scale=scale)
            if pending is not None:
                kv = pending()
        out_t, lse_t = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.split, ctx.causal = split, causal
        return out_t.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        split, causal = ctx.split, ctx.causal
        scale = q.shape[-1] ** -0.5
        mine = chunks_of(split.rank, split.cp, balanced=split.balanced)
        n = len(mine)
        qs, dos, lses, outs = _chunks(q.float(), n), _chunks(grad_out.float(), n), _chunks(lse, n), _chunks(out, n)
        deltas = _chunks((grad_out.float() * out).sum(-1), n)  # rowsum(dO * O), per query
        dq = [torch.zeros_like(c) for c in qs]
        # K and V travel around the ring as in forward, the next block on its way while this one's
        # gradients are computed. The gradient accumulator of the block held travels one step
        # behind: it arrives from the previous rank (its share added) while this rank computes its
        # own share, is added to, and sent on; after P steps one more pass brings it home.
        kv = torch.stack((k, v)).float()
        acc_pending = None
        for step in range(split.cp):
            source = (split.rank - step) % split.cp
            kv_pending = _pass_on(kv, split) if step < split.cp - 1 else None
            ks, vs = _chunks(kv[0], n), _chunks(kv[1], n)
            mine_grads = torch.zeros_like(kv)  # this rank's share of the held block's dK, dV
            dks, dvs = _chunks(mine_grads[0], n), _chunks(mine_grads[1], n)
            theirs = chunks_of(source, split.cp, balanced=split.balanced)
            for a, qa in enumerate(qs):
                for b, kb in enumerate(ks):
                    pair = _pair(mine[a], theirs[b], causal)
                    if pair == "hidden":
                        continue
                    g = _block_backward(dos[a], qa, kb, vs[b], outs[a], lses[a], deltas[a],
                                        diagonal=pair == "diagonal", scale=scale)
                    dq[a] += g[0]
                    dks[b] += g[1]
                    dvs[b] += g[2]
            acc = mine_grads if acc_pending is None else acc_pending().add_(mine_grads)
            acc_pending = _pass_on(acc, split)
            if kv_pending is not None:
                kv = kv_pending()
        assert acc_pending is not None
        dk, dv = acc_pending()
        return torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attend_blocks(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], mine: list[int],
                  theirs: list[int], out: list[torch.Tensor], lse: list[torch.Tensor], *, causal: bool,
                  scale: float) -> None:
    """Merge one key/value block (chunks `theirs`) into the running outputs and log-sum-exps of
    the query chunks `mine`, in place (online softmax); chunk pairs the causal mask hides are skipped."""
    for a, qa in enumerate(qs):
        for b, kb in enumerate(ks):
            pair = _pair(mine[a], theirs[b], causal)
            if pair == "hidden":
                continue
            block_out, block_lse = _block_forward(qa, kb, vs[b], diagonal=pair == "diagonal", scale=scale)
            new = torch.logaddexp(lse[a], block_lse)
            out[a] = out[a] * torch.exp(lse[a] - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None]
            lse[a] = new


def _chunks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Views of the sequence dimension (2) in `n` equal chunks (the chunks this rank holds)."""
    return list(x.chunk(n, dim=2))


def _pair(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """Query chunk vs key chunk (equal lengths): "visible", "hidden" (skipped) or "diagonal" (causal)."""
    if not causal or k_chunk < q_chunk:
        return "visible"
    return "hidden" if k_chunk > q_chunk else "diagonal"


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, diagonal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of one block. On CPU torch's flash kernel, which returns the
    log-sum-exp (never a C x C score matrix); elsewhere the plain formulas (C x C scores)."""
    if q.device.type == "cpu" and CPU_FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diagonal, scale=scale)
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, *, diagonal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv) given the *merged* output and log-sum-exp of the queries: the
    flash backward with the global softmax statistics gives exactly this block's share."""
    if q.device.type == "cpu" and CPU_FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, diagonal, scale=scale)
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -torch.inf)
    p = torch.exp(s - lse[..., None])
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ do


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


@torch._dynamo.disable
def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, *,
                  split: ContextSplit) -> torch.Tensor:
    """Ulysses: (all heads, local tokens) -> (heads / cp, all tokens), whole-sequence causal
    attention, and back; each all-to-all is differentiable (torch's functional collectives). cp divides
    the heads (shoal.rules refuses cp_mode=a2a otherwise)."""
    cp = split.cp
    assert q.shape[1] % cp == 0, f"cp_mode=a2a scatters {q.shape[1]} heads over cp={cp}"
    seq_len = q.shape[2] * cp
    order = split.rank_order(seq_len, q.device)
    to_global = torch.argsort(order)  # gathered (rank-major) order -> position order
    qh, kh, vh = (_heads_to_sequence(t, split, to_global) for t in (q, k, v))
    y = causal_attention(qh, kh, vh, dropout_p)
    return _sequence_to_heads(y, split, order)


def _heads_to_sequence(x_BHTE: torch.Tensor, split: ContextSplit, to_global: torch.Tensor) -> torch.Tensor:
    B, H, T, E = x_BHTE.shape
    cp = split.cp
    send = x_BHTE.reshape(B, cp, H // cp, T, E).transpose(0, 1).contiguous()  # (cp, B, H/cp, T, E)
    got = funcol.all_to_all_single_autograd(send, None, None, split.group)  # [r]: rank r's tokens
    whole = got.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * T, E)  # rank-major token order
    return whole.index_select(2, to_global)


def _sequence_to_heads(y_BHTE: torch.Tensor, split: ContextSplit, order: torch.Tensor) -> torch.Tensor:
    B, Hc, T, E = y_BHTE.shape
    cp = split.cp
    ranked = y_BHTE.index_select(2, order).reshape(B, Hc, cp, T // cp, E)
    send = ranked.permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, T/cp, E): [r] goes to rank r
    got = funcol.all_to_all_single_autograd(send, None, None, split.group)  # [r]: heads of rank r
    return got.permute(1, 0, 2, 3, 4).reshape(B, cp * Hc, T // cp, E)
