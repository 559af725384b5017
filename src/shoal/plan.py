"""The parallel strategy as data.

A `Plan` says how many ways each parallel axis splits the work and how the axes behave.
It is what `--plan` takes ("dp2,tp2,pp2,mb=8") and what `str(plan)` prints back.

Axes (degree after the name): dp replicated data, fsdp sharded data, tp tensor, pp pipeline,
cp context (sequence), ep expert. dp takes up whatever the others leave of the world size;
ep is carved out of the ranks that see different tokens (dp x fsdp x cp).
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "fsdp", "tp", "pp", "cp", "ep")
# Mesh dimension order, outermost first: pipeline stages span the slowest links, tensor
# parallel the fastest (the torchtitan / Megatron convention).
MESH_AXES = ("pp", "dp", "fsdp", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
"""The pipeline schedules (shoal.parallel.schedules builds each one's table)."""
FP8_RECIPES = ("rowwise", "tensorwise")
"""torchao's float8 training recipes a plan can name (`fp8=`; shoal.parallel.float8 applies them)."""

_CHOICES = {
    "sched": SCHEDULES,
    "cp_mode": ("ring", "a2a"),
    "ac": ("none", "selective", "full"),
    "precision": ("fp32", "bf16", "fp16"),
    "fp8": FP8_RECIPES,
    "reduce": ("fp32", "bf16", "fp16"),
    "sp": ("on", "off"),
    "zero": ("1", "2", "3"),
    "offload": ("on", "off"),
    "compile": ("on", "off"),
    "vocab": ("gathered", "sharded"),
}
_ON_OFF = ("sp", "offload", "compile")
NEEDS_AXIS = {"zero": "fsdp", "bucket": "fsdp", "offload": "fsdp", "vocab": "fsdp", "mb": "pp", "sched": "pp",
              "vpp": "pp", "split": "pp", "cp_mode": "cp", "sp": "tp"}
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
    zero: int | None = None
    """ZeRO stage of the fsdp axis: 1 optimizer state, 2 + gradients, 3 + parameters. None: 3,
    or 2 where the plan's pipeline schedule needs shoal's ZeRO-1/2 engine (shoal.rules)."""
    bucket: int | None = None
    """Transformer blocks gathered and reduced together (an FSDP2 unit at zero=3, a bucket of the
    ZeRO-1/2 engine): larger units mean fewer, larger collectives and more transient memory.
    None: 2 for zero=1/2, 1 for zero=3."""
    offload: bool = False
    """Keep the fsdp shards (parameters, gradients, optimizer state) in CPU memory; the optimizer
    step runs on the CPU (FSDP2's CPUOffloadPolicy). Needs fsdp > 1."""
    vocab: str | None = None
    """How the fsdp axis holds the vocabulary tables (token embedding, classifier): gathered (FSDP2
    units, each table gathered whole for forward and backward) or sharded (rows split over the fsdp
    ranks, never gathered: the activations travel instead, shoal/parallel/sharded_vocab.py). None:
    sharded where a table outweighs a micro-batch's logits on a plan of data axes alone (shoal.rules)."""
    mb: int | None = None
    """Pipeline micro-batches per step. None: 2 x pp, or the valid count nearest it where 2 x pp
    does not divide the sequences each pipeline gets (shoal.rules)."""
    sched: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved or zb."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedules). None: 2 under sched=interleaved,
    else 1."""
    split: tuple[int, ...] | None = None
    """The first layer of every pipeline stage but the first (`split=2/5`: layers 0-1, 2-4, 5-);
    None: balanced by cost (shoal.parallel.pipeline.split_layers)."""
    cp_mode: str = "ring"
    """How context parallelism exchanges keys/values: ring (pass K/V) or a2a (all-to-all heads)."""
    sp: bool | None = None
    """Sequence-parallel norms and residuals between tensor-parallel sublayers. None: on, unless
    the sequence does not split over tp (shoal.rules)."""
    ac: str = "none"
    """Activation recompute: none, selective or full (per block)."""
    precision: str | None = None
    """Parameter/compute precision: fp32, bf16 (fp32 master weights) or fp16 (loss scaling).
    None: the device's default (shoal.rules.DEVICE_DEFAULTS)."""
    fp8: str | None = None
    """Float8 training of the transformer blocks' linear layers (torchao's float8 training, shoal/parallel/float8.py)
    with the named scaling recipe: rowwise (a scale per row: the accurate one) or tensorwise (a scale per tensor: the
    one FSDP2 gathers in float8). The rest runs in bf16 (`precision` bf16, its default with fp8). None: no float8."""
    reduce: str = "fp32"
    """Dtype gradients are reduced (all-reduced / reduce-scattered) in: fp32 (exact sums, the
    default), or bf16/fp16 (half the gradient traffic, rounded sums)."""
    compile: bool | None = None
    """Compile each transformer block with torch.compile (inductor), as torchtitan does: fused
    kernels, and selective recompute decided at compile time. None: the device's default
    (shoal.rules.DEVICE_DEFAULTS)."""
    auto: bool = False
    """Ask the planner to choose the plan."""

    def __post_init__(self) -> None:
        # Plan.parse checks the text; a Plan built in Python gets the same one-line errors here.
        for axis in AXES:
            degree = getattr(self, axis)
            if degree is not None and degree < 1:
                raise ValueError(f"plan axis {axis}={degree} needs a degree >= 1")
        if self.zero is not None and self.zero not in (1, 2, 3):
            raise ValueError(f"plan option zero={self.zero} is not valid; valid: 1, 2, 3")
        for key in ("bucket", "mb", "vpp"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"plan option {key}={value} needs a whole number >= 1")
        for key in ("sched", "cp_mode", "ac", "precision", "fp8", "reduce", "vocab"):
            value = getattr(self, key)
            if value is not None and value not in _CHOICES[key]:
                raise ValueError(f"plan option {key}={value!r} is not valid; valid: {', '.join(_CHOICES[key])}")
        defaults = _DEFAULT_OPTIONS or {}
        self._check_axes([k for k in NEEDS_AXIS if k in defaults and getattr(self, k) not in
                          (defaults[k], _USUAL.get(k, defaults[k]))])

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
            raise ValueError("empty plan; valid: a comma-separated list such as 'dp2', 'fsdp4,zero=1', "
                             "'tp2,pp2' or 'auto'")
        fields: dict[str, object] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                raise ValueError(f"plan {text!r} has an empty item; items are separated by single commas")
            name = part.partition("=")[0].strip()
            key = name.rstrip("0123456789") if "=" not in part else name
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
                if part in ("mb", "vpp", "split", "bucket", *_CHOICES):  # an option without its value
                    valid = (", ".join(_CHOICES[part]) if part in _CHOICES else "layer indices joined by '/'"
                             if part == "split" else "a whole number >= 1")
                    raise ValueError(f"plan option {part!r} in {text!r} needs a value, as {part}=VALUE; valid: {valid}")
                if name not in AXES:
                    raise ValueError(
                        f"unknown plan axis {part!r} in {text!r}; valid axes: "
                        + ", ".join(f"{a}N" for a in AXES) + ", options key=value, or 'auto'"
                    )
                if not digits or int(digits) < 1:
                    raise ValueError(f"plan axis {part!r} needs a degree >= 1, as in '{name}2'")
                fields[name] = int(digits)
        if fields.get("auto") and len(fields) > 1:  # the planner chooses whole plans, not the rest around fixed axes
            raise ValueError(f"plan {text!r}: 'auto' has the planner choose every axis and stands alone; valid: "
                             "auto by itself, or a plan without it such as dp2 or fsdp2,tp2")
        plan = cls(**fields)  # type: ignore[arg-type]  # values parsed per field above
        plan._check_axes([k for k in NEEDS_AXIS if k in fields])  # given, even at its default value
        return plan

    def __str__(self) -> str:
        parts = ["auto"] if self.auto else []
        for axis in AXES:
            degree = getattr(self, axis)
            if degree is not None and (degree != 1 or (axis == "dp" and not parts and self._only_dp())):
                parts.append(f"{axis}{degree}")
        for key in ("zero", "bucket", "offload", "vocab", "mb", "sched", "vpp", "split", "cp_mode", "sp", "ac",
                    "precision", "fp8", "reduce", "compile"):
            value = getattr(self, key)
            if value is None or value == _USUAL.get(key, getattr(_DEFAULT, key)):
                continue
            if key in ("zero", "bucket", "vocab") and self.fsdp == 1:
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

    @property
    def data_ranks(self) -> int:
        """Number of ranks that see different sequences (dp x fsdp); dp must be resolved."""
        assert self.dp is not None, "resolve the plan first (shoal.rules.resolve)"
        return self.dp * self.fsdp

    @property
    def world_size(self) -> int:
        assert self.dp is not None, "resolve the plan first (shoal.rules.resolve)"
        return self.dp * self.non_dp_product

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Names and sizes of the device-mesh dimensions (every axis, size-1 ones too)."""
        assert self.dp is not None, "resolve the plan first (shoal.rules.resolve)"
        return MESH_AXES, tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def micro_batches(self) -> int:
        return self.mb if self.mb is not None else 2 * self.pp

    # ------------------------------------------------------------------ words
    def describe(self) -> str:
        """The plan in words, one line per axis in use."""
        assert self.dp is not None, "resolve the plan first (shoal.rules.resolve)"
        lines = [f"plan {self} on {self.world_size} process(es):"]
        if self.pp > 1:
            assert self.vpp is not None, "resolve the plan first (shoal.rules.resolve)"
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
            assert self.zero is not None, "resolve the plan first (shoal.rules.resolve)"
            what = {1: "optimizer state", 2: "optimizer state and gradients",
                    3: "parameters, gradients and optimizer state"}[self.zero]
            lines.append(f"  sharded data: ZeRO-{self.zero}, {what} sharded {self.fsdp} ways"
                         + (f", {self.bucket} block(s) per gather/reduce unit" if self.bucket else "")
                         + (", shards kept in CPU memory (optimizer step on the CPU)" if self.offload else "")
                         + (", the vocabulary tables' rows split, never gathered" if self.vocab == "sharded" else ""))
        if self.dp > 1 or self.data_ranks == 1:
            lines.append(f"  data: {self.dp} replica(s), each sees 1/{self.data_ranks} of every global batch")
        if self.ep > 1:
            outside = self.data_ranks // self.ep
            lines.append(f"  expert: experts split {self.ep} ways over the data ranks"
                         + (f", each sharded over the {outside} data ranks outside ep"
                            if self.fsdp > 1 < outside else "")
                         + (f", each expert's FFN split {self.tp} ways like the dense FFN" if self.tp > 1 else ""))
        if self.ac != "none":
            lines.append(f"  recompute: {self.ac} activation checkpointing")
        reduce = f", gradients reduced in {self.reduce}" if self.reduce != "fp32" else ""
        fp8 = f", the blocks' linear layers in float8 ({self.fp8} scaling)" if self.fp8 else ""
        lines.append(f"  precision: {self.precision}{fp8}{reduce}")
        if self.compile:
            lines.append("  compile: each transformer block compiled with torch.compile (the first steps pay for it)")
        return "\n".join(lines)


_DEFAULT_OPTIONS: dict[str, object] | None = None  # None while the line below builds the default Plan
_USUAL: dict[str, object] = {"zero": 3, "sp": True, "vpp": 1, "vocab": "gathered"}
"""The values options left out usually take (shoal.rules says when another is chosen): a resolved
plan prints an option only where it differs from these."""
_DEFAULT = Plan()
_DEFAULT_OPTIONS = {k: getattr(_DEFAULT, k) for k in NEEDS_AXIS}


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

