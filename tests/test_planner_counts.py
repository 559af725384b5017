"""The op counts in shoal.planner.costs, recounted from the code as it is now.

The cost model prices a CPU step's host time as counts of ops, taken from the model and the
parallel code, times the seconds calibration measures per op. A count goes stale silently when
the code it was taken from changes; these tests recount each (shoal.calibration.counts, which says
what one op is) and fail until the constant is updated to the new count. The counts are exact
(whole ops, views at half), so they are compared exactly: a different count is a different model.

The tiny preset, as the constants were counted on it; small batches (a count does not depend on
the tensors' sizes).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shoal import rules
from shoal.calibration import counts
from shoal.loss import IGNORE
from shoal.mesh import build_mesh
from shoal.models import PRESETS
from shoal.plan import Plan
from shoal.planner.costs import DTENSOR_DISPATCHES, DTENSOR_DISPATCHES_PER_OP, OPS_PER_BLOCK, RING_OPS_PER_HOP
from shoal.testing.parity import case, parallel_setup
from shoal.train.step import split_micro

TINY = PRESETS["tiny"].replace(max_seq_len=16)


def test_eager_block_ops():
    assert counts.block_ops(TINY) == OPS_PER_BLOCK[False]


def test_compiled_block_ops():
    """The compiled block's calls on a CPU, where the estimate charges them (one compile of one block)."""
    assert counts.block_ops(TINY, compiled=True) == OPS_PER_BLOCK[True]


def test_ring_ops_per_hop(pools):
    assert pools(2).run(_ring_ops) == [RING_OPS_PER_HOP] * 2


def _ring_ops() -> float:
    mesh = build_mesh(rules.resolve(Plan.parse("cp2"), world_size=dist.get_world_size()))
    return counts.ring_ops_per_hop(mesh["cp"])


def test_dtensor_dispatches_per_chain_op(pools):
    assert pools(2).run(counts.dtensor_dispatches_per_chain_op) == [DTENSOR_DISPATCHES_PER_OP] * 2


def test_dtensor_dispatches_per_block_and_head(pools):
    """A tp2 forward and backward of the tiny model with 2 and with 4 blocks: the difference is two
    blocks' dispatches, the rest of the 2-block model's the embedding's, head's and loss's. Without
    sequence parallelism a block runs as many (the estimate uses one count for both) and the head no more."""
    pool = pools(2)
    found = {}
    for plan in ("tp2", "tp2,sp=off"):
        two, four = (pool.run(_tp_dispatches, plan, layers) for layers in (2, 4))
        assert two[0] == two[1] and four[0] == four[1], (plan, two, four)
        block = (four[0] - two[0]) / 2
        found[plan] = {"block": block, "head": two[0] - 2 * block}
    assert found["tp2"] == DTENSOR_DISPATCHES
    assert found["tp2,sp=off"]["block"] == DTENSOR_DISPATCHES["block"]
    assert found["tp2,sp=off"]["head"] <= DTENSOR_DISPATCHES["head"]


def _tp_dispatches(plan: str, num_layers: int) -> int:
    runtime, _, batches = parallel_setup(case(plan=plan, model=TINY.replace(num_layers=num_layers),
                                              global_batch=2, seq_len=16, steps=1))
    micro = split_micro(*batches[0], 1)
    runtime.forward_backward(micro)  # warm-up: first calls initialise what later ones skip
    return counts.dtensor_dispatches(lambda: runtime.forward_backward(micro))


