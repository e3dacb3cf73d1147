"""Synthetic data for throughput runs: random tokens and random images, fixed per index.

Sample ``i`` is drawn from its own generator seeded with the entropy ``(seed, stream, i)``
(NumPy ``SeedSequence`` → PCG64 for tokens, → a 63-bit seed of a torch CPU generator for
images), so it depends on nothing but those three numbers: not on the
order of access, the sampler, the rank or the worker. That makes them safe under
``DistributedSampler``, with ``num_workers > 0`` and across a resume. ``stream`` separates
independent sets built from one seed (train uses 0, validation 1).

The data carry no signal (tokens are uniform, images are unit Gaussian noise with uniform
labels): use them to measure speed and memory, never to judge learning. The best possible loss
on ``SyntheticTokens`` is ``ln(vocab_size)`` nats.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from scaletrain.errors import UserError


def _rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, index])


def _torch_generator(seed: int, stream: int, index: int) -> torch.Generator:
    """A torch CPU generator seeded from the same entropy (torch.randn is ~3x faster than
    NumPy's standard_normal for image-sized draws)."""
    state = np.random.SeedSequence([seed, stream, index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) >> 1)  # manual_seed wants < 2**63


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise UserError(f"{name} must be a positive integer, got {value}")


def _check_index(index: int, n: int) -> int:
    if index < 0:
        index += n
    if not 0 <= index < n:
        raise IndexError(f"index {index} out of range for {n} samples")
    return index


class SyntheticTokens(Dataset):
    """Sample ``i`` → (x, y), int64 [seq_len] each, uniform in 0..vocab_size-1; y = x shifted."""

    kind = "text"

    def __init__(
        self, vocab_size: int, seq_len: int, num_samples: int, seed: int = 0, *, stream: int = 0
    ) -> None:
        _check_positive(vocab_size=vocab_size, seq_len=seq_len, num_samples=num_samples)
        if seed < 0 or stream < 0:
            raise UserError(f"seed and stream must be non-negative, got {seed} and {stream}")
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples
        self.seed, self.stream = seed, stream

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = _check_index(index, self.num_samples)
        tokens = _rng(self.seed, self.stream, index).integers(
            0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64
        )
        window = torch.from_numpy(tokens)
        return window[:-1], window[1:]

    @property
    def tokens_per_sample(self) -> int:
        """Target tokens per sample (for tokens/s)."""
        return self.seq_len


class SyntheticImages(Dataset):
    """Sample ``i`` → (x: float32 [channels, size, size] ~ N(0, 1), y: int64 in 0..classes-1)."""

    kind = "image"

    def __init__(
        self,
        channels: int,
        size: int,
        classes: int,
        num_samples: int,
        seed: int = 0,
        *,
        stream: int = 0,
    ) -> None:
        _check_positive(channels=channels, size=size, classes=classes, num_samples=num_samples)
        if seed < 0 or stream < 0:
            raise UserError(f"seed and stream must be non-negative, got {seed} and {stream}")
        self.channels, self.size, self.num_classes = channels, size, classes
        self.num_samples, self.seed, self.stream = num_samples, seed, stream

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = _check_index(index, self.num_samples)
        g = _torch_generator(self.seed, self.stream, index)
        y = torch.randint(0, self.num_classes, (), generator=g, dtype=torch.int64)
        x = torch.randn(self.channels, self.size, self.size, generator=g)
        return x, y
