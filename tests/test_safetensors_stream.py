"""The streaming safetensors writer (shoal/models/safetensors_io.py) against the library's own
reader: every dtype and shape (0-d included) reads back bit for bit, and a tensor that does not
match the header is refused in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shoal.models.safetensors_io import write_streaming


def test_written_file_reads_back_exactly(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen).bfloat16(),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.tensor(2.5, dtype=torch.float16),
               "e": torch.zeros(0, 4)}
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    fetched = []
    path = write_streaming(tmp_path / "w.safetensors", entries, lambda k: fetched.append(k) or tensors[k],
                           {"format": "pt", "source": "test"})
    assert fetched == list(tensors)  # one at a time, in the header's order
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_a_tensor_that_does_not_match_its_header_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tensor a: got torch.float32 \\(2,\\), the header says"):
        write_streaming(tmp_path / "w.safetensors", [("a", torch.float32, (3,))], lambda k: torch.zeros(2), {})
    assert not list(tmp_path.iterdir())  # no file, not even the temporary one
