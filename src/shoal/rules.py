"""Which plans run: every reason a plan cannot run on a device type with a model and a batch, the
values an option left out takes, and which data-parallel engine runs the plan.

One place, pure (no torch), so that every caller asks the same question and gets the same
one-line answer: `validate`, `parallelize`, the planner's search, `shoal plan --plan` and
`shoal train` before any worker starts. A rule written in two places drifts; add new ones here.

What a rule may look at: the plan, the world size, the device type ("cpu" or "cuda"), the model's
config (a `ModelConfig`: shapes, experts, positions, dropout, ties; another family's shape is judged
by the axes its adapter takes and the family's own rule), or, for a model that has none, its number
of blocks, and the batch (global batch, sequence length, `--micro-batch`). A rule whose inputs a
caller does not have is not asked (parallelize knows no batch; the trainer checks it before start).

Defaults never make a plan invalid: an option left out (micro-batches `mb`, `sp`, `vpp`, `zero`)
takes its usual value where that is valid and otherwise the valid value nearest it, and
`resolve_noting` says which it chose and why.

The data-parallel engines (shoal/parallel/data.py builds them; `choose_engine` picks one):
- none: one data rank in full precision; the model is left as the other axes made it.
- autocast: one data rank, nothing else split, in bf16 or fp16: the fp32 parameters are the master
  weights and torch.autocast casts them for each product (shoal/parallel/precision.py). FSDP2 of
  degree 1 would cast them too, at a higher host cost per step (bench/engine_overhead.py measures
  both; docs/measurements.md holds the figures).
- ddp: torch's DistributedDataParallel (replicated, no tensor parallel); in bf16 or fp16 under
  torch.autocast, as for one data rank (fp32 master weights, gradients reduced in `reduce`'s dtype
  by DDP's compression hook): the plain loop's step, where FSDP2 of shard degree 1 would add its
  per-block hooks and copies (bench/host_overhead.py measures both).
- zero: shoal's ZeRO-1/2 engine (shoal/parallel/zero.py): fsdp > 1 at stage 1 or 2, on a model
  without tensor parallelism and without offload. Under pp it also runs replicated data
  parallelism (fsdp = 1, at ZeRO-1: gradients accumulate over the micro-batches and are
  all-reduced after the last one's backward): DDP prepares its reduction in forward, and a
  pipeline runs later forwards before earlier backwards.
- fsdp2: torch's FSDP2 `fully_shard` for everything else: ZeRO-3, offload, and data parallel over a
  tensor-parallel model (a shard degree of 1 when only replicated).
Two pipeline schedules need more of the engine than some engines give: zero-bubble's weight
passes assign gradients no FSDP2 hook sees (zb runs without an engine or on shoal's ZeRO-1/2
engine), and interleaved chunks would each need an engine of their own (interleaved runs with
no data engine).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.models.adapter import FAMILY_AXES, family_of_config
from shoal.models.config import ModelConfig
from shoal.plan import SCHEDULES, Plan

if TYPE_CHECKING:
    from shoal.models.adapter import ModelShape

DEFAULT_BUCKET = {1: 2, 2: 2, 3: 1}
"""Transformer blocks per gather/reduce unit unless the plan says `bucket=`: two at ZeRO-1/2
(fewer, larger collectives; the full parameters are kept anyway), one at ZeRO-3, where a
unit's full parameters are the transient memory sharding exists to save."""

