"""Consolidated single-file weights (safetensors): out of a checkpoint or a live model, and back in.

A DCP checkpoint is a folder of per-rank pieces that only DCP reads; other tools (inference
servers, converters, a notebook) want one file of full tensors. `export_checkpoint` turns a
checkpoint folder into that file in one process, no process group and no model needed: it reads
DCP's metadata for the global shapes, allocates full tensors and lets DCP fill them (that is
DCP's own resharding, to a single unsharded copy). `export_model` writes the same file from a
live, possibly sharded model through its parallel runtime (every rank calls it; rank 0 writes).
`import_weights` loads such a file into a runtime under any plan: every rank reads the full
tensors (safetensors maps the file, nothing is copied twice) and keeps its own shard.

Names are the model's own parameter names without wrapper prefixes ("layers.0.attention.wq.weight").
Only weights travel: optimizer state stays in the checkpoint. With `hf=True` the export is a
Hugging Face folder instead (model.safetensors in the names and layout of the model's family, by
its adapter's weight map (shoal.models.adapter), plus config.json) that `transformers` loads
directly; `import_weights` reads such folders back. When the run's tokens came from a Hugging
Face tokenizer folder (`--tokenizer`, or the manifest of the prepared `--data`), its files are
copied into the folder too, so that `AutoTokenizer.from_pretrained` reads it beside the model (the
byte tokenizer has no files).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError  # the library's own spelling
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from shoal.infra.world import rank
from shoal.models.adapter import TRANSFORMER, adapter_of_config
from shoal.models.config import ModelConfig
from shoal.models.safetensors_io import write_streaming
from shoal.runtime import Runtime
from shoal.train.safe_load import SafeLoadPlanner, SafeReader, UnsafeCheckpointError

MODEL_KEY = "model"  # the top-level key shoal.train.checkpoint saves the model state under


def export_checkpoint(checkpoint: Path | str, out: Path | str, *, metadata: dict[str, str] | None = None,
                      hf: bool = False, config: ModelConfig | None = None, tokenizer: str | None = None) -> Path:
    """Write the model weights of DCP checkpoint folder `checkpoint` to one safetensors file `out`.

    hf: `out` is a Hugging Face folder instead; the model shape is `config`, or else the one
    stored in the checkpoint's trainer state (as `shoal train` writes it), and the tokenizer
    folder whose files go along is `tokenizer`, or else the run's (from the same state)."""
    checkpoint, out = Path(checkpoint), Path(out)
    cfg = (config or _checkpoint_model_config(checkpoint)) if hf else None
    if hf and tokenizer is None and config is None:
        tokenizer = _checkpoint_tokenizer(checkpoint)
    extra_files = tokenizer_files(tokenizer) if hf else []  # before any tensor is written
    try:
        meta = SafeReader(str(checkpoint)).read_metadata()
    except UnsafeCheckpointError as exc:
        raise ValueError(f"checkpoint {checkpoint} is not exported: its DCP metadata {exc}") from None
    except Exception as exc:  # missing folder, no or unreadable .metadata
        raise ValueError(f"checkpoint {checkpoint} cannot be exported: its DCP metadata is unreadable "
                         f"({exc})") from None
    prefix = MODEL_KEY + "."
    stored = {key[len(prefix):]: item for key, item in meta.state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}
    if not stored:
        raise ValueError(f"checkpoint {checkpoint} holds no '{MODEL_KEY}.*' tensors; is it a shoal checkpoint?")

    def fetch(name: str) -> torch.Tensor:  # one tensor at a time: the export's peak is the largest tensor
        item = stored[name]
        tensor = torch.empty(item.size, dtype=item.properties.dtype)
        with warnings.catch_warnings():  # no process group is intended here; DCP warns about it anyway
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({MODEL_KEY: {name: tensor}}, checkpoint_id=str(checkpoint),
                     storage_reader=SafeReader(str(checkpoint)), planner=SafeLoadPlanner(), no_dist=True)
        return tensor

    if cfg is not None:  # refused before reading any weight (a selection bias is read to see whether it is zero)
        weight_map = adapter_of_config(cfg).weight_map()
        biases = [k for k in stored if k.endswith(weight_map.SELECTION_BIAS)]
        cfg = weight_map.writable_config(cfg, lambda: max((fetch(k).abs().max().item() for k in biases), default=0.0))
        weight_map.hf_family(cfg)
    layout = weight_map.hf_layout(cfg) if cfg is not None else []
    needed = [p for t in layout for p in t.parts] if cfg is not None else list(stored)
    missing = [k for k in needed if k not in stored]
    if missing:
        raise ValueError(f"checkpoint {checkpoint} lacks {missing[0]!r}, which the model config needs")

    info = {"format": "pt", "source": str(checkpoint), **{k: str(v) for k, v in (metadata or {}).items()}}
    if cfg is None:
        entries = [(k, stored[k].properties.dtype, tuple(stored[k].size)) for k in needed]
        return _stream(out, entries, fetch, info)
    by_hf = {t.name: t for t in layout}
    entries = [(t.name, stored[t.parts[0]].properties.dtype,
                weight_map.hf_shape(t, [tuple(stored[p].size) for p in t.parts])) for t in layout]
    folder = _hf_folder(out)
    _stream(folder / "model.safetensors", entries,
            lambda hf: weight_map.to_hf_tensor(by_hf[hf], [fetch(p) for p in by_hf[hf].parts], cfg), info)
    _write_hf_config(folder, cfg, special_token_ids(tokenizer))
    _copy_files(extra_files, folder)
    return folder