def test_loss_logit_copies():
    """shoal.planner.memory.CONSUMED_LOGIT_COPIES, recounted: the peak of live tensors over a head matmul
    and the runtime's cross-entropy, forward and backward, above the weights and gradients held before,
    in fp32 copies of the logits (the hidden states and weights are < 1% of a copy, so the count is read
    to the nearest quarter), the logits handed over and held meanwhile as the runtime does, with the
    cross-entropy's block temporaries (blocks as large as the logits, and tiny ones), fp32 and bf16."""
    import torch

    from shoal.parallel import loss as parallel_loss
    from shoal.planner.memory import CONSUMED_LOGIT_COPIES, LOSS_PIECE_ELEMENTS
    from shoal.train.memory import TensorPeak

    assert parallel_loss.ROWS_ELEMENTS == LOSS_PIECE_ELEMENTS
    N, D, V = 256, 16, 20000
    copy_mb = N * V * 4 / 2**20
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, V, (N,), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (parallel_loss.ROWS_ELEMENTS, 1 << 12):
            h = torch.randn(N, D, generator=gen).to(dtype).requires_grad_()
            w = torch.randn(V, D, generator=gen).to(dtype).requires_grad_()
            w.grad = torch.zeros_like(w)
            held_mb = (2 * h.numel() + 2 * w.numel()) * h.element_size() / 2**20
            saved, parallel_loss.ROWS_ELEMENTS = parallel_loss.ROWS_ELEMENTS, rows
            try:
                with TensorPeak(h, w) as peak:
                    logits = h @ w.T
                    parallel_loss.cross_entropy_sum(logits, targets, consume=True).backward()
                    del logits
            finally:
                parallel_loss.ROWS_ELEMENTS = saved
            assert peak.peak_mb is not None, "torch's MemTracker did not count this step"
            copies = (peak.peak_mb - held_mb) / copy_mb
            during, after = CONSUMED_LOGIT_COPIES[dtype.itemsize]
            want = max(during + 3 * min(N * V, rows) * 4 / 2**20 / copy_mb, after)
            assert abs(copies - want) < 0.25, (rows, dtype, copies, want)


def test_loss_parallel_logit_copies(pools):
    """shoal.planner.memory.LOSS_LOGIT_COPIES, recounted on two ranks: the peak of live tensors over a
    vocabulary-parallel head and the runtime's cross-entropy under DTensor's loss_parallel, forward and
    backward, above the weights and gradients held before, in fp32 copies of a rank's logits, fp32 and bf16;
    the logits dropped after the loss as the runtime drops them (holding them costs one copy more)."""
    from shoal.planner.memory import LOSS_LOGIT_COPIES

    for dtype in ("float32", "bfloat16"):
        copies = pools(2).run(_loss_parallel_copies, dtype)
        assert all(abs(c - LOSS_LOGIT_COPIES[2 if dtype == "bfloat16" else 4]) < 0.25 for c in copies), copies


