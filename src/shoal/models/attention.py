"""The attention kernels and the rotary embedding shoal's attention modules share (shoal.models.transformer's
Attention, shoal.models.mla's LatentAttention): plain PyTorch, no distributed imports.

Shape legend: B batch, T sequence, H heads, E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_rope(x_BTHE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by the rotation rows (shoal.models.rope.rotation_rows), (T, E), or
    (B, T, E) for positions per sequence."""
    # Rotate in at least float32 (16-bit inputs lose the angle's precision); float64 stays float64.
    x = x_BTHE.to(torch.promote_types(x_BTHE.dtype, torch.float32))
    # Pair (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), written as x * (c, c) + (x2, x1) * (-s, s) over
    # whole contiguous rows: the same products and sums (so the same bits) as the pairwise formula,
    # without strided halves and the stack that joins them (twice the multiplications' time on CPU).
    cos, sin = (t[None, :, None, :] if t.dim() == 2 else t[:, :, None, :] for t in (cos_TE, sin_TE))
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * cos + swapped * sin).type_as(x_BTHE)


def causal_attention(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                     dropout_p: float = 0.0, *, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention over whole sequences (SDPA: flash attention on GPUs). The seam a
    context-parallel plan replaces (`Attention.core`) with attention over a split sequence. `scale`:
    the softmax scale (None: 1/sqrt(E))."""
    return F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, is_causal=True, dropout_p=dropout_p, scale=scale)


def sliding_window_attention(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                             dropout_p: float = 0.0, *, window: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention where query i sees keys i - window + 1 .. i (Mistral; Beltagy et al. 2020,
    Longformer): a banded mask, so sequences longer than the window are exact."""
    T = q_BHTE.shape[-2]
    if T <= window:
        return causal_attention(q_BHTE, k_BHTE, v_BHTE, dropout_p, scale=scale)
    i = torch.arange(T, device=q_BHTE.device)
    band_TT = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, attn_mask=band_TT, dropout_p=dropout_p, scale=scale)


Documents = tuple[torch.Tensor, torch.Tensor]
"""Document masking: (positions_BT within each token's document, allowed_B1TT: a query may see a
key of its own document at or before it)."""


def documents(tokens_BT: torch.Tensor, eos_id: int) -> Documents:
    """Where each document of packed sequences starts and ends: a document ends with `eos_id`
    (shoal data prepare's separator), the next one starts after it."""
    T = tokens_BT.shape[1]
    ends_BT = (tokens_BT == eos_id).long()
    doc_BT = ends_BT.cumsum(1) - ends_BT  # the EOS belongs to the document it ends
    index_T = torch.arange(T, device=tokens_BT.device)
    starts_BT = torch.ones_like(doc_BT, dtype=torch.bool)
    starts_BT[:, 1:] = doc_BT[:, 1:] != doc_BT[:, :-1]
    first_BT = torch.where(starts_BT, index_T, 0).cummax(1).values  # where each token's document starts
    allowed_BTT = (doc_BT[:, :, None] == doc_BT[:, None, :]) & (index_T[:, None] >= index_T[None, :])
    return index_T - first_BT, allowed_BTT[:, None]


def document_attention(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor, allowed_B1TT: torch.Tensor,
                       dropout_p: float = 0.0, window: int = 0, *, scale: float | None = None) -> torch.Tensor:
    """Causal attention kept inside each document (a block-diagonal causal mask; SDPA's masked
    kernels: memory-efficient attention on GPUs, not flash), and inside the window if one is set."""
    T = q_BHTE.shape[-2]
    if 0 < window < T:
        i = torch.arange(T, device=q_BHTE.device)
        allowed_B1TT = allowed_B1TT & (i[None, :] > i[:, None] - window)
    return F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, attn_mask=allowed_B1TT, dropout_p=dropout_p,
                                          scale=scale)
