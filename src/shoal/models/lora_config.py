"""Low-rank adapters' settings (Hu et al. 2021, LoRA): which projections, what rank and scale, and how many
parameters they add. Pure (no torch): the command line, the rules and the planner read it; the transformation
that adds the adapters to a model is shoal.models.lora.

A target projection W (out, in) gains A (r, in) and B (out, r); the layer computes W x + (alpha / r) B A drop(x),
with W frozen. Its trainable share is r (in + out) / (in x out).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shoal.models.config import ModelConfig

TARGETS: dict[str, str] = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
                           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
"""Target name (Hugging Face's projection names, short) -> the module inside each block of shoal's Transformer:
q_proj, k_proj, v_proj, o_proj, gate_proj (w1), up_proj (w3) and down_proj (w2)."""

BASES = ("none", "nf4", "int8")
"""The forms a LoRA run's frozen base can be stored in (`--lora base=...`); none: the weights' own dtype."""

NF4_BLOCK = 64
"""Weights per NF4 scale (QLoRA's block size)."""
NF4_SCALER_BLOCK = 256
"""Scales per int8 block of the double quantisation (QLoRA's); smaller where a weight has fewer blocks."""


def nf4_scaler_block(numel: int) -> int:
    """The scaler block size a weight of `numel` elements takes: NF4_SCALER_BLOCK, or its number of blocks
    where that is fewer (a small weight's scales are one block)."""
    return max(1, min(NF4_SCALER_BLOCK, numel // NF4_BLOCK))


def check_quantizable(name: str, shape: tuple[int, ...], base: str) -> None:
    """A one-line ValueError where weight `name` of `shape` cannot be stored as `base`: NF4 needs whole blocks
    of NF4_BLOCK weights, and whole blocks of scales."""
    numel = 1
    for n in shape:
        numel *= n
    if base == "nf4" and (numel % NF4_BLOCK or numel // NF4_BLOCK % nf4_scaler_block(numel)):
        raise ValueError(f"--lora base=nf4: {name} {tuple(shape)} has {numel} weights, not whole blocks of "
                         f"{NF4_BLOCK} (and of {NF4_SCALER_BLOCK} blocks above that); valid: base=int8 or "
                         "base=none for this model")


def base_bytes(in_features: int, out_features: int, base: str) -> float:
    """Bytes a frozen (out, in) weight takes stored as `base` (none: float32): the codes plus their scales
    (nf4: an int8 scale per block, a float32 factor per scaler block and their float32 mean; int8: a float32
    scale and an int8 zero point per row)."""
    numel = in_features * out_features
    if base == "nf4":
        blocks = numel / NF4_BLOCK
        return numel / 2 + blocks + 4 * blocks / nf4_scaler_block(numel) + 4
    if base == "int8":
        return numel + 5 * out_features
    return 4.0 * numel


FFN_TARGETS = ("gate", "up", "down")
"""The targets inside the feed-forward slot (the experts' matrices, where the slot holds an MoE layer)."""


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """The adapters of a run (`--lora r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down`)."""

    r: int = 16
    """Rank of each adapter."""
    alpha: float = 32.0
    """The update is scaled by alpha / r (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's lora_dropout); the frozen path sees the input unchanged."""
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    """Projections that get an adapter, names of TARGETS."""
    init_b_std: float = 0.0
    """B's initial values: zeros (peft's default: the adapted model starts equal to the base), or normal with
    this std (tests, so that A's first gradients are not zero)."""
    base: str = "none"
    """How the frozen weights of the adapted projections are stored (QLoRA-style, shoal.models.quantized_base):
    none (their own dtype), nf4 (4-bit NormalFloat in blocks of 64) or int8 (a scale per row), dequantised in
    forward."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"--lora r={self.r} is not valid; valid: a whole number >= 1")
        if self.alpha <= 0:
            raise ValueError(f"--lora alpha={self.alpha:g} is not valid; valid: a number > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora dropout={self.dropout:g} is not valid; valid: 0 <= dropout < 1")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"--lora targets={','.join(bad) or '(none)'} is not valid; valid: a comma-separated "
                             f"subset of {','.join(TARGETS)}")
        if self.base not in BASES:
            raise ValueError(f"--lora base={self.base} is not valid; valid: {', '.join(BASES)}")

    @property
    def scale(self) -> float:
        """alpha / r: the factor on B A x."""
        return self.alpha / self.r

    @classmethod
    def parse(cls, text: str) -> LoRAConfig:
        """`r=16,alpha=32,dropout=0.05,targets=q,k,v`: keys r, alpha, dropout, targets; a bare word after
        targets= is one more target. Keys left out keep their defaults. A one-line ValueError otherwise."""
        values: dict[str, str] = {}
        targets: list[str] = []
        key = None
        for item in (t.strip() for t in text.split(",")):
            if "=" in item:
                key, _, value = item.partition("=")
                key = key.strip()
                if key not in ("r", "alpha", "dropout", "base", "targets"):
                    raise ValueError(f"--lora key {key!r} is not valid; valid: r, alpha, dropout, base, targets "
                                     "(e.g. r=16,alpha=32,dropout=0.05,base=nf4,targets=q,k,v,o)")
                if key == "targets":
                    targets = [value.strip()] if value.strip() else []
                else:
                    values[key] = value.strip()
            elif key == "targets" and item:
                targets.append(item)
            elif item:
                raise ValueError(f"--lora {text!r}: {item!r} is not key=value; valid: r=16,alpha=32,dropout=0.05,"
                                 "targets=q,k,v,o,gate,up,down")
        try:
            kwargs: dict[str, object] = {k: (int(v) if k == "r" else v if k == "base" else float(v))
                                         for k, v in values.items()}
        except ValueError:
            raise ValueError(f"--lora {text!r}: r takes a whole number, alpha and dropout numbers") from None
        if "targets" in text:
            kwargs["targets"] = tuple(targets)
        return cls(**kwargs)  # type: ignore[arg-type]  # keys checked above

    def text(self) -> str:
        """The form `parse` reads back (base= where it is not none)."""
        base = f",base={self.base}" if self.base != "none" else ""
        return f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g}{base},targets={','.join(self.targets)}"


def block_targets(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, str]:
    """Target -> module path inside a block, for the targets `cfg` has: a GELU MLP's first projection is its up
    projection (feed_forward.w1), and it has no gate."""
    paths = dict(TARGETS)
    if cfg.activation != "swiglu":
        paths.pop("gate")
        paths["up"] = "feed_forward.w1"
    return {t: paths[t] for t in lora.targets if t in paths}


def expert_matrices(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, str]:
    """FFN target -> the experts' stacked matrix it names (shoal.moe.experts.Experts: w1, w3 (E, F, D) and w2
    (E, D, F)), for the FFN targets `cfg` has."""
    return {t: path.rsplit(".", 1)[-1] for t, path in block_targets(cfg, lora).items() if t in FFN_TARGETS}


def check_model(lora: LoRAConfig, cfg: ModelConfig) -> None:
    """A one-line ValueError where `cfg` has none of the targets' projections, or the targets name Mixture-of-Experts
    experts' matrices with settings they do not take: dropout (peft's adapters of 3-D expert weights have none), a
    low-bit base, or experts shared across blocks (share_moe)."""
    if not block_targets(cfg, lora):
        raise ValueError(f"--lora targets={','.join(lora.targets)}: the model has none of these projections; "
                         "valid: q,k,v,o,up,down (and gate with a SwiGLU MLP)")
    if not (cfg.num_experts and expert_matrices(cfg, lora)):
        return
    bad = ("share_moe" if cfg.share_moe else f"dropout={lora.dropout:g}" if lora.dropout
           else f"base={lora.base}" if lora.base != "none" else None)
    if bad is not None:
        raise ValueError(f"--lora targets={','.join(lora.targets)} with {bad}: adapters on Mixture-of-Experts experts' "
                         "matrices take no dropout, a base of their own dtype and experts of their own in each block; "
                         "valid: dropout=0,base=none, or targets among q,k,v,o")


@dataclass(frozen=True)
class Adapted:
    """One kind of adapted matrix of a model: `count` copies (blocks, times experts) of an (out, in) weight."""

    target: str
    in_features: int
    out_features: int
    count: int
    routed: bool = False
    """A routed expert's matrix (split over ep); else a dense projection or a shared expert's."""
    layer: int = 0
    """The block it is in."""


@functools.lru_cache(maxsize=256)
def adapted_matrices(cfg: ModelConfig, lora: LoRAConfig) -> tuple[Adapted, ...]:
    """Every matrix of the model that gets an adapter: attention projections and dense FFNs per block, and in an MoE
    block each routed and shared expert's matrices."""
    D, Q, KV = cfg.dim, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def ffn(F: int) -> dict[str, tuple[int, int]]:
        return {"gate": (D, F), "up": (D, F), "down": (F, D)}

    attention = {"q": (D, Q), "k": (D, KV), "v": (D, KV), "o": (Q, D)}
    out: list[Adapted] = []
    for index in range(cfg.num_layers):
        for target in block_targets(cfg, lora):
            if target in attention:
                out.append(Adapted(target, *attention[target], 1, layer=index))
            elif not cfg.is_moe_layer(index):
                out.append(Adapted(target, *ffn(cfg.dense_width)[target], 1, layer=index))
            else:
                out.append(Adapted(target, *ffn(cfg.ffn_dim)[target], cfg.num_experts, routed=True, layer=index))
                if cfg.num_shared_experts:
                    out.append(Adapted(target, *ffn(cfg.shared_ffn_dim or cfg.ffn_dim)[target],
                                       cfg.num_shared_experts, layer=index))
    return tuple(out)


def projections(cfg: ModelConfig, lora: LoRAConfig) -> list[tuple[int, int]]:
    """(in, out) of every projection of the model that gets an adapter (an expert's matrices once per expert)."""
    return [(a.in_features, a.out_features) for a in adapted_matrices(cfg, lora) for _ in range(a.count)]


def adapter_params(cfg: ModelConfig, lora: LoRAConfig) -> int:
    """Parameters the adapters add: r (in + out) per adapted projection."""
    return sum(a.count * lora.r * (a.in_features + a.out_features) for a in adapted_matrices(cfg, lora))


def quantized_base_per_rank(cfg: ModelConfig, lora: LoRAConfig, *, layers: int) -> tuple[float, float]:
    """(weights, bytes) of the adapted projections' frozen weights one rank holds for `layers` blocks when the base
    is low-bit (base_bytes each): whole on every rank, as no engine shards them (tp is refused; FSDP leaves them
    whole); (0, 0) for base none. Experts' matrices are never low-bit (check_model)."""
    if lora.base == "none":
        return 0.0, 0.0
    shapes = projections(cfg, lora)
    per_block = layers / cfg.num_layers
    return (float(sum(i * o for i, o in shapes) * per_block),
            sum(base_bytes(i, o, lora.base) for i, o in shapes) * per_block)


def adapted_params(cfg: ModelConfig, lora: LoRAConfig) -> int:
    """Parameters of the projections that get an adapter (in x out each), whose share the adapters are."""
    return sum(a.count * a.in_features * a.out_features for a in adapted_matrices(cfg, lora))


def check_plan(lora: LoRAConfig, *, tp: int, cp: int) -> None:
    """A one-line ValueError for adapter dropout under tp or cp: their ranks draw dropout masks from one generator
    state over their shards of a layer's input (DTensor's offsetting RNG tracker is CUDA-only), which is not shown
    to equal one process's draw; and for a low-bit base under tp (its quantised weights are not split by
    features: an NF4 block or an int8 row's scale would have to be cut along the split, not shown right)."""
    if lora.base != "none" and tp > 1:
        raise ValueError(f"--lora base={lora.base} under tp={tp} is not available; valid: base=none with tp, or a "
                         "plan without tp (dp, fsdp, pp)")
    if lora.dropout > 0 and (tp > 1 or cp > 1):
        axes = ", ".join(f"{name}={d}" for name, d in (("tp", tp), ("cp", cp)) if d > 1)
        raise ValueError(f"--lora dropout={lora.dropout:g} under {axes} is not available; valid: dropout=0 with "
                         "tp or cp, or a plan without them")


ROW_PARALLEL = ("o", "down")
"""Targets whose layer tensor parallelism splits by input features (the rest by output features)."""


def adapter_elements_per_rank(cfg: ModelConfig, lora: LoRAConfig, *, tp: int, layers: int, ep: int = 1) -> float:
    """Adapter parameters one rank holds for `layers` blocks (a model's mean block; shoal.parallel.tensor,
    shoal.parallel.expert): a column-parallel layer's B (out/tp, r) beside its whole A (r, in), a row-parallel
    layer's A (r, in/tp) beside its whole B (out, r); a routed expert's on one ep rank in E/ep."""
    total = 0.0
    for a in adapted_matrices(cfg, lora):
        i, o = a.in_features, a.out_features
        each = lora.r * (i / tp + o if a.target in ROW_PARALLEL else i + o / tp)
        total += each * a.count / (ep if a.routed else 1)
    return total * layers / cfg.num_layers
