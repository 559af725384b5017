"""safetensors files in and out: reading a model's weights whole or one slice at a time, and writing
them one tensor at a time; for Hugging Face folders (the layout of the model adapter's weight map,
shoal.models.hf.families) and for shoal's own names (`shoal export`) alike.

Reading. A path is a .safetensors file, or a folder of them: one `model.safetensors`, shards listed
in `model.safetensors.index.json`, or every *.safetensors. `open_pretrained` (`shoal train --init
PATH`) checks the files against the model from their headers alone (names, shapes, dtypes; no tensor
data), so the launcher runs it before any worker starts and refuses bad input in one line. The object
it returns is the `WeightSource` that `parallelize(..., weights=...)` fills each rank's shards from
while materializing (shoal/parallel/materialize.py): a rank asks for the box of each parameter it
holds (its tensor/sharded-data rows and columns, its pipeline stage's layers, its experts) and
safetensors' lazy slices read just that box from the mapped file. `load_hf_state` reads a Hugging
Face folder whole (`shoal.from_hf`, one process).

Dtypes: the file's floating dtype is cast to the parameters' (bf16 files into fp32 training and
the reverse), said once in the log (`describe`). Missing or unexpected tensors are an error
naming the first few, unless `ignore` (glob patterns over shoal names or file keys) covers them:
an ignored missing (or differently shaped) tensor starts from the seed's initial values instead.

Writing. safetensors' own writer (`save_file`) takes every tensor at once, so exporting a model that
way holds the whole model in memory. The format is simple (an 8-byte little-endian header length, a
JSON header of names, dtypes, shapes and byte offsets, then the tensors' bytes in that order), and
every name, dtype and shape is known before any data is read (from a checkpoint's metadata), so
`write_streaming` writes the header first and then each tensor as `fetch` produces it: the peak is
one tensor. The file is written under a temporary name and renamed into place, so a crash leaves no
half file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import re
import struct
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shoal.models import fp8_blocks
from shoal.models.adapter import adapter_of_config
from shoal.models.config import ModelConfig, ModelWarning
from shoal.models.fp8_blocks import FP8_DTYPES, SCALE_SUFFIX, DequantizedView
from shoal.models.hf.common import Box, OpenKey, SliceLayout, read_box
from shoal.models.transformer import Transformer

INDEX = "model.safetensors.index.json"
"""The file of a sharded folder that names the shard holding each tensor."""
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
"""torch dtypes and their names in the safetensors format."""
FLOAT_DTYPES = {DTYPES[dtype]: dtype for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
"""The safetensors dtypes a run can take (cast to the parameters' dtype)."""
_MAX_HEADER = 100 * 2**20


def _shoal_sources(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    if name == "output.weight" and cfg.tie_embeddings:
        return {"tok_embeddings.weight": shape}
    return {name: shape}


def _shoal_read(cfg: ModelConfig, name: str, shape: tuple[int, ...], box: Box, open_key: OpenKey) -> torch.Tensor:
    (key,) = _shoal_sources(cfg, name, shape)
    return read_box(open_key, key, box)


SHOAL = SliceLayout(name="shoal", marker="", sources=_shoal_sources, read_slice=_shoal_read,
                    optional=lambda cfg, key: cfg.tie_embeddings and key == "output.weight")
"""shoal's own names (`shoal export`): stacked experts and every tensor as the model holds them."""


class Pretrained:
    """Weight files checked against a model; reads boxes of its parameters (a `WeightSource`)."""

    def __init__(self, path: Path, cfg: ModelConfig, layout: SliceLayout, files: dict[str, Path],
                 headers: dict[str, tuple[str, tuple[int, ...]]], skipped: set[str],
                 dropped: Sequence[str] = (), block: fp8_blocks.Block | None = None) -> None:
        self.path, self.cfg, self.layout = path, cfg, layout
        self.block = block
        """The block of the file's fp8 weights (shoal.models.fp8_blocks), read as float32 values; None: none."""
        self.dropped = tuple(dropped)
        """File keys the model has no use for that `ignore` let pass: never read."""
        self.files = files
        """File key -> the file holding it."""
        self.headers = headers
        """File key -> (safetensors dtype, shape)."""
        self.skipped = skipped
        """Shoal names that `ignore` leaves to the seed's initial values."""
        self.bytes_read = 0
        """Bytes of tensor data read so far (every box's size)."""
        self._handles: dict[Path, Any] = {}

    def read(self, name: str, shape: tuple[int, ...], box: Box) -> torch.Tensor | None:
        """The `box` of shoal parameter `name` (full `shape`); None for an ignored one."""
        if name in self.skipped:
            return None
        return self.layout.read_slice(self.cfg, name, shape, box, self._open)

    def _open(self, key: str) -> _Counted | DequantizedView:
        if self.block is not None and self.headers[key][0] in FP8_DTYPES:
            return DequantizedView(self._view(key), self._view(key + SCALE_SUFFIX), self.block)
        return self._view(key)

    def _view(self, key: str) -> _Counted:
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return _Counted(self._handles[file].get_slice(key), self)

    def close(self) -> None:
        """Let go of the mapped files."""
        self._handles.clear()

    def file_dtypes(self) -> list[str]:
        """The safetensors dtypes of the tensors read, sorted."""
        return sorted({dtype for dtype, _ in self.headers.values()})

    def describe(self, param_dtype: torch.dtype) -> str:
        """One line for the log: what is read from where, and the cast."""
        dtypes = [str(FLOAT_DTYPES.get(d) or FP8_DTYPES[d]).removeprefix("torch.") for d in self.file_dtypes()]
        target = str(param_dtype).removeprefix("torch.")
        cast = "no cast" if dtypes == [target] else f"cast to {target} parameters"
        if self.block is not None:
            cast = f"fp8 weights times their {self.block[0]}x{self.block[1]} block multipliers, {cast}"
        line = f"init: weights from {self.path} ({self.layout.name} names, {'/'.join(dtypes)} in the file, {cast})"
        if self.skipped:
            names = sorted(self.skipped)
            line += f"; {len(names)} ignored tensor(s) start from the seed instead: {', '.join(names[:3])}"
        if self.dropped:
            line += f"; {len(self.dropped)} ignored tensor(s) of the file left unread: {', '.join(self.dropped[:3])}"
        return line


class _Counted:
    """A safetensors slice that counts the bytes each read returns."""

    def __init__(self, view: Any, owner: Pretrained) -> None:
        self._view, self._owner = view, owner

    def get_shape(self) -> list[int]:
        return list(self._view.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._view[index]
        self._owner.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


class WeightsMismatch(ValueError):
    """The files hold weights of another model than the run's (a family, a tensor's shape, missing or unexpected
    names): where the run's model was a guess (no config.json beside them), the refusal says so."""


def open_pretrained(path: str | Path, cfg: ModelConfig, *, ignore: Sequence[str] = ()) -> Pretrained:
    """The weights at `path` checked against model `cfg` from the files' headers (no tensor data
    is read): one-line ValueErrors for a folder with no weights, a missing or damaged shard,
    missing or unexpected tensors (unless `ignore`d), a shape the model does not have, a dtype
    the run cannot take."""
    path = Path(path)
    patterns = [p.strip() for item in ignore for p in item.split(",") if p.strip()]
    files = _weight_files(path)
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    key_files: dict[str, Path] = {}
    for file in files:
        for key, entry in _read_header(file).items():
            headers[key], key_files[key] = entry, file
    _check_index(path, key_files)
    block = _fp8_block(path, headers)
    layouts = adapter_of_config(cfg).weight_map().SLICE_LAYOUTS
    layout = next((lay for lay in layouts if lay.marker in headers), SHOAL)
    experts = any(".experts." in key for key in headers)
    if experts != bool(cfg.num_experts):  # a family mismatch, which layout.check would word as a field's value
        held, model = ("Mixture-of-Experts", "dense") if experts else ("dense", "Mixture-of-Experts")
        raise WeightsMismatch(f"--init {path} holds a {held} model's weights (expert tensors: "
                              f"{'some' if experts else 'none'}) but the model is {model}; valid: a {held} "
                              f"--model, or weights of a {model} model")
    try:
        layout.check(cfg)
    except ValueError as exc:
        raise WeightsMismatch(f"--init {path} holds {layout.name} weights, but {exc}") from None
    with torch.device("meta"):
        built = Transformer(cfg)
        shapes = {name: tuple(p.shape) for name, p in built.named_parameters()}
        buffers = {name: tuple(b.shape) for name, b in built.state_dict().items() if name not in shapes}
    skipped: set[str] = set()
    used: set[str] = set()
    missing: list[str] = []
    for name, shape in {**shapes, **buffers}.items():
        for key, want in layout.sources(cfg, name, shape).items():
            used.add(key)
            ignored = _matches(patterns, name, key)
            if key not in headers:
                if ignored or name in buffers:  # a buffer the files lack keeps its initial values
                    skipped.add(name)
                else:
                    missing.append(key)
                continue
            dtype, found = headers[key]
            if tuple(found) != tuple(want):
                if ignored:
                    skipped.add(name)
                    continue
                raise WeightsMismatch(f"--init {path}: tensor {key} in {key_files[key].name} has shape "
                                      f"{tuple(found)}, the model expects {tuple(want)} (for {name}); is --model the "
                                      "same model?")
            if dtype in FP8_DTYPES and block is not None:
                used.add(key + SCALE_SUFFIX)
            elif dtype not in FLOAT_DTYPES:
                raise ValueError(f"--init {path}: tensor {key} in {key_files[key].name} is {dtype}, which the run "
                                 f"cannot take as a weight; valid: {', '.join(FLOAT_DTYPES)}")
    for pattern in patterns:  # a pattern that matches nothing is a typo, not a no-op
        if not any(fnmatch.fnmatchcase(n, pattern) for n in (*shapes, *used, *headers)):
            raise ValueError(f"--init-ignore {pattern} matches no tensor of the model or of --init {path}; valid: "
                             f"a glob over the model's names ({', '.join(list(shapes)[:2])}, ...) or the file's "
                             f"({', '.join(list(headers)[:2])}, ...)")
    extra = [k for k in headers if k not in used and not layout.optional(cfg, k)]
    mtp = _mtp_keys(path, extra, cfg) if layout is not SHOAL else []
    unexpected = sorted(k for k in extra if not _matches(patterns, k) and k not in mtp)
    dropped = sorted(k for k in extra if _matches(patterns, k) or k in mtp)
    if missing or unexpected:
        parts = ([f"missing {len(missing)} tensor(s) the model needs ({', '.join(missing[:3])})"] if missing else []) \
            + ([f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])})"] if unexpected else [])
        raise WeightsMismatch(f"--init {path} ({layout.name} names) does not fit the model: {'; '.join(parts)}; "
                              "--init-ignore PATTERN skips tensors by name (glob)")
    read = {k: v for k, v in headers.items() if k in used and k in key_files}
    return Pretrained(path, cfg, layout, {k: key_files[k] for k in read}, read, skipped, dropped, block)


def _fp8_block(path: Path, headers: dict[str, tuple[str, tuple[int, ...]]]) -> fp8_blocks.Block | None:
    """The block of the files' fp8 weights, each checked to have its multipliers (shoal.models.fp8_blocks);
    None when the files hold no fp8 tensor."""
    quantized = [k for k, (dtype, _) in headers.items() if dtype in FP8_DTYPES]
    if not quantized:
        return None
    block = fp8_blocks.block_size(path, f"--init {path}")
    for key in quantized:
        fp8_blocks.check_scales(f"--init {path}", key, headers[key][1], headers.get(key + SCALE_SUFFIX), block)
    return block


def _mtp_keys(path: Path, keys: list[str], cfg: ModelConfig) -> list[str]:
    """Of `keys`, those of the multi-token-prediction layers a config.json beside the weights declares
    (num_nextn_predict_layers, DeepSeek-V3's: model.layers.{num_layers} and above), which transformers
    does not load either: left unread, with a one-line warning."""
    folder = path if path.is_dir() else path.parent
    try:
        declared = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("num_nextn_predict_layers")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(declared, int) or declared < 1:
        return []
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    mtp = [k for k in keys if (m := pattern.match(k)) and int(m.group(1)) >= cfg.num_layers]
    if mtp:
        warnings.warn(ModelWarning(f"--init {path} holds {len(mtp)} tensors of {declared} multi-token-prediction "
                                   f"layer(s) (model.layers.{cfg.num_layers} and above); shoal does not train them "
                                   "and leaves them unread, as transformers does"), stacklevel=3)
    return mtp


def _matches(patterns: Sequence[str], *names: str) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def check_exists(path: str | Path) -> None:
    """--init's PATH refused in one line where nothing is there."""
    if not Path(path).exists():
        raise ValueError(f"--init {Path(path).absolute()}: no such file or folder; valid: a Hugging Face folder of "
                         "safetensors or a file/folder written by shoal export")


def content_digest(path: str | Path) -> str:
    """sha256 over the bytes of the weight files at `path` (`--init`'s files, in their order): what a checkpoint
    of adapters on a frozen base records of that base, so that a resume on other weights is refused."""
    digest = hashlib.sha256()
    for file in _weight_files(Path(path)):
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files at `path`: itself, the shards its index names, model.safetensors, or
    every *.safetensors of a folder."""
    check_exists(path)
    if path.is_file() and path.name != INDEX:
        return [path]
    index = path if path.is_file() else path / INDEX
    if index.is_file():
        try:
            names = sorted(set(read_index(index).values()))
        except ValueError as exc:
            raise ValueError(f"--init {path}: {exc}") from None
        absent = [n for n in names if not (index.parent / n).is_file()]
        if absent:
            raise ValueError(f"--init {path}: shard file {absent[0]} named in {index.name} is missing")
        return [index.parent / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    found = sorted(path.glob("*.safetensors"))
    if not found and (path / "checkpoints").is_dir():  # a run folder: its weights are in checkpoints, not here
        raise ValueError(f"--init {path} is a run folder, whose checkpoints --init does not read; valid: shoal "
                         f"export --run {path} --out W.safetensors, then --init W.safetensors, or --resume {path}")
    if not found:
        raise ValueError(f"--init {path}: the folder holds no weights (no model.safetensors, {INDEX} or "
                         "*.safetensors); valid: a Hugging Face folder of safetensors or shoal export's output")
    return found


def _check_index(path: Path, key_files: dict[str, Path]) -> None:
    """Every tensor an index names is in the shard it names."""
    index = path if path.is_file() and path.name == INDEX else path / INDEX
    if not index.is_file():
        return
    for key, name in read_index(index).items():
        if key_files.get(key, Path()).name != name:
            raise ValueError(f"--init {path}: {INDEX} puts tensor {key} in {name}, which does not hold it")


def read_index(index: Path) -> dict[str, str]:
    """{tensor key: shard file name} from a sharded folder's index; a one-line ValueError if it is none."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise TypeError("its weight_map is no map of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index.name} is not a safetensors index ({exc})") from None
    return dict(weight_map)


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (dtype, shape)} from a safetensors file's header (8-byte length, JSON), checking that
    the file is long enough to hold every tensor it lists."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError("its first 8 bytes are no header's length")
            header = json.loads(f.read(length))
            size = os.fstat(f.fileno()).st_size
        entries = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--init: {file} is not a safetensors file ({exc}); valid: a .safetensors file, a folder of "
                         "them (sharded with model.safetensors.index.json, as Hugging Face writes them) or a "
                         "shoal export") from None
    if 8 + length + end > size:
        raise ValueError(f"--init: {file} is cut short ({size:,} bytes; its header lists {8 + length + end:,}); "
                         "valid: the whole file (a download or copy that finished)")
    return entries