def _loss_parallel_copies(dtype_name: str) -> float:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shoal.parallel.loss import cross_entropy_sum, vocab_parallel_loss
    from shoal.train.memory import TensorPeak

    dtype = getattr(torch, dtype_name)
    mesh = build_mesh(rules.resolve(Plan.parse("tp2"), world_size=dist.get_world_size()))["tp"]
    B, T, D, V = 4, 64, 16, 20000
    gen = torch.Generator().manual_seed(0)
    h = distribute_tensor(torch.randn(B * T, D, generator=gen).to(dtype), mesh, [Replicate()]).requires_grad_()
    w = distribute_tensor(torch.randn(V, D, generator=gen).to(dtype), mesh, [Shard(0)]).requires_grad_()
    w.grad = torch.zeros_like(w)
    targets = torch.randint(0, V, (B, T), generator=gen)
    held_mb = (2 * h.numel() + 2 * w.numel() // 2) * dtype.itemsize / 2**20
    with TensorPeak(h, w) as peak:
        logits = (h @ w.T).unflatten(0, (B, T))  # vocabulary-sharded, as the tp head hands them over
        with vocab_parallel_loss(logits):
            loss = cross_entropy_sum(logits, targets, consume=True)
            del logits
            loss.backward()
    assert peak.peak_mb is not None
    return (peak.peak_mb - held_mb) / (B * T * V / 2 * 4 / 2**20)


def test_runtime_cross_entropy_is_torchs():
    """The runtime's cross-entropy (shoal.parallel.loss) is torch's F.cross_entropy(reduction="sum"),
    bit for bit, loss and gradient, whatever its blocks, with ignored targets, fp32 and bf16 logits,
    writing into the logits or not."""
    import torch
    import torch.nn.functional as F

    from shoal.parallel import loss as parallel_loss

    gen = torch.Generator().manual_seed(0)
    for rows in (parallel_loss.ROWS_ELEMENTS, 64, 1000):
        for n, v, consume, dtype in ((7, 11, False, torch.float32), (300, 5000, True, torch.float32),
                                     (64, 1000, False, torch.bfloat16), (513, 257, True, torch.float32),
                                     (0, 5, True, torch.float32)):
            x = (3 * torch.randn(n, v, generator=gen)).to(dtype)
            t = torch.randint(0, v, (n,), generator=gen)
            t[1:n:3] = IGNORE
            ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
            saved, parallel_loss.ROWS_ELEMENTS = parallel_loss.ROWS_ELEMENTS, rows
            try:
                loss = parallel_loss.cross_entropy_sum(ours * 1.0, t, consume=consume)
                (0.37 * loss).backward()
            finally:
                parallel_loss.ROWS_ELEMENTS = saved
            ref = F.cross_entropy(theirs.float(), t, ignore_index=IGNORE, reduction="sum")
            (0.37 * ref).backward()
            assert torch.equal(loss, ref) and torch.equal(ours.grad, theirs.grad), (rows, n, v, consume, dtype)


def test_accumulated_table_gradient():
    """The planner's accumulation term (shoal.planner.peak.peak_terms): an embedding table's
    gradient peaks at two tables beside its weight when micro-batches accumulate (the next
    micro-batch's gradient made whole, then added), one with a single micro-batch; and the planner
    charges a stage the larger of that table and the loss's logits (they are not held at once)."""
    import torch
    from torch import nn

    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.estimate import Workload, estimate
    from shoal.train.memory import TensorPeak

    table = nn.Embedding(20000, 32)
    one_mb = table.weight.numel() * 4 / 2**20
    tokens = torch.randint(0, 20000, (2, 64), generator=torch.Generator().manual_seed(0))
    for micro, tables in ((1, 2), (3, 3)):
        table.weight.grad = None
        with TensorPeak(table.weight) as peak:
            for _ in range(micro):
                table(tokens).sum().backward()
        assert peak.peak_mb is not None and abs(peak.peak_mb / one_mb - tables) < 0.05, (micro, peak.peak_mb / one_mb)

    cfg = TINY.replace(vocab_size=100000, dim=512, max_seq_len=32)  # a table (205 MB) above the logits (38 MB)
    plan = rules.resolve(Plan.parse("pp2,mb=4"), world_size=2, device="cpu")
    mem = estimate(plan, Workload(model=cfg, global_batch=4, seq_len=32), parse_cluster("2xcpu")).memory
    assert mem["accumulation"] > 0 and mem["logits"] + mem["accumulation"] == cfg.vocab_size * cfg.dim * 4, mem


@pytest.mark.parametrize("tables", ["gathered", "sharded"])
def test_fsdp_vocabulary_tables(pools, tables):
    """The planner's fsdp2 terms for a model whose vocabulary tables outweigh its blocks, against the peak
    of live tensors of a real fsdp2 step (the second, with the optimizer state held) at 50k and 100k words,
    within the goal's 15% above it, and no more than 0.1% under it (the terms leave out the optimizer's
    per-tensor step counts and the like: kilobytes).
    - vocab=gathered: each table an FSDP2 unit (shoal.planner.peak.fsdp_table_bytes: a table gathered
      whole, its unsharded gradient and the reduce-scatter's input). The terms sum every peak (the loss's
      logits, the tables' three copies, all sharded gradients) though the head's backward holds only its
      own sharded gradient, so they lie above the measured peak (7% when counted).
    - vocab=sharded (shoal/parallel/sharded_vocab.py): no table gathered, the classifier's backward
      holding SHARDED_LOGIT_COPIES of the logits."""
    from shoal.calibration.auto_plan import memory_cluster
    from shoal.planner.estimate import Workload, estimate

    for vocab in (50000, 100000):
        cfg = TINY.replace(vocab_size=vocab, dim=64)
        measured = pools(2).run(_fsdp_step_peak, cfg, f"fsdp2,vocab={tables}")
        plan = rules.resolve(Plan.parse(f"fsdp2,vocab={tables}"), world_size=2, device="cpu")
        terms = estimate(plan, Workload(model=cfg, global_batch=2, seq_len=16), memory_cluster(2, "cpu")).memory
        priced = sum(terms.values()) / 2**20
        assert all(0.999 * m <= priced <= 1.15 * m for m in measured), (vocab, priced, measured)


def test_sharded_logit_copies(pools):
    """shoal.planner.memory.SHARDED_LOGIT_COPIES, recounted: the peak of live tensors over the sharded
    classifier and the runtime's cross-entropy, forward and backward, above the weights and gradients
    held before, in fp32 copies of this rank's (T, V) logits (hidden states and table shards are < 1% of
    a copy; the cross-entropy's 16 MB blocks are a fifth of one, so the count is read to the nearest
    quarter)."""
    from shoal.planner.memory import SHARDED_LOGIT_COPIES

    for copies in pools(2).run(_sharded_logits_peak):
        assert abs(copies - SHARDED_LOGIT_COPIES) < 0.25, copies


def _sharded_logits_peak() -> float:
    import torch
    from torch import nn

    from shoal.parallel import loss as parallel_loss
    from shoal.parallel.sharded_vocab import shard_classifier
    from shoal.train.memory import TensorPeak

    T, D, V = 512, 16, 40000
    mesh = build_mesh(rules.resolve(Plan.parse("fsdp2"), world_size=dist.get_world_size()))["fsdp"]
    gen = torch.Generator().manual_seed(dist.get_rank())
    linear = nn.Linear(D, V, bias=False)
    weight = shard_classifier(linear, mesh)
    weight.grad = torch.zeros_like(weight)
    h = torch.randn(T, D, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (T,), generator=gen)
    held_mb = (2 * h.numel() + 2 * weight.to_local().numel()) * 4 / 2**20
    with TensorPeak(h, weight) as peak:
        logits = linear(h)
        parallel_loss.cross_entropy_sum(logits, targets, consume=True).backward()
        del logits
    assert peak.peak_mb is not None, "torch's MemTracker did not count this step"
    return (peak.peak_mb - held_mb) / (T * V * 4 / 2**20)


def _fsdp_step_peak(cfg: object, plan: str) -> float:
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OptimConfig
    from shoal.testing.parity import case
    from shoal.train.memory import TensorPeak
    from shoal.train.step import train_step

    runtime, _, batches = parallel_setup(case(plan=plan, model=cfg, global_batch=2, seq_len=16, steps=2))
    optimizer = build_optimizer(runtime, OptimConfig())  # the trainer's (fused AdamW), whose step the planner prices
    train_step(runtime, optimizer, split_micro(*batches[0], 1))  # makes the optimizer state
    with TensorPeak(*runtime.parts, optimizer) as peak:
        train_step(runtime, optimizer, split_micro(*batches[1], 1))
    assert peak.peak_mb is not None, "torch's MemTracker did not count this step"
    return peak.peak_mb


def test_cpu_adamw_step_temporaries():
    """shoal.planner.peak.optimizer_step_bytes, recounted: a CPU AdamW step as the trainer builds it (torch's fused
    kernel, shoal.optim.builder) holds nothing beside the model states, where torch's default per-tensor step
    holds two fp32 copies of its largest tensor (which the count sees: it is not blind to temporaries)."""
    import torch

    from shoal.optim.builder import adamw_kernel
    from shoal.planner.peak import optimizer_step_bytes
    from shoal.train.memory import TensorPeak

    def step_peak_mb(**kernel: bool) -> float:
        big, small = torch.nn.Parameter(torch.randn(20000, 64)), torch.nn.Parameter(torch.randn(64, 64))
        optimizer = torch.optim.AdamW([big, small], lr=1e-3, **kernel)
        for p in (big, small):
            p.grad = torch.randn_like(p)
        optimizer.step()  # makes the state
        with TensorPeak(big, small, big.grad, small.grad, optimizer) as peak:
            optimizer.step()
        assert peak.peak_mb is not None
        return peak.peak_mb

    held_mb = 4 * 4 * (20000 * 64 + 64 * 64) / 2**20  # parameters, gradients, two moments
    largest_mb = 4 * 20000 * 64 / 2**20
    assert abs(step_peak_mb() - held_mb - 2 * largest_mb) < 0.05 * largest_mb  # the per-tensor loop's two copies
    assert abs(step_peak_mb(**adamw_kernel({"cpu"})) - held_mb) < 0.05 * largest_mb
    cfg = TINY.replace(vocab_size=20000, dim=64)
    assert optimizer_step_bytes(cfg, tp=1, ep=1, shards=1, on_cpu=True) == 0
    assert optimizer_step_bytes(cfg, tp=1, ep=1, shards=1, on_cpu=False) == 0


def test_cpu_muon_step_temporaries():
    """peak.MUON_STEP_BYTES and MUON_NEWTON_SCHULZ_BYTES, recounted: a one-process Muon step over eight (F, D)
    matrices holds, beside the model states (weights, gradients, one momentum), 10 bytes per parameter and 8 per
    element of one matrix (the Newton-Schulz temporaries), to 1% (what else the step holds: scalars)."""
    import torch

    from shoal.optim.muon import Muon
    from shoal.planner.peak import optimizer_step_bytes
    from shoal.train.memory import TensorPeak

    cfg = TINY.replace(dim=128, ffn_dim=512)
    params = [torch.nn.Parameter(torch.randn(cfg.ffn_dim, cfg.dim)) for _ in range(8)]
    optimizer = Muon([{"params": params}], lr=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # makes the state
    with TensorPeak(*params, *[p.grad for p in params], optimizer) as peak:
        optimizer.step()
    assert peak.peak_mb is not None
    count = sum(p.numel() for p in params)
    extra = peak.peak_mb * 2**20 - 3 * 4 * count
    priced = optimizer_step_bytes(cfg, tp=1, ep=1, shards=1, on_cpu=True, orthogonalised=count)
    assert abs(extra - priced) <= 0.01 * priced, (extra, priced)


@pytest.mark.parametrize(("plan", "world"), [("tp2", 2), ("tp2,sp=off", 2), ("tp4", 4)])
def test_tensor_parallel_activation_count(pools, plan, world):
    """memory.activation_elements under tensor parallelism, recounted: what autograd saves on a rank in
    one forward of the tiny model with 4 blocks less that with 2, per block and token. Under sequence
    parallelism DTensor keeps the all-gathered input of the product after each norm whole (1.5 D a block
    more at tp4 than splitting it would). Exact: whole elements of whole tensors."""
    from shoal.planner import memory

    sizes = [pools(world).run(_saved_per_token, plan, layers) for layers in (2, 4)]
    assert len({*sizes[0]}) == 1 and len({*sizes[1]}) == 1, sizes  # every rank saves the same
    resolved = rules.resolve(Plan.parse(plan), world_size=world)
    per_block = (sizes[1][0] - sizes[0][0]) / 2
    assert per_block == memory.activation_elements(TINY, 0, seq_len=TINY.max_seq_len, tp=resolved.tp,
                                                   sp=bool(resolved.sp), ac="none", fused_attention=True)


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt"])
def test_dropout_activation_count(model):
    """At dropout > 0 a CPU keeps each hidden-state dropout's noise in the activation's dtype (aten's fused
    dropout is CUDA's only), and SDPA, which has no CPU kernel that drops out, runs its math path: the scaled q
    and k, the probabilities, the noise and the dropped probabilities in place of a log-sum-exp a head
    (memory.dropout_kept_elements); the embedding's dropout keeps its noise once, outside the blocks. Recounted
    as elements autograd saves, 4 blocks less 2 per block and token, and the 2-block model less its blocks (the
    final norm's 3D + 1 and the embedding's D). Exact: whole elements of whole float32 tensors."""
    import torch

    from shoal.calibration.saved import saved_activation_elements
    from shoal.models import Transformer
    from shoal.planner import memory

    cfg = PRESETS[model].replace(max_seq_len=16, dropout=0.1)
    inputs = torch.randint(0, cfg.vocab_size, (2, 16))
    saved = [saved_activation_elements(Transformer(cfg.replace(num_layers=n)).train(), inputs) / inputs.numel()
             for n in (2, 4)]
    per_block = (saved[1] - saved[0]) / 2
    kw = dict(seq_len=16, tp=1, sp=False, ac="none", fused_attention=True)
    priced = memory.activation_elements(cfg, 0, on_cpu=True, element_bytes=4, **kw)
    assert per_block == priced
    assert priced - memory.activation_elements(cfg.replace(dropout=0.0), 0, **kw) == 2 * 128 + 3 * 8 * 16 - 8
    outside = memory.norm_elements(cfg) + memory.embedding_dropout_elements(cfg, tp=1, sp=False, on_cpu=True,
                                                                            element_bytes=4)
    assert saved[0] - 2 * per_block == outside


@pytest.mark.parametrize("plan", ["tp2", "tp2,sp=off"])
def test_tensor_parallel_dropout_activation_count(pools, plan):
    """The same under tp2: the hidden-state dropouts' noise split by tp under sequence parallelism, whole on every
    rank without it; the math path's scores split with the heads."""
    from shoal.planner import memory

    model = TINY.replace(dropout=0.1)
    sizes = [pools(2).run(_saved_per_token, plan, layers, model) for layers in (2, 4)]
    assert len({*sizes[0]}) == 1 and len({*sizes[1]}) == 1, sizes
    per_block = (sizes[1][0] - sizes[0][0]) / 2
    assert per_block == memory.activation_elements(model, 0, seq_len=16, tp=2, sp=plan == "tp2", ac="none",
                                                   fused_attention=True, on_cpu=True, element_bytes=4)


def test_tensor_parallel_moe_activation_count(pools):
    """The same under tp2 for an MoE block, dropless (the count takes every token to its top-k experts):
    each tp rank permutes every token to its experts, D wide, so the permuted tokens and the experts'
    outputs do not split by tp, nor does the router. The count leaves out the routing groups' per-sequence
    tallies and slack in the permutation's buffers: at most 4 elements a token (2.3 measured, of 2,300)."""
    from shoal.planner import memory

    moe = PRESETS["tiny-moe"].replace(max_seq_len=16, capacity_factor=0.0)
    for plan in ("tp2", "tp2,sp=off"):
        sizes = [pools(2).run(_saved_per_token, plan, layers, moe) for layers in (2, 4)]
        per_block = (sizes[1][0] - sizes[0][0]) / 2
        priced = memory.activation_elements(moe, 0, seq_len=16, tp=2, sp=plan == "tp2", ac="none",
                                            fused_attention=True)
        assert 0 <= per_block - priced <= 4, (plan, per_block, priced)


def _saved_per_token(plan: str, num_layers: int, model=TINY) -> float:
    from shoal.calibration.saved import saved_activation_elements

    runtime, _, batches = parallel_setup(case(plan=plan, model=model.replace(num_layers=num_layers),
                                              global_batch=2, seq_len=model.max_seq_len, steps=1))
    inputs, _ = batches[0]
    (model,) = runtime.parts  # no pipeline: the one part, sharded in place
    return saved_activation_elements(model, inputs) / inputs.numel()


@pytest.mark.parametrize("plan", ["dp1", "tp2", "tp2,sp=off"])
@pytest.mark.parametrize(("model", "dropout"), [("tiny", 0.0), ("tiny-gpt", 0.0), ("tiny", 0.1)])
def test_selective_recompute_activation_count(pools, plan, model, dropout):
    """memory.activation_elements under ac=selective (shoal's policy: the weight products', the attention
    kernel's and the reductions' outputs kept), recounted: the storages a forward creates that are still alive
    after it (recompute.kept_activation_bytes: the block inputs the checkpoints keep and what the policy saves; a
    DTensor by this rank's local tensor), 4 blocks less 2, per block and token; the dropouts' noise is
    recomputed, not kept, and a CPU's SDPA, which drops out in its math path, keeps no fused kernel's output.
    Exact: whole elements of whole float32 tensors."""
    from shoal.planner import memory

    cfg = PRESETS[model].replace(max_seq_len=16, dropout=dropout)
    world = 1 if plan == "dp1" else 2
    sizes = [pools(world).run(_kept_per_token, f"{plan},ac=selective", layers, cfg) for layers in (2, 4)]
    assert len({*sizes[0]}) == 1 and len({*sizes[1]}) == 1, sizes  # every rank keeps the same
    resolved = rules.resolve(Plan.parse(f"{plan},ac=selective"), world_size=world)
    assert (sizes[1][0] - sizes[0][0]) / 2 == memory.activation_elements(
        cfg, 0, seq_len=16, tp=resolved.tp, sp=bool(resolved.sp), ac="selective", fused_attention=True, on_cpu=True,
        element_bytes=4)


def _kept_per_token(plan: str, num_layers: int, model) -> float:
    from shoal.parallel.recompute import kept_activation_bytes

    runtime, _, batches = parallel_setup(case(plan=plan, model=model.replace(num_layers=num_layers), global_batch=2,
                                              seq_len=model.max_seq_len, steps=1))
    inputs, _ = batches[0]
    (part,) = runtime.parts
    kept, out = kept_activation_bytes(lambda: part(inputs))  # the output held: the graph lives as long as it
    del out
    return kept / 4 / inputs.numel()  # float32 elements


@pytest.mark.parametrize(("model", "autocast"), [
    pytest.param("tiny", False, marks=pytest.mark.slow),  # each a cold compile: 15-20 s on 2 cores
    pytest.param("tiny-gpt", True, marks=pytest.mark.slow),
    ("tiny,qk_norm", True),
])
def test_compiled_activation_count(model, autocast):
    """A compiled block (compile=on) keeps what AOTAutograd's partitioner saves: RMSNorm's normalised input and
    SwiGLU's silu(gate) are recomputed from what it keeps (memory.compiled_recomputed_elements); under autocast
    every tensor is 16-bit but one float32 copy of the hidden state, the log-sum-exp and the norms' statistics
    (memory.autocast_extra_elements). Recounted as bytes autograd saves in one forward after a warm-up step, 2
    blocks less 1, per token, less the 16-bit casts of the block's weights (priced with the parameters). Exact:
    whole bytes of whole tensors."""
    import torch
    import torch._dynamo
    from torch import nn

    from shoal.calibration.saved import saved_activation_bytes
    from shoal.models import Transformer
    from shoal.parallel.compile import apply_compile
    from shoal.parallel.precision import Autocast
    from shoal.planner import memory

    name, *flags = model.split(",")
    cfg = PRESETS[name].replace(max_seq_len=64, **{flag: True for flag in flags})
    inputs = torch.randint(0, cfg.vocab_size, (1, 64))

    def saved_bytes(layers: int) -> float:
        torch.manual_seed(0)
        per_block = rules.resolve(Plan.parse("dp2,compile=on"), world_size=2)  # each block compiled on its own
        net: nn.Module = apply_compile(Transformer(cfg.replace(num_layers=layers)), plan=per_block)
        if autocast:
            net = Autocast(net, dtype=torch.bfloat16, device_type="cpu")
        net(inputs).float().sum().backward()  # compiled, forward and backward
        return saved_activation_bytes(net, inputs) / inputs.numel()

    try:
        per_block = saved_bytes(2) - saved_bytes(1)
    finally:
        torch._dynamo.reset()
    block = Transformer(cfg.replace(num_layers=1)).layers["0"]
    casts = 2 * sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)) if autocast else 0
    kept = memory.activation_elements(cfg, 0, seq_len=64, tp=1, sp=False, ac="none", fused_attention=True,
                                      compiled=True)
    if autocast:
        kept += memory.autocast_extra_elements(cfg, 0, ac="none", compiled=True)
    assert per_block - casts / inputs.numel() == kept * (2 if autocast else 4)
    eager = memory.activation_elements(cfg, 0, seq_len=64, tp=1, sp=False, ac="none", fused_attention=True)
    assert kept < eager + (memory.autocast_extra_elements(cfg, 0, ac="none") if autocast else 0)


