"""FLOPs and memory traffic of one transformer block per token: pure functions of the model shape.

Matrix multiplies cost 2 FLOPs per multiply-add (Kaplan et al. 2020, "Scaling Laws", table 1);
a backward pass costs twice its forward (one product for the input gradient, one for the
weight gradient; Narayanan et al. 2021, section 5.1), except a fused attention kernel's, which also
recomputes the scores (FUSED_BACKWARD). Attention adds QK^T and AV, 2 * 2 * T *
D_attn FLOPs per token over the whole context; a causal kernel that skips masked blocks
(FlashAttention, Dao 2022) does half of that. Activation recompute repeats a forward: the whole
block under full recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation", section 5);
under selective recompute what shoal's policy does not keep (`recomputed`).

Low-rank adapters (LoRA, Hu et al. 2021) freeze the weights: a frozen weight's backward computes the input's
gradient alone, one product per forward product, not two; the adapters' own products run all three
(`step_weight_flops`).

Elementwise work (norms, residual adds, RoPE, the gated activation, softmax when it is not
fused) is memory-bound: its cost is the bytes it reads and writes over the memory bandwidth
(the roofline, Williams et al. 2009). Counts below are per token and per element read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.models.config import ModelConfig
from shoal.models.lora_config import ROW_PARALLEL, LoRAConfig, adapted_matrices


@dataclass(frozen=True, kw_only=True)
class BlockWork:
    """One block's forward work for one token, split the way the cost model prices it."""

    matmul: float
    """FLOPs in the weight matrix multiplies (divided by tp when tensor-parallel)."""
    attention: float
    """FLOPs in QK^T and AV over the token's context."""
    elementwise: float
    """Elements read or written by memory-bound ops in forward (priced in bytes by the dtype); backward moves
    twice as many."""
    dropout: float = 0.0
    """Elements the block's dropouts move in forward (`dropout_elements`), beside `elementwise`."""
    dropout_backward: float = 0.0
    """Elements the dropouts' gradients move in backward: each reads the gradient and the mask and writes the
    gradient."""
    scores: float = 0.0
    """Of `elementwise` and `dropout`, the forward elements of unfused attention's scores: what a recompute policy
    that reruns the attention core reruns beside QK^T and AV (memory.RecomputePolicy.rerun's `scores`)."""
    hidden: float = 0.0
    """Of `elementwise` and `dropout`, the forward elements on the hidden state (the norms, the residual adds and
    their dropouts), which tensor parallelism without sequence parallelism runs whole on every rank (Korthikanti
    et al. 2022, section 4.2.2: the layer norms and dropouts are replicated; memory.activation_elements counts
    their tensors so)."""
    hidden_backward: float = 0.0
    """Of the backward's elements, those on the hidden state."""


def mlp_matmul_flops(cfg: ModelConfig, width: float | None = None) -> float:
    """Forward FLOPs per token of one FFN of hidden `width` (default: the dense FFN's, dense_width):
    2 per weight (three matrices for SwiGLU)."""
    return 2.0 * (3 if cfg.activation == "swiglu" else 2) * cfg.dim * (cfg.dense_width if width is None else width)


def shared_width(cfg: ModelConfig) -> int:
    """Hidden width of each shared expert: its own (Qwen2-MoE's shared_expert_intermediate_size), else ffn_dim."""
    return cfg.shared_ffn_dim or cfg.ffn_dim


def ffn_width(cfg: ModelConfig, index: int) -> float:
    """Summed hidden width of the FFNs a token passes through in block `index`: dense_width in a dense
    block; in an MoE block top-k routed experts (or one per prototype group) of ffn_dim each, plus
    every shared expert at its own width."""
    if not cfg.is_moe_layer(index):
        return float(cfg.dense_width)
    routed = cfg.num_prototypes if cfg.num_prototypes else cfg.top_k
    return float(routed * cfg.ffn_dim + cfg.num_shared_experts * shared_width(cfg))


def attention_matmul_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the Q, K, V and output projections (grouped K/V heads smaller); latent
    attention's (shoal.models.mla): 2 per weight of its down-, up-, rotary-key and output projections."""
    if cfg.latent_attention:
        return 2.0 * (cfg.latent_attention_params() - cfg.q_lora_rank - cfg.kv_lora_rank)  # less the two norms
    q_out = cfg.num_heads * cfg.head_dim
    kv_out = cfg.kv_heads * cfg.head_dim
    return 2.0 * cfg.dim * (2 * q_out + 2 * kv_out)


