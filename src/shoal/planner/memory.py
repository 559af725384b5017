"""Memory per device: model states under each ZeRO stage, activations per block, pipeline
in-flight micro-batches per schedule. Pure functions of shapes and degrees; bytes throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shoal.models.config import ModelConfig
from shoal.planner import compute

FRAGMENTATION = 1.10
"""The caching allocator's slack on top of what tensors hold: PyTorch's allocator rounds blocks
and keeps freed ones, typically 5-15% above the live bytes (Rajbhandari et al. 2020, section 3.2,
"memory fragmentation"); 10% is the margin the search keeps."""


class RecomputePolicy(Protocol):
    """What selective recompute (`ac=selective`) keeps of a block for its backward and what the backward reruns: the
    policy of the trainer whose step is priced. SHOAL_SELECTIVE is shoal's own (shoal.parallel.recompute)."""

    def kept_elements(self, cfg: ModelConfig, index: int, *, tp: int, sp: bool, fused_attention: bool,
                      on_cpu: bool) -> float | None:
        """Elements block `index` keeps per token on one tensor-parallel rank; None for what `activation_elements`
        counts then: all but the attention core's scores, probabilities and their dropout (Korthikanti et al. 2022,
        section 5)."""

    def rerun_matmul(self, cfg: ModelConfig, *, moe: bool) -> float:
        """Forward FLOPs per token of the block's weight products that the backward reruns."""

    def rerun(self, *, matmul: float, attention: float, elementwise: float, scores: float,
              fused_attention: bool) -> float:
        """The forward work the backward reruns, in any one unit (FLOPs or seconds), of the block's attention core
        (`attention`), its elementwise work (`elementwise`, of which `scores` is the work on unfused attention's
        scores) and the weight products `rerun_matmul` names (`matmul`)."""

    def rerun_holds(self, *, whole: float, kept: float) -> float:
        """Elements per token the block being recomputed holds again in backward, of `whole` (every tensor it keeps
        without recompute) and `kept` (what this policy keeps of it)."""


@dataclass(frozen=True)
class ShoalSelective:
    """shoal's selective recompute (shoal.parallel.recompute): the outputs of the weight products, of the attention
    kernel and of the tensor-parallel reductions are kept; the norms, RoPE, the activation, the residual adds and
    the dropouts are rerun (with unfused attention's score products)."""

    def kept_elements(self, cfg: ModelConfig, index: int, *, tp: int, sp: bool, fused_attention: bool,
                      on_cpu: bool) -> float | None:
        """A dense block's `shoal_selective_elements`; an MoE block's as Korthikanti et al. count (the expert
        kernels' own saving is not counted: an upper bound)."""
        if cfg.is_moe_layer(index):
            return None
        fused = fused_attention and not (on_cpu and cfg.dropout > 0.0)  # a CPU drops out in SDPA's math path: unfused
        return shoal_selective_elements(cfg, index, tp=tp, sp=sp, fused_attention=fused)

    def rerun_matmul(self, cfg: ModelConfig, *, moe: bool) -> float:
        return 0.0

    def rerun(self, *, matmul: float, attention: float, elementwise: float, scores: float,
              fused_attention: bool) -> float:
        return compute.recomputed("selective", matmul=0.0, attention=attention, elementwise=elementwise,
                                  fused_attention=fused_attention, selective_matmul=matmul)

    def rerun_holds(self, *, whole: float, kept: float) -> float:
        """What the policy did not keep (the products' outputs come from the forward's)."""
        return whole - kept


SHOAL_SELECTIVE = ShoalSelective()


@dataclass(frozen=True, kw_only=True)
class SequenceParallelLayout:
    """How the trainer's tensor parallelism runs sequence parallelism, where trainers differ; the defaults are
    DTensor's styles, which shoal's tensor parallelism applies (shoal.parallel.tensor)."""

    keeps_gathered_input: bool = True
    """The product after each norm keeps the all-gathered input it was given, whole (DTensor's all-gather hands it
    the whole sequence and autograd keeps that); False: it keeps its sequence shard and gathers it again in
    backward (Korthikanti et al. 2022, section 4.2.2)."""
    relayout_copies: bool = True
    """Each all-gather's output and each reduce-scatter's input is re-laid out around the collective, a read and a
    write of the whole activation (shoal.planner.costs.Costs._sp_collectives: a (batch, sequence, dim) stream
    sharded on dim 1 around NCCL's dim-0 collectives); False: a (sequence, batch, dim) stream, which copies
    nothing."""