DEVICES = ("cpu", "cuda")
DEVICE_DEFAULTS = {"cpu": {"precision": "fp32", "compile": False}, "cuda": {"precision": "bf16", "compile": True}}
"""Options a plan leaves out take these values on each device: bf16 compute with fp32 master
weights and fp32 gradient reduction on GPUs (what users expect there), plain fp32 on CPUs (no
fast bf16 matmuls; exact parity with a single process). Blocks are compiled on GPUs, where fused
kernels replace a small model's many short ones; on CPUs the cold compile every run starts with
costs more than it saves at the sizes one trains there (bench/gpu_throughput.py compares compiled
and eager on either device; --compile-on-cpu on a CPU)."""


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What the rules are told about one run; None: not known to this caller, its rules not asked."""

    world_size: int
    device: str = "cpu"
    model: ModelShape | None = None
    """A model family's shape (shoal.models.adapter.Family): a text transformer's, which most rules read, or
    another family's, which `_family_rule` judges by its adapter's axes and the family's own rule."""
    num_layers: int | None = None
    """Blocks of a model without a config (a user's module); the config's num_layers otherwise."""
    global_batch: int | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    """`--micro-batch`: sequences per accumulation pass on one data rank (plans without pp)."""

    @property
    def layers(self) -> int | None:
        return self.model.num_layers if self.model is not None else self.num_layers

    @property
    def text_model(self) -> ModelConfig | None:
        """The model's shape when it is a text transformer's (the rules below ask of those)."""
        return self.model if isinstance(self.model, ModelConfig) else None


# ----------------------------------------------------------------------------- the questions callers ask
def resolve(plan: Plan, *, world_size: int, device: str = "cpu", model: ModelShape | None = None,
            num_layers: int | None = None, global_batch: int | None = None, seq_len: int | None = None,
            micro_batch: int | None = None) -> Plan:
    """The plan with dp and every option left out filled in, checked: ValueError (one line) naming
    the first reason it cannot run with what the caller knows."""
    facts = RunFacts(world_size=world_size, device=device, model=model, num_layers=num_layers,
                  global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch)
    return resolve_noting(plan, facts)[0]


def resolve_noting(plan: Plan, facts: RunFacts) -> tuple[Plan, list[str]]:
    """`resolve`, and one line per option whose usual default was not valid here (which value it
    took instead, and why)."""
    resolved = _resolve_degrees(plan, facts)
    resolved, notes = _choose_defaults(resolved, facts)
    reason = refusal(resolved, facts)
    if reason is not None:
        raise ValueError(reason)
    return resolved, notes


def fill(plan: Plan, facts: RunFacts) -> Plan:
    """dp and the options left out filled in, without asking whether shoal can run the plan: for
    pricing a layout another system ran (the planner's published runs), never for a run."""
    return _choose_defaults(_resolve_degrees(plan, facts), facts)[0]


def validate(plan: Plan, model: ModelShape, *, global_batch: int, seq_len: int) -> None:
    """Check a resolved plan against a model shape and batch; one-line ValueError if it cannot run."""
    assert plan.dp is not None, "resolve the plan first"
    check(plan, RunFacts(world_size=plan.world_size, model=model, global_batch=global_batch, seq_len=seq_len))


def check(plan: Plan, facts: RunFacts) -> None:
    """ValueError (one line) for the first reason a resolved plan cannot run."""
    reason = refusal(plan, facts)
    if reason is not None:
        raise ValueError(reason)


def refusal(plan: Plan, facts: RunFacts) -> str | None:
    """The first reason a resolved plan cannot run, or None (the planner's search asks this for
    every candidate it prices)."""
    assert plan.dp is not None and plan.zero is not None and plan.sp is not None and plan.vpp is not None, \
        "resolve the plan first"
    for rule in _RULES:
        reason = rule(plan, facts)
        if reason is not None:
            return reason
    return None


def micro_batches(plan: Plan, *, local_batch: int, micro_batch: int | None = None) -> int:
    """Passes per step on one data rank: a pipeline's micro-batches (`mb`), otherwise the local
    batch over `--micro-batch` sequences per pass (gradient accumulation; None: one pass)."""
    if plan.pp > 1:
        return plan.micro_batches
    return local_batch // (micro_batch or local_batch)


