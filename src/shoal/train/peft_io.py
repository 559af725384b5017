"""peft adapter folders in and out: a LoRA run's adapters as `adapter_config.json` and `adapter_model.safetensors`
under peft's names, which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face base model, and
such a folder read back as the settings and initial adapters of a run on that base (`shoal train --init DIR`).

peft names an adapter of module M of the transformers model `base_model.model.M.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r), the layout shoal's adapters have (shoal.models.lora). M is the transformers name of the
shoal projection, from the family's weight map; the rows of a query or key projection are permuted as its weight's
are (shoal rotates interleaved pairs, transformers halves), and permuting W's rows permutes B's alone. Mixtral's
and Qwen3-MoE's experts' adapters go out and come back as peft's adapters of transformers' fused 3-D parameters
(target_parameters). One process, no process group: DCP fills full tensors from the checkpoint as `shoal export`
does.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shoal.models.adapter import adapter_of_config
from shoal.models.config import ModelConfig
from shoal.models.lora import is_adapter
from shoal.models.lora_config import LoRAConfig
from shoal.train.safe_load import SafeLoadPlanner, SafeReader

PEFT_PREFIX = "base_model.model."
"""What peft puts before a transformers module's name in an adapter file."""


def checkpoint_adapters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every adapter tensor of a LoRA run's checkpoint, full, by shoal name."""
    meta = SafeReader(str(checkpoint)).read_metadata()
    stored = {k.removeprefix("model."): item for k, item in meta.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    names = [k for k in stored if is_adapter(k)]
    if not names:
        raise ValueError(f"checkpoint {checkpoint} holds no low-rank adapters; valid: a checkpoint of a "
                         "shoal train --lora run")
    tensors = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in names}
    with warnings.catch_warnings():  # no process group is intended here; DCP warns about it anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": tensors}, checkpoint_id=str(checkpoint), storage_reader=SafeReader(str(checkpoint)),
                 planner=SafeLoadPlanner(), no_dist=True)
    return tensors


def hf_module_names(cfg: ModelConfig, modules: list[str]) -> dict[str, str]:
    """shoal module name (`layers.0.attention.wq`) -> the transformers module it is (`model.layers.0.self_attn.
    q_proj`), by the family's weight map; a one-line ValueError for a family whose projection is fused or
    transposed there (GPT-2's Conv1D c_attn), which peft's adapters do not map to one to one."""
    weight_map = adapter_of_config(cfg).weight_map()
    by_part = {t.parts[0]: t for t in weight_map.hf_layout(cfg) if len(t.parts) == 1}
    out = {}
    for module in modules:
        entry = by_part.get(f"{module}.weight")
        if entry is None or entry.transpose or entry.expert is not None:
            raise ValueError(f"{module} has no transformers projection of its own in the "
                             f"{weight_map.hf_family(cfg)} layout; valid: a Llama-layout family (llama, mistral, "
                             "qwen2, qwen3) for a peft adapter")
        out[module] = entry.name.removesuffix(".weight")
    return out


EXPERT_FAMILIES = ("mixtral", "qwen3_moe")
"""Families whose experts' adapters export: transformers holds their routed experts as `model.layers.{i}.mlp.experts`
with fused 3-D parameters gate_up_proj (E, 2F, D) (gate rows first) and down_proj (E, D, F), and no shared expert."""