DTENSOR = SequenceParallelLayout()


def model_state_bytes(psi: float, *, shards: int, stage: int, param_bytes: float, grad_bytes: float,
                      optim_bytes: float) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes per device for `psi` parameters replicated
    over `shards` data ranks at ZeRO `stage` (0 nothing sharded, 1 optimizer state, 2 + gradients,
    3 + parameters). Rajbhandari et al. 2020, "ZeRO", section 5.1 and figure 1: mixed-precision
    Adam holds 2 + 2 + 12 bytes per parameter (fp16 weights, fp16 gradients, fp32 master copy,
    momentum and variance); fp32 training 4 + 4 + 8."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not valid; valid: 0, 1, 2, 3")
    return (psi * param_bytes / (shards if stage >= 3 else 1),
            psi * grad_bytes / (shards if stage >= 2 else 1),
            psi * optim_bytes / (shards if stage >= 1 else 1))


def state_bytes_per_param(precision: str) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per parameter for Adam at `precision` (see above)."""
    return (4.0, 4.0, 8.0) if precision == "fp32" else (2.0, 2.0, 12.0)


MOMENT_BYTES = 4.0
"""Bytes of one fp32 moment (momentum or variance) per parameter: the optimizer states' unit beside the master
copy."""

OPTIMIZER_MOMENTS = {"adamw": (2, 2), "lamb": (2, 2), "cowclip": (2, 2), "lars": (1, 1), "muon": (1, 2)}
"""fp32 moments each optimizer of `shoal train --optimizer` holds per parameter: (the hidden layers' matrices and
stacked experts, the rest: embeddings, head, norms). AdamW, LAMB and CowClip (over AdamW) keep momentum and
variance on every parameter; LARS (over momentum SGD) one momentum buffer; Muon one momentum buffer on the
matrices it orthogonalises and AdamW's two on the rest (shoal.optim.builder.build_muon)."""


def optimizer_bytes(adam_bytes: float, moments: int) -> float:
    """Optimizer bytes per parameter holding `moments` fp32 moments, from Adam's (`adam_bytes`, two moments and
    any master copy: state_bytes_per_param)."""
    return adam_bytes - MOMENT_BYTES * (2 - moments)


def vector_params(cfg: ModelConfig, *, blocks: int, tp: int) -> float:
    """Parameters of the norms of `blocks` blocks on one tensor-parallel rank (two of width D each), as
    shoal.planner.costs.Costs.params_per_rank counts them: the 1-D tensors every optimizer's split sends to its
    element-wise rule."""
    return blocks * 2 * cfg.dim / tp