def load_hf_state(folder: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors (one file or an index and its shards)."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            shards = sorted(set(read_index(index).values()))
        except ValueError as exc:
            raise ValueError(f"hf folder {str(folder)!r}: {exc}") from None
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(folder / shard)))
        return _dequantized(state, folder)
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"hf folder {str(folder)!r} holds neither model.safetensors nor {INDEX}; "
                         "valid: a folder written by save_pretrained (safetensors)")
    return _dequantized(load_file(str(single)), folder)


def _dequantized(state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """`state` with its fp8 weights as float32 values (shoal.models.fp8_blocks)."""
    if not any(t.dtype in FP8_DTYPES.values() for t in state.values()):
        return state
    where = f"hf folder {str(folder)!r}"
    return fp8_blocks.dequantize_state(state, fp8_blocks.block_size(folder, where), where)


# ----------------------------------------------------------------------------- writing


def write_streaming(path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                    fetch: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write `entries` (name, dtype, shape) to safetensors file `path`, each tensor's values from
    fetch(name), which must return that dtype and shape; returns `path`."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name} has dtype {dtype}, which safetensors cannot hold; valid: "
                             + ", ".join(map(str, DTYPES)))
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, dtype, shape in entries:
                tensor = fetch(name)
                if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise ValueError(f"tensor {name}: got {tensor.dtype} {tuple(tensor.shape)}, the header says "
                                     f"{dtype} {tuple(shape)}")
                f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written stays behind
        raise
    os.replace(tmp, path)
    return path
