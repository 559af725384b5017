"""Images in, labelled batches out, for the image classifiers (the Mixer presets).

The default image set is scikit-learn's copy of the UCI optical digits (Alpaydin and Kaynak
1998): 1,797 grey 8x8 images of the digits 0-9, 4-bit pixels (0..16), shipped inside the
scikit-learn package as a 30 KB csv.gz, so it needs no download. It is read from the package's
files directly (scikit-learn itself is not imported: that would import scipy, a few seconds per
process). Another set: an .npz file with `images` (N, H, W) or (N, channels, H, W), floats or
integers, and integer `labels` (N,).

The held-out images are a fixed share of the set (`val_fraction`), chosen by a permutation that
depends on the set alone, not on the run's seed: every run of every seed is scored on the same
images. Training batch `step` is a pure function of (seed, step), as for text
(shoal.data.text.TokenBatches): any number of ranks agree on it without talking, and a resumed
run sees the batches an unbroken one would have. Held-out batches run through the held-out
images in order; the last batch is padded with blank images labelled IGNORE, which count
neither in the loss nor in the accuracy.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from shoal.loss import IGNORE

DIGITS = "digits"
"""The `--data` name of the built-in image set (also what --data left out means for an image model)."""
SPLIT_SEED = 20210905
"""Seed of the held-out split's permutation: a constant, so every run holds out the same images."""


def digits_file() -> Path:
    """Where scikit-learn keeps the digits (ValueError in one line when it is not installed)."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    raise ValueError("the image set 'digits' ships with scikit-learn, which is not installed here; valid: "
                     "pip install scikit-learn, or --data FILE.npz (images and labels)")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 1, 8, 8) float32 in [0, 1], labels (1797,) int64)."""
    with gzip.open(digits_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return (table[:, :64] / 16.0).reshape(-1, 1, 8, 8), table[:, 64].astype(np.int64)


def load_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """An .npz image set: (images (N, channels, H, W) float32, labels (N,) int64)."""
    file = Path(path)
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise ValueError(f"image set {path!r} {what}; valid: --data {DIGITS} (built in) or an .npz file with images "
                         "and labels")
    try:
        with np.load(file) as data:
            images, labels = np.asarray(data["images"]), np.asarray(data["labels"])
    except (KeyError, ValueError, OSError, EOFError) as exc:
        raise ValueError(f"image set {path!r} cannot be read as an .npz with 'images' and 'labels' "
                         f"({' '.join(str(exc).split())[:100]})") from None
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or labels.shape != (images.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"image set {path!r} must hold images (N, H, W) or (N, channels, H, W) and integer labels "
                         f"(N,); got images {images.shape}, labels {labels.dtype} {labels.shape}")
    return images.astype(np.float32), labels.astype(np.int64)


def load_image_set(path: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels `--data` names (None or 'digits': the built-in digits)."""
    return load_digits() if path in (None, DIGITS) else load_npz(str(path))


def split_images(images: np.ndarray, labels: np.ndarray, val_fraction: float) -> tuple[
        tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(training, held-out) images and labels: a fixed permutation's last val_fraction (at least one)."""
    n = len(labels)
    num_val = max(int(n * val_fraction), 1)
    if n - num_val < 1:
        raise ValueError(f"the image set holds {n} images: too few for a training and a held-out split")
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    train, val = order[:-num_val], order[-num_val:]
    return (images[train], labels[train]), (images[val], labels[val])


class ImageBatches:
    """Training batches: the images visited in a seeded random order per epoch."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, *, seed: int) -> None:
        self.images, self.labels, self.seed = torch.from_numpy(images), torch.from_numpy(labels), seed

    # B019: the cache holds at most four epochs' orders of this one set.
    @functools.lru_cache(maxsize=4)  # noqa: B019
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.labels))

    def batch(self, step: int, size: int, part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (B, channels, H, W) and labels (B,) of this rank's slice `part` = (index, count)
        of global batch `step`."""
        index, count = part
        local = size // count
        n = len(self.labels)
        samples = np.arange(step * size + index * local, step * size + (index + 1) * local)
        rows = np.array([self._order(int(s // n))[s % n] for s in samples])
        return self.images[rows], self.labels[rows]


class HeldOutImages:
    """Held-out batches: the images in order, the last batch padded with IGNORE-labelled blanks."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = torch.from_numpy(images), torch.from_numpy(labels)

    def num_batches(self, size: int) -> int:
        """Global batches of `size` that cover every held-out image."""
        return -(-len(self.labels) // size)

    def batch(self, step: int, size: int, part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        index, count = part
        local = size // count
        first = step * size + index * local
        rows = torch.arange(first, first + local)
        real = rows < len(self.labels)
        safe = rows.clamp(max=len(self.labels) - 1)
        images = torch.where(real[:, None, None, None], self.images[safe], 0.0)
        return images, torch.where(real, self.labels[safe], IGNORE)


def check_shape(images: np.ndarray, labels: np.ndarray, *, channels: int, image_size: int, num_classes: int,
                data: str) -> None:
    """ValueError (one line) when the image set does not fit the model's input and classes."""
    shape = tuple(images.shape[1:])
    if shape != (channels, image_size, image_size):
        raise ValueError(f"the image set {data!r} holds images of shape {shape} but the model takes "
                         f"({channels}, {image_size}, {image_size}); valid: --set channels={shape[0]} "
                         f"--set image_size={shape[1]} (square images only)")
    top = int(labels.max()) if len(labels) else 0
    if labels.min() < 0 or top >= num_classes:
        raise ValueError(f"the image set {data!r} has labels up to {top} but the model has num_classes="
                         f"{num_classes}; valid: --set num_classes={top + 1}")


def correct_and_count(logits_BK: torch.Tensor, labels_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(images classified right, images that count) of a batch, as float tensors: IGNORE labels
    (padding) count in neither."""
    counted = labels_B != IGNORE
    right = (logits_BK.argmax(dim=-1) == labels_B) & counted
    return right.sum().float(), counted.sum().float()