def activation_elements(cfg: ModelConfig, index: int, *, seq_len: int, tp: int, sp: bool, ac: str,
                        fused_attention: bool, policy: RecomputePolicy = SHOAL_SELECTIVE,
                        sp_layout: SequenceParallelLayout = DTENSOR, on_cpu: bool = False,
                        element_bytes: float = 2.0, compiled: bool = False) -> float:
    """Elements block `index` keeps for backward per token on one tensor-parallel rank.

    Counted the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", section 4) count, op by op, for what autograd saves in shoal's blocks
    (tests/test_planner.py checks the count against saved_tensors_hooks):
      - each norm keeps its input and its statistics (RMSNorm the reciprocal RMS and its normalised
        input, before the weight; LayerNorm the mean and reciprocal deviation), and the linear
        after it keeps the norm's output: 3D + 1 per RMSNorm, 2D + 2 per LayerNorm (`norm_elements`);
      - attention keeps q, k and v with k and v already repeated to every query head (grouped-
        query attention repeats them before SDPA), its output (the output projection's input, a
        view of it) and the log-sum-exp per head: 4HE + H; unfused attention adds the softmax
        probabilities, H*T per token;
      - the FFN keeps the up projections' outputs, the activation's output and the down
        projection's input: 4F for SwiGLU, 2F for GELU.
    Tensor parallelism splits heads and FFN columns by tp, not the tokens an MoE layer permutes to its
    experts (each tp rank permutes every token, D wide, and splits the experts' FFN columns); sequence
    parallelism also splits the norms' tensors, and the input of the product after each norm as `sp_layout`
    keeps it (`sp_norm_elements`).
    Full recompute keeps only the block's input (the recomputed block's own tensors are counted once, in
    `transient`). Selective recompute keeps what `policy` keeps (shoal's: `shoal_selective_elements` for a dense
    block), or where the policy leaves it to this count, all but unfused attention's probabilities (Korthikanti
    et al. 2022, section 5).
    At `cfg.dropout` > 0 the dropouts keep more (`dropout_kept_elements`, on a CPU or a GPU: `on_cpu`, of
    activations `element_bytes` each); shoal's selective policy recomputes them.
    A `compiled` block (torch.compile) keeps less without recompute: `compiled_recomputed_elements`."""
    D, width = cfg.dim, compute.ffn_width(cfg, index)  # shared experts at their own width
    moe = cfg.is_moe_layer(index)
    ffns = (cfg.num_prototypes or cfg.top_k) + cfg.num_shared_experts if moe else 1
    norms = 2 * sp_norm_elements(cfg, tp=tp, layout=sp_layout) if sp else 2 * norm_elements(cfg)
    attention = attention_kept_elements(cfg)
    split = attention + (4 * width if cfg.activation == "swiglu" else 2 * width)
    permuted = 2 * ffns * D + router_elements(cfg) if moe else 0  # tokens permuted to their experts, their outputs
    scores = 0 if fused_attention else cfg.num_heads * seq_len
    if ac == "full":
        return D / (tp if sp else 1)
    if ac == "selective":
        kept = policy.kept_elements(cfg, index, tp=tp, sp=sp, fused_attention=fused_attention, on_cpu=on_cpu)
        if kept is not None:
            return kept
    masks, dropped = dropout_kept_elements(cfg, seq_len=seq_len, tp=tp, sp=sp, fused_attention=fused_attention,
                                           on_cpu=on_cpu, element_bytes=element_bytes)
    if ac == "selective":
        scores = dropped = 0
    rerun = compiled_recomputed_elements(cfg, index, tp=tp, sp=sp) if compiled and ac == "none" else 0.0
    return norms + masks + permuted + latent_kept_elements(cfg) + (split + scores + dropped) / tp - rerun


def attention_kept_elements(cfg: ModelConfig) -> float:
    """What attention keeps per token before tp splits its heads: q, k, v and the output (H E each)
    and the kernel's log-sum-exp (H), with qk_norm's per-head norms. Latent attention
    (shoal.models.mla) keeps the concatenated q and k (H C each), wkv_b's output (H (N + V): the
    values the kernel keeps are a view of it), the kernel's output and its copy in (B, T, H V) for wo
    (H V each) and the log-sum-exp (RoPE keeps nothing: its tables are buffers). A kernel that takes
    one head width only (torch's flash kernels) leaves values of another width to SDPA's math path,
    which keeps the scores instead (unfused attention: activation_elements' `scores`)."""
    H = cfg.num_heads
    if cfg.latent_attention:
        C, N, V = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        return H * (2 * C + N + 2 * V) + H
    return 4 * H * cfg.head_dim + H + qk_norm_elements(cfg)


def latent_kept_elements(cfg: ModelConfig) -> float:
    """What latent attention's low-rank path keeps per token on every tensor-parallel rank (it runs
    whole on each, shoal.models.adapter): each latent's down-projection output, its RMSNorm's
    normalised input and output (the up-projection's input) and reciprocal RMS (3 r + 1 for a
    latent of rank r); 0 without latent attention."""
    if not cfg.latent_attention:
        return 0.0
    return sum(3 * r + 1 for r in (cfg.q_lora_rank, cfg.kv_lora_rank) if r)


def compiled_recomputed_elements(cfg: ModelConfig, index: int, *, tp: int, sp: bool) -> float:
    """What a compiled block (shoal.parallel.compile: torch.compile, one graph a block) keeps per token less than
    the same block run op by op, on one tensor-parallel rank: AOTAutograd's min-cut partitioner saves what
    backward needs at the least cost and recomputes cheap pointwise ops from it, here each RMSNorm's normalised
    input before its weight (from the input and the reciprocal RMS it keeps: D a block norm, split by tp under
    sequence parallelism, and a head's width for each of qk_norm's per-head norms) and SwiGLU's silu(gate) (from
    gate: the FFN's width, split by tp). LayerNorm and GELU keep what they keep eager. Recounted on shoal's blocks
    by tests/test_planner_counts.py (the tiny presets, float32, autocast and tp2). Dense blocks without dropout
    only: an MoE block and the dropouts keep their eager count (an upper bound)."""
    if not _partitioned(cfg, index):
        return 0.0
    rms = cfg.norm == "rmsnorm"
    norms = 2 * cfg.dim / (tp if sp else 1) if rms else 0.0
    heads = cfg.head_dim * (cfg.num_heads + cfg.kv_heads) / tp if rms and cfg.qk_norm else 0.0
    gate = compute.ffn_width(cfg, index) / tp if cfg.activation == "swiglu" else 0.0
    return norms + heads + gate