def attention_core_flops(cfg: ModelConfig, context: int, *, causal_skip: bool) -> float:
    """Forward FLOPs per token of QK^T (2 C per key and head, C the query/key head width) and AV (2 V,
    the value head's) over `context` keys; half when masked blocks are skipped."""
    full = 2.0 * context * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)
    return full / 2 if causal_skip else full


def qkv_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """Per token, the widths of the queries, keys and values attention reads: grouped K/V heads
    narrower; latent attention's keys expanded to every head (its rotary key repeated)."""
    if cfg.latent_attention:
        return cfg.num_heads * cfg.qk_head_dim, cfg.num_heads * cfg.qk_head_dim, cfg.num_heads * cfg.v_head_dim
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return q, kv, kv


def latent_elements(cfg: ModelConfig, *, compiled: bool) -> float:
    """Elements per token latent attention moves besides the projections and the attention kernel
    (shoal.models.mla): its two latent RMSNorms (compiled: read and write; eager: 7 passes, as
    `_hidden_elements`' norms), RoPE on the rotary parts of the query heads and the one shared key
    (compiled: read and write; eager: 12 passes, as `_eager_elements`), and the query's and key's
    concatenation of their two parts (read and write)."""
    H, R, C = cfg.num_heads, cfg.qk_rope_head_dim, cfg.qk_head_dim
    norms = (2 if compiled else 7) * (cfg.q_lora_rank + cfg.kv_lora_rank)
    rope = (2 if compiled else 12) * (H * R + R)
    return norms + rope + 2 * 2 * H * C


def block_index(cfg: ModelConfig, *, moe: bool) -> int:
    """The block the estimates price for every block of its kind: the first with experts, or the first without
    (0 when every block has them)."""
    return next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i) == moe), 0)


def experts_per_token(cfg: ModelConfig) -> float:
    """FFNs a token passes through in an MoE layer: top-k (or one per prototype group) plus shared."""
    routed = cfg.num_prototypes if cfg.num_prototypes else cfg.top_k
    return routed + cfg.num_shared_experts


