"""The parallel strategy as data.

A `Plan` says how many ways each parallel axis splits the work and how the axes behave.
It is what `--plan` takes ("dp2,tp2,pp2,mb=8") and what `str(plan)` prints back.

Axes (degree after the name): dp replicated data, fsdp sharded data, tp tensor, pp pipeline,
cp context (sequence), ep expert. dp takes up whatever the others leave of the world size;
ep is carved out of the ranks that see different tokens (dp x fsdp x cp).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.models.config import ModelConfig

AXES = ("dp", "fsdp", "tp", "pp", "cp", "ep")
DEVICES = ("cpu", "cuda")
DEVICE_DEFAULTS = {"cpu": {"precision": "fp32", "compile": False}, "cuda": {"precision": "bf16", "compile": True}}
"""Options a plan leaves out take these values on each device: bf16 compute with fp32 master
weights and fp32 gradient reduction on GPUs (what users expect there), plain fp32 on CPUs (no
fast bf16 matmuls; exact parity with a single process). Blocks are compiled on GPUs, where fused
kernels replace a small model's many short ones; on CPUs the cold compile every run starts with
costs more than it saves at the sizes one trains there (bench/gpu_throughput.py compares compiled
and eager on either device; --compile-on-cpu on a CPU)."""
# Mesh dimension order, outermost first: pipeline stages span the slowest links, tensor
# parallel the fastest (the torchtitan / Megatron convention).
MESH_AXES = ("pp", "dp", "fsdp", "cp", "tp")

_CHOICES = {
    "sched": ("gpipe", "1f1b", "interleaved", "zb"),
    "cp_mode": ("ring", "a2a"),
    "ac": ("none", "selective", "full"),
    "precision": ("fp32", "bf16", "fp16"),
    "reduce": ("fp32", "bf16", "fp16"),
    "sp": ("on", "off"),
    "zero": ("1", "2", "3"),
    "offload": ("on", "off"),
    "compile": ("on", "off"),
}
_ON_OFF = ("sp", "offload", "compile")
NEEDS_AXIS = {"zero": "fsdp", "bucket": "fsdp", "offload": "fsdp", "mb": "pp", "sched": "pp", "vpp": "pp", "split": "pp",
              "cp_mode": "cp", "sp": "tp"}
"""Options that act on one axis only: given without that axis they would do nothing, so they
are refused (the other options act on every plan)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How one training run is split across processes."""

    dp: int | None = None
    """Replicated data-parallel degree; None takes whatever the other axes leave."""
    fsdp: int = 1
    """Sharded data-parallel degree (ZeRO)."""
    tp: int = 1
    """Tensor-parallel degree (attention heads and MLP columns split)."""
    pp: int = 1
    """Pipeline-parallel degree (layers split into stages)."""
    cp: int = 1
    """Context-parallel degree (the sequence split, ring self-attention)."""
    ep: int = 1
    """Expert-parallel degree (experts split over data ranks)."""
    zero: int = 3
    """ZeRO stage of the fsdp axis: 1 optimizer state, 2 + gradients, 3 + parameters."""
    bucket: int | None = None
    """Transformer blocks gathered and reduced together (an FSDP2 unit at zero=3, a bucket of the
    ZeRO-1/2 engine): larger units mean fewer, larger collectives and more transient memory.
    None: 2 for zero=1/2, 1 for zero=3."""
    offload: bool = False
    """Keep the fsdp shards (parameters, gradients, optimizer state) in CPU memory; the optimizer
    step runs on the CPU (FSDP2's CPUOffloadPolicy). Needs fsdp > 1."""
    mb: int | None = None
    """Pipeline micro-batches per step (None: 2 x pp)."""
    sched: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved or zb."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved schedules)."""
    split: tuple[int, ...] | None = None
    """The first layer of every pipeline stage but the first (`split=2/5`: layers 0-1, 2-4, 5-);
    None: balanced by cost (shoal.parallel.pipeline.split_layers)."""
    cp_mode: str = "ring"
    """How context parallelism exchanges keys/values: ring (pass K/V) or a2a (all-to-all heads)."""
    sp: bool = True
    """Sequence-parallel norms and residuals between tensor-parallel sublayers."""
    ac: str = "none"
    """Activation recompute: none, selective or full (per block)."""
    precision: str | None = None
    """Parameter/compute precision: fp32, bf16 (fp32 master weights) or fp16 (loss scaling).
    None: the device's default (DEVICE_DEFAULTS), filled in by `resolve`."""
    reduce: str = "fp32"
    """Dtype gradients are reduced (all-reduced / reduce-scattered) in: fp32 (exact sums, the
    default), or bf16/fp16 (half the gradient traffic, rounded sums)."""
    compile: bool | None = None
    """Compile each transformer block with torch.compile (inductor), as torchtitan does: fused
    kernels, and selective recompute decided at compile time. None: the device's default
    (DEVICE_DEFAULTS), filled in by `resolve`."""
    auto: bool = False
    """Ask the planner to choose the plan."""

    def __post_init__(self) -> None:
        # Plan.parse checks the text; a Plan built in Python gets the same one-line errors here.
        for axis in AXES:
            degree = getattr(self, axis)
            if degree is not None and degree < 1:
                raise ValueError(f"plan axis {axis}={degree} needs a degree >= 1")
        if self.zero not in (1, 2, 3):
            raise ValueError(f"plan option zero={self.zero} is not valid; valid: 1, 2, 3")
        for key in ("bucket", "mb", "vpp"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"plan option {key}={value} needs a whole number >= 1")
        for key in ("sched", "cp_mode", "ac", "precision", "reduce"):
            value = getattr(self, key)
            if value is not None and value not in _CHOICES[key]:
                raise ValueError(f"plan option {key}={value!r} is not valid; valid: {', '.join(_CHOICES[key])}")
        defaults = _DEFAULT_OPTIONS or {}
        self._check_axes([k for k in NEEDS_AXIS if k in defaults and getattr(self, k) != defaults[k]])

    def _check_axes(self, keys: list[str]) -> None:
        """ValueError for the first option in `keys` whose axis this plan lacks."""
        for key in keys:
            axis = NEEDS_AXIS[key]
            if getattr(self, axis) == 1:
                value = getattr(self, key)
                shown = ("on" if value else "off") if key in _ON_OFF else value
                raise ValueError(f"plan option {key}={shown} acts on the {axis} axis, which plan {self} lacks "
                                 f"({axis}=1); valid: add {axis}N (e.g. {axis}2,{key}={shown}), or leave {key} out")

    # ------------------------------------------------------------------ parsing / printing
    @classmethod
    def parse(cls, text: str) -> Plan:
        """Parse a plan string such as "dp2,tp2", "fsdp4,zero=1" or "auto"."""
        text = text.strip()
        if not text:
            raise ValueError("empty plan; valid: a comma-separated list such as 'dp2', 'fsdp4,zero=1', 'tp2,pp2' or 'auto'")
        fields: dict[str, object] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                raise ValueError(f"plan {text!r} has an empty item; items are separated by single commas")
            key = part.partition("=")[0].strip().rstrip("0123456789") if "=" not in part else part.partition("=")[0].strip()
            if key in fields:
                raise ValueError(f"plan {text!r} names {key!r} twice")
            if part == "auto":
                fields["auto"] = True
            elif "=" in part:
                key, _, value = part.partition("=")
                fields[key.strip()] = _parse_option(key.strip(), value.strip(), text)
            else:
                name = part.rstrip("0123456789")
                digits = part[len(name):]
                if name not in AXES:
                    raise ValueError(
                        f"unknown plan axis {part!r} in {text!r}; valid axes: "
                        + ", ".join(f"{a}N" for a in AXES) + ", options key=value, or 'auto'"
                    )
                if not digits or int(digits) < 1:
                    raise ValueError(f"plan axis {part!r} needs a degree >= 1, as in '{name}2'")
                fields[name] = int(digits)
        plan = cls(**fields)  # type: ignore[arg-type]
        plan._check_axes([k for k in NEEDS_AXIS if k in fields])  # given, even at its default value
        return plan

    def __str__(self) -> str:
        parts = ["auto"] if self.auto else []
        for axis in AXES:
            degree = getattr(self, axis)
            if degree is not None and (degree != 1 or (axis == "dp" and not parts and self._only_dp())):
                parts.append(f"{axis}{degree}")
        defaults = Plan()
        for key in ("zero", "bucket", "offload", "mb", "sched", "vpp", "split", "cp_mode", "sp", "ac", "precision",
                    "reduce", "compile"):
            value = getattr(self, key)
            if value == getattr(defaults, key):
                continue
            if key in ("zero", "bucket") and self.fsdp == 1:
                continue
            shown = ("on" if value else "off") if key in _ON_OFF else value
            if key == "split":
                shown = "/".join(map(str, value))
            parts.append(f"{key}={shown}")
        return ",".join(parts) if parts else "dp1"

    def _only_dp(self) -> bool:
        return all(getattr(self, a) == 1 for a in AXES if a != "dp")

    # ------------------------------------------------------------------ degrees
    @property
    def non_dp_product(self) -> int:
        return self.fsdp * self.tp * self.pp * self.cp

    def resolve(self, world_size: int, device: str = "cpu") -> Plan:
        """Fill in dp from the world size, and the options left out from the device's defaults
        (DEVICE_DEFAULTS); check that the degrees multiply to the world size."""
        if device not in DEVICES:
            raise ValueError(f"device {device!r} is not valid; valid: {', '.join(DEVICES)}")
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be >= 1")
        others = self.non_dp_product
        if self.dp is None:
            if world_size % others:
                raise ValueError(
                    f"plan {self} needs a multiple of {others} processes (fsdp*tp*pp*cp = {others}); "
                    f"got {world_size}; valid: {', '.join(str(others * k) for k in range(1, 5))}, ..."
                )
            plan = dataclasses.replace(self, dp=world_size // others)
        else:
            plan = self
            if plan.dp * others != world_size:
                raise ValueError(
                    f"plan {self} uses dp*fsdp*tp*pp*cp = {plan.dp * others} processes but the world size is "
                    f"{world_size}; leave dp out to let it take what the other axes leave"
                )
        if world_size % plan.ep or plan.data_ranks * plan.cp % plan.ep:
            raise ValueError(
                f"ep={plan.ep} must divide the ranks that see different tokens (dp*fsdp*cp = "
                f"{plan.data_ranks * plan.cp}); valid: {_divisors(plan.data_ranks * plan.cp)}"
            )
        unset = {k: v for k, v in DEVICE_DEFAULTS[device].items() if getattr(plan, k) is None}
        return dataclasses.replace(plan, **unset) if unset else plan

    @property
    def data_ranks(self) -> int:
        """Number of ranks that see different sequences (dp x fsdp); dp must be resolved."""
        assert self.dp is not None, "call Plan.resolve(world_size) first"
        return self.dp * self.fsdp

    @property
    def world_size(self) -> int:
        assert self.dp is not None, "call Plan.resolve(world_size) first"
        return self.dp * self.non_dp_product

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Names and sizes of the device-mesh dimensions (every axis, size-1 ones too)."""
        assert self.dp is not None, "call Plan.resolve(world_size) first"
        return MESH_AXES, tuple(getattr(self, a) for a in MESH_AXES)

    # ------------------------------------------------------------------ validation
    def validate(self, model: ModelConfig, *, global_batch: int, seq_len: int) -> None:
        """Check the (resolved) plan against a model shape and batch; one-line ValueError if wrong."""
        assert self.dp is not None, "call Plan.resolve(world_size) first"
        num_kv = model.num_kv_heads or model.num_heads
        for what, size in (
            ("attention heads", model.num_heads),
            ("KV heads", num_kv),
            ("FFN hidden size", model.ffn_dim),
            ("vocabulary size", model.vocab_size),
        ):
            if size % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {size} {what}; valid: {_divisors(size)}")
        if self.tp > 1 and self.sp and seq_len % self.tp:
            raise ValueError(f"tp={self.tp} with sequence parallelism does not divide the sequence length {seq_len}; "
                             f"valid: tp in {_divisors(seq_len)}, or the plan option sp=off")
        if self.reduce != "fp32" and self.data_ranks == 1:
            raise ValueError(f"plan option reduce={self.reduce} sets the dtype gradients are reduced in over the "
                             f"data ranks, and plan {self} has one; valid: more processes for dp or fsdp, or leave "
                             f"reduce out")
        if self.pp > model.num_layers:
            raise ValueError(f"pp={self.pp} exceeds the model's {model.num_layers} layers; valid: 1..{model.num_layers}")
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ValueError(f"cp={self.cp} splits each sequence into 2*cp = {2 * self.cp} equal chunks (zig-zag, for "
                             f"balanced causal work) and {seq_len} tokens do not divide; valid: a sequence length that "
                             f"is a multiple of {2 * self.cp}, or cp in "
                             f"{', '.join(str(d) for d in range(1, seq_len + 1) if seq_len % (2 * d) == 0)}")
        heads = model.num_heads // self.tp  # each tp rank's heads
        if self.cp > 1 and self.cp_mode == "a2a" and heads % self.cp:
            raise ValueError(f"cp_mode=a2a scatters the {heads} heads of each tp rank over cp={self.cp}, which does "
                             f"not divide them; valid: cp in {_divisors(heads)}, or cp_mode=ring")
        if self.cp > 1 and model.pos_emb != "rope":
            raise ValueError(f"cp={self.cp} with pos_emb={model.pos_emb!r}: positions follow the sequence split "
                             f"for RoPE only in this version; valid: a RoPE model, or no cp")
        if self.cp > 1 and model.dropout:
            raise ValueError(f"cp={self.cp} with dropout={model.dropout}: attention dropout under context "
                             "parallelism is not available; valid: --set dropout=0, or no cp")
        if model.num_experts:
            if self.cp > 1:
                raise ValueError(f"cp={self.cp} with a Mixture-of-Experts model (num_experts={model.num_experts}) is "
                                 "not available in this version; valid: dp, fsdp, tp, pp and ep axes, or a dense "
                                 "model (num_experts=0)")
            if model.share_moe and self.fsdp > 1:
                raise ValueError(f"fsdp={self.fsdp} with share_moe (WideNet): the one shared MoE layer sits in "
                                 "every block's shard unit; valid: dp axes, or share_moe=false")
            for axis in ("tp", "pp"):  # pp: the one shared layer would be copied into every stage
                if model.share_moe and getattr(self, axis) > 1:
                    raise ValueError(f"{axis}={getattr(self, axis)} with share_moe (WideNet) is not available in this "
                                     "version; valid: dp and ep axes, or share_moe=false")
            if model.bias and self.tp > 1:
                raise ValueError(f"tp={self.tp} with an MoE model with bias=true: expert biases are not split over "
                                 "tp in this version; valid: bias=false, or no tp")
            replicas = self.data_ranks // self.ep  # the data ranks outside ep, which shard the experts under fsdp
            sharded = self.fsdp > 1 and (self.ep > 1 or self.tp > 1) and not self.data_ranks % self.ep
            if sharded and model.dim % replicas:
                raise ValueError(f"fsdp={self.fsdp} with ep={self.ep}, tp={self.tp} shards every expert's model dim "
                                 f"{model.dim} over the {replicas} data ranks outside ep, which do not divide it; "
                                 f"valid: (dp*fsdp)/ep in {_divisors(model.dim)}")
        if self.ep > 1:
            if model.num_experts == 0:
                raise ValueError(f"ep={self.ep} needs a Mixture-of-Experts model; this one has num_experts=0")
            if self.data_ranks % self.ep:
                raise ValueError(f"ep={self.ep} is carved out of the {self.data_ranks} data ranks (dp*fsdp) and does "
                                 f"not divide them; valid: {_divisors(self.data_ranks)}")
            if model.num_experts % self.ep:
                raise ValueError(
                    f"ep={self.ep} does not divide {model.num_experts} experts; valid: {_divisors(model.num_experts)}"
                )
        if global_batch % self.data_ranks:
            raise ValueError(
                f"global batch {global_batch} is not divisible by the {self.data_ranks} data-parallel ranks "
                f"(dp*fsdp); valid: multiples of {self.data_ranks}"
            )
        if self.pp > 1:
            if model.tie_embeddings:
                raise ValueError(f"pp={self.pp} with tie_embeddings: the first and last stages would share the "
                                 "embedding; valid: --set tie_embeddings=false, or no pp")
            if (self.sched == "interleaved") != (self.vpp > 1):
                raise ValueError(f"sched={self.sched} with vpp={self.vpp}: interleaved schedules run vpp >= 2 chunks "
                                 "per rank, the others one; valid: sched=interleaved,vpp=2 or another sched with vpp=1")
            if self.pp * self.vpp > model.num_layers:
                raise ValueError(f"pp={self.pp} x vpp={self.vpp} = {self.pp * self.vpp} stages need as many layers; "
                                 f"the model has {model.num_layers}; valid: pp*vpp <= {model.num_layers}")
            if self.split is not None and (len(self.split) != self.pp * self.vpp - 1 or list(self.split) != sorted(
                    set(self.split)) or not all(0 < p < model.num_layers for p in self.split)):
                raise ValueError(f"split={'/'.join(map(str, self.split))} does not split {model.num_layers} layers "
                                 f"into {self.pp * self.vpp} stages; valid: {self.pp * self.vpp - 1} increasing layer "
                                 f"indices in 1..{model.num_layers - 1}")
            if self.sched == "interleaved" and self.micro_batches % self.pp:
                raise ValueError(f"sched=interleaved needs micro-batches in multiples of pp={self.pp}; mb="
                                 f"{self.micro_batches}; valid: mb in multiples of {self.pp}")
            micro = self.micro_batches
            if (global_batch // self.data_ranks) % micro:
                raise ValueError(
                    f"mb={micro} does not divide the {global_batch // self.data_ranks} sequences each pipeline "
                    f"gets per step; valid: {_divisors(global_batch // self.data_ranks)}"
                )

    @property
    def micro_batches(self) -> int:
        return self.mb if self.mb is not None else 2 * self.pp

    # ------------------------------------------------------------------ words
    def describe(self) -> str:
        """The plan in words, one line per axis in use."""
        assert self.dp is not None, "call Plan.resolve(world_size) first"
        lines = [f"plan {self} on {self.world_size} process(es):"]
        if self.pp > 1:
            lines.append(
                f"  pipeline: layers split into {self.pp} stages ({self.sched}, {self.micro_batches} micro-batches"
                + (f", {self.vpp} virtual stages per rank" if self.vpp > 1 else "") + ")"
            )
        if self.tp > 1:
            lines.append(
                f"  tensor: attention heads and MLP columns split {self.tp} ways"
                + (", norms/residuals sequence-sharded" if self.sp else "")
            )
        if self.cp > 1:
            lines.append(f"  context: each sequence split into {self.cp} chunks ({self.cp_mode} attention)")
        if self.fsdp > 1:
            what = {1: "optimizer state", 2: "optimizer state and gradients",
                    3: "parameters, gradients and optimizer state"}[self.zero]
            lines.append(f"  sharded data: ZeRO-{self.zero}, {what} sharded {self.fsdp} ways"
                         + (f", {self.bucket} block(s) per gather/reduce unit" if self.bucket else "")
                         + (", shards kept in CPU memory (optimizer step on the CPU)" if self.offload else ""))
        if self.dp > 1 or self.data_ranks == 1:
            lines.append(f"  data: {self.dp} replica(s), each sees 1/{self.data_ranks} of every global batch")
        if self.ep > 1:
            outside = self.data_ranks // self.ep
            lines.append(f"  expert: experts split {self.ep} ways over the data ranks"
                         + (f", each sharded over the {outside} data ranks outside ep" if self.fsdp > 1 < outside else "")
                         + (f", each expert's FFN split {self.tp} ways like the dense FFN" if self.tp > 1 else ""))
        if self.ac != "none":
            lines.append(f"  recompute: {self.ac} activation checkpointing")
        lines.append(f"  precision: {self.precision}" + (f", gradients reduced in {self.reduce}" if self.reduce != "fp32" else ""))
        if self.compile:
            lines.append("  compile: each transformer block compiled with torch.compile (the first steps pay for it)")
        return "\n".join(lines)


_DEFAULT_OPTIONS: dict[str, object] | None = None  # None while the line below builds the default Plan
_DEFAULT_OPTIONS = {k: getattr(Plan(), k) for k in NEEDS_AXIS}


def _parse_option(key: str, value: str, text: str) -> object:
    if key == "split":
        if not all(p.isdigit() for p in value.split("/")):
            raise ValueError(f"plan option split={value!r} in {text!r} needs layer indices separated by '/', "
                             "such as split=2/5 (the first layer of every stage but the first)")
        return tuple(int(p) for p in value.split("/"))
    if key in ("mb", "vpp", "bucket"):
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"plan option {key}={value!r} in {text!r} needs a whole number >= 1")
        return int(value)
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise ValueError(f"plan option {key}={value!r} is not valid; valid: {', '.join(_CHOICES[key])}")
        if key == "zero":
            return int(value)
        if key in _ON_OFF:
            return value == "on"
        return value
    valid = ", ".join(["mb", "vpp", "split", *_CHOICES, "bucket"])
    raise ValueError(f"unknown plan option {key!r} in {text!r}; valid options: {valid}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) if n > 0 else "none"
