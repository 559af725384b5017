"""One plan's per-rank costs of a micro-batch: the terms shoal.planner.estimate adds up into a step.

`Costs` prices what one rank does for one micro-batch (compute, the tensor-, context- and
expert-parallel collectives, the pipeline's point-to-points, the host's dispatch), the step's own
small collectives, and the data axes' gradient and parameter traffic with the part of it that
hides behind compute (data_schedule, overlap_exposed). The formulas and their sources are listed
in shoal.planner.estimate's docstring and named beside each term here; estimate keeps what is
priced once a step (the pipeline bubble, the optimizer, memory) and the result. estimate imports
this module, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal import rules
from shoal.models.config import ModelConfig
from shoal.models.lora_config import ROW_PARALLEL, LoRAConfig, adapted_matrices
from shoal.plan import Plan
from shoal.planner import compute, memory
from shoal.planner.comm import Network
from shoal.planner.hardware import Cluster
from shoal.rules import EngineChoice

OPS_PER_BLOCK = {False: 42, True: 13}
"""Host ops of one dense block's forward (each with its backward, the unit calibration times),
eager and compiled, on a CPU, the one device whose host time the estimate charges: every call
into the dispatcher, views at half (the norms, attention with RoPE and grouped-query heads, the
FFN, the residual adds and dropouts); compiled, the graph's fused kernels and the matmul and
attention kernels it calls. Counted by shoal.calibration.counts.block_ops on the tiny preset;
tests/test_planner_counts.py recounts them."""
HEAD_OPS = 10
"""Host ops of the embedding, final norm, head and loss, forward with backward, counted as OPS_PER_BLOCK is."""
DTENSOR_DISPATCHES = {"block": 144, "head": 56}
"""DTensor dispatches of one block's forward and backward under tensor parallelism, and of the
vocabulary-parallel embedding, head and loss: shoal.calibration.counts.dtensor_dispatches on the tiny
preset at tp2, the block's from 2 and 4 layers; tests/test_planner_counts.py recounts them. Without
sequence parallelism a block runs as many (its norms' DTensor ops replace the all-reduces'
wrapping) and the head slightly fewer; these serve both."""
DTENSOR_DISPATCHES_PER_OP = 25 / 17
"""What the calibration's DTensor chain (measure._measure_dtensor_dispatch, whose figure is per op of
the chain, its backward included) runs per op: 25 dispatches for its 16 ops and the final sum
(shoal.calibration.counts.dtensor_dispatches_per_chain_op; tests/test_planner_counts.py recounts it)."""
RING_OPS_PER_HOP = 34.25
"""Host ops of one block's ring attention per ring step (context parallelism): one fused-kernel call per
held block, the log-sum-exp merge and the exchange, forward and hand-written backward
(shoal.parallel.context), counted as OPS_PER_BLOCK is by shoal.calibration.counts.ring_ops_per_hop at
cp2, the smallest ring; tests/test_planner_counts.py recounts it."""
HOST_FORWARD_SHARE = 0.4
"""The forward's share of the host's work in an eager forward and backward (the rest is backward: autograd's
engine runs each forward op's gradient ops), by which a GPU step's host time is split between the phases it is
compared with the device's in (shoal.planner.estimate). Measured as bench/gpu_check/calibrate_cuda.measure_host
times it (a deep tiny model, host-bound on any device); docs/measurements.md records the figures."""
STEP_HOST_OPS = 10
"""Host ops a GPU step runs for the gradient norm, clipping and optimizer, whatever the number of parameters: the
norm over all gradients (torch's foreach norm, the stack of the per-tensor norms, their norm), clipping (the
coefficient, its clamp, one foreach multiply), fused AdamW (the step counters' foreach add and the one fused
kernel) and the loss kept for the metrics (shoal.train.step, shoal.optim.builder: fused AdamW on GPUs)."""
OVERLAP_SLOWDOWN = 0.189
"""How much longer a GPU's compute takes while a collective runs beside it (NCCL's kernels hold SMs and
memory bandwidth): the mean slowdown measured over GPT and Llama layers on A100 and H100 in Tatikonda
et al. 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning"
(arXiv 2507.03114, abstract: 18.9% on average, 40.0% at most). Charged on the communication time hidden."""


@dataclass(frozen=True, kw_only=True)
class GradientReduction:
    """What the data engine of the trainer whose step is priced reduces and gathers, with which collective and when,
    and what it holds for it. The defaults are the engine shoal's runtime picks for the plan
    (shoal.rules.choose_engine); Costs.data_sync and shoal.planner.peak read the rest."""

    overlaps: bool = True
    """Each collective hides behind the pass that issues it (`data_schedule`); False: all of them run once a step,
    after the last micro-batch's backward, beside no compute."""
    reduces_whole: bool = False
    """Sharded gradients are all-reduced whole over the shards instead of reduce-scattered."""
    accumulation_bytes: float = 0.0
    """Bytes per parameter each micro-batch moves on the compute stream adding its gradients into an fp32 buffer
    (the traffic term "fp32_accumulation")."""
    reduction_copy_bytes: float = 0.0
    """Bytes per parameter copied on the compute stream around the step's reduction, once a step (in
    "fp32_accumulation")."""
    fp32_buffer: bool = False
    """An fp32 buffer of the rank's whole gradients, unsharded, held beside the gradients the whole step (the memory
    term "fp32_gradients": 4 bytes a parameter)."""
    unsharded_accumulation: bool = False
    """FSDP2 at ZeRO-3 accumulates unsharded gradients across micro-batches, its sync turned off for every backward
    but the last; shoal's own leaves the sync on, each micro-batch's gradients reduce-scattered into the sharded
    ones (shoal.parallel.data)."""

    def engine(self, plan: Plan, choice: EngineChoice) -> EngineChoice:
        """The engine whose traffic is priced, given shoal's choice for `plan` (ValueError where this trainer's
        engine does not run the plan)."""
        return choice


