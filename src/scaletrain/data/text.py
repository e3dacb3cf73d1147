"""The shipped English text (Shakespeare, public domain) as bytes, its fixed split and a dataset.

Corpus: 42 works, 5,057,323 bytes of ASCII, stored xz-compressed in
``corpora/shakespeare/shakespeare.txt.xz`` (see ``corpora/shakespeare/SOURCE.md``).

Split (fixed, never shuffled): the cut is placed at byte ``floor(0.9 * N)`` and moved forward to
just after the next newline, so validation starts on a fresh line. ``train = text[:cut]``,
``val = text[cut:]``: the last ~10% (part of *Troilus and Cressida*, then *Twelfth Night*,
*Two Gentlemen of Verona* and *The Winter's Tale*) is validation; the two never overlap.
"""

from __future__ import annotations

import functools
import lzma
from importlib import resources

import numpy as np
import torch
from torch.utils.data import Dataset

from scaletrain.errors import UserError

SPLITS = ("train", "val")
VAL_FRACTION = 0.1
TEXT_FILE = ("corpora", "shakespeare", "shakespeare.txt.xz")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")


@functools.lru_cache(maxsize=1)
def _corpus() -> np.ndarray:
    """The whole corpus as a read-only uint8 array [N] (decompressed once per process, ~0.1 s)."""
    path = resources.files("scaletrain.data").joinpath(*TEXT_FILE)
    data = np.frombuffer(lzma.decompress(path.read_bytes()), dtype=np.uint8)
    data.flags.writeable = False
    return data


def split_point() -> int:
    """Byte offset where validation starts (see the module docstring for the rule)."""
    data = _corpus()
    cut = int(len(data) * (1.0 - VAL_FRACTION))
    newlines = np.flatnonzero(data[cut:] == ord("\n"))
    return cut + int(newlines[0]) + 1 if len(newlines) else cut


def load_text(split: str) -> np.ndarray:
    """Bytes of ``split`` ("train" or "val") as a read-only uint8 array (a view, no copy)."""
    _check_split(split)
    data, cut = _corpus(), split_point()
    return data[:cut] if split == "train" else data[cut:]


@functools.lru_cache(maxsize=None)
def byte_unigram_entropy(split: str) -> float:
    """Entropy of the byte frequencies of ``split``, in nats per byte: H = -sum_b p_b ln p_b.

    This is the loss of the best model that ignores context (predicts every byte from the
    split's own byte histogram), so a language model's validation loss in nats per byte should
    fall well below it. About 3.32 nats (4.8 bits) per byte for this corpus.
    """
    counts = np.bincount(load_text(split), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class TextDataset(Dataset):
    """Windows of the shipped text for next-byte prediction.

    Sample ``i`` starts at byte ``s = i * stride`` of the split and returns
    ``(x, y) = (text[s : s + seq_len], text[s + 1 : s + seq_len + 1])`` as int64 tensors of
    shape [seq_len]: ``y`` is ``x`` shifted left by one byte. ``stride`` defaults to ``seq_len``
    (non-overlapping inputs; every byte is a target exactly once per epoch). The length is the
    number of windows that fit entirely: ``(len(text) - seq_len - 1) // stride + 1``.
    Indexing is a pure function of ``i`` (no state, no randomness), so any sampler works.
    """

    kind = "text"
    vocab_size = 256

    def __init__(self, split: str, seq_len: int, *, stride: int | None = None) -> None:
        _check_split(split)
        if seq_len < 1:
            raise UserError(f"seq_len must be a positive number of tokens, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride < 1:
            raise UserError(f"stride must be a positive number of tokens, got {stride}")
        self.split, self.seq_len, self.stride = split, seq_len, stride
        self._data = load_text(split)
        if len(self._data) < seq_len + 1:
            raise UserError(
                f"seq_len {seq_len} is longer than the {split} text ({len(self._data)} bytes); "
                f"use seq_len <= {len(self._data) - 1}"
            )
        self._len = (len(self._data) - seq_len - 1) // stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return window_pair(self._data, index, self._len, self.stride, self.seq_len)

    @property
    def tokens_per_sample(self) -> int:
        """Target tokens per sample (for tokens/s)."""
        return self.seq_len

    def __repr__(self) -> str:
        return (
            f"TextDataset(split={self.split!r}, seq_len={self.seq_len}, stride={self.stride}, "
            f"windows={self._len}, bytes={len(self._data)})"
        )


def window_pair(tokens: np.ndarray, index: int, n: int, stride: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window ``index`` of ``n`` (negative counts from the end): ``x = t[s : s + seq_len]``, ``y`` = ``x``
    shifted by one token, ``s = index * stride``; int64 [seq_len] each."""
    if index < 0:
        index += n
    if not 0 <= index < n:
        raise IndexError(f"index {index} out of range for {n} windows")
    s = index * stride
    window = torch.from_numpy(np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64))
    return window[:-1], window[1:]
