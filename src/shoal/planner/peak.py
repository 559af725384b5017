"""The busiest device's peak memory under one resolved plan: the model states, the activations of the
busiest stage, each data engine's transient buffers and the optimizer step's temporaries, as terms that add
up to the step's peak (shoal.planner.memory's pieces put together; estimate() adds the fragmentation margin).
Every term is checked against the live tensors of a dry run: tests/test_dry_run.py and
tests/test_planner_counts.py.
"""

from __future__ import annotations

from typing import Protocol

from shoal import rules
from shoal.models.config import ModelConfig
from shoal.plan import Plan
from shoal.planner import compute, memory

CPU_STEP_BYTES = 29 * 2**20
"""Host memory a CPU process's training step holds beyond its tensors and the baseline, whatever the model: the
code of the kernels it pages in, the Python objects of the model, plan and optimizer, gloo's buffers, the
allocator's own. The median, over dry runs under dp1, dp2, fsdp2, fsdp4, tp2, pp2 and tp4, of a model whose tensors
are negligible, on jemalloc keeping freed pages (shoal's CPU workers' allocator, shoal.infra.host_memory): what
`python -m bench.memory_model --models runtime` measures."""


class MicroBatch(Protocol):
    """What the memory terms need of one micro-batch's costs on a rank (shoal.planner.costs.Costs)."""

    tokens: float
    """Tokens of one micro-batch on this rank."""
    seq_len: int
    bytes: float
    """Bytes of an activation element."""
    fused: bool
    recompute: memory.RecomputePolicy
    sp_layout: memory.SequenceParallelLayout
    on_cpu: bool

    def moe_count(self, lo: int, hi: int) -> int: ...


def fsdp_table_bytes(cfg: ModelConfig, *, tp: int, param_bytes: float, grad_bytes: float,
                     reduce_bytes: float) -> float:
    """An FSDP2 table unit (the embeddings, or the head) at its backward: the table gathered whole, its
    unsharded gradient and the reduce-scatter's input (torch's FSDP2 copies the unsharded gradients into one
    flat buffer of the reduce dtype before reducing, `foreach_reduce`), each a (V, D/tp) table. Counted from
    the live tensors of a dry run: tests/test_planner_counts.py."""
    return cfg.vocab_size * cfg.dim / tp * (param_bytes + grad_bytes + reduce_bytes)


def zero_bucket_bytes(numel: float, *, shards: int, reduce_bytes: float, on_cpu: bool) -> float:
    """What shoal's ZeRO-1/2 engine holds while it reduces one bucket of `numel` gradient elements
    (shoal/parallel/zero.py, _reduce and _complete): the gradients packed rank-major in the reduce dtype, the
    collective's output and the fp32 gradient shard the result lands in. On gloo the output is an all_to_all's,
    every rank's copy of this rank's rows, a whole bucket (zero._ALL_TO_ALL_ON); on NCCL a reduce-scatter's, one
    shard, which at fp32 is the gradient shard itself. Counted from live tensors: tests/test_dry_run.py."""
    packed, shard = numel * reduce_bytes, numel / shards * 4.0
    if on_cpu:
        return 2 * packed + shard
    return packed + (shard if reduce_bytes == 4 else numel / shards * reduce_bytes + shard)