SHOAL_GRADIENTS = GradientReduction()


def matmul_dtype(plan: Plan, cluster: Cluster, *, tf32: bool = False) -> str:
    """The matmul rate's key: the plan's precision, fp16's for bf16 on a device without it, TF32's for fp32 GEMMs
    with `tf32` on a GPU that has it."""
    rates = cluster.device.peak_flops
    if plan.precision == "fp32" and tf32 and cluster.device_type == "cuda" and "tf32" in rates:
        return "tf32"
    return plan.precision if plan.precision in rates else "fp16"


class Costs:
    """Per-rank costs of one micro-batch under one plan (the pieces `estimate` adds up)."""

    def __init__(self, plan: Plan, cfg: ModelConfig, cluster: Cluster, net: Network, *, tokens: float,
                 seq_len: int, fused: bool, recompute: memory.RecomputePolicy = memory.SHOAL_SELECTIVE,
                 sp_layout: memory.SequenceParallelLayout = memory.DTENSOR, tf32: bool = False,
                 fused_qkv: bool = False, pipe_scatter: bool = False, lora: LoRAConfig | None = None) -> None:
        self.fused, self.recompute, self.sp_layout, self.pipe_scatter = fused, recompute, sp_layout, pipe_scatter
        self.lora = lora
        """Low-rank adapters on a frozen base: the weights' backward is their input's gradient alone, and the
        adapters' products are priced apart (compute.step_weight_flops)."""
        self.plan, self.cfg, self.net, self.tokens, self.seq_len = plan, cfg, net, tokens, seq_len
        self.rate = cluster.device.flops(matmul_dtype(plan, cluster, tf32=tf32))
        # fp8: the dense blocks' linear layers at the float8 rate; the head, attention's products, MoE blocks: bf16.
        self.block_rate = (cluster.device.fp8_flops(plan.fp8) if plan.fp8 else None) or self.rate
        # unfused attention runs QK^T and AV as batched GEMMs, at the matmul rate; a fused kernel at its published
        # rate for the model's head dimension and each kernel's sequence (a cp chunk; the ring's chunk pairs mostly
        # unmasked), forward and backward apart (hardware.DeviceSpec.attention_rates).
        forward_rate, backward_rate = (cluster.device.attention_rates(
            matmul_dtype(plan, cluster), head_dim=cfg.qk_head_dim, seq_len=seq_len / plan.cp, causal=plan.cp == 1)
            if fused else (self.rate, self.rate))
        self.attention_rate = forward_rate
        self.attention_bwd_time = forward_rate / backward_rate  # a backward FLOP's time over a forward FLOP's
        # A GPU's fused kernel recomputes the scores in backward (the calibrated CPU profile times its own kernel).
        self.attention_bwd = compute.attention_backward_multiplier(fused_kernel=fused and cluster.device_type == "cuda")
        self.mem_bw = cluster.device.memory_bw
        self.device = cluster.device
        self.bytes = 4.0 if plan.precision == "fp32" else 2.0
        on_cpu = self.on_cpu = cluster.device_type == "cpu"
        # Collectives on a CPU share its cores with compute (gloo's threads): little of them hides.
        self.overlap = 0.0 if on_cpu else 1.0
        # A CPU's cores run the ops and their arithmetic, so its host time adds to the compute (op_overhead); a GPU's
        # host queues kernels ahead of the device, so its host time (host_op) bounds each phase from below instead
        # (shoal.planner.estimate takes the larger of the two).
        self.host_op, self.host_dtensor = cluster.device.op_overhead, cluster.device.dtensor_overhead
        self.op_overhead = self.host_op if on_cpu else 0.0
        self.dtensor_overhead = self.host_dtensor if on_cpu else 0.0
        self.stride = {"tp": 1, "cp": plan.tp, "fsdp": plan.tp * plan.cp, "dp": plan.tp * plan.cp * plan.fsdp,
                       "pp": plan.tp * plan.cp * plan.fsdp * (plan.dp or 1), "ep": plan.tp}
        # Small products run below the large-GEMM rate (hardware.DeviceSpec.gemm_factor), and on a GPU skinny ones
        # at the pace of its memory (_product_time; a CPU's calibrated rate holds its caches' effects): multipliers.
        ridge = 0.0 if on_cpu else self.rate * self.bytes / self.mem_bw
        self.mm_scale = {moe: _gemm_scale(cluster.device, cfg, tokens, plan.tp, moe=moe, fused_qkv=fused_qkv,
                                          ridge=ridge) for moe in (False, True)}
        self.head_scale = _training_gemm_time(cluster.device, tokens, cfg.vocab_size / plan.tp, cfg.dim, ridge=ridge)
        self.work = {moe: compute.block_work(cfg, compute.block_index(cfg, moe=moe), seq_len=seq_len,
                                             causal_skip=fused, fused_attention=fused, compiled=bool(plan.compile),
                                             element_bytes=self.bytes)
                     for moe in (False, True)}
        # Seconds per token of one block's adapters (forward; a tp rank's), each product held to its memory floor:
        # rank-r products are skinny (_training_gemm_time).
        self.adapter_time = {moe: _adapter_time(cluster.device, cfg, lora, tokens, plan.tp, moe=moe, ridge=ridge)
                             / self.rate if lora is not None else 0.0 for moe in (False, True)}
        # The share of a block's weight-product work selective recompute reruns (none under shoal's policy).
        self.selective_share = {moe: (recompute.rerun_matmul(cfg, moe=moe) / self.work[moe].matmul
                                      if plan.ac == "selective" else 0.0)
                                for moe in (False, True)}

    def head_in_blocks(self) -> float:
        dense = self.work[False]
        return compute.head_flops(self.cfg) / (dense.matmul + dense.attention)

    def moe_count(self, lo: int, hi: int) -> int:
        """MoE blocks among lo..hi-1 (ModelConfig.is_moe_layer)."""
        return sum(self.cfg.is_moe_layer(i) for i in range(lo, hi))

    def stage(self, lo: int, hi: int, *, head: bool) -> tuple[float, float, dict[str, float]]:
        """(forward, backward, terms per micro-batch) of blocks lo..hi-1 (and the head)."""
        p, T, tp = self.plan, self.tokens, self.plan.tp
        assert p.vpp is not None, "estimates are of resolved plans"
        moe = self.moe_count(lo, hi)
        blocks = [(self.work[True], moe), (self.work[False], hi - lo - moe)]
        mm_moe = self.mm_scale[True] * blocks[0][0].matmul * moe * T / tp / self.rate
        mm_dense = self.mm_scale[False] * blocks[1][0].matmul * (hi - lo - moe) * T / tp / self.block_rate
        mm = mm_moe + mm_dense
        selective_mm = self.selective_share[True] * mm_moe + self.selective_share[False] * mm_dense
        attn = sum(w.attention * n for w, n in blocks) * T / tp / self.attention_rate
        element = T * self.bytes / tp / self.mem_bw  # seconds of one element a token
        whole = tp - 1 if tp > 1 and not p.sp else 0  # the hidden state's work, replicated on every rank
        elem = sum((w.elementwise + w.dropout + whole * w.hidden) * n for w, n in blocks) * element
        elem_bwd = sum((2 * w.elementwise + w.dropout_backward + whole * w.hidden_backward) * n
                       for w, n in blocks) * element
        block_elem = elem
        if head:
            mm += self.head_scale * compute.head_flops(self.cfg) * T / tp / self.rate
            logits = 4 * T * self.cfg.vocab_size * 4 / tp / self.mem_bw  # logits: write, softmax, grad
            elem, elem_bwd = elem + logits, elem_bwd + 2 * logits
        if p.ac == "selective":  # the blocks' work, not the head's
            recompute = self.recompute.rerun(matmul=selective_mm, attention=attn, elementwise=block_elem,
                                             scores=sum(w.scores * n for w, n in blocks) * element,
                                             fused_attention=self.fused)
        else:
            recompute = compute.recomputed(p.ac, matmul=mm, attention=attn, elementwise=elem,
                                           fused_attention=self.fused)
        if self.on_cpu and p.ac == "selective":  # the calibrated CPU model keeps the accounting it was checked with
            recompute = attn
        host = self.stage_host(lo, hi, head=head) if self.on_cpu else 0.0
        n = hi - lo
        act = T * self.cfg.dim * self.bytes
        sp = tp > 1 and p.sp
        gather, scatter = self._sp_collectives(act) if sp else (0.0, 0.0)  # priced only where they run
        if sp:
            tp_fwd = 2 * (gather + scatter)
        else:
            tp_fwd = 2 * self.net.time("all_reduce", tp, act, stride=1)
        tp_comm = n * tp_fwd * (3 if p.ac == "full" else 2)  # the recompute repeats the forward's
        if sp and p.ac == "selective" and not self.on_cpu:  # reductions kept, not all-gathers: 2 rerun
            tp_comm += n * 2 * gather
        if tp > 1 and head:  # vocabulary-parallel embedding and loss: ~2 collectives each way, small
            tp_comm += 4 * self.net.time("all_reduce", tp, T * 4.0, stride=1)
        cp_comm = n * self._ring(attn / max(n, 1))
        ranks = compute.expert_ranks_per_token(self.cfg, p.ep)  # each token once per rank holding its choices
        ep_comm = (moe * 4 * self.net.time("all_to_all", p.ep, ranks * act, stride=self.stride["ep"])
                   if p.ep > 1 else 0.0)
        p2p = 0.0
        if p.pp > 1:  # a sequence-parallel activation is a 1/tp shard; a scattered one is gathered on arrival
            scattered = self.pipe_scatter and tp > 1 and not sp
            p2p = p.vpp * (self.net.time("send_recv", 2, act / (tp if sp or scattered else 1),
                                         stride=self.stride["pp"])
                           + (self.net.time("all_gather", tp, act, stride=1) if scattered else 0.0))
        attention_bwd = self.attention_bwd * self.attention_bwd_time * attn
        adapters = (self.adapter_time[True] * moe + self.adapter_time[False] * (hi - lo - moe)) * T
        if p.ac == "full":
            recompute += adapters
        weight_passes = 3 if self.lora is None else 2  # a frozen weight: no weight gradient
        terms = {"compute_matmul": weight_passes * mm, **({"compute_adapters": 3 * adapters} if self.lora else {}),
                 "compute_attention": attn + attention_bwd,
                 "compute_elementwise": elem + elem_bwd,
                 "recompute": recompute, "tp_comm": tp_comm, "cp_comm_exposed": cp_comm, "ep_comm": ep_comm,
                 "pp_p2p": 2 * p2p, "host_overhead": host}
        fwd = mm + adapters + attn + elem + n * tp_fwd + cp_comm / 3 + ep_comm / 2 + p2p + host / 3
        return fwd, sum(terms.values()) - fwd, terms

    def stage_host(self, lo: int, hi: int, *, head: bool) -> float:
        """Host seconds of one micro-batch's forward and backward of blocks lo..hi-1 (and the head): its ops
        (OPS_PER_BLOCK eager, or the compiled block's kernel calls; twice the blocks' under full recompute; the ring's
        per hop) at the device's seconds per op, and under tensor parallelism its DTensor dispatches at theirs."""
        p = self.plan
        ops: float = ((hi - lo) * OPS_PER_BLOCK[bool(p.compile)] * (2 if p.ac == "full" else 1)
                      + (HEAD_OPS if head else 0))
        if p.cp > 1:
            ops += (hi - lo) * RING_OPS_PER_HOP * p.cp if p.cp_mode == "ring" else 0
        host = ops * self.host_op
        if p.tp > 1:
            dispatches = (hi - lo) * DTENSOR_DISPATCHES["block"] + (DTENSOR_DISPATCHES["head"] if head else 0)
            host += dispatches / DTENSOR_DISPATCHES_PER_OP * self.host_dtensor
        return host

    def _sp_collectives(self, act: float) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of one sequence-parallel collective of an activation of `act` bytes
        (gathered size) under tp > 1 with sequence parallelism, with the copies DTensor makes around it
        (`sp_layout.relayout_copies`). Its residual stream is (batch, sequence, dim), sharded on dim 1, and NCCL
        gathers and scatters on dim 0, so torch's functional collectives (torch/distributed/_functional_collectives.py)
        re-lay each one out: all_gather_tensor's result is chunked and concatenated along dim 1 (_maybe_view_chunk_cat:
        a view only when the micro-batch holds one sequence), reduce_scatter_tensor's input chunked along dim 1 and
        concatenated along dim 0 (_chunk_or_narrow_cat), each a read and a write of the whole activation on the
        compute stream. A (sequence, batch, dim) stream gathers on dim 0 and copies nothing."""
        tp = self.plan.tp
        gather = self.net.time("all_gather", tp, act, stride=1)
        scatter = self.net.time("reduce_scatter", tp, act, stride=1)
        if self.sp_layout.relayout_copies:
            copy = 2 * act / self.mem_bw
            sequences = self.tokens * self.plan.cp / self.seq_len
            gather += copy if sequences > 1 else 0.0
            scatter += copy
        return gather, scatter

    def _ring(self, attn_fwd: float) -> float:
        """Exposed ring time of one block (forward + backward) given its attention's forward time.
        Forward passes K and V on cp-1 times; backward (in fp32) passes them cp-1 times more and the
        dK, dV accumulator cp times (shoal.parallel.context). Each hop hides behind one chunk's
        attention, 1/cp of the block's."""
        cp = self.plan.cp
        if cp == 1:
            return 0.0
        _, k, v = compute.qkv_widths(self.cfg)
        if self.cfg.latent_attention:  # keys and values of two widths travel padded to the wider (ring_attention)
            k = v = max(k, v)
        kv = self.tokens * (k + v) / self.plan.tp
        hop = self.net.time("ring", cp, kv * self.bytes, stride=self.stride["cp"])
        hop_fp32 = self.net.time("ring", cp, kv * 4, stride=self.stride["cp"])
        hidden = self.overlap * attn_fwd / cp
        return (cp - 1) * max(0.0, hop - hidden) + (2 * cp - 1) * max(0.0, hop_fp32 - hidden)

    def step_sync(self, kind: str) -> float:
        """The small collectives of every step, each a latency (shoal.train): the trainer's agreement
        on stop signals (the world), the loss averaged over each data and cp axis, the gradient
        norm's reduction over each axis that shards the gradients (DTensor reduces one mesh
        dimension at a time) and over the pipeline's stages, and under tensor parallelism without
        FSDP the norm weights' partial gradients (shoal.parallel.tensor.reduce_partial_grads)."""
        p = self.plan
        axes = [("dp", p.dp or 1), ("fsdp", p.fsdp), ("cp", p.cp)]  # the loss's mean
        axes += [("fsdp", p.fsdp)] if kind in ("zero", "fsdp2") else []  # the norm's reductions
        axes += [("tp", p.tp), ("pp", p.pp)]
        axes += [("tp", p.tp)] if kind == "none" else []  # the partial gradients (FSDP2 reduces its own)
        calls = [(n, self.stride[axis]) for axis, n in axes if n > 1]
        calls += [(p.world_size, 1)] if p.world_size > 1 else []  # the stop-signal agreement
        return sum(self.net.time("all_reduce", n, 8.0, stride=stride) for n, stride in calls)

    def params_per_rank(self, blocks: int, *, head: bool, embedding: bool = False) -> tuple[float, float]:
        """(dense parameters, expert parameters) one rank of a stage of `blocks` blocks holds; under pp
        the stage holds the embedding table when `embedding` and the head's when `head`."""
        cfg, p = self.cfg, self.plan
        D = cfg.dim
        attn = compute.attention_matmul_flops(cfg) / 2
        mlp = compute.mlp_matmul_flops(cfg) / 2
        moe = round(blocks * self.moe_count(0, cfg.num_layers) / cfg.num_layers)
        moe_sets = 1 if cfg.share_moe and moe else moe
        shared = cfg.num_shared_experts * compute.mlp_matmul_flops(cfg, compute.shared_width(cfg)) / 2
        shared += D if cfg.shared_gate and cfg.num_shared_experts else 0  # at their own width, and their gate
        dense = (blocks * (attn + 2 * D) + (blocks - moe) * mlp + moe * (D * cfg.num_experts + shared))
        embed = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2)
        # Under pp the last stage holds the head's table: its own, or a copy of a tied embedding's.
        dense += embed if p.pp == 1 else cfg.vocab_size * D * (int(head) + int(embedding))
        experts = moe_sets * cfg.num_experts * compute.mlp_matmul_flops(cfg, cfg.ffn_dim) / 2 / p.ep  # ffn_dim wide
        return dense / p.tp, experts / p.tp

    def muon_step(self, blocks: int, *, shards: int) -> dict[str, float]:
        """Seconds of one Muon step's Newton-Schulz iterations and of the owners' exchange on a rank of a stage of
        `blocks` blocks (shoal.optim.orthogonalize, the owner design), beside the update's elementwise work, which
        estimate prices as AdamW's. A matrix split over W = `shards` x tp holders is orthogonalised whole by one of
        them, the matrices dealt round-robin: each rank runs 1/W of the iterations (compute.newton_schulz_products, in
        bfloat16, each product at its shape's rate) and sends its slices to the owners and takes its slices of the
        results back: one all-to-all each way of its local shards in bfloat16. A routed expert's matrices live on
        their ep rank whole except for tp's split. Replicas (dp, cp, pp's other stages' ranks) orthogonalise their
        own copies: no exchange, none of the work shared."""
        cfg, p = self.cfg, self.plan
        moe = round(blocks * self.moe_count(0, cfg.num_layers) / cfg.num_layers)
        moe_sets = 1 if cfg.share_moe and moe else moe
        dense_index, moe_index = (compute.block_index(cfg, moe=m) for m in (False, True))
        holders = {False: shards * p.tp, True: p.tp}  # a dense matrix's holders; a routed expert's
        flops = {False: 0.0, True: 0.0}
        elements = {False: 0.0, True: 0.0}
        for index, copies in ((dense_index, blocks - moe), (moe_index, moe_sets)):
            if not copies:
                continue
            for rows, cols, count, routed in compute.hidden_matrices(cfg, index):
                n = count * copies / (p.ep if routed else 1)
                products = compute.newton_schulz_products(rows, cols)  # each at its shape's rate
                flops[routed] += n * compute.NEWTON_SCHULZ_STEPS * sum(
                    2.0 * m * nn * k / self.device.gemm_factor(m, nn, k) for m, nn, k in products)
                elements[routed] += n * rows * cols
        # A calibrated CPU profile keeps no bf16 rate below fp32's quarter (shoal.calibration.measure): at most that.
        has_16 = any(d in self.device.peak_flops for d in ("bf16", "fp16"))
        rate = self.device.flops("bf16") if has_16 else self.device.flops("fp32") / 4
        newton_schulz = sum(flops[r] / holders[r] for r in flops) / rate
        stride = 1 if p.tp > 1 else self.stride["fsdp"]
        exchange = sum(2 * self.net.time("all_to_all", holders[r], 2.0 * elements[r] / holders[r], stride=stride)
                       for r in elements if holders[r] > 1)
        return {"muon_newton_schulz": newton_schulz, "muon_exchange": exchange}

    def vocab_traffic(self, micro: int) -> dict[str, float]:
        """vocab=sharded, one step's seconds of moving the tables' activations instead of the tables: per
        micro-batch the token ids and the (N*T, D) embedding rows (reduce-scattered forward, gathered
        backward), the hidden states (gathered forward, reduce-scattered backward), and the (T, V) logits
        by all-to-all each way (shoal/parallel/sharded_vocab.py), over the ranks the tables are split on
        (fsdp x cp, consecutive in the mesh's rank order)."""
        cfg, n, stride = self.cfg, self.plan.fsdp * self.plan.cp, self.stride["cp"]
        rows = n * self.tokens * cfg.dim * self.bytes  # every such rank's tokens' rows
        return {"vocab_rows": micro * 2 * (self.net.time("reduce_scatter", n, rows, stride=stride)
                                           + self.net.time("all_gather", n, rows, stride=stride)),
                "vocab_logits": micro * 2 * self.net.time("all_to_all", n, self.tokens * cfg.vocab_size * self.bytes,
                                                          stride=stride)}

    def data_sync(self, kind: str, zero: int, params: float, experts: float, *, micro: int, units: int,
                  fwd: float, bwd: float, gradients: GradientReduction = SHOAL_GRADIENTS,
                  trainable: float | None = None) -> tuple[float, dict[str, float]]:
        """(exposed seconds, {term: seconds}) of the data axes' gradient and parameter traffic, given one
        micro-batch's forward and backward seconds on this rank: each collective hides only behind the
        pass it is issued in (`data_schedule`), all but its last unit's piece (`overlap_exposed`). `gradients`:
        what the trainer's engine reduces with which collective, and what it moves on the compute stream for it
        (all of that waited for at once). `trainable`: of `params` and `experts`, the parameters that have
        gradients (low-rank adapters on a frozen base); None: all. Only their gradients are reduced and accumulated;
        the frozen ones are gathered as any."""
        p = self.plan
        # Gradient bytes per parameter, spread over every parameter: a frozen one has none to reduce.
        share = 1.0 if trainable is None else min(1.0, trainable / max(params + experts, 1.0))
        grad = (4.0 if p.reduce == "fp32" else 2.0) * share
        # Context-parallel ranks see other tokens with the same weights: they join the gradient reduction.
        dp, fsdp = (p.dp or 1) * p.cp, p.fsdp
        calls = units + 1  # one collective per bucket or unit, plus the rest of the model
        span = ((p.dp or 1) - 1) * self.stride["dp"] + (p.cp - 1) * self.stride["cp"]
        dp_stride = max(1, span // max(1, dp - 1))  # the dp x cp group's spread in rank order

        def net(kind: str, n: int, nbytes: float, *, stride: int) -> float:
            return calls * self.net.time(kind, n, nbytes / calls, stride=stride)

        terms: dict[str, float] = {}
        if kind == "ddp" or (kind == "fsdp2" and fsdp == 1):
            terms["dp_allreduce"] = net("all_reduce", dp, params * grad, stride=dp_stride)
            if experts and p.ep < p.data_ranks:  # each expert's replicas: the data ranks outside its ep group
                terms["expert_allreduce"] = net("all_reduce", p.data_ranks // p.ep, experts * grad,
                                                stride=p.ep * p.tp)
        elif kind in ("zero", "fsdp2"):
            tables = 0.0
            if p.vocab == "sharded":  # the tables stay sharded; their rows' activations travel (sharded_vocab.py)
                tables = self.cfg.vocab_size * self.cfg.dim * (1.0 if self.cfg.tie_embeddings else 2.0)
                params -= tables
                terms.update(self.vocab_traffic(micro))
            # ZeRO-2 and -3 reduce every micro-batch's gradients, ZeRO-1 only the last's
            # (shoal.parallel.data); ZeRO-3 gathers each unit in forward and again in backward,
            # FSDP2 at zero=1/2 once per micro-batch, shoal's ZeRO-1/2 engine once per step.
            reduces = 1 if zero == 1 else micro
            gathers = {3: 2 * micro}.get(zero, micro if kind == "fsdp2" else 1)
            terms["fsdp_reduce_scatter"] = reduces * net("all_reduce" if gradients.reduces_whole else "reduce_scatter",
                                                         fsdp, params * grad, stride=self.stride["fsdp"])
            terms["fsdp_all_gather"] = gathers * net("all_gather", fsdp, params * self.bytes,
                                                     stride=self.stride["fsdp"])
            if dp > 1:  # every shard's gradient, the tables' too (averaged over dp as FSDP2 averages its own)
                terms["dp_allreduce"] = reduces * net("all_reduce", dp, (params + tables) * grad / fsdp,
                                                      stride=dp_stride)
            if experts and p.ep < p.data_ranks:
                terms["expert_allreduce"] = net("all_reduce", p.data_ranks // p.ep, experts * grad,
                                                stride=p.ep * p.tp)  # the replicas outside each ep group
            if kind == "fsdp2":
                terms["fsdp_copies"] = fsdp2_copy_bytes(params, param_bytes=self.bytes, grad_bytes=self.bytes,
                                                        reduce_bytes=grad, gathers=gathers,
                                                        reduces=reduces) / self.mem_bw
        accumulated = micro * gradients.accumulation_bytes + gradients.reduction_copy_bytes
        if accumulated:
            terms["fp32_accumulation"] = accumulated * (params + experts) * share / self.mem_bw
        # Under autocast each micro-batch casts every weight for its products and each gradient back,
        if rules.under_autocast(kind, p.precision or "fp32"):
            recast = 4 + 2 if p.ac != "none" else 0  # and a recomputed block its weights once more
            terms["autocast_casts"] = micro * (params + experts) * (AUTOCAST_CAST_BYTES + recast) / self.mem_bw
        # Unsharded FSDP2 is priced as DDP is: one reduction, in the last micro-batch's backward (the traffic
        # above counts it once, as a pipeline's last backward or no_sync would run it).
        schedule = data_schedule("ddp" if kind == "fsdp2" and fsdp == 1 else kind, zero, micro=micro)
        passes = {"forward": 0.0, "backward": 0.0}
        # Waited for at once: the tables' activations, and FSDP2's copies and autocast's casts on the compute stream.
        blocking = sum(seconds for term, seconds in terms.items()
                       if term.startswith("vocab_") or term in ("fsdp_copies", "autocast_casts", "fp32_accumulation"))
        for term, seconds in terms.items():
            for phase, share in schedule.get(term, {}).items():
                passes[phase] += share * seconds
        windows = {"forward": schedule["forward_passes"] * fwd, "backward": schedule["backward_passes"] * bwd}
        exposed = hidden = 0.0
        for phase, seconds in passes.items():
            shown, hid = overlap_exposed(seconds, self.overlap * windows[phase], pieces=units + 1)
            exposed, hidden = exposed + shown, hidden + hid
        return blocking + exposed + OVERLAP_SLOWDOWN * hidden, terms


AUTOCAST_CAST_BYTES = (4 + 2) + (2 + 4)
"""Bytes per parameter that torch.autocast moves per forward and backward (shoal.parallel.precision.Autocast):
each fp32 weight read and written as a 16-bit copy for its products (cached for the rest of that forward), and
its 16-bit gradient read and written as the fp32 gradient it accumulates into."""


def fsdp2_copy_bytes(params: float, *, param_bytes: float, grad_bytes: float, reduce_bytes: float, gathers: int,
                     reduces: int) -> float:
    """Device-memory bytes one rank's FSDP2 moves in a step copying around its collectives, for `params` parameters
    (unsharded) gathered `gathers` and reduced `reduces` times. Read from torch's FSDP2
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py; torch/distributed/_composable/fsdp/ before 2.6):
    after each all-gather `foreach_all_gather_copy_out` copies the gathered buffer into the parameters
    (split_with_sizes_copy: every gathered element read and written at the parameter dtype), and before each
    reduce-scatter `foreach_reduce` copies the unsharded gradients into the reduce-scatter input at the reduce
    dtype (read at the gradient's, written at the reduce dtype's). Both run on, or are waited for by, the compute
    stream, so neither hides behind compute. The all-gather's copy-in (a rank's own shard cast to the parameter
    dtype, on a side stream) moves 1/N of that and is left out."""
    return params * (gathers * 2 * param_bytes + reduces * (grad_bytes + reduce_bytes))


def data_schedule(kind: str, zero: int, *, micro: int) -> dict[str, Any]:
    """Where each data-axis collective of a step runs, read off the engines' schedules (shoal.parallel.data,
    shoal.parallel.zero): {term: {pass: share of its seconds}}, and over how many micro-batches' forward and
    backward passes each pass's collectives are spread ("forward_passes", "backward_passes").

    - Parameter all-gathers run in forward: FSDP2 gathers each unit just before it runs (prefetching the
      next) on every micro-batch, and at zero=3 once more in backward (half of its gathers); shoal's ZeRO-1/2
      engine starts every bucket's gather when the step's first forward begins and waits for each just
      before its blocks run, so they hide behind one forward only.
    - Gradient reduce-scatters and all-reduces run in backward as each unit's (bucket's) gradients are
      produced: every micro-batch's at zero=2 and 3, the last micro-batch's only at zero=1 and under DDP
      (gradients accumulate under no_sync)."""
    every = zero >= 2 and kind in ("zero", "fsdp2")
    gathers_fwd = 0.5 if kind == "fsdp2" and zero == 3 else 1.0
    backward = {"backward": 1.0}
    return {"fsdp_all_gather": {"forward": gathers_fwd, "backward": 1 - gathers_fwd},
            "fsdp_reduce_scatter": backward, "dp_allreduce": backward, "expert_allreduce": backward,
            "forward_passes": 1 if kind == "zero" else micro, "backward_passes": micro if every else 1}


def overlap_exposed(traffic: float, window: float, *, pieces: int) -> tuple[float, float]:
    """(exposed, hidden) seconds of `traffic` issued as `pieces` equal collectives, one as each piece of the
    work they follow completes, beside `window` seconds of compute. The last piece starts when the compute
    is done, so it is always exposed; the others hide as far as the compute lasts (the overlap of bucketed
    gradient reduction, Li et al. 2020, "PyTorch Distributed", section 3.2.3; of FSDP's per-unit gathers and
    reduce-scatters, Zhao et al. 2023, "PyTorch FSDP", section 3.3)."""
    if traffic <= 0:
        return 0.0, 0.0
    hidden = max(0.0, min(window, traffic * (1 - 1 / pieces)))
    return traffic - hidden, hidden


def _training_gemm_time(device: Any, tokens: float, n: float, k: float, *, ridge: float = 0.0) -> float:
    """Time over time-at-the-large-GEMM-rate of one weight's three products in a training step, each as much
    work: forward (tokens x k) @ (k x n), the input gradient (tokens x n) @ (n x k) and the weight gradient
    (k x tokens) @ (tokens x n), whose outputs differ in shape (hardware.DeviceSpec.gemm_factor), each held to
    its memory floor (_product_time) where `ridge` is given."""
    products = ((tokens, n, k), (tokens, k, n), (k, n, tokens))
    return sum(_product_time(device, m, nn, kk, ridge=ridge) for m, nn, kk in products) / 3


def _product_time(device: Any, m: float, n: float, k: float, *, ridge: float) -> float:
    """Time over time-at-the-large-GEMM-rate of an (m x k) @ (k x n) product: its shape factor's, or, when
    reading its operands and writing its output once from device memory ((m k + k n + m n) elements) takes
    longer than its 2 m n k FLOPs at the large-GEMM rate, the memory's (the roofline bound, Williams, Waterman
    and Patterson 2009, "Roofline", CACM 52(4)). `ridge` is the device's ridge point in FLOPs per element moved
    (large-GEMM FLOP/s x bytes per element / memory bytes/s; 0: no floor). Large skinny products meet it: under
    tp8 an 8B Llama's K and V projections have n = 128 over m ~ 10^5 tokens, ~250 FLOPs an element moved against
    an H100's ridge of ~535 (its large bf16 GEMM rate over its memory bandwidth, 2 bytes an element)."""
    shaped = 1 / device.gemm_factor(m, n, k)
    return max(shaped, ridge * (m * k + k * n + m * n) / (2 * m * n * k))


def _adapter_time(device: Any, cfg: ModelConfig, lora: LoRAConfig, tokens: float, tp: int, *, moe: bool,
                  ridge: float) -> float:
    """FLOPs per token of one block's adapters on a tp rank (compute.adapter_flops), each product weighted by its
    time over time-at-the-large-GEMM-rate (_training_gemm_time): A (r, in) and B (out, r) of each adapted matrix, a
    routed expert's over its share of the tokens."""
    index = compute.block_index(cfg, moe=moe)
    routed = cfg.num_prototypes if cfg.num_prototypes else cfg.top_k
    total = 0.0
    for a in adapted_matrices(cfg, lora):
        if a.layer != index:
            continue
        row = a.target in ROW_PARALLEL
        i, o = (a.in_features / tp, a.out_features) if row else (a.in_features, a.out_features / tp)
        copies, m = (routed, tokens * routed / a.count) if a.routed else (a.count, tokens)
        for n, k in ((lora.r, i), (o, lora.r)):
            total += copies * 2.0 * n * k * _training_gemm_time(device, m, n, k, ridge=ridge)
    return total


def _gemm_scale(device: Any, cfg: ModelConfig, tokens: float, tp: int, *, moe: bool, fused_qkv: bool = False,
                ridge: float = 0.0) -> float:
    """Time over time-at-the-large-GEMM-rate of one block's weight products, FLOP-weighted: Q, K and V (one
    fused product with `fused_qkv`; three otherwise, as shoal's wq, wk, wv) and output projections and the dense
    FFN as (tokens x k) @ (k x n) on one tp rank, forward and backward (_training_gemm_time). Routed experts and the
    router are left at 1."""
    D, F, hd = cfg.dim, cfg.dense_width, cfg.head_dim
    q, kv = cfg.num_heads * hd / tp, cfg.kv_heads * hd / tp
    gemms: list[tuple[float, float]] = [(q + 2 * kv, D)] if fused_qkv else [(q, D), (kv, D), (kv, D)]  # (n, k)
    gemms += [(D, q)]
    whole_gemms = []  # products every tp rank runs whole: block_work counts them once, the ranks tp times
    if cfg.latent_attention:  # shoal.models.mla: up-projections split by heads, down-projections whole
        H, Q, L = cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        gemms = [(H * cfg.qk_head_dim / tp, Q or D), (H * (cfg.qk_nope_head_dim + cfg.v_head_dim) / tp, L),
                 (D, H * cfg.v_head_dim / tp)]
        whole_gemms = [(float(n), float(D)) for n in (Q, L, cfg.qk_rope_head_dim) if n]
    if not moe:
        gemms += [(F / tp, D)] * (2 if cfg.activation == "swiglu" else 1) + [(D, F / tp)]
    # per token, all ranks (block_work's convention)
    listed = sum(2.0 * n * k for n, k in gemms) * tp + sum(2.0 * n * k for n, k in whole_gemms)
    slow = sum(2.0 * n * k * _training_gemm_time(device, tokens, n, k, ridge=ridge)
               for n, k in gemms + whole_gemms) * tp
    whole = compute.block_work(cfg, compute.block_index(cfg, moe=moe), seq_len=1, causal_skip=True,
                               fused_attention=True).matmul
    return (whole - listed + slow) / whole


def model_ops(num_layers: int, *, compiled: bool = False) -> float:
    """Host ops of one forward and backward of a dense model of `num_layers` blocks, eager or compiled
    (OPS_PER_BLOCK, HEAD_OPS): what the host time of such a model is divided by to give seconds per op."""
    return num_layers * OPS_PER_BLOCK[compiled] + HEAD_OPS