def test_tensor_parallel_compiled_activation_count(pools):
    """The same under tp2 with sequence parallelism (compiled blocks of DTensors): the norms' normalised input
    split by tp with the norm's own tensors, SwiGLU's silu(gate) with the FFN's columns. 4 blocks less 2, per
    block and token on a rank; exact."""
    from shoal.planner import memory

    sizes = [pools(2).run(_compiled_saved_per_token, "tp2,compile=on", layers, TINY) for layers in (2, 4)]
    assert len({*sizes[0]}) == 1 and len({*sizes[1]}) == 1, sizes
    per_block = (sizes[1][0] - sizes[0][0]) / 2
    assert per_block == memory.activation_elements(TINY, 0, seq_len=16, tp=2, sp=True, ac="none",
                                                   fused_attention=True, compiled=True)


def _compiled_saved_per_token(plan: str, num_layers: int, model) -> float:
    import torch._dynamo
    from torch.distributed.tensor import DTensor

    from shoal.calibration.saved import saved_activation_elements

    runtime, _, batches = parallel_setup(case(plan=plan, model=model.replace(num_layers=num_layers), global_batch=2,
                                              seq_len=model.max_seq_len, steps=1))
    inputs, _ = batches[0]
    (part,) = runtime.parts
    out = part(inputs)  # compiled, forward and backward, before the count
    (out.full_tensor() if isinstance(out, DTensor) else out).float().sum().backward()
    try:
        return saved_activation_elements(part, inputs) / inputs.numel()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt", "tiny,qk_norm"])
