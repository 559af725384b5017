"""Model adapters: what shoal's parallel layer knows about a model family, in one place.

The parallel modules (shoal/parallel/) are generic: where one must know how a family's module
tree is laid out (which blocks repeat, which modules a pipeline's first and last stage keep, where
attention's core sits, which modules tensor parallelism shards and how), it asks the family's
`ModelAdapter`, found by `adapter_for(model)`. An adapter is data and small functions of the
model; it attaches nothing to the model and imports neither torch.distributed nor (at import)
torch, so shoal.rules can ask it which axes a family takes.

The family defined here:
- `TRANSFORMER`, shoal's Transformer, and with it every Hugging Face family shoal computes (Llama,
  Mistral, Qwen2/3, Mixtral, Qwen2-MoE, GPT-2): those are the same module tree under different
  config flags, so they share one adapter. Their weight names and layouts to and from Hugging
  Face (one layout per family, chosen by the config: `hf_family(cfg)`) are the adapter's
  `weight_map()`, which export, `--init` and `shoal.from_hf` ask; the parallel layer never does.
A `Family` joins an adapter to its shape's class, its module's class, its presets and its training task;
`family_of_config(shape)` and `adapter_for(module)` find it. An experiment's family (shoal.experiments)
brings its own and registers it (`register_family`) when it is imported.

A user's own module has no adapter: it trains under the data axes (dp, fsdp), its blocks found
by shape (shoal.parallel.data.blocks_of), and an axis that needs an adapter says so in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from shoal.models.config import PRESETS, ModelConfig

if TYPE_CHECKING:
    from torch import nn

FAMILY_AXES = ("tp", "pp", "cp", "ep")
"""The axes that need a family's knowledge (dp and fsdp need none: every module takes them)."""

TP_STYLES = ("embedding", "vocab_embedding", "positions", "residual_norm", "attention_input", "ffn_input", "colwise",
             "rowwise", "head_norm", "vocab_head", "replicate", "shared_key")
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
- vocab_head: the classifier, its logits left sharded on the vocabulary;
- replicate: a module every rank runs whole on the sublayer's gathered input (latent attention's
  down-projections and their norms), its output's gradient whole on every rank;
- shared_key: a projection every rank runs whole whose output every head uses (latent attention's
  rotary key): its output's gradient, taken on this rank's heads only, is a partial sum over ranks.
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
    """Paths inside a block where a Mixture-of-Experts layer may sit (shoal.moe.layer.MoELayer)."""
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
        **(_latent_attention_tp_plan(model.config) if model.config.latent_attention else {
            "layers.*.attention.wq": "colwise",
            "layers.*.attention.wk": "colwise",
            "layers.*.attention.wv": "colwise",
        }),
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "residual_norm",
        "layers.*.feed_forward": "ffn_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
    })
    blocks = list(model.layers.values())
    if any(getattr(block.attention, "q_norm", None) is not None for block in blocks):
        plan["layers.*.attention.q_norm"] = "head_norm"  # Qwen3's per-head norms
        plan["layers.*.attention.k_norm"] = "head_norm"
    if any(getattr(block.feed_forward, "w3", None) is not None for block in blocks):  # an MoE slot has none
        plan["layers.*.feed_forward.w3"] = "colwise"  # SwiGLU's gate
    if model.norm is not None:
        plan["norm"] = "residual_norm"
    if output is not None:
        plan["output"] = "vocab_head"
    return plan


def _latent_attention_tp_plan(cfg: ModelConfig) -> dict[str, str]:
    """Latent attention (shoal.models.mla) split by heads: the query and key/value up-projections
    column-parallel, the down-projections and their norms replicated on the gathered input, the
    shared rotary key replicated with its gradient summed over the ranks' heads."""
    queries = {"layers.*.attention.wq_a": "replicate", "layers.*.attention.q_a_norm": "replicate",
               "layers.*.attention.wq_b": "colwise"} if cfg.q_lora_rank else {"layers.*.attention.wq": "colwise"}
    return {**queries, "layers.*.attention.wkv_a": "replicate", "layers.*.attention.kv_a_norm": "replicate",
            "layers.*.attention.wkv_b": "colwise", "layers.*.attention.wk_rope": "shared_key"}


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