def peak_terms(plan: Plan, cfg: ModelConfig, cost: MicroBatch, kind: str, zero: int, bucket: int, params: float,
            experts: float, micro: int, stages: list[tuple[int, int, bool]], *,
            unsharded_accumulation: bool = False, fp32_gradient_buffer: bool = False,
            trainable: float | None = None,
            quantized: tuple[float, float] = (0.0, 0.0),
            moments: tuple[int, int] = (2, 2)) -> tuple[dict[str, float], float]:
    """The busiest device's memory terms in bytes, and all its gradients' bytes. `unsharded_accumulation` and
    `fp32_gradient_buffer`: the trainer's data engine accumulates FSDP2's gradients unsharded, and holds an fp32
    buffer of the rank's whole gradients beside them, the whole step (shoal.planner.costs.GradientReduction).
    `trainable`: the rank's trainable parameters beside `params` frozen ones (low-rank adapters on a frozen
    base, shoal.models.lora): only they have gradients, optimizer state and gradient buffers; None: every
    parameter trains. `quantized`: (weights, bytes) of the frozen ones stored low-bit and whole on the rank (a
    QLoRA-style base, shoal.models.lora_config.quantized_base_per_rank), priced at those bytes. `moments`: the
    optimizer's fp32 moments per parameter of the hidden layers' matrices (stacked experts and adapters included)
    and of the rest (memory.OPTIMIZER_MOMENTS)."""
    pb, gb, ob = memory.state_bytes_per_param(plan.precision or "fp32")
    pe = pb  # an expert's parameter bytes
    casts = rules.under_autocast(kind, plan.precision or "fp32")
    if casts:  # fp32 parameters (the master weights) and gradients, and the 16-bit casts of the
        # products' weights (every expert's too: shoal.moe.experts), kept from each product's forward to its backward.
        pe, gb, ob = 4.0 + pb, 4.0, 8.0
        pb = 4.0 + pb * (memory.cast_parameters(cfg, params) / params if params else 1.0)
    rb = 4.0 if plan.reduce == "fp32" else 2.0  # bytes of a gradient element as the data axis reduces it
    shards = plan.fsdp if kind in ("zero", "fsdp2") else 1
    # shoal's ZeRO-1 engine holds full gradients only to accumulate them (no_sync): with one micro-batch and no
    # pipeline it reduces each bucket into its shard at once, as ZeRO-2 does (shoal/parallel/zero.py).
    full_grads = kind != "zero" or zero != 1 or micro > 1 or plan.pp > 1
    stage = zero if full_grads else 2
    # One block's parameters: the rank's, less the vocabulary tables it holds (both without pp; under pp the
    # busier stage holds one, the embedding or the head), which are units of their own.
    tables = cfg.vocab_size * cfg.dim / plan.tp * ((1 if cfg.tie_embeddings else 2) if plan.pp == 1 else 1)
    stage_blocks = max(1, cfg.num_layers // plan.pp)
    # The optimizer's state: the hidden matrices' moments and the rest's (tables and norms) may differ (Muon, LARS).
    oh, orest = (memory.optimizer_bytes(ob, m) for m in moments)
    hidden = max(0.0, params - tables - memory.vector_params(cfg, blocks=stage_blocks, tp=plan.tp))
    dense = memory.model_state_bytes(params, shards=shards, stage=stage, param_bytes=pb, grad_bytes=gb,
                                     optim_bytes=orest)
    dense = (*dense[:2], dense[2] + memory.model_state_bytes(hidden, shards=shards, stage=stage, param_bytes=0.0,
                                                             grad_bytes=0.0, optim_bytes=oh - orest)[2])
    frozen = trainable is not None
    share = 1.0 if trainable is None else trainable / params if params else 0.0  # of the parameters, trained
    if trainable is not None:  # the adapters' states, beside the frozen base's parameters
        adapters = memory.model_state_bytes(trainable, shards=shards, stage=stage, param_bytes=pb, grad_bytes=gb,
                                            optim_bytes=oh)
        low_bit = memory.model_state_bytes(quantized[0], shards=shards, stage=stage, param_bytes=pb, grad_bytes=gb,
                                           optim_bytes=ob)[0]
        dense = (dense[0] - low_bit + quantized[1] + adapters[0], adapters[1], adapters[2])
    # Under sharded data the experts are also split over the data ranks outside ep, gathered per
    # layer in forward (shoal/parallel/expert.py): ZeRO-3 over those replicas.
    replicas = plan.data_ranks // plan.ep if plan.fsdp > 1 else 1
    expert = memory.model_state_bytes(experts, shards=replicas, stage=3 if replicas > 1 else 0, param_bytes=pe,
                                      grad_bytes=gb, optim_bytes=oh)
    if frozen:
        expert = (expert[0], 0.0, 0.0)
    tokens = cost.tokens  # of one micro-batch on this rank
    # Accumulating over micro-batches without a data engine, each micro-batch after the first makes
    # its gradient of the embedding table (or the classifier) whole before adding it to the one held
    # (tests/test_planner_counts.py measures it): a table's bytes more, late in the backward, after the
    # loss's logits are freed, so a stage holds the larger of the two, not both.
    accumulates = micro > 1 and kind in ("none", "autocast") and not frozen
    table = cfg.vocab_size * cfg.dim / plan.tp * gb if accumulates else 0.0
    worst: dict[str, float] = {}
    # Under autocast (16 bits without FSDP2) the norms and the residual stream stay fp32 and each product casts
    # its own copy of its input: more than a 16-bit run keeps (memory.autocast_extra_elements).
    def kept(moe: bool) -> float:
        index = compute.block_index(cfg, moe=moe)
        extra = (memory.autocast_extra_elements(cfg, index, ac=plan.ac, compiled=bool(plan.compile))
                 if casts else 0.0)
        return extra + memory.activation_elements(cfg, index, seq_len=cost.seq_len, tp=plan.tp, sp=bool(plan.sp),
                                                  ac=plan.ac, fused_attention=cost.fused, policy=cost.recompute,
                                                  sp_layout=cost.sp_layout, on_cpu=cost.on_cpu,
                                                  element_bytes=cost.bytes, compiled=bool(plan.compile))
    per_block = {moe: kept(moe) for moe in (False, True)}
    # The block being recomputed in backward holds its tensors again: all of them under full recompute (unfused
    # attention's scores, at the run's sequence length, and the dropouts' masks too), under selective recompute
    # what the policy says (shoal's: those it did not keep; its products' outputs come from the forward's).
    # Compiled, the rerun block's backward graph holds its recomputed tensors as eager autograd would save them:
    # the eager count.
    def count(ac: str) -> float:
        return memory.activation_elements(cfg, 0, seq_len=cost.seq_len, tp=plan.tp, sp=bool(plan.sp), ac=ac,
                                          fused_attention=cost.fused, policy=cost.recompute, sp_layout=cost.sp_layout,
                                          on_cpu=cost.on_cpu, element_bytes=cost.bytes)
    recomputed = 0.0
    if plan.ac == "full":
        recomputed = count("none")
    elif plan.ac == "selective":
        recomputed = cost.recompute.rerun_holds(whole=count("none"), kept=count("selective"))
    # The embedding's dropout is outside every block's recompute: its mask is kept whatever `ac` is.
    embedded = memory.embedding_dropout_elements(cfg, tp=plan.tp, sp=bool(plan.sp), on_cpu=cost.on_cpu,
                                                 element_bytes=cost.bytes)
    for lo, hi, head in stages:
        moe = cost.moe_count(lo, hi)
        act = per_block[True] * moe + per_block[False] * (hi - lo - moe) + (embedded if lo == 0 else 0.0)
        held = act * tokens * cost.bytes * memory.in_flight(plan.sched, pp=plan.pp, micro=micro, vpp=plan.vpp)  # type: ignore[arg-type]  # resolved
        held += recomputed * tokens * cost.bytes
        logits = memory.logits_bytes(cfg, tokens, tp=plan.tp, logit_bytes=int(cost.bytes)) if head else 0.0
        if head and plan.vocab == "sharded":  # the classifier's backward: the logits' gradient, both all-to-all buffers
            logits = max(logits, memory.SHARDED_LOGIT_COPIES * tokens * cfg.vocab_size * cost.bytes)
        if head:
            final_norm = memory.head_norm_elements(cfg, tp=plan.tp, sp=bool(plan.sp), layout=cost.sp_layout)
            held += final_norm * tokens * cost.bytes
        accumulated = max(0.0, table - logits)
        if held + logits + accumulated > sum(worst.values()):
            worst = {"activations": held, "logits": logits, "accumulation": accumulated}
    layer = max(0.0, params - tables) / stage_blocks
    transient = 0.0
    if kind == "fsdp2" and zero == 3:
        transient = 2 * bucket * layer * cost.bytes + bucket * layer * 4 * share  # gathered units, one unit's grads
        # The embedding table and the classifier are units of their own (parallel/data.py), each gathered whole:
        # in its backward a table's unit holds three (V, D/tp) tables at once, its gathered weight, its unsharded
        # gradient and the reduce-scatter's input, which outweigh any block's unit once the vocabulary is large.
        if plan.vocab != "sharded":  # sharded tables are never gathered (shoal/parallel/sharded_vocab.py)
            transient = max(transient, fsdp_table_bytes(cfg, tp=plan.tp, param_bytes=pb, grad_bytes=0.0 if frozen
                                                        else gb, reduce_bytes=0.0 if frozen else rb))
        # Accumulating over micro-batches adds nothing in shoal: FSDP2 at ZeRO-3 reduce-scatters every micro-batch's
        # gradients and adds them to the sharded ones (shoal.parallel.data: no_sync leaves the sync on).
        if micro > 1 and unsharded_accumulation:
            transient += params * share * 4  # the unsharded gradients accumulate while the sync waits
    elif kind == "zero":
        # A bucket of blocks is reduced once its blocks' backward is done, their activations freed; the bucket of
        # the rest (the tables, the final norm) at the end of the backward, every activation and the logits freed.
        blocks, rest = (zero_bucket_bytes(n, shards=shards, reduce_bytes=rb, on_cpu=cost.on_cpu)
                        for n in (bucket * layer * share, 0.0 if frozen else tables))
        # Gradients accumulated in full (ZeRO-1 over micro-batches) are priced already: packing frees them.
        held = gb if zero == 1 and full_grads else 0.0
        block = per_block[False] * tokens * cost.bytes  # one block's activations of one micro-batch
        transient = max(0.0, blocks - bucket * (layer * held + block), rest - tables * held - sum(worst.values()))
    elif kind == "ddp":
        transient = params * share * gb  # DDP's bucket copies of the gradients
    # The optimizer step holds the model states and its own temporaries, after the backward's are freed: a
    # stage holds the larger of the two (as with the accumulated table above), so only the excess is a term.
    step = optimizer_step_bytes(cfg, tp=plan.tp, ep=plan.ep, shards=shards if zero >= 1 else 1, on_cpu=cost.on_cpu,
                                orthogonalised=(hidden / (shards if stage >= 1 else 1) + experts) * share
                                if moments[0] < moments[1] else 0.0)
    # The step's peak is the larger of its backward's (activations, logits, transients and the gradients made
    # by then) and its optimizer step's (every gradient and the step's temporaries); each term below is what
    # its phase adds, so that the terms add up to that peak. With one micro-batch and no pipeline the backward
    # starts without gradients (zero_grad(set_to_none=True) dropped them) and makes them as it frees the
    # activations, the classifier's first, while the logits are alive: the backward's peak holds only the
    # classifier's (under tp not even that while loss_parallel's copies are alive: its peak passes before the
    # classifier's backward, which then holds the logits' gradient, one copy, beside its own). Gradient
    # accumulation and pipelines keep the first micro-batch's gradients through the next ones' forwards: all
    # of them count. Against live tensors: tests/test_dry_run.py and tests/test_planner_counts.py
    # (test_fsdp_vocabulary_tables).
    gradients = dense[1] + expert[1]
    during = gradients
    if micro == 1 and plan.pp == 1:
        during = min(gradients, cfg.vocab_size * cfg.dim / plan.tp * dense[1] / params) if params and not frozen \
            else 0.0
        if plan.tp > 1:
            copies = memory.LOSS_LOGIT_COPIES[2 if cost.bytes <= 2 else 4] - 1
            during = max(0.0, during - copies * 4.0 * tokens * cfg.vocab_size / plan.tp)
    backward = sum(worst.values()) + transient + during
    return {"parameters": dense[0] + expert[0], "gradients": during + max(0.0, gradients - backward),
            "fp32_gradients": 4.0 * (params * share + (0.0 if frozen else experts)) if fp32_gradient_buffer else 0.0,
            "optimizer": dense[2] + expert[2], **worst, "transient": transient,
            "optimizer_step": max(0.0, gradients + step - max(backward, gradients))}, gradients


MUON_STEP_BYTES = 10.0
"""Bytes per orthogonalised parameter a Muon step holds beside the model states (shoal.optim.muon.Muon.step),
each matrix whole on its rank: the new momentum and the Nesterov update of every matrix (fp32, 4 + 4), made
before the first Newton-Schulz so that the owners' gathers go in one batch, and every matrix's bfloat16 result
(2) until the weights take them."""

MUON_OWNER_STEP_BYTES = 16.0
"""The same per parameter of a local shard, the matrices split over ranks (shoal.optim.orthogonalize, the owner
design), at the results' all-to-all, its peak: MUON_STEP_BYTES' fp32 pair (8), and in bfloat16 (2 each) the
update's cast, the results' slices for every holder (a whole matrix for every W slices, on average one element
per parameter) and their flat send buffer, and what comes back."""

MUON_NEWTON_SCHULZ_BYTES = 8.0
"""Bytes per element of the largest whole matrix that Newton-Schulz's temporaries hold (bfloat16 copies of the
iterate, its Gram matrix and the products: torch.optim._muon._zeropower_via_newtonschulz)."""


def optimizer_step_bytes(cfg: ModelConfig, *, tp: int, ep: int, shards: int, on_cpu: bool,
                         orthogonalised: float = 0.0) -> float:
    """The temporaries of an optimizer step beside the model states. AdamW's: none. shoal takes torch's fused
    AdamW on GPUs and CPUs alike (shoal.optim.builder.adamw_kernel), whose kernel updates each tensor in place.
    Muon's (`orthogonalised`: the parameters it orthogonalises on this rank, local shards): MUON_STEP_BYTES per
    parameter (MUON_OWNER_STEP_BYTES where fsdp or tp split the matrices) and MUON_NEWTON_SCHULZ_BYTES per element
    of the largest whole hidden matrix. Measured: tests/test_planner_counts.py, tests/test_dry_run.py."""
    del ep, on_cpu
    if not orthogonalised:
        return 0.0
    largest = cfg.dim * max(cfg.dim, cfg.ffn_dim)  # a block's projections: (D, D) attention, (D, F) feed-forward
    per_param = MUON_OWNER_STEP_BYTES if shards > 1 or tp > 1 else MUON_STEP_BYTES
    return per_param * orthogonalised + MUON_NEWTON_SCHULZ_BYTES * largest