def expert_ranks_per_token(cfg: ModelConfig, ep: int) -> float:
    """Expected number of distinct expert-parallel ranks among a token's routed choices: what shoal's all-to-all
    sends each token to (once per rank that holds any of its choices, shoal.parallel.expert), its own rank included.

    Rank r of `ep` holds the m = E/ep consecutive experts r*m .. r*m+m-1. The k choices are taken as k distinct
    experts drawn uniformly from the P experts the token may choose, which span R ranks: every expert (P = E,
    R = ep), or, under group-limited routing whose groups each fill whole ranks (ep a multiple of router_groups),
    the experts of its router_topk_groups groups (P = topk_groups x E/groups, R = P/m). A rank holds none of the k
    with probability C(P - m, k) / C(P, k) (hypergeometric), so the expectation is R (1 - C(P - m, k) / C(P, k)).
    Groups smaller than a rank, and prototype groups, are priced as if every expert could be chosen (P = E), which
    spreads the choices at least as wide. Balanced routing is the premise, as everywhere in the cost model."""
    k = cfg.num_prototypes if cfg.num_prototypes else cfg.top_k
    if ep <= 1:
        return 1.0
    E = cfg.num_experts
    m = E // ep
    groups, chosen = cfg.router_groups, cfg.router_topk_groups
    pool = E
    if groups > 1 and 0 < chosen < groups and ep % groups == 0:
        pool = chosen * (E // groups)
    ranks = pool // m
    missed = 1.0
    for i in range(k):  # C(P - m, k) / C(P, k) as a product of k ratios
        missed *= max(pool - m - i, 0) / (pool - i)
    return ranks * (1.0 - missed)


def block_work(cfg: ModelConfig, index: int, *, seq_len: int, causal_skip: bool, fused_attention: bool,
               compiled: bool = True, element_bytes: float = 2.0) -> BlockWork:
    """Forward work per token of block `index` (MoE or dense FFN) at sequence length `seq_len`.

    `compiled`: elementwise ops fused into one kernel per region (torch.compile, or hand-fused
    kernels), so each tensor is read and written once; eager PyTorch runs shoal's
    block op by op (RMSNorm's pow/mean/rsqrt/mul/mul, RoPE's eight products and sums in fp32, the
    GQA repeat, the head transposes), which moves the elements counted in `_eager_elements`. `element_bytes`: an
    activation's bytes, against which a dropout mask's byte counts."""
    D, width = cfg.dim, ffn_width(cfg, index)
    moe = cfg.is_moe_layer(index)
    matmul = attention_matmul_flops(cfg) + mlp_matmul_flops(cfg, width)
    if moe:
        matmul += 2.0 * D * cfg.num_experts  # the router
        matmul += 2.0 * D if cfg.shared_gate and cfg.num_shared_experts else 0.0  # the shared experts' gate
    q_kv = cfg.num_heads * cfg.head_dim + 2 * cfg.kv_heads * cfg.head_dim
    hidden = _hidden_elements(cfg, compiled=compiled)
    if cfg.latent_attention:
        # Attention reads q, k and v and writes its output (H V); the heads' transpose copies it back (eager).
        q, k, v = qkv_widths(cfg)
        output = cfg.num_heads * cfg.v_head_dim
        act = (3 if compiled else 5) * width if cfg.activation == "swiglu" else (2 if compiled else 4) * width
        elementwise: float = (hidden + latent_elements(cfg, compiled=compiled) + q + k + v + output
                              + (0 if compiled else 2 * output) + act)
    elif compiled:
        # The hidden state's norms and residual adds; RoPE reads and writes q and k; attention reads q, k, v and
        # writes its output.
        elementwise = hidden + 2 * q_kv + q_kv + D
        # Grouped K/V heads are repeated to every query head before SDPA (shoal's repeat_interleave,
        # torchtitan's repeat_kv: an expanded view reshaped), a copy no compiled region fuses into the
        # attention kernel: K and V are written, then read by attention, at the query heads' width.
        elementwise += 4 * (cfg.num_heads - cfg.kv_heads) * cfg.head_dim
        # The gated activation reads gate and up and writes their product (GELU: read 1, write 1).
        elementwise += 3 * width if cfg.activation == "swiglu" else 2 * width
    else:
        elementwise = hidden + _eager_elements(cfg, width)
    scores = 0.0
    if not fused_attention:
        # Unfused attention writes the scores, softmax reads and writes them, AV reads them:
        # four passes over the token's row of scores per head (causal mask applied in place).
        scores = 4.0 * cfg.num_heads * seq_len
        elementwise += scores
    drop = dropout_elements(cfg, seq_len, fused_attention=fused_attention, compiled=compiled,
                            element_bytes=element_bytes)
    return BlockWork(matmul=matmul, attention=attention_core_flops(cfg, seq_len, causal_skip=causal_skip),
                     elementwise=float(elementwise), dropout=drop.hidden + drop.scores,
                     dropout_backward=drop.hidden_backward + drop.scores, scores=scores + drop.scores,
                     hidden=hidden + drop.hidden, hidden_backward=2 * hidden + drop.hidden_backward)


MASK_BYTES = 1.0
"""A dropout mask's bytes an element: torch keeps it as bool (the dropout kernel writes it beside its output in
forward; backward reads it)."""


@dataclass(frozen=True)
class DropoutWork:
    """Elements per token a block's dropouts move (`dropout_elements`)."""

    hidden: float
    """The two on the hidden state, in forward."""
    hidden_backward: float
    """Their gradients, in backward."""
    scores: float
    """The one on unfused attention's probabilities, in forward and as many in backward."""


def dropout_elements(cfg: ModelConfig, seq_len: int, *, fused_attention: bool, compiled: bool,
                     element_bytes: float = 2.0) -> DropoutWork:
    """Elements per token of a block's dropouts at `cfg.dropout`, of `element_bytes` each (a mask's MASK_BYTES
    counts as that fraction of an element).

    Two on the hidden state, after the attention's output projection and after the FFN (shoal.models.transformer):
    run on its own, each reads and writes the activation and writes its mask; fused into the residual add
    (compiled, or a hand-fused bias-dropout-add kernel), only the mask is written, and backward scales the gradient
    by it either way (read the gradient and the mask, write the gradient). Unfused attention drops its
    probabilities with torch.nn.Dropout: a read and a write of the scores and the mask, and backward's mirror. A
    fused attention kernel draws its dropout inside (FlashAttention regenerates the mask in backward from its RNG
    state), moving nothing more. The embedding's dropout, once a model, is left out."""
    if cfg.dropout <= 0.0:
        return DropoutWork(hidden=0.0, hidden_backward=0.0, scores=0.0)
    D, mask = cfg.dim, MASK_BYTES / element_bytes
    mirror = 2 + mask  # read and write the tensor, and the mask
    return DropoutWork(hidden=2 * (mask if compiled else mirror) * D, hidden_backward=2 * mirror * D,
                       scores=0.0 if fused_attention else mirror * cfg.num_heads * seq_len)


def _hidden_elements(cfg: ModelConfig, *, compiled: bool) -> float:
    """Elements per token a block's two norms and two residual adds move on the hidden state: a compiled norm reads
    x and writes y, an eager one runs pow (r, w), mean (r), x * rsqrt (r, w) and * weight (r, w); each add reads 2
    and writes 1."""
    norm = 2 if compiled else 7
    return 2 * norm * cfg.dim + 2 * 3 * cfg.dim


def _eager_elements(cfg: ModelConfig, width: float) -> float:
    """Elements read and written per token by shoal's block run op by op (shoal.models.transformer),
    its FFNs `width` wide in all (ffn_width), off the hidden state (`_hidden_elements`)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    rope = 12 * (q + kv) if cfg.pos_emb == "rope" else 0  # to fp32, 4 products, 2 sums, stack, cast
    grouped = 2 * 2 * q if kv < q else 0  # repeat_interleave of k and v to every head
    heads = 2 * q  # the attention output's transpose copied back to (B, T, D)
    act = 5 * width if cfg.activation == "swiglu" else 4 * width  # silu (r, w) then the product (r 2, w 1)
    return rope + grouped + heads + act + 3 * (q + 2 * kv)  # + attention's reads


def head_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the output projection onto the vocabulary."""
    return 2.0 * cfg.dim * cfg.vocab_size


FUSED_BACKWARD = 2.5
"""A fused attention kernel's backward over its forward in matrix FLOPs: it keeps no scores, so its backward
recomputes QK^T before the four products of the gradients (five products against the forward's two).
FlashAttention-2 counts its backward so (Dao 2023, "FlashAttention-2", section 4.1; `flops` in
github.com/Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py: fwd f, bwd 2.5 f, fwd + bwd 3.5 f),
which makes its published fwd + bwd rates rates of 3.5 f."""


def attention_backward_multiplier(*, fused_kernel: bool) -> float:
    """Backward matrix FLOPs of the attention core over its forward: 2 when the scores are kept (one
    product for each input's gradient per forward product), FUSED_BACKWARD for a fused GPU kernel."""
    return FUSED_BACKWARD if fused_kernel else 2.0


NEWTON_SCHULZ_STEPS = 5
"""torch.optim.Muon's default ns_steps (`shoal train --muon-ns-steps`)."""


def newton_schulz_products(rows: int, cols: int) -> tuple[tuple[int, int, int], ...]:
    """One iteration of torch.optim.Muon's Newton-Schulz on a (rows, cols) matrix as (m, n, k) products, each an
    (m x k) @ (k x n). It works on the wide orientation, X of (a, b) with a = min(rows, cols): A = X X^T, then
    A A for B = b A + c A A, then B X for X = a X + B X (torch.optim._muon._zeropower_via_newtonschulz)."""
    a, b = min(rows, cols), max(rows, cols)
    return (a, a, b), (a, a, a), (a, b, a)


def newton_schulz_flops(rows: int, cols: int, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """FLOPs of `steps` Newton-Schulz iterations on one (rows, cols) matrix: 2 m n k per product."""
    return steps * sum(2.0 * m * n * k for m, n, k in newton_schulz_products(rows, cols))


def hidden_matrices(cfg: ModelConfig, index: int) -> tuple[tuple[int, int, int, bool], ...]:
    """The 2-D weights of block `index` that Muon orthogonalises (shoal.optim.builder.build_muon: every matrix of
    the blocks), as (rows, cols, how many, routed expert): attention's projections (latent attention's own,
    shoal.models.mla), then a dense FFN's matrices, or an MoE block's router, its shared experts (and their gate)
    and each routed expert's matrices, one matrix per expert (shoal.optim.orthogonalize.newton_schulz)."""
    D, H = cfg.dim, cfg.num_heads
    if cfg.latent_attention:
        C, L, R, V = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
        nope = cfg.qk_nope_head_dim
        queries = [(D, H * C)] if not cfg.q_lora_rank else [(D, cfg.q_lora_rank), (cfg.q_lora_rank, H * C)]
        attention = [*queries, (D, L), (L, H * (nope + V)), (D, R), (H * V, D)]
    else:
        attention = [(i, o) for _, i, o, _ in block_matmuls(cfg)[:4]]
    out = [(o, i, 1, False) for i, o in attention]  # nn.Linear's (out, in) layout
    per_ffn = 3 if cfg.activation == "swiglu" else 2
    if not cfg.is_moe_layer(index):
        return (*out, *((D, cfg.dense_width, per_ffn, False),))
    out.append((cfg.num_experts, D, 1, False))  # the router
    if cfg.num_shared_experts:
        out.append((D, shared_width(cfg), per_ffn * cfg.num_shared_experts, False))
        out += [(1, D, 1, False)] if cfg.shared_gate else []
    out.append((D, cfg.ffn_dim, per_ffn * cfg.num_experts, True))
    return tuple(out)


def block_matmuls(cfg: ModelConfig) -> tuple[tuple[str, int, int, bool], ...]:
    """A dense block's weight products in the order its forward calls them, as (name, input width, output width,
    column-parallel): attention's wq, wk, wv, then wo; a SwiGLU FFN's w1, then w3, then w2 (`w2(silu(w1(x)) *
    w3(x))`: Python evaluates w1 first); a GELU FFN's w1, then w2. Under tensor parallelism a column-parallel
    product's output is split over the ranks; a row-parallel one (wo, w2) produces the whole width on every rank,
    a partial sum before its reduction."""
    D, q, kv = cfg.dim, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    F = cfg.dense_width
    ffn = ([("w1", D, F, True), ("w3", D, F, True)] if cfg.activation == "swiglu" else [("w1", D, F, True)])
    return (("wq", D, q, True), ("wk", D, kv, True), ("wv", D, kv, True), ("wo", q, D, False),
            *ffn, ("w2", F, D, False))


def recomputed(ac: str, *, matmul: float, attention: float, elementwise: float, fused_attention: bool,
               selective_matmul: float = 0.0) -> float:
    """The forward work backward reruns, of a block's matmul, attention-core and elementwise work (in any one
    unit: FLOPs or seconds). Full recompute reruns all of it. Selective recompute runs shoal's policy
    (shoal.parallel.recompute: the outputs of matmuls and of the fused attention kernel are kept, every other
    op is recomputed): the elementwise ops, and unfused attention's score products with them (batched
    products the policy does not keep); plus `selective_matmul`, the part of `matmul` a policy that keeps
    fewer products reruns (memory.RecomputePolicy.rerun_matmul)."""
    if ac == "full":
        return matmul + attention + elementwise
    if ac == "selective":
        return elementwise + selective_matmul + (0.0 if fused_attention else attention)
    return 0.0


def train_multiplier(ac: str, *, part: str) -> float:
    """Forward passes' worth of work in one training step: 1 forward + 2 backward, plus the
    recompute: full repeats every forward part, selective only the attention core."""
    recompute = ac == "full" or (ac == "selective" and part == "attention")
    return 3.0 + (1.0 if recompute else 0.0)


def adapter_flops(cfg: ModelConfig, lora: LoRAConfig, index: int | None = None, *, tp: int = 1) -> float:
    """Forward FLOPs per token of the low-rank adapters (shoal.models.lora) of block `index` (None: every block) on
    one tensor-parallel rank: x A^T, then B times that, 2 r (in + out) per adapted matrix a token passes through (a
    routed expert's top-k times, or once per prototype group; a shared expert's once each). Under tp the factor on
    the matrix's split features is split, the other whole on every rank (lora_config.ROW_PARALLEL)."""
    routed = cfg.num_prototypes if cfg.num_prototypes else cfg.top_k
    total = 0.0
    for a in adapted_matrices(cfg, lora):
        if index is not None and a.layer != index:
            continue
        i, o = a.in_features, a.out_features
        each = 2.0 * lora.r * (i / tp + o if a.target in ROW_PARALLEL else i + o / tp)
        total += each * (routed if a.routed else a.count)
    return total


def weight_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the model's weight products: every block's (block_work's matmul) and the head's."""
    blocks = sum(block_work(cfg, i, seq_len=1, causal_skip=True, fused_attention=True).matmul
                 for i in range(cfg.num_layers))
    return blocks + head_flops(cfg)


def step_weight_flops(cfg: ModelConfig, lora: LoRAConfig | None = None) -> float:
    """FLOPs per token of a training step's weight products: 3 x their forward (the forward, the input's gradient
    and the weight's gradient, as much work each); with low-rank adapters on a frozen base, 2 x (a frozen weight
    has no weight gradient, and every weight is frozen: a weight the adapters leave alone too, the head included)
    plus 3 x the adapters' (adapter_flops). The embedding's lookup is no product and has no gradient either way."""
    if lora is None:
        return 3.0 * weight_flops(cfg)
    return 2.0 * weight_flops(cfg) + 3.0 * adapter_flops(cfg, lora)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The FLOPs a step is credited with for MFU: 6N + 12 L H Q T (PaLM, Chowdhery et al. 2022,
    appendix B), whatever recompute or causal skipping the run actually does."""
    return cfg.flops_per_token(seq_len)
