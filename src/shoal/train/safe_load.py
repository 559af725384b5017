"""Reading a checkpoint folder without running code from it.

torch.distributed.checkpoint (DCP) reads a checkpoint's `.metadata` with `pickle.load`, and the
non-tensor items of a state dict (an optimizer's hyper-parameters) with `torch.load(...,
weights_only=False)`: a checkpoint folder from someone else could run any code when loaded. shoal
reads both through the two pieces below, which DCP lets a caller pass in (`storage_reader=`,
`planner=`), so the rest of DCP (resharding, the file layout) stays torch's own:
- `SafeReader`: DCP's file-system reader whose metadata unpickler builds only the classes DCP's
  metadata is made of, and refuses anything else naming the class;
- `SafeLoadPlanner`: DCP's default load planner reading non-tensor items with `weights_only=True`
  (plain numbers, strings, lists, tuples, dicts), as DCP already reads the tensors.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name (torch.strided), from a fixed table
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""What a DCP `.metadata` pickle may name (module -> names); torch's dtypes are allowed besides."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names a class that loading would have to build (and so run code of)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and _is_dtype(name)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"names {module}.{name}, which is not one of the classes DCP's metadata is made "
                                    "of (loading it could run code); valid: a checkpoint written by shoal or DCP")


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def read_metadata(stream: Any) -> Metadata:
    """A DCP `.metadata` file's contents, built from the allowed classes only."""
    return _MetadataUnpickler(stream).load()


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with `read_metadata` through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # The same steps as torch's FileSystemReader.read_metadata, with its pickle.load replaced.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # set just above when None
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # The parent's load_bytes (how the value reaches the state dict, flattened or not) stays
        # torch's: it gets the item re-saved after a weights-only load, so what it unpickles holds
        # only the plain types that load allowed.
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:  # torch names the class in a long text: keep the name
            found = re.search(r"GLOBAL (\S+)", str(exc))
            raise UnsafeCheckpointError(f"item {read_item.dest_index.fqn!r} names {found[1] if found else 'a class'}, "
                                        "which is not a plain value (loading it could run code); valid: a "
                                        "checkpoint written by shoal or DCP") from None
        again = io.BytesIO()
        torch.save(item, again)
        again.seek(0)
        super().load_bytes(read_item, again)