def _partitioned(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index`, compiled, is priced by what the partitioner keeps (`compiled_recomputed_elements`):
    dense blocks without dropout, the ones measured."""
    return not cfg.is_moe_layer(index) and cfg.dropout == 0.0


def dropout_kept_elements(cfg: ModelConfig, *, seq_len: int, tp: int, sp: bool, fused_attention: bool,
                          on_cpu: bool, element_bytes: float) -> tuple[float, float]:
    """What a block's dropouts keep per token beyond `activation_elements`' count without them, in elements of
    `element_bytes`: (on the hidden state, on one tensor-parallel rank; in attention, before tp splits its heads).

    Each of the two dropouts on the hidden state (shoal.models.transformer) keeps
    its mask: on a GPU torch's fused dropout kernel writes a bool (compute.MASK_BYTES); a CPU has no fused kernel
    (aten's dropout takes native_dropout on CUDA only, is_fused_kernel_acceptable), so torch multiplies by a
    noise tensor of the activation's dtype and keeps that. Without sequence parallelism every tensor-parallel
    rank runs them on the whole hidden state. Unfused attention's dropout keeps its mask and the dropped
    probabilities beside the probabilities (Korthikanti et al. 2022, section 4.1: 5 bytes a score in 16 bits).
    A fused GPU kernel keeps its RNG state only. A CPU's SDPA has no fused kernel that drops out, and its math
    path, in float32 whatever the inputs' dtype (16-bit inputs are cast up), keeps the scaled q and k, the
    repeated v, the probabilities, the noise and the dropped probabilities where the fused kernel kept q, k and v
    and a float32 log-sum-exp a head. Recounted: tests/test_planner_counts.py (float32, one process and tp2) and
    tests/test_devices.py (bf16, on the CPU and on a GPU)."""
    if cfg.dropout <= 0.0:
        return 0.0, 0.0
    mask = _mask_elements(on_cpu, element_bytes)
    hidden = 2 * mask * cfg.dim / (tp if sp else 1)
    heads, scores, qkv = cfg.num_heads, cfg.num_heads * seq_len, 3 * cfg.num_heads * cfg.head_dim
    if not fused_attention:
        return hidden, (1 + mask) * scores
    if not on_cpu:
        return hidden, 0.0
    return hidden, 4.0 / element_bytes * (qkv + 3 * scores - heads) - qkv  # float32 bytes, less the fused kernel's


def embedding_dropout_elements(cfg: ModelConfig, *, tp: int, sp: bool, on_cpu: bool, element_bytes: float) -> float:
    """What the dropout after the embedding keeps per token, once a model, on the first pipeline stage: a mask
    (see `dropout_kept_elements`), split by tp under sequence parallelism."""
    if cfg.dropout <= 0.0:
        return 0.0
    return _mask_elements(on_cpu, element_bytes) * cfg.dim / (tp if sp else 1)


def _mask_elements(on_cpu: bool, element_bytes: float) -> float:
    """A dropout mask's elements an element of the activation it drops (`dropout_kept_elements`)."""
    return 1.0 if on_cpu else compute.MASK_BYTES / element_bytes


def autocast_extra_elements(cfg: ModelConfig, index: int, *, ac: str, compiled: bool = False) -> float:
    """What block `index` keeps per token beyond `activation_elements` under torch.autocast (one process in bf16
    or fp16, the engine "autocast"), in 16-bit elements (a float32 tensor counts twice), as the planner prices
    a 16-bit run's activations at 2 bytes. Autocast leaves the residual stream and the norms in float32: a norm
    keeps its input and its statistics in float32 (RMSNorm also its normalised input: 2D + 1 more; LayerNorm
    D + 2); and it casts a float32 tensor afresh for every product that reads it, so each product after a norm
    keeps its own 16-bit copy where 16-bit parameters would share one (q, k and v: 2D more; SwiGLU's up
    projections: D more). The attention kernel's log-sum-exp is float32 too (H more), and so are the per-head
    norms of qk_norm, whose fp32 weights promote their 16-bit inputs. Only without recompute (a recomputed
    block's tensors are rerun, not kept); an MoE layer's experts take their tokens in the 16-bit dtype
    (shoal.moe.experts). A fused RMSNorm kernel (CUDA) keeps less: an upper bound there. Recounted, byte for
    byte: tests/test_planner_counts.py.
    Compiled (`compiled_recomputed_elements`), a dense block keeps every tensor in 16 bits but one float32 copy of
    the hidden state, the float32 log-sum-exp and the norms' float32 statistics (one an RMSNorm, two a LayerNorm,
    one a head for qk_norm): D + H + those, measured as above."""
    if ac != "none":
        return 0.0
    D = cfg.dim
    if compiled and _partitioned(cfg, index):
        stats = 2 * (1 if cfg.norm == "rmsnorm" else 2) + (cfg.num_heads + cfg.kv_heads if cfg.qk_norm else 0)
        return D + cfg.num_heads + stats
    norms = 2 * (2 * D + 1 if cfg.norm == "rmsnorm" else D + 2)
    ffn = D if cfg.activation == "swiglu" and not cfg.is_moe_layer(index) else 0
    return norms + 2 * D + ffn + cfg.num_heads + qk_norm_elements(cfg)


def qk_norm_elements(cfg: ModelConfig) -> float:
    """What Qwen3's RMSNorm over each query and key head (qk_norm) keeps per token: per head its input, its
    normalised input and its reciprocal RMS (tensor parallelism splits them with the heads); 0 without it."""
    return (2 * cfg.head_dim + 1) * (cfg.num_heads + cfg.kv_heads) if cfg.qk_norm else 0


def cast_parameters(cfg: ModelConfig, params: float) -> float:
    """Of a one-process model's `params` dense parameters, those torch.autocast casts to 16 bits for its products:
    all but an untied embedding table, whose lookup casts nothing."""
    return max(0.0, params - (0.0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim))


def router_elements(cfg: ModelConfig) -> float:
    """What an MoE layer's router keeps per token, replicated under tp (shoal.moe.router): its float32 logits and
    probabilities (E each), its top-k weights twice (as chosen, and as the multiplier of the experts' outputs) and
    two per-token statistics (the z-loss's log-sum-exp, the top-k weights' sum), within one element a token of
    what autograd keeps with or without the z-loss and the normalisation."""
    return 2 * cfg.num_experts + 2 * cfg.top_k + 2


def shoal_selective_elements(cfg: ModelConfig, index: int, *, tp: int, sp: bool, fused_attention: bool = True) -> float:
    """Elements a dense block keeps per token on one tensor-parallel rank under shoal's selective recompute
    (shoal.parallel.recompute keeps the outputs of the weight products, of the attention kernel and of the
    tensor-parallel reductions; the norms, RoPE, the activation and the residual adds are recomputed): the
    checkpointed block's input (split under sequence parallelism); q, k and v before RoPE and the grouped heads'
    repeat, and a fused kernel's output and log-sum-exp per head (unfused attention's batched products are rerun),
    split by tp; the up projections' outputs, split by tp; and the two row-parallel products' outputs whole (a
    partial sum under tp), each with its reduction's output under tp (all-reduce: whole; reduce-scatter: split).
    tests/test_planner_counts.py recounts it."""
    D, width = cfg.dim, compute.ffn_width(cfg, index)
    heads = cfg.num_heads * cfg.head_dim
    qkv = heads + 2 * cfg.kv_heads * cfg.head_dim
    whole = 0.0  # latent attention's down-projections' and rotary key's outputs, on every tp rank
    if cfg.latent_attention:  # its up-projections' outputs are its q, k and v
        H = cfg.num_heads
        heads, qkv = H * cfg.v_head_dim, H * (cfg.qk_head_dim + cfg.qk_nope_head_dim + cfg.v_head_dim)
        whole = cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    attention = heads + cfg.num_heads if fused_attention else 0
    up = (2 if cfg.activation == "swiglu" else 1) * width
    reduced = 0.0 if tp == 1 else (D / tp if sp else D)
    return D / (tp if sp else 1) + whole + (qkv + attention + up) / tp + 2 * (D + reduced)


def norm_elements(cfg: ModelConfig) -> float:
    """What a norm and the linear after it keep per token (see activation_elements)."""
    return 3 * cfg.dim + 1 if cfg.norm == "rmsnorm" else 2 * cfg.dim + 2


def sp_norm_elements(cfg: ModelConfig, *, tp: int, layout: SequenceParallelLayout = DTENSOR) -> float:
    """What a norm and the product after it keep per token on one rank under sequence parallelism: the norm's
    own tensors split by tp, and the product's input (the norm's output, D) whole where `layout` keeps the
    gathered input (DTensor's: tests/test_planner_counts.py counts it under tp2 and tp4), else split too."""
    if not layout.keeps_gathered_input:
        return norm_elements(cfg) / tp
    return (norm_elements(cfg) - cfg.dim) / tp + cfg.dim


def head_norm_elements(cfg: ModelConfig, *, tp: int, sp: bool, layout: SequenceParallelLayout = DTENSOR) -> float:
    """What the final norm keeps per token, with the output projection's input."""
    return sp_norm_elements(cfg, tp=tp, layout=layout) if sp else norm_elements(cfg)


LOSS_LOGIT_COPIES = {4: 4.0, 2: 4.0}
"""fp32-sized copies of vocabulary-sharded logits (tokens x vocabulary / tp) at the loss's peak under tensor
parallelism, by the logits' bytes per element, where DTensor's loss_parallel takes torch's cross-entropy: the
log-softmax output it saved, the gradient arriving at it, the gradient it hands to the logits and one more
temporary of that size in its backward (a 16-bit run's logits, half a copy, are by then freed: the runtime keeps
no reference to them). tests/test_planner_counts.py recounts it from live tensors on two ranks (3.94 and 3.97)."""

CONSUMED_LOGIT_COPIES = {4: (1.0, 1.0), 2: (1.5, 2.0)}
"""fp32-sized copies of plain logits at the loss's backward, by the logits' bytes per element, with the
runtime's own cross-entropy (shoal.parallel.loss), which writes the gradient into the fp32 logits it is
handed: (while it works through the blocks of rows, after). fp32 logits are one tensor throughout;
16-bit logits are held (half a copy) beside their fp32 copy that becomes the gradient (one), and then the
16-bit gradient handed back (half). Recounted in tests/test_planner_counts.py."""

LOSS_PIECE_ELEMENTS = 1 << 22
"""shoal.parallel.loss.ROWS_ELEMENTS (a test holds them equal): the logits one block of the runtime's
cross-entropy works on; its backward keeps three fp32 temporaries of a block (the block's log-softmax, the
gradient arriving at it, the gradient it gives) beside the logits."""


SHARDED_LOGIT_COPIES = 3
"""vocab=sharded (shoal/parallel/sharded_vocab.py): the classifier's backward holds the logits' gradient
(written into the logits by the loss), the copy it sends by all-to-all and the one it receives, each (T, V)
in the compute dtype. Counted from live tensors: tests/test_planner_counts.py."""


def logits_bytes(cfg: ModelConfig, tokens: float, *, tp: int, logit_bytes: int = 4) -> float:
    """The last stage's logits at the loss's peak: LOSS_LOGIT_COPIES fp32 copies of the vocabulary-sharded
    logits under tp, else CONSUMED_LOGIT_COPIES of the plain ones (`logit_bytes` per element as the head
    makes them) with, while it works through its blocks, the runtime's cross-entropy's three temporaries."""
    elements = tokens * cfg.vocab_size / tp
    if tp > 1:
        return LOSS_LOGIT_COPIES[2 if logit_bytes <= 2 else 4] * 4.0 * elements
    during, after = CONSUMED_LOGIT_COPIES[2 if logit_bytes <= 2 else 4]
    return max(during * 4.0 * elements + 3 * 4.0 * min(elements, LOSS_PIECE_ELEMENTS), after * 4.0 * elements)


def in_flight(sched: str, *, pp: int, micro: int, vpp: int) -> float:
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of one
    stage's (its layers') activations for one micro-batch.

    GPipe holds all m (Huang et al. 2019). 1F1B holds p (Narayanan et al. 2021, section 2.2.1);
    so does ZB-H1 (Qi et al. 2023, section 3). Interleaved 1F1B with v chunks holds its warm-up
    of 2(p-1) + (v-1)p + 1 chunk-micro-batches, each 1/v of a stage (Narayanan et al. 2021,
    section 2.2.2: a factor 1 + (p-1)/(pv) over 1F1B)."""
    if pp == 1:
        return 1.0
    if sched == "gpipe":
        return float(micro)
    if sched == "interleaved":
        return min(micro * vpp, 2 * (pp - 1) + (vpp - 1) * pp + 1) / vpp
    return float(min(pp, micro))
