"""Write a safetensors file one tensor at a time.

safetensors' own writer (`save_file`) takes every tensor at once, so exporting a model that way
holds the whole model in memory. The format is simple (an 8-byte little-endian header length, a
JSON header of names, dtypes, shapes and byte offsets, then the tensors' bytes in that order), and
every name, dtype and shape is known before any data is read (from the checkpoint's metadata), so
this writes the header first and then each tensor as `fetch` produces it: the peak is one tensor.
The file is written under a temporary name and renamed into place, so a crash leaves no half file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
"""torch dtypes and their names in the safetensors format."""


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
