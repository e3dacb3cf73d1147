"""The shipped handwritten digits (UCI optdigits test set, as bundled by scikit-learn).

1,797 grey 8×8 images, pixel values 0..16 (counts of "on" pixels in 4×4 blocks of a 32×32
bitmap), labels 0..9; stored in ``corpora/digits/digits.npz`` (see ``corpora/digits/SOURCE.md``).

Split (fixed, in file order, not stratified): the first ``floor(0.8 * 1797) = 1437`` images are
train, the last 360 validation. Every class appears in both (train 141–146 per class,
val 33–37).

Preprocessing, per sample (so large ``image_size`` costs no memory up front):
pixels / 16 → [0, 1]; bilinear resize to ``image_size`` × ``image_size``
(``F.interpolate(mode="bilinear", align_corners=False, antialias=False)``; the identity at 8);
normalise with the mean and standard deviation of the train split's 8×8 pixels in [0, 1];
repeat the grey channel ``channels`` times (3 for the reference vision models).
"""

from __future__ import annotations

import functools
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from scaletrain.errors import UserError

SPLITS = ("train", "val")
TRAIN_FRACTION = 0.8
DIGITS_FILE = ("corpora", "digits", "digits.npz")
NUM_CLASSES = 10
PIXEL_MAX = 16.0


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """All digits: (images uint8 [1797, 8, 8] in 0..16, labels uint8 [1797] in 0..9), read-only."""
    path = resources.files("scaletrain.data").joinpath(*DIGITS_FILE)
    with path.open("rb") as fh, np.load(fh) as npz:
        images, labels = npz["images"], npz["labels"]
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def split_indices(split: str) -> range:
    """Indices into :func:`load_digits` of ``split`` ("train": first 80%, "val": the rest)."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    n = len(load_digits()[1])
    cut = int(n * TRAIN_FRACTION)
    return range(0, cut) if split == "train" else range(cut, n)


@functools.lru_cache(maxsize=1)
def train_pixel_stats() -> tuple[float, float]:
    """(mean, std) of the train split's 8×8 pixels scaled to [0, 1], used to normalise inputs."""
    images, _ = load_digits()
    idx = split_indices("train")
    pixels = images[idx.start : idx.stop].astype(np.float64) / PIXEL_MAX
    return float(pixels.mean()), float(pixels.std())


class DigitsDataset(Dataset):
    """Sample ``i`` → (x: float32 [channels, image_size, image_size], y: int64 scalar in 0..9)."""

    kind = "image"
    num_classes = NUM_CLASSES

    def __init__(self, split: str, image_size: int = 32, channels: int = 3) -> None:
        if image_size < 1:
            raise UserError(f"image_size must be a positive number of pixels, got {image_size}")
        if channels < 1:
            raise UserError(f"channels must be positive, got {channels}")
        self.split, self.image_size, self.channels = split, image_size, channels
        self._indices = split_indices(split)
        images, labels = load_digits()
        self._images = images[self._indices.start : self._indices.stop]
        self._labels = labels[self._indices.start : self._indices.stop]
        self._mean, self._std = train_pixel_stats()

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.from_numpy(self._images[index].astype(np.float32)) / PIXEL_MAX  # [8, 8]
        img = img[None, None]  # [1, 1, 8, 8]: interpolate wants a batch and a channel axis
        if self.image_size != img.shape[-1]:
            img = F.interpolate(
                img, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        img = (img[0] - self._mean) / self._std  # [1, S, S]
        x = img.expand(self.channels, -1, -1).contiguous()
        y = torch.tensor(int(self._labels[index]), dtype=torch.int64)
        return x, y

    @property
    def labels(self) -> np.ndarray:
        """Labels of this split, uint8 [len(self)], read-only."""
        return self._labels

    def __repr__(self) -> str:
        return (
            f"DigitsDataset(split={self.split!r}, image_size={self.image_size}, "
            f"channels={self.channels}, samples={len(self)})"
        )