def test_autocast_activation_count(model):
    """One process in bf16 runs under torch.autocast (rules: the engine "autocast"), which keeps the residual
    stream and the norms in float32 and casts a norm's output once for each product reading it: 2 bytes for
    each of memory.activation_elements and memory.autocast_extra_elements, recounted as bytes autograd saves
    (4 blocks less 2, per block and token) less the 16-bit casts of the blocks' weights (priced with the
    parameters). Qwen3's per-head norms (qk_norm) are counted in fp32 as well (activation_elements), and promoted
    to fp32 under autocast by their fp32 weights. Exact: whole bytes of whole tensors."""
    import torch
    from torch import nn

    from shoal.calibration.saved import saved_activation_bytes, saved_activation_elements
    from shoal.models import Transformer
    from shoal.parallel.precision import Autocast
    from shoal.planner import memory

    name, *flags = model.split(",")
    cfg = PRESETS[name].replace(max_seq_len=16, **{flag: True for flag in flags})
    inputs = torch.randint(0, cfg.vocab_size, (2, 16))

    def per_token(layers: int) -> float:
        net = Autocast(Transformer(cfg.replace(num_layers=layers)), dtype=torch.bfloat16, device_type="cpu")
        return saved_activation_bytes(net, inputs) / inputs.numel()

    block = Transformer(cfg.replace(num_layers=1)).layers["0"]
    casts = 2 * sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
    per_block = (per_token(4) - per_token(2)) / 2 - casts / inputs.numel()
    priced = memory.activation_elements(cfg, 0, seq_len=16, tp=1, sp=False, ac="none", fused_attention=True)
    assert per_block == 2 * (priced + memory.autocast_extra_elements(cfg, 0, ac="none"))
    fp32 = [saved_activation_elements(Transformer(cfg.replace(num_layers=n)), inputs) / inputs.numel() for n in (2, 4)]
    assert (fp32[1] - fp32[0]) / 2 == priced  # the same blocks in fp32, element for element