# ----------------------------------------------------------------------------- the engine
@dataclass(frozen=True, kw_only=True)
class EngineChoice:
    """The data-parallel engine of one plan and how it groups the model."""

    kind: str
    """none, autocast, ddp, zero or fsdp2 (see the module docstring)."""
    zero: int
    """The ZeRO stage it runs: 1, 2 or 3; 0 for none, autocast and ddp (nothing sharded)."""
    bucket: int
    """Transformer blocks per gather/reduce unit (0 when nothing is gathered or reduced by units)."""
    units: int
    """Gather/reduce units of blocks (the rest of the model, embeddings and head, is one more)."""

    def describe(self) -> str:
        """One line for the plan's words at start-up."""
        if self.kind == "none":
            return "one data rank, nothing to replicate or shard"
        if self.kind == "autocast":
            return "one data rank: fp32 master weights, cast for each product by torch.autocast"
        if self.kind == "ddp":
            return "torch DDP (bucketed all-reduce overlapped with backward; 16-bit products under torch.autocast)"
        engine = "shoal's ZeRO-1/2 engine" if self.kind == "zero" else "torch FSDP2"
        return f"{engine} at ZeRO-{self.zero}, {self.units} unit(s) of {self.bucket} block(s) plus the rest"


def choose_engine(plan: Plan, *, num_layers: int) -> EngineChoice:
    """The engine that runs the (resolved) plan's dp and fsdp axes for a model of `num_layers`
    blocks (the module docstring says why each)."""
    assert plan.dp is not None and plan.precision is not None and plan.zero is not None, "resolve the plan first"
    full_precision = plan.precision == "fp32" and plan.reduce == "fp32"
    one_data_rank = plan.dp == 1 and plan.fsdp == 1 and plan.cp == 1
    if one_data_rank and full_precision:
        return EngineChoice(kind="none", zero=0, bucket=0, units=0)
    if one_data_rank and plan.tp == 1 and plan.pp == 1 and not plan.offload:
        return EngineChoice(kind="autocast", zero=0, bucket=0, units=0)
    if plan.pp > 1 and plan.tp == 1 and not plan.offload and (plan.fsdp == 1 or plan.zero < 3):
        zero = 1 if plan.fsdp == 1 else plan.zero
        bucket = plan.bucket if plan.bucket is not None else DEFAULT_BUCKET[zero]
        return EngineChoice(kind="zero", zero=zero, bucket=bucket, units=-(-num_layers // bucket))
    if plan.fsdp == 1 and plan.tp == 1 and not plan.offload:
        return EngineChoice(kind="ddp", zero=0, bucket=0, units=0)
    # Replicated only (fsdp1): nothing to free after forward, so the gathered copy is kept (zero=2).
    zero = plan.zero if plan.fsdp > 1 else 2
    bucket = plan.bucket if plan.bucket is not None else DEFAULT_BUCKET[zero]
    units = -(-num_layers // bucket)
    kind = "zero" if zero < 3 and plan.fsdp > 1 and plan.tp == 1 and not plan.offload else "fsdp2"
    return EngineChoice(kind=kind, zero=zero, bucket=bucket, units=units)


def under_autocast(kind: str, precision: str) -> bool:
    """Whether engine `kind` runs a plan of `precision` under torch.autocast (fp32 master weights and
    gradients, a 16-bit copy of each weight cast for its products): one data rank, and DDP, in bf16 or fp16."""
    return kind == "autocast" or (kind == "ddp" and precision in ("bf16", "fp16"))


def compile_unit(plan: Plan) -> str:
    """What `compile=on` compiles in a (resolved) plan: "model", the whole model as one graph, where the plan
    splits nothing (one process: no engine hooks a block, and a forward or backward is one compiled region, as
    in the plain compiled loop); "block" otherwise, each block on its own (torchtitan's way: FSDP2, DDP, the
    ZeRO engine and the other axes act on blocks from outside the compiled code)."""
    assert plan.dp is not None, "resolve the plan first"
    return "model" if plan.world_size == 1 and plan.ep == 1 else "block"


# ----------------------------------------------------------------------------- degrees and defaults
def _resolve_degrees(plan: Plan, facts: RunFacts) -> Plan:
    """dp from the world size, the device's defaults for precision and compile."""
    world = facts.world_size
    if facts.device not in DEVICES:
        raise ValueError(f"device {facts.device!r} is not valid; valid: {', '.join(DEVICES)}")
    if world < 1:
        raise ValueError(f"world size {world} must be >= 1")
    others = plan.non_dp_product
    if plan.dp is None:
        if world % others:
            raise ValueError(
                f"plan {plan} needs a multiple of {others} processes (fsdp*tp*pp*cp = {others}); "
                f"got {world}; valid: {', '.join(str(others * k) for k in range(1, 5))}, ..."
            )
        plan = dataclasses.replace(plan, dp=world // others)
    elif plan.dp * others != world:
        raise ValueError(
            f"plan {plan} uses dp*fsdp*tp*pp*cp = {plan.dp * others} processes but the world size is "
            f"{world}; leave dp out to let it take what the other axes leave"
        )
    defaults = DEVICE_DEFAULTS[facts.device] | ({"precision": "bf16"} if plan.fp8 else {})  # fp8: bf16 around it
    unset: dict[str, Any] = {k: v for k, v in defaults.items() if getattr(plan, k) is None}
    return dataclasses.replace(plan, **unset) if unset else plan


def _choose_defaults(plan: Plan, facts: RunFacts) -> tuple[Plan, list[str]]:
    """Options left out (None) take their usual value where valid, else the nearest valid one
    (micro-batches: at least pp where possible, and of two equally near, the fewer)."""
    notes: list[str] = []
    sp = plan.sp
    if sp is None:
        sp = True
        if plan.tp > 1 and facts.seq_len is not None and facts.seq_len % plan.tp:
            sp = False
            notes.append(f"sp=off: sequence-parallel norms need the sequence length {facts.seq_len} to split "
                         f"over tp={plan.tp}")
    vpp = plan.vpp if plan.vpp is not None else (2 if plan.sched == "interleaved" else 1)
    zero = plan.zero
    if zero is None:
        zero = 3
        trial = dataclasses.replace(plan, sp=sp, vpp=vpp, zero=3)
        if plan.fsdp > 1 and plan.sched == "zb" and _engine_refusal(trial, facts) is not None:
            zero = 2
            notes.append("zero=2: zero-bubble pipelines run on shoal's ZeRO-1/2 engine, not on FSDP2 (ZeRO-3)")
    plan = dataclasses.replace(plan, sp=sp, vpp=vpp, zero=zero)
    if plan.vocab is None:
        plan = dataclasses.replace(plan, vocab=default_vocab(plan, facts))
    if plan.mb is None and plan.pp > 1 and facts.global_batch is not None and \
            facts.global_batch % plan.data_ranks == 0:
        local = facts.global_batch // plan.data_ranks
        usual = 2 * plan.pp
        valid = [m for m in _divisors(local) if plan.sched != "interleaved" or m % plan.pp == 0]
        if valid:
            mb = min(valid, key=lambda m: (m < plan.pp, abs(m - usual), m))
            if mb != usual:
                notes.append(f"mb={mb}: the usual 2*pp = {usual} micro-batches do not divide the {local} sequences "
                             "each pipeline gets per step")
            plan = dataclasses.replace(plan, mb=mb)
    return plan, notes


# ----------------------------------------------------------------------------- the rules
Rule = Callable[[Plan, RunFacts], "str | None"]


def _auto_rule(plan: Plan, facts: RunFacts) -> str | None:
    if plan.auto:
        return ("plan 'auto' is chosen before the model is parallelized: `shoal train --plan auto` does it, "
                "or in Python shoal.calibration.auto_plan.choose(...); valid: the chosen plan, e.g. dp2 or fsdp2,tp2")
    return None


def _expert_degree_rule(plan: Plan, facts: RunFacts) -> str | None:
    data = plan.data_ranks * plan.cp
    if facts.world_size % plan.ep or data % plan.ep:
        return (f"ep={plan.ep} must divide the ranks that see different tokens (dp*fsdp*cp = {data}); "
                f"valid: {divisor_list(data)}")
    return None


def _tensor_rule(plan: Plan, facts: RunFacts) -> str | None:
    model = facts.text_model
    if model is not None and plan.tp > 1:
        sizes = [("attention heads", model.num_heads), ("KV heads", model.kv_heads),
                 ("FFN hidden size", model.ffn_dim), ("vocabulary size", model.vocab_size)]
        if model.num_shared_experts and model.shared_ffn_dim:
            sizes.append(("shared-expert hidden size", model.shared_ffn_dim))
        if model.dense_ffn_dim:
            sizes.append(("dense-layer FFN hidden size", model.dense_ffn_dim))
        common = math.gcd(*(size for _, size in sizes))  # a valid tp divides every one of them
        for what, size in sizes:
            if size % plan.tp:
                return f"tp={plan.tp} does not divide {size} {what}; valid: tp in {divisor_list(common)}"
    seq = facts.seq_len
    if seq is not None and plan.tp > 1 and plan.sp and seq % plan.tp:
        return (f"tp={plan.tp} with sequence parallelism does not divide the sequence length {seq}; "
                f"valid: tp in {divisor_list(seq)}, or the plan option sp=off")
    return None


def default_vocab(plan: Plan, facts: RunFacts) -> str:
    """What a plan that leaves `vocab` out takes: sharded where `_sharded_vocab_pays`, else gathered (the
    planner's search asks it again for each ZeRO stage and micro-batch size it prices)."""
    return "sharded" if _sharded_vocab_pays(plan, facts) else "gathered"


def _sharded_vocab_pays(plan: Plan, facts: RunFacts) -> bool:
    """The vocabulary tables sharded by rows (shoal/parallel/sharded_vocab.py) where that can run and a
    table (V x D) is at least a micro-batch's logits on one rank (T x V), i.e. D >= T: then a rank holds
    the tables' shards instead of three gathered tables for one more logits buffer, and moves fewer bytes
    (activations and logits instead of each table twice). Not known (no model, batch or sequence): gathered."""
    model, seq = facts.text_model, facts.seq_len
    if model is None or seq is None or facts.global_batch is None or _vocab_refusal(plan) is not None:
        return False
    sequences = facts.micro_batch or max(1, facts.global_batch // plan.data_ranks)
    return model.dim >= sequences * seq / plan.cp


def _vocab_refusal(plan: Plan) -> str | None:
    if plan.fsdp == 1:
        return "vocab=sharded splits the vocabulary tables over the fsdp ranks; valid: add fsdpN"
    others = [f"{axis}{getattr(plan, axis)}" for axis in ("tp", "pp", "ep") if getattr(plan, axis) != 1]
    if others:
        return (f"vocab=sharded runs beside the data axes (dp, fsdp, cp) in this version, and plan {plan} has "
                f"{', '.join(others)}; valid: vocab=gathered (tp splits the tables itself)")
    if plan.zero != 3 or plan.offload:
        what = "offload=on" if plan.offload else f"zero={plan.zero}"
        return f"vocab=sharded runs beside FSDP2 at zero=3 without offload, not with {what}; valid: vocab=gathered"
    return None


def _vocab_rule(plan: Plan, facts: RunFacts) -> str | None:
    if plan.vocab != "sharded":
        return None
    if facts.model is not None and facts.text_model is None:
        return "vocab=sharded is for text transformers' vocabulary tables; valid: vocab=gathered"
    return _vocab_refusal(plan)


def _reduce_rule(plan: Plan, facts: RunFacts) -> str | None:
    if plan.reduce != "fp32" and plan.data_ranks == 1:
        return (f"plan option reduce={plan.reduce} sets the dtype gradients are reduced in over the data ranks, "
                f"and plan {plan} has one; valid: more processes for dp or fsdp, or leave reduce out")
    return None


def _context_rule(plan: Plan, facts: RunFacts) -> str | None:
    if plan.cp == 1:
        return None
    seq, model = facts.seq_len, facts.text_model
    if seq is not None and seq % (2 * plan.cp):
        return (f"cp={plan.cp} splits each sequence into 2*cp = {2 * plan.cp} equal chunks (zig-zag, for balanced "
                f"causal work) and {seq} tokens do not divide; valid: a sequence length that is a multiple of "
                f"{2 * plan.cp}, or cp in {', '.join(str(d) for d in range(1, seq + 1) if seq % (2 * d) == 0)}")
    if model is None:
        return None
    heads = model.num_heads // plan.tp  # each tp rank's heads
    if plan.cp_mode == "a2a" and heads % plan.cp:
        return (f"cp_mode=a2a scatters the {heads} heads of each tp rank over cp={plan.cp}, which does not divide "
                f"them; valid: cp in {divisor_list(heads)}, or cp_mode=ring")
    if model.pos_emb != "rope":
        return (f"cp={plan.cp} with pos_emb={model.pos_emb!r}: positions follow the sequence split for RoPE only "
                "in this version; valid: a RoPE model, or no cp")
    if model.sliding_window:
        return (f"cp={plan.cp} with sliding_window={model.sliding_window}: ring and a2a attention attend over the "
                "whole causal prefix, not a band; valid: no cp, or --set sliding_window=0 (another model)")
    if model.dropout:
        return (f"cp={plan.cp} with dropout={model.dropout}: attention dropout under context parallelism is not "
                "available; valid: --set dropout=0, or no cp")
    if model.num_experts:
        return (f"cp={plan.cp} with a Mixture-of-Experts model (num_experts={model.num_experts}) is not available "
                "in this version; valid: dp, fsdp, tp, pp and ep axes, or a dense model (num_experts=0)")
    return None


def _moe_rule(plan: Plan, facts: RunFacts) -> str | None:
    model = facts.text_model
    if model is None:
        return None
    if plan.ep > 1 and model.num_experts == 0:
        return f"ep={plan.ep} needs a Mixture-of-Experts model; this one has num_experts=0"
    if not model.num_experts:
        return None
    ranks = plan.data_ranks * plan.cp  # the ranks that see other tokens of each micro-batch
    local = facts.global_batch // plan.data_ranks if facts.global_batch else None
    accumulates = facts.micro_batch is not None and local is not None and facts.micro_batch < local
    if model.aux_loss_pooled and accumulates and ranks > 1:
        return (f"aux_loss_pooled with --micro-batch {facts.micro_batch} on {ranks} data ranks: each forward pools "
                f"a micro-batch of every rank ({ranks} x {facts.micro_batch} sequences), which no one-process run "
                "pools, so the loss curve would not be one process's; valid: no --micro-batch, one data rank "
                "(tp), or aux_loss_pooled=false")
    if model.aux_loss_pooled and plan.pp > 1 and plan.micro_batches > 1 and ranks > 1:  # the same, by the pipeline
        return (f"aux_loss_pooled with pp={plan.pp}'s mb={plan.micro_batches} micro-batches on {ranks} data ranks: "
                f"each micro-batch pools one of every rank's, which no one-process run pools, so the loss curve "
                "would not be one process's; valid: mb=1, one data rank (pp, tp), or aux_loss_pooled=false")
    if model.share_moe and plan.fsdp > 1:
        return (f"fsdp={plan.fsdp} with share_moe (WideNet): the one shared MoE layer sits in every block's shard "
                "unit; valid: dp axes, or share_moe=false")
    for axis in ("tp", "pp"):  # pp: the one shared layer would be copied into every stage
        if model.share_moe and getattr(plan, axis) > 1:
            return (f"{axis}={getattr(plan, axis)} with share_moe (WideNet) is not available in this version; "
                    "valid: dp and ep axes, or share_moe=false")
    if model.bias and plan.tp > 1:
        return (f"tp={plan.tp} with an MoE model with bias=true: expert biases are not split over tp in this "
                "version; valid: bias=false, or no tp")
    if plan.offload and (plan.ep > 1 or plan.tp > 1):
        return (f"offload=on with an expert-parallel or tensor-parallel MoE model is not available in this version "
                f"(the experts are sharded outside FSDP2); plan {plan}; valid: offload=off")
    if plan.data_ranks % plan.ep:
        return (f"ep={plan.ep} is carved out of the {plan.data_ranks} data ranks (dp*fsdp) and does not divide "
                f"them; valid: {divisor_list(plan.data_ranks)}")
    if model.num_experts % plan.ep:
        experts = model.num_experts
        return f"ep={plan.ep} does not divide {experts} experts; valid: ep in {divisor_list(experts)}"
    replicas = plan.data_ranks // plan.ep  # the data ranks outside ep, which shard the experts under fsdp
    if plan.fsdp > 1 and (plan.ep > 1 or plan.tp > 1) and model.dim % replicas:
        return (f"fsdp={plan.fsdp} with ep={plan.ep}, tp={plan.tp} shards every expert's model dim {model.dim} over "
                f"the {replicas} data ranks outside ep, which do not divide it; valid: (dp*fsdp)/ep in "
                f"{divisor_list(model.dim)}")
    return None


def _family_rule(plan: Plan, facts: RunFacts) -> str | None:
    """A model family runs under the data axes (dp, fsdp at any zero stage) and the axes its adapter takes
    (shoal.models.adapter), within what its own rule allows (a family an experiment registers may bring one)."""
    family = family_of_config(facts.model) if facts.model is not None else None
    if family is None:
        return None
    adapter = family.adapter
    for axis in FAMILY_AXES:
        if not adapter.takes(axis) and getattr(plan, axis) > 1:
            axes = ["dp", "fsdp", *(a for a in FAMILY_AXES if adapter.takes(a))]
            examples = [f"{a}2" for a in axes] + ([f"dp2,{axes[-1]}2"] if len(axes) > 2 else [])
            return (f"{axis}={getattr(plan, axis)} with the {adapter.family} is not available: it trains under "
                    f"{_listed(axes, 'and')}; valid: plans such as {_listed(examples, 'or')}")
    return family.plan_rule(plan, facts) if family.plan_rule is not None else None


def _listed(words: list[str], last: str) -> str:
    """"a, b and c" (or "a, b or c")."""
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else words[0]


def _batch_rule(plan: Plan, facts: RunFacts) -> str | None:
    batch = facts.global_batch
    if batch is None:
        return None
    if batch % plan.data_ranks:
        return (f"global batch {batch} is not divisible by the {plan.data_ranks} data-parallel ranks (dp*fsdp); "
                f"valid: multiples of {plan.data_ranks}")
    local = batch // plan.data_ranks
    micro = facts.micro_batch
    if micro is not None and plan.pp > 1:
        return (f"--micro-batch {micro} sets gradient accumulation, and plan {plan} has a pipeline, whose "
                "micro-batches are the plan option mb=; valid: leave --micro-batch out, or set mb")
    if micro is not None and (micro < 1 or local % micro):
        return (f"--micro-batch {micro} does not divide the {local} sequences each of the {plan.data_ranks} data "
                f"ranks gets (global batch {batch}); valid: {divisor_list(local)}")
    return None


def _pipeline_rule(plan: Plan, facts: RunFacts) -> str | None:
    if plan.pp == 1:
        return None
    assert plan.vpp is not None, "the rules see plans whose options are chosen"
    layers = facts.layers
    if layers is not None and plan.pp > layers:
        return f"pp={plan.pp} exceeds the model's {layers} layers; valid: 1..{layers}"
    reason = schedule_refusal(plan.sched, num_ranks=plan.pp, num_micro=plan.micro_batches, vpp=plan.vpp)
    if reason is not None:
        return reason
    stages = plan.pp * plan.vpp
    if layers is not None and stages > layers:
        return (f"pp={plan.pp} x vpp={plan.vpp} = {stages} stages need as many layers; the model has {layers}; "
                f"valid: pp*vpp <= {layers}")
    if layers is not None and plan.split is not None:
        reason = split_refusal(plan.split, num_layers=layers, num_stages=stages)
        if reason is not None:
            return reason
    if facts.global_batch is not None:
        local = facts.global_batch // plan.data_ranks
        if local % plan.micro_batches:
            return (f"mb={plan.micro_batches} does not divide the {local} sequences each pipeline gets per step; "
                    f"valid: {divisor_list(local)}")
    return _engine_refusal(plan, facts)


def _engine_refusal(plan: Plan, facts: RunFacts) -> str | None:
    """A pipeline schedule the plan's data engine cannot run (the module docstring says why)."""
    if plan.pp == 1:
        return None
    assert plan.vpp is not None, "the rules see plans whose options are chosen"
    kind = choose_engine(plan, num_layers=facts.layers or plan.pp * plan.vpp).kind
    if plan.vpp > 1 and kind != "none":
        return (f"sched=interleaved runs with pp, tp and cp only in this version (a data engine per chunk is not "
                f"built yet); plan {plan} uses {kind}; valid: sched=1f1b, gpipe or zb, or no dp/fsdp axis")
    if plan.sched == "zb" and kind == "fsdp2":
        return (f"sched=zb does not run on FSDP2 in this version (its weight passes bypass FSDP2's gradient hooks); "
                f"plan {plan} needs FSDP2 (zero=3, tp or offload with data axes); valid: sched=1f1b or gpipe, or "
                "zero=1/2 without tp")
    return None


def schedule_refusal(sched: str, *, num_ranks: int, num_micro: int, vpp: int) -> str | None:
    """Why a pipeline schedule table cannot be built for these counts (shoal.parallel.schedules asks too)."""
    if sched not in SCHEDULES:
        return f"sched={sched!r} is not a pipeline schedule; valid: {', '.join(SCHEDULES)}"
    for key, value in (("pp", num_ranks), ("mb", num_micro), ("vpp", vpp)):
        if value < 1:
            return f"{key}={value} is not a count; valid: an integer >= 1"
    if (sched == "interleaved") != (vpp > 1):
        return (f"sched={sched} with vpp={vpp}: interleaved schedules run vpp >= 2 chunks per rank, the others one; "
                "valid: sched=interleaved,vpp=2 or another sched with vpp=1")
    if sched == "interleaved" and num_micro % num_ranks:
        return (f"sched=interleaved needs micro-batches in multiples of pp={num_ranks}; mb={num_micro}; "
                f"valid: mb in multiples of {num_ranks}")
    return None


def split_refusal(points: Sequence[int], *, num_layers: int, num_stages: int) -> str | None:
    """Why `split=` (the first layer of every stage but the first) does not split the layers."""
    if len(points) != num_stages - 1 or list(points) != sorted(set(points)) or \
            not all(0 < p < num_layers for p in points):
        return (f"split={'/'.join(map(str, points))} does not split {num_layers} layers into {num_stages} stages; "
                + (f"valid: one layer index in 1..{num_layers - 1} (the second stage's first layer)" if num_stages == 2
                   else f"valid: {num_stages - 1} increasing layer indices in 1..{num_layers - 1} joined by '/' (the "
                   "first layer of each stage after the first)"))
    return None


def _fp8_rule(plan: Plan, facts: RunFacts) -> str | None:
    """fp8= runs the blocks' linear layers in float8 inside a bf16 run (shoal/parallel/float8.py); the GPU's
    compute capability is checked where the device is known (a CUDA GPU below 8.9 has no float8 matmul)."""
    if plan.fp8 is None or plan.precision == "bf16":
        return None
    return (f"fp8={plan.fp8} with precision={plan.precision}: float8 training computes the blocks' linear layers "
            "in float8 and everything else in bf16; valid: precision=bf16, or leave precision out")


def _doc_mask_rule(plan: Plan, facts: RunFacts) -> str | None:
    """--doc-mask on (the model's doc_eos_id) runs where attention is SDPA over whole sequences
    and the model sees the token ids that end documents: dp, fsdp, tp, ep, recompute, compile."""
    model = facts.text_model
    if model is None or getattr(model, "doc_eos_id", -1) < 0:
        return None
    if plan.cp > 1:
        return (f"--doc-mask on with cp={plan.cp}: ring and all-to-all attention over a split sequence have no "
                "document mask in this version; valid: --doc-mask off, or no cp")
    if plan.pp > 1:
        return (f"--doc-mask on with pp={plan.pp}: stages after the first see hidden states, not the token ids "
                "that end documents; valid: --doc-mask off, or no pp")
    return None


_RULES: tuple[Rule, ...] = (_auto_rule, _expert_degree_rule, _family_rule, _tensor_rule, _reduce_rule, _vocab_rule,
                            _context_rule, _moe_rule, _batch_rule, _pipeline_rule, _doc_mask_rule, _fp8_rule)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def divisor_list(n: int) -> str:
    """The divisors of `n`, comma-separated, for a refusal's "valid:" ("none" for n <= 0)."""
    return ", ".join(map(str, _divisors(n))) if n > 0 else "none"