def _stream(out: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], fetch: Callable[[str], torch.Tensor],
            info: dict[str, str]) -> Path:
    write_streaming(out, entries, fetch, info)
    _usual_permissions(out)
    return out


def export_model(runtime: Runtime, out: Path | str, *, metadata: dict[str, str] | None = None,
                 hf: bool = False, tokenizer: str | None = None) -> Path | None:
    """Write the runtime's full weights to one safetensors file. Collective over the default process
    group when there is one (sharded parameters are gathered); only rank 0 writes and returns the path.

    hf: `out` is a Hugging Face folder instead (shape from the model's own config), with the
    files of the tokenizer folder `tokenizer` copied in when one is given."""
    cfg = _live_model_config(runtime) if hf else None
    if cfg is not None:  # every rank refuses alike, before the weights are gathered
        weight_map = adapter_of_config(cfg).weight_map()
        cfg = weight_map.writable_config(cfg, lambda: _largest_live_bias(runtime, weight_map.SELECTION_BIAS))
        weight_map.hf_family(cfg)
    extra_files = tokenizer_files(tokenizer) if hf else []
    weights = runtime.full_weights()
    if rank() != 0:
        return None
    weights = {k: v.detach() for k, v in weights.items()
               if cfg is None or cfg.router_bias or not k.endswith(weight_map.SELECTION_BIAS)}
    if cfg is not None:
        folder = _write_hf(weights, Path(out), cfg, metadata or {}, special_token_ids(tokenizer))
        _copy_files(extra_files, folder)
        return folder
    return _write(weights, Path(out), metadata or {})


def import_weights(path: Path | str, *, runtime: Runtime, strict: bool = True) -> None:
    """Load a safetensors file of full weights into the runtime's model under any plan (each rank
    keeps its own shard). Collective when the model is sharded.

    A Hugging Face folder (its model.safetensors) or file in a supported family's names is
    converted to shoal's names and layout first."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    try:
        weights = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"weights file {path} cannot be read as safetensors: {exc}") from None
    if TRANSFORMER.weight_map().is_hf_state(weights):  # a transformers family's layout
        cfg = _live_model_config(runtime)
        weights = adapter_of_config(cfg).weight_map().hf_to_shoal(weights, cfg)
    try:
        runtime.load_full_weights(weights, strict=strict)
    except ValueError as exc:
        raise ValueError(f"weights file {path} {exc}") from None


def _write_hf(weights: dict[str, torch.Tensor], out: Path, cfg: ModelConfig, metadata: dict[str, str],
              special: dict[str, int]) -> Path:
    """Folder `out` with model.safetensors (transformers' names) and config.json; returns the folder."""
    _write(adapter_of_config(cfg).weight_map().shoal_to_hf(weights, cfg), _hf_folder(out) / "model.safetensors",
           metadata)
    _write_hf_config(out, cfg, special)
    return out


def _hf_folder(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--hf export goes to a folder, but {str(out)!r} is a file")
    return out


def special_token_ids(tokenizer: str | None) -> dict[str, int]:
    """The config.json entries that tell transformers' generate where text ends (and begins): a Hugging Face
    tokenizer's own ids, byte 0 for the byte tokenizer (the EOS `shoal data prepare` ends documents with), none
    without a tokenizer."""
    if tokenizer is None:
        return {}
    if tokenizer == "byte":
        return {"eos_token_id": 0}
    from shoal.data.text import HFTokenizer

    return HFTokenizer(tokenizer).special_ids()


def _write_hf_config(out: Path, cfg: ModelConfig, special: dict[str, int]) -> None:
    tmp = out / f".config.json.tmp-{os.getpid()}"
    config = {**adapter_of_config(cfg).weight_map().hf_config(cfg), **special}
    tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _usual_permissions(tmp)
    os.replace(tmp, out / "config.json")


def _checkpoint_model_config(checkpoint: Path) -> ModelConfig:
    """The model shape stored in a `shoal train` checkpoint's trainer_state.json."""
    from shoal.train.config import from_flat, resolve_model  # the trainer's config, only when needed

    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint {checkpoint} has no readable trainer_state.json for --hf ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise ValueError(f"checkpoint {checkpoint} stores no run config in its trainer_state.json (not written "
                         "by `shoal train`?); give the model shape as export_checkpoint(..., config=ModelConfig)")
    model = resolve_model(from_flat(state["config"]))
    if not isinstance(model, ModelConfig):
        from shoal.train.task import task_for

        raise ValueError(task_for(model).message("export_hf", checkpoint=checkpoint))
    return model


def _checkpoint_tokenizer(checkpoint: Path) -> str:
    """The tokenizer a `shoal train` checkpoint's run read its tokens with: `--tokenizer`, or the
    prepared `--data`'s (its manifest names it); "byte" for the byte tokenizer."""
    from shoal.data.text import resolve_tokenizer
    from shoal.train.config import from_flat  # the trainer's config, only when needed

    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))  # read by the caller already
    data = from_flat(state["config"]).data
    name = data.tokenizer
    if name == "byte":
        try:
            name = resolve_tokenizer(data, given=False).tokenizer
        except (OSError, ValueError, KeyError):  # the prepared data has moved since: the byte tokenizer recorded
            pass
    return name


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
"""The files of a Hugging Face tokenizer folder (those transformers' tokenizers save), copied on export."""