@pytest.mark.parametrize("experts", [0, 4])
@pytest.mark.parametrize("optimizer", ["adamw", "lamb", "lars", "cowclip", "muon"])
def test_optimizer_state_per_parameter(optimizer, experts):
    """memory.OPTIMIZER_MOMENTS, recounted: the bytes of every state tensor each optimizer of `shoal train` holds
    after one step of a small dense and MoE model in one process, against the planner's optimizer term. Exact,
    less what the planner leaves out: the final norm's moments (D parameters at the rest's moments) and the step
    counters (0-d tensors). Muon holds one fp32 moment on the blocks' matrices and stacked experts, AdamW's two on
    the embeddings, head and norms; LARS one everywhere."""
    import torch

    from shoal import parallelize
    from shoal.models import Transformer
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OPTIMIZERS, OptimConfig
    from shoal.planner import memory
    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.estimate import Workload, estimate

    assert set(memory.OPTIMIZER_MOMENTS) == set(OPTIMIZERS)
    cfg = TINY.replace(num_layers=2, vocab_size=256, **({"num_experts": experts, "top_k": 2, "ffn_dim": 64}
                                                          if experts else {}))
    torch.manual_seed(0)
    runtime = parallelize(Transformer(cfg))
    opt = build_optimizer(runtime, OptimConfig(optimizer=optimizer))
    logits = runtime.parts[0](torch.randint(0, cfg.vocab_size, (2, 16)))
    logits.float().square().mean().backward()
    opt.step()
    tensors = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    held = sum(v.numel() * v.element_size() for v in tensors)
    counters = sum(v.numel() * v.element_size() for v in tensors if v.dim() == 0)
    plan = rules.resolve(Plan.parse("dp1"), world_size=1, device="cpu")
    priced = estimate(plan, Workload(model=cfg, global_batch=2, seq_len=16, optimizer=optimizer),
                      parse_cluster("1xcpu")).memory["optimizer"]
    final_norm = memory.MOMENT_BYTES * memory.OPTIMIZER_MOMENTS[optimizer][1] * cfg.dim
    assert held == priced + final_norm + counters


def test_shoal_plan_prices_the_optimizer_s_state(capsys):
    """`shoal plan --optimizer muon` prices one moment on the blocks' matrices (the optimizer term falls below
    AdamW's, above LARS's one moment everywhere), prints the train line with the flag; a bad name is one line."""
    import json

    from shoal import cli
    from shoal.testing.asserts import assert_user_error

    terms = {}
    for optimizer in ("adamw", "muon", "lars"):
        argv = ["plan", "--model", "small", "--cluster", "8xA100-80GB", "--plan", "fsdp8", "--json"]
        assert cli.main([*argv, "--optimizer", optimizer]) == 0
        terms[optimizer] = json.loads(capsys.readouterr().out)[0]["breakdown"]["optimizer_gb"]
    assert terms["lars"] < terms["muon"] < terms["adamw"]
    assert cli.main(["plan", "--model", "small", "--cluster", "8xA100-80GB", "--plan", "fsdp8",
                     "--optimizer", "muon"]) == 0
    assert "--optimizer muon" in capsys.readouterr().out.splitlines()[-1]
    assert_user_error(capsys, ["plan", "--optimizer", "sgd"], "--optimizer 'sgd'", "adamw, lamb")
