"""Model adapters: what shoal's parallel layer knows about a model family, in one place.

The parallel modules (shoal/parallel/) are generic: where one must know how a family's module
tree is laid out (which blocks repeat, which modules a pipeline's first and last stage keep, where
attention's core sits, which modules tensor parallelism shards and how), it asks the family's
`ModelAdapter`, found by `adapter_for(model)`. An adapter is data and small functions of the
model; it attaches nothing to the model and imports neither torch.distributed nor (at import)
torch, so shoal.rules can ask it which axes a family takes.

Two families today:
- `TRANSFORMER`, shoal's Transformer, and with it every Hugging Face family shoal computes (Llama,
  Mistral, Qwen2/3, Mixtral, Qwen2-MoE, GPT-2): those are the same module tree under different
  config flags, so they share one adapter. Their weight names and layouts to and from Hugging
  Face (one layout per family, chosen by the config: `hf_family(cfg)`) are the adapter's
  `weight_map()`, which export, `--init` and `shoal.from_hf` ask; the parallel layer never does.
- `MIXER`, the image Mixer and Sparse-MLP: data axes and ep only; no Hugging Face layout.

A user's own module has no adapter: it trains under the data axes (dp, fsdp), its blocks found
by shape (shoal.parallel.data.blocks_of), and an axis that needs an adapter says so in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

FAMILY_AXES = ("tp", "pp", "cp", "ep")
"""The axes that need a family's knowledge (dp and fsdp need none: every module takes them)."""

TP_STYLES = ("embedding", "vocab_embedding", "positions", "residual_norm", "attention_input", "ffn_input", "colwise",
             "rowwise", "head_norm", "vocab_head")
"""The names a tensor-parallel plan gives its modules; shoal.parallel.tensor turns each into a style:
- embedding: a lookup table split by columns (each rank 1/t of every row's features);
- vocab_embedding: one split by rows, vocabulary-parallel (tied to the classifier, which shards so);
- positions: learned absolute positions, looked up at this rank's sequence shard under sp;
- residual_norm: a norm over the residual stream (sequence-parallel under sp, else replicated);
- attention_input, ffn_input: a sublayer's input gathered from the residual stream's layout
  (attention takes (x, rotary tables), the MLP (x));
- colwise, rowwise: the first and second projection of a sublayer (rowwise hands its sum back in
  the residual stream's layout);
- head_norm: a norm over each attention head's features, on this rank's heads (Qwen3's q/k norms);
- vocab_head: the classifier, its logits left sharded on the vocabulary.
A block's MoE slot holding a Mixture-of-Experts layer takes the style "moe" instead of its dense
MLP's styles (the parallel layer finds which blocks do, from `moe_slots`)."""


@dataclass(frozen=True, kw_only=True)
class AttentionSeam:
    """Where context parallelism replaces a family's attention: inside every block, the module at
    `module` holds its causal attention kernel in the attribute `core`, (q, k, v, dropout_p) ->
    output, all (B, H, T, E); its forward's positional argument `rope_arg` (None: none) is the
    rotary tables, whose rows must follow the sequence split."""

    module: str
    core: str = "core"
    rope_arg: int | None = None


@dataclass(frozen=True, kw_only=True)
class ModelAdapter:
    """Everything the parallel layer needs to know about one model family's module tree."""

    family: str
    """The family's name, for messages."""
    axes: frozenset[str]
    """The axes of FAMILY_AXES this family takes; an adapter-less model takes none of them."""
    blocks: str
    """The attribute holding the repeated blocks, a ModuleDict keyed "0".."L-1" in order: the units
    that recompute, compile and sharded data parallelism wrap, and that a pipeline splits."""
    embeddings: tuple[str, ...] = ()
    """Modules before the blocks (a pipeline's first stage keeps them; FSDP2 units of their own)."""
    head: tuple[str, ...] = ()
    """Modules after the blocks (the last stage keeps them; one FSDP2 unit)."""
    classifier: str | None = None
    """The module of `head` whose weight matrix costs FLOPs (the last pipeline stage's extra cost)."""
    moe_slots: tuple[str, ...] = ()
    """Paths inside a block where a Mixture-of-Experts layer may sit (shoal.moe.MoELayer)."""
    attention: AttentionSeam | None = None
    """The seam context parallelism replaces (None: the family has no causal attention to split)."""
    tp_plan: Callable[[Any], dict[str, str]] | None = None
    """model -> {module-name pattern: style name of TP_STYLES}, for the modules the model holds
    (a pipeline stage holds some only); `*` in a pattern stands for any block's key."""
    weights: bool = False
    """Whether the family's weight names and layouts map to and from Hugging Face's, by the model's
    config: `weight_map()` is then shoal.models.hf.families (`hf_family`, `hf_layout`, `shoal_to_hf`,
    `hf_to_shoal`, `hf_config`, and `SLICE_LAYOUTS` for reading slices of files)."""

    def __post_init__(self) -> None:
        assert self.axes <= set(FAMILY_AXES), f"{self.family}: axes {sorted(self.axes)} outside {FAMILY_AXES}"
        assert ("tp" in self.axes) == (self.tp_plan is not None), f"{self.family}: tp takes a plan"
        assert ("cp" in self.axes) == (self.attention is not None), f"{self.family}: cp takes an attention seam"
        assert self.classifier is None or self.classifier in self.head, f"{self.family}: the classifier is in the head"

    def takes(self, axis: str) -> bool:
        """Whether this family runs under `axis` (one of FAMILY_AXES) at a degree above 1."""
        assert axis in FAMILY_AXES, axis
        return axis in self.axes

    def block_container(self, model: nn.Module) -> nn.ModuleDict:
        """The ModuleDict of `model`'s blocks (a pipeline stage's: those it kept)."""
        return getattr(model, self.blocks)

    def blocks_of(self, model: nn.Module) -> list[nn.Module]:
        """`model`'s blocks, in order."""
        return list(self.block_container(model).values())

    def weight_map(self) -> ModuleType:
        """The family's Hugging Face weight map (see `weights`); a one-line ValueError if it has none."""
        if not self.weights:
            raise ValueError(f"the {self.family} has no Hugging Face weight layout; valid: shoal's own names "
                             "(shoal export without --hf), or a Transformer family")
        from shoal.models.hf import families  # imports torch: on first use

        return families