def tokenizer_files(tokenizer: str | None) -> list[Path]:
    """The files of tokenizer folder `tokenizer` to copy with an export (None or "byte": none);
    a folder without any (moved since the run) raises ValueError in one line."""
    if tokenizer is None or tokenizer == "byte":
        return []
    files = [Path(tokenizer) / n for n in TOKENIZER_FILES if (Path(tokenizer) / n).is_file()]
    if not files:
        raise ValueError(f"tokenizer {tokenizer!r} has none of the files to copy with the export "
                         f"({', '.join(TOKENIZER_FILES[:3])}, ...); valid: a Hugging Face tokenizer folder")
    return files


def _copy_files(files: list[Path], folder: Path) -> None:
    for source in files:
        tmp = folder / f".{source.name}.tmp-{os.getpid()}"
        shutil.copyfile(source, tmp)
        _usual_permissions(tmp)
        os.replace(tmp, folder / source.name)


def _largest_live_bias(runtime: Runtime, suffix: str) -> float:
    """The largest |selection bias| (buffers named `...suffix`) in the whole model. Every rank holds its layers'
    biases whole (a router is replicated); under a pipeline each holds its stage's, hence the reduction over
    the default process group, which every rank of a sharded runtime joins."""
    local = [b.to_local() if isinstance(b, DTensor) else b
             for part in runtime.parts for name, b in part.named_buffers() if name.endswith(suffix)]
    largest = torch.stack([b.detach().abs().max().float().cpu() for b in local]).max() if local else torch.zeros(())
    if runtime.mesh is not None:
        largest = largest.to(runtime.mesh.device_type)  # NCCL reduces only GPU tensors
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest)


def _live_model_config(runtime: Runtime) -> ModelConfig:
    """The ModelConfig of the shoal Transformer the runtime trains."""
    for module in runtime.parts[0].modules():
        config = getattr(module, "config", None)
        if isinstance(config, ModelConfig):
            return config
    raise ValueError(f"{type(runtime.parts[0]).__name__} holds no shoal Transformer (no ModelConfig `config`); "
                     "Hugging Face weights need one to convert")


def _write(weights: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> Path:
    """Write atomically: a temporary file renamed into place, so a crash never leaves half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    # Tied weights are separate copies here (safetensors refuses shared storage); clone to be sure.
    save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(tmp),
              metadata={"format": "pt", **{k: str(v) for k, v in metadata.items()}})
    _usual_permissions(tmp)
    os.replace(tmp, out)
    return out


def _usual_permissions(path: Path) -> None:
    """The mode a plain `open(path, "w")` would have given (0666 less the umask): safetensors
    creates its files 0600, which other users of a shared model folder could not read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