def peft_state(adapters: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """shoal's adapter tensors under peft's names and layout, and the adapter_config.json fields that say what they
    adapt (target_modules; for experts' matrices target_parameters, rank_pattern and alpha_pattern)."""
    from shoal.models.hf import llama

    dense = {k: v for k, v in adapters.items() if k.rsplit(".", 1)[-1] in ("lora_A", "lora_B")}
    hf = hf_module_names(cfg, sorted({name.rsplit(".", 1)[0] for name in dense}))
    out = {}
    for name, tensor in dense.items():
        module, leaf = name.rsplit(".", 1)
        if leaf == "lora_B":  # its rows are the weight's: permuted as the weight's
            tensor = llama.to_halves(tensor, llama.rotated_heads(f"{module}.weight", cfg), cfg.head_dim)
        out[f"{PEFT_PREFIX}{hf[module]}.{leaf}.weight"] = tensor.contiguous()
    fields: dict[str, Any] = {"target_modules": sorted({hf[m].rsplit(".", 1)[-1] for m in hf})}
    dense_ffn = sorted(set(fields["target_modules"]) & {"gate_proj", "up_proj", "down_proj"})
    if dense_ffn and cfg.num_experts and adapter_of_config(cfg).weight_map().hf_family(cfg) in EXPERT_FAMILIES:
        raise ValueError(f"the adapters of this MoE model's dense MLP blocks ({','.join(dense_ffn)}) do not export to "
                         "peft: on transformers 5 it reads those target_modules as the experts' fused parameters; "
                         "valid: targets among q,k,v,o, or a model whose every block has experts")
    experts = {k: v for k, v in adapters.items() if k not in dense}
    if experts:
        tensors, expert_fields = _peft_experts(experts, cfg, lora)
        out.update(tensors)
        fields.update(expert_fields)
    return out, fields


def _peft_experts(adapters: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The experts' adapters (shoal.models.lora.LoRAExperts: per matrix A (E, r, in), B (E, out, r)) as peft's
    adapters of transformers' fused 3-D parameters (peft.tuners.lora.ParamWrapper). peft's adapter of a parameter
    (E, out, in) holds lora_A.weight (E r', in), expert e's A the rows e r' .. (e + 1) r', and lora_B.weight
    (out, r' E), expert e's B the columns k E + e. gate_up_proj fuses gate (w1) over up (w3): their two adapters are
    one of rank 2r, A stacked and B block-diagonal, at alpha 2 alpha (the same scale); one of them alone is rank r
    with the other's rows of B zero. peft nests one wrapper per parameter, the last (down_proj) outermost: an
    inner one's names hold `base_layer.` once per wrapper around it."""
    family = adapter_of_config(cfg).weight_map().hf_family(cfg)
    if family not in EXPERT_FAMILIES or cfg.num_shared_experts:
        raise ValueError(f"adapters on the experts of a {family} model do not export to peft; valid: a "
                         f"{' or '.join(EXPERT_FAMILIES)} model, or targets among q,k,v,o")
    matrices = sorted({k.rsplit(".", 1)[-1].split("_")[0] for k in adapters})
    params: list[tuple[str, int, str]] = []  # (transformers parameter, its adapter's rank, shoal matrices)
    if {"w1", "w3"} & set(matrices):
        fused = [m for m in ("w1", "w3") if m in matrices]
        params.append(("gate_up_proj", lora.r * len(fused), ",".join(fused)))
    if "w2" in matrices:
        params.append(("down_proj", lora.r, "w2"))
    layers = sorted({int(k.split(".")[1]) for k in adapters})
    out = {}
    for layer in layers:
        prefix = f"layers.{layer}.feed_forward.experts."
        for depth, (_, rank, which) in enumerate(params):
            a, b = _fused_pair(adapters, prefix, which.split(","))
            E = a.shape[0]
            module = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts." + "base_layer." * (len(params) - 1 - depth)
            out[f"{module}lora_A.weight"] = a.reshape(E * rank, a.shape[-1]).contiguous()
            out[f"{module}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], rank * E).contiguous()
    wide = {f"mlp.experts.{p}": (rank, rank // lora.r) for p, rank, _ in params if rank != lora.r}
    return out, {"target_parameters": [f"mlp.experts.{p}" for p, _, _ in params],
                 "rank_pattern": {k: r for k, (r, _) in wide.items()},
                 "alpha_pattern": {k: lora.alpha * n for k, (_, n) in wide.items()}}


def _fused_pair(adapters: dict[str, torch.Tensor], prefix: str, matrices: list[str]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (E, r', in), B (E, out, r')) of one transformers parameter: w2's own pair, or gate_up_proj's from w1's and
    w3's (A stacked, B block-diagonal; a matrix not adapted has zero rows of B)."""
    if matrices == ["w2"]:
        return adapters[prefix + "w2_lora_A"], adapters[prefix + "w2_lora_B"]
    some = adapters[prefix + f"{matrices[0]}_lora_B"]
    E, F, r = some.shape
    a = torch.cat([adapters[prefix + f"{m}_lora_A"] for m in matrices], dim=1)
    b = some.new_zeros(E, 2 * F, r * len(matrices))
    for k, m in enumerate(matrices):
        rows = slice(0, F) if m == "w1" else slice(F, 2 * F)
        b[:, rows, k * r:(k + 1) * r] = adapters[prefix + f"{m}_lora_B"]
    return a, b


def peft_config(lora: LoRAConfig, fields: dict[str, Any], base: str | None) -> dict[str, Any]:
    """adapter_config.json for peft's LoraConfig: the targets by their transformers leaf names (`fields`, from
    peft_state)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.r, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": [], "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
            "base_model_name_or_path": base, **fields}


def export_lora_adapter(checkpoint: Path | str, out: Path | str) -> Path:
    """Folder `out` (created) with a LoRA run checkpoint's adapters as peft writes them; returns it."""
    from shoal.train.export import _checkpoint_model_config

    checkpoint, out = Path(checkpoint), Path(out)
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    text = state.get("config", {}).get("lora")
    if text is None:
        raise ValueError(f"checkpoint {checkpoint} is not of a LoRA run (no lora in its config); valid: a "
                         "checkpoint of shoal train --lora, or shoal export --out without --lora-adapter")
    cfg = _checkpoint_model_config(checkpoint)
    lora = LoRAConfig.parse(text)
    tensors, fields = peft_state(checkpoint_adapters(checkpoint), cfg, lora)
    base = state.get("lora_base", {}).get("init")
    out.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(lora, fields, base)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return out



def export_merged(checkpoint: Path | str, out: Path | str) -> Path:
    """Hugging Face folder `out` of a LoRA run's checkpoint with its adapters merged into the base weights
    (`merged_state`), which transformers loads as an ordinary model; returns it. The base is rebuilt from its
    source (shoal.train.build.adapted_model)."""
    from shoal.models.lora import merged_state
    from shoal.train.build import adapted_model
    from shoal.train.export import (
        _checkpoint_model_config,
        _checkpoint_tokenizer,
        _copy_files,
        _write_hf,
        special_token_ids,
        tokenizer_files,
    )

    checkpoint, out = Path(checkpoint), Path(out)
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    cfg = _checkpoint_model_config(checkpoint)
    tokenizer = _checkpoint_tokenizer(checkpoint)
    extra_files = tokenizer_files(tokenizer)
    model = adapted_model(cfg, state["config"]["lora"], state.get("lora_base"))
    model.load_state_dict(checkpoint_adapters(checkpoint), strict=False)
    folder = _write_hf(merged_state(model), out, cfg, {"source": str(checkpoint)}, special_token_ids(tokenizer))
    _copy_files(extra_files, folder)
    return folder

PEFT_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}
"""peft's target module names (transformers' Llama-layout projections) -> shoal's LoRA targets."""


def is_peft_folder(path: str | Path) -> bool:
    """Whether `path` is a peft adapter folder (it holds adapter_config.json)."""
    return (Path(path) / "adapter_config.json").is_file()


EXPERT_PARAMETERS = {"mlp.experts.gate_up_proj": ("gate", "up"), "mlp.experts.down_proj": ("down",)}
"""peft's target parameters of transformers' fused experts (EXPERT_FAMILIES) -> the shoal targets they hold."""


def read_peft_config(folder: str | Path) -> tuple[LoRAConfig, str]:
    """(the adapters' settings, the base model's folder) of peft adapter folder `folder`; a one-line ValueError for
    settings shoal does not train (another peft type, rsLoRA, DoRA, per-module ranks other than the experts'
    parameters', scales alpha / r that differ across targets) or a base that is no local folder.

    shoal's run takes one rank and one scale for every target: its r is the folder's largest rank R and its alpha
    scale x R; a target of lower rank is padded to R (read_peft_adapters). An adapter of `mlp.experts.gate_up_proj`
    of rank R becomes the targets gate and up, each of rank R."""
    path = Path(folder) / "adapter_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--init {folder}: {path.name} is not readable JSON ({exc})") from None
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"--init {folder}: a peft adapter of type {config.get('peft_type')} with rsLoRA or DoRA is "
                         "not available; valid: a plain LoRA adapter")
    params = list(config.get("target_parameters") or [])
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    odd = [p for p in [*params, *ranks, *alphas] if p not in EXPERT_PARAMETERS]
    if odd:
        raise ValueError(f"--init {folder}: per-module ranks or target parameters {','.join(odd)} are not shoal's; "
                         f"valid: target_parameters and rank_pattern among {', '.join(EXPERT_PARAMETERS)}")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t not in PEFT_TARGETS]
    if unknown or not (targets or params):
        raise ValueError(f"--init {folder}: target_modules {','.join(unknown) or '(none)'} are not shoal's; valid: "
                         f"{', '.join(PEFT_TARGETS)}")
    r, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    pairs = {t: (r, alpha) for t in targets} | {p: (int(ranks.get(p, r)), float(alphas.get(p, alpha))) for p in params}
    scales = {name: a / rank for name, (rank, a) in pairs.items()}
    if max(scales.values()) - min(scales.values()) > 1e-12 * max(scales.values()):
        raise ValueError(f"--init {folder}: its adapters' scales lora_alpha / r differ across targets ("
                         f"{', '.join(f'{n} {s:g}' for n, s in scales.items())}); valid: one scale for every target, "
                         "which shoal's --lora holds")
    rank = max(rank for rank, _ in pairs.values())
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ValueError(f"--init {folder}: its base_model_name_or_path {base!r} is not a local folder; valid: an "
                         "adapter whose adapter_config.json names its base's folder on this machine")
    named = {PEFT_TARGETS[t] for t in targets} | {t for p in params for t in EXPERT_PARAMETERS[p]}
    lora = LoRAConfig(r=rank, alpha=next(iter(scales.values())) * rank,
                      dropout=float(config.get("lora_dropout", 0.0)),
                      targets=tuple(t for t in PEFT_TARGETS.values() if t in named))
    return lora, str(Path(base).absolute())


def read_peft_adapters(folder: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The adapter tensors of peft folder `folder` under shoal's names and layout (the inverse of `peft_state`), each
    of the run's rank (read_peft_config): a pair of lower rank gains rows of A drawn as a new adapter's A (normal,
    std 1 / sqrt(3 in), from a fixed seed) and zero columns of B, which leave B A unchanged."""
    from safetensors.torch import load_file

    from shoal.models.hf import llama

    rank = read_peft_config(folder)[0].r
    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    weight_map = adapter_of_config(cfg).weight_map()
    by_hf = {t.name.removesuffix(".weight"): t.parts[0].removesuffix(".weight")
             for t in weight_map.hf_layout(cfg) if len(t.parts) == 1 and t.name.endswith(".weight")}
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        wrapper, leaf = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rsplit(".", 1)
        hf_module = wrapper.replace(".base_layer", "")
        module = by_hf.get(hf_module)
        if re.fullmatch(r"model\.layers\.\d+\.mlp\.experts", hf_module) and leaf in ("lora_A", "lora_B"):
            experts.setdefault(wrapper, {})[leaf] = tensor
            continue
        if module is None or leaf not in ("lora_A", "lora_B"):
            raise ValueError(f"--init {folder}: tensor {key} is no adapter of a projection of the base model")
        if leaf == "lora_B":
            tensor = llama.to_pairs(tensor, llama.rotated_heads(f"{module}.weight", cfg), cfg.head_dim)
        out[f"{module}.{leaf}"] = tensor
    if experts:
        out.update(_shoal_experts(experts, cfg, folder))
    return {name: _padded(t, rank, name) for name, t in out.items()}


def _shoal_experts(wrappers: dict[str, dict[str, torch.Tensor]], cfg: ModelConfig, folder: str | Path
                   ) -> dict[str, torch.Tensor]:
    """peft's adapters of transformers' fused expert parameters (by wrapper module: its lora_A and lora_B) as
    shoal's LoRAExperts tensors, the inverse of `_peft_experts`. gate_up_proj's adapter of rank R, A shared by its
    gate rows (w1) and up rows (w3), is two adapters of rank R: w1 (A, B's gate rows) and w3 (A, B's up rows), the
    same function; training then moves the two A's apart. Which parameter a wrapper adapts is read from its shapes
    (gate_up: A (E R, D), B (2F, R E); down: A (E R, F), B (D, R E)), not from the wrappers' nesting order."""
    family = adapter_of_config(cfg).weight_map().hf_family(cfg)
    if family not in EXPERT_FAMILIES or cfg.num_shared_experts:
        raise ValueError(f"--init {folder}: adapters of experts' parameters (target_parameters) do not map onto a "
                         f"{family} model; valid: a {' or '.join(EXPERT_FAMILIES)} model without shared experts")
    E, D, F = cfg.num_experts, cfg.dim, cfg.ffn_dim
    out = {}
    for wrapper, pair in wrappers.items():
        layer = int(wrapper.split(".")[2])
        a, b = pair.get("lora_A"), pair.get("lora_B")
        shapes = None if a is None or b is None else (a.shape[-1], b.shape[0])
        if shapes not in ((D, 2 * F), (F, D)) or a is None or b is None or a.shape[0] % E:
            raise ValueError(f"--init {folder}: {PEFT_PREFIX}{wrapper} holds no adapter of the experts' gate_up_proj "
                             f"or down_proj of this base ({E} experts, dim {D}, ffn {F})")
        R = a.shape[0] // E
        a_ERI = a.reshape(E, R, a.shape[-1])
        b_EOR = b.reshape(b.shape[0], R, E).permute(2, 0, 1)
        prefix = f"layers.{layer}.feed_forward.experts."
        if shapes == (F, D):
            out[prefix + "w2_lora_A"], out[prefix + "w2_lora_B"] = a_ERI, b_EOR
            continue
        for m, rows in (("w1", slice(0, F)), ("w3", slice(F, 2 * F))):
            out[prefix + f"{m}_lora_A"], out[prefix + f"{m}_lora_B"] = a_ERI.clone(), b_EOR[:, rows]
    return {name: t.contiguous() for name, t in out.items()}


def _padded(tensor: torch.Tensor, rank: int, name: str) -> torch.Tensor:
    """Adapter tensor `name` (A (..., r, in) or B (..., out, r)) at rank `rank` >= r: A's new rows normal with std
    1 / sqrt(3 in) from a generator seeded 0, B's new columns zero."""
    is_a = name.endswith("lora_A")
    r = tensor.shape[-2] if is_a else tensor.shape[-1]
    if r == rank:
        return tensor
    if is_a:
        shape = (*tensor.shape[:-2], rank - r, tensor.shape[-1])
        new = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        return torch.cat([tensor, (new / math.sqrt(3 * tensor.shape[-1])).to(tensor.dtype)], dim=-2)
    return torch.cat([tensor, tensor.new_zeros(*tensor.shape[:-1], rank - r)], dim=-1)