def _transformer_tp_plan(model: Any) -> dict[str, str]:
    """shoal's Transformer: attention split by heads, the MLP by columns, the residual stream
    between them in the norms' layout; only the modules this model (or stage) holds."""
    plan: dict[str, str] = {}
    embeddings, output = model.tok_embeddings, model.output
    if embeddings is not None:
        # Tied to the classifier (also on a pipeline's first stage, which holds no classifier but
        # must shard its copy of the table as the last stage does): by rows, the classifier's way.
        tied = (output is not None and output.weight is embeddings.weight) or model.config.tie_embeddings
        plan["tok_embeddings"] = "vocab_embedding" if tied else "embedding"
    if model.pos_embeddings is not None:
        plan["pos_embeddings"] = "positions"
    plan.update({
        "layers.*.attention_norm": "residual_norm",
        "layers.*.attention": "attention_input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "residual_norm",
        "layers.*.feed_forward": "ffn_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
    })
    blocks = list(model.layers.values())
    if any(block.attention.q_norm is not None for block in blocks):
        plan["layers.*.attention.q_norm"] = "head_norm"  # Qwen3's per-head norms
        plan["layers.*.attention.k_norm"] = "head_norm"
    if any(getattr(block.feed_forward, "w3", None) is not None for block in blocks):  # an MoE slot has none
        plan["layers.*.feed_forward.w3"] = "colwise"  # SwiGLU's gate
    if model.norm is not None:
        plan["norm"] = "residual_norm"
    if output is not None:
        plan["output"] = "vocab_head"
    return plan


TRANSFORMER = ModelAdapter(
    family="transformer",
    axes=frozenset(FAMILY_AXES),
    blocks="layers",
    embeddings=("tok_embeddings", "pos_embeddings"),
    head=("norm", "output"),
    classifier="output",
    moe_slots=("feed_forward",),
    attention=AttentionSeam(module="attention", core="core", rope_arg=1),
    tp_plan=_transformer_tp_plan,
    weights=True,
)
"""shoal's Transformer (shoal/models/transformer.py) and the Hugging Face families built as one.
A pipeline stage boundary carries the residual stream, hidden states (B, T, D): the model takes
them in place of token ids when it holds no embeddings, and returns them when it holds no head."""

MIXER = ModelAdapter(
    family="image Mixer (Sparse-MLP)",
    axes=frozenset({"ep"}),
    blocks="layers",
    embeddings=("patch_embed",),
    head=("norm", "output"),
    classifier="output",
    moe_slots=("token_mixing.mlp", "channel_mixing"),
)
"""The image Mixer and Sparse-MLP (shoal/models/mixer.py): no tensor-parallel plan for its blocks,
no pipeline stages (the head pools over all patches), and its patches are not a causal sequence
to split over cp; its MoE_S and MoE_C layers take ep."""


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The adapter of `model`'s family, by its class; None for a module of no known family."""
    from shoal.models.mixer import Mixer
    from shoal.models.transformer import Transformer

    if isinstance(model, Transformer):
        return TRANSFORMER
    if isinstance(model, Mixer):
        return MIXER
    return None


def adapter_of_config(config: Any) -> ModelAdapter:
    """The adapter of the family a model config builds (shoal.models ModelConfig or MixerConfig)."""
    from shoal.models.mixer_config import MixerConfig

    return MIXER if isinstance(config, MixerConfig) else TRANSFORMER


def adapter_with(model: nn.Module, axis: str) -> ModelAdapter:
    """The adapter of `model`'s family when it takes `axis`; a one-line ValueError otherwise."""
    adapter = adapter_for(model)
    if adapter is None:
        hf = " (a transformers model: load its folder with shoal.from_hf)" if hasattr(model, "config") and \
            hasattr(model, "generate") else ""
        raise ValueError(f"{axis} needs a model adapter (shoal.models.adapter) and {type(model).__name__} has none; "
                         f"valid: shoal's Transformer or Mixer{hf}, or the data axes dp and fsdp")
    if not adapter.takes(axis):
        raise ValueError(f"{axis} is not available for the {adapter.family}; it takes "
                         f"{', '.join(sorted(adapter.axes)) or 'no axis'} besides dp and fsdp")
    return adapter
