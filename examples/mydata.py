"""A dataset of your own, trained by name: `scaletrain train data.name=py:mydata:make_dataset ...`
(README, "Bring your own data"). Run scaletrain from this directory or put it on PYTHONPATH so that
`mydata` imports.

The factory takes ``split`` ("train" or "val") and returns a plain map-style ``torch`` ``Dataset`` of
``(inputs, targets)`` pairs: here byte windows of a multiplication table written out as text, each
target the next byte of its input (what the byte-vocabulary reference models such as gpt2-tiny read).
Nothing in it knows scaletrain.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq`` bytes (tokens) of ``text``, with their next-byte targets."""

    def __init__(self, text: str, seq: int = 64) -> None:
        self.data = torch.tensor(list(text.encode()), dtype=torch.long)
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[i * self.seq: (i + 1) * self.seq + 1]
        return w[:-1], w[1:]


def make_dataset(split: str = "train") -> Dataset:
    """Rows 1-80 of the table for training, rows 81-90 for validation (different text, same form)."""
    rows = range(1, 81) if split == "train" else range(81, 91)
    return ByteWindows("".join(f"{a} x {b} = {a * b}\n" for a in rows for b in range(1, 13)))