# ----------------------------------------------------------------------------- the families
class ModelShape(Protocol):
    """What the core reads of any family's shape: a frozen keyword-only dataclass whose fields `--set key=value`
    overrides, with its count of blocks and of parameters."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def num_layers(self) -> int: ...

    def num_params(self, *, active: bool = False) -> int: ...

    def with_overrides(self, pairs: list[str] | dict[str, str]) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class Family:
    """A model family shoal trains: its adapter, its shape's class, its module's class, its presets, and what
    its training and its plans need beyond the text transformer's. Found by its shape (`family_of_config`) or
    its module (`adapter_for`); an experiment registers its own (`register_family`) when it is imported."""

    name: str
    """The `family` key of a stored shape (a run folder's config.toml); the transformer's shape is stored
    without one."""
    adapter: ModelAdapter
    config: type
    """The class of its shapes (a ModelShape)."""
    model: Callable[[], type]
    """Its module's class, imported on first use (it needs torch; the registry does not)."""
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """`--model NAME` -> a shape of this family."""
    task: Callable[[], Any] | None = None
    """Its training task (a shoal.train.task.Task), imported on first use; None: the text language model's."""
    plan_rule: Callable[[Any, Any], str | None] | None = None
    """(plan, shoal.rules.RunFacts) -> why the family cannot run a plan beyond the axes it takes, or None."""


def _transformer() -> type:
    from shoal.models.transformer import Transformer

    return Transformer


_FAMILIES: list[Family] = [Family(name="transformer", adapter=TRANSFORMER, config=ModelConfig, model=_transformer,
                                  presets=PRESETS)]
"""Every registered family, the transformer first (messages list them in this order)."""


def register_family(family: Family) -> None:
    """Make `family` known to the command line, the trainer, the rules and the parallel layer (idempotent)."""
    known = {f.name: f for f in _FAMILIES}
    if family.name in known:
        assert known[family.name] == family, f"two families named {family.name!r}"
        return
    clash = set(family.presets) & {name for f in _FAMILIES for name in f.presets}
    assert not clash, f"{family.name}: presets {sorted(clash)} are another family's"
    _FAMILIES.append(family)


def families() -> tuple[Family, ...]:
    """The registered families, the transformer first."""
    return tuple(_FAMILIES)


def family_of_config(config: Any) -> Family | None:
    """The family whose shapes are of `config`'s class; None for an object of no registered family."""
    return next((f for f in _FAMILIES if type(config) is f.config), None)


def require_family(config: Any) -> Family:
    """The family whose shapes are of `config`'s class; a one-line ValueError for an object of no family."""
    family = family_of_config(config)
    if family is None:
        raise ValueError(f"{type(config).__name__} is no registered model family's shape; valid: "
                         f"{', '.join(f.config.__name__ for f in _FAMILIES)}")
    return family


def family_named(name: str) -> Family:
    """The family a stored shape names; a one-line ValueError naming the known ones otherwise."""
    for family in _FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"model_config family {name!r} is not known here; valid: "
                     f"{', '.join(f.name for f in _FAMILIES)} (an experiment registers its family when "
                     "shoal.experiments is imported)")


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The adapter of `model`'s family, by its class; None for a module of no known family."""
    for family in _FAMILIES:
        if isinstance(model, family.model()):
            return family.adapter
    return None


def adapter_of_config(config: Any) -> ModelAdapter:
    """The adapter of the family a model config builds; a one-line ValueError for a config of no family."""
    return require_family(config).adapter


def adapter_with(model: nn.Module, axis: str) -> ModelAdapter:
    """The adapter of `model`'s family when it takes `axis`; a one-line ValueError otherwise."""
    adapter = adapter_for(model)
    if adapter is None:
        hf = " (a transformers model: load its folder with shoal.from_hf)" if hasattr(model, "config") and \
            hasattr(model, "generate") else ""
        known = " or ".join(family.model().__name__ for family in _FAMILIES)
        raise ValueError(f"{axis} needs a model adapter (shoal.models.adapter) and {type(model).__name__} has none; "
                         f"valid: shoal's {known}{hf}, or the data axes dp and fsdp")
    if not adapter.takes(axis):
        raise ValueError(f"{axis} is not available for the {adapter.family}; it takes "
                         f"{', '.join(sorted(adapter.axes)) or 'no axis'} besides dp and fsdp")
    return adapter
