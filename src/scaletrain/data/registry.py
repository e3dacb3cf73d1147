"""Dataset names a config or the CLI can give (``data.name``) and the function that builds them."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset

from scaletrain.errors import UserError

from .images import DigitsDataset
from .synthetic import SyntheticImages, SyntheticTokens
from .text import SPLITS, TextDataset


@dataclass(frozen=True)
class DatasetInfo:
    """What a name stands for; ``kind`` is "text" (token ids) or "image" (C×H×W floats)."""

    kind: str
    description: str


DATASETS: dict[str, DatasetInfo] = {
    "shakespeare": DatasetInfo(
        "text", "42 Shakespeare works, 5.06 MB of public-domain English, byte tokens (vocab 256)"
    ),
    "digits": DatasetInfo(
        "image", "1,797 UCI handwritten digits 8x8 (CC BY 4.0), resized, 10 classes"
    ),
    "synthetic-text": DatasetInfo("text", "uniform random tokens, fixed per index (throughput)"),
    "synthetic-images": DatasetInfo("image", "Gaussian noise images, fixed per index (throughput)"),
}

DEFAULT_SEQ_LEN = 256
"""Tokens per text sample when ``seq_len`` is not given."""
DEFAULT_SYNTHETIC_SAMPLES = {"train": 100_000, "val": 1_000}
"""Synthetic set sizes when ``num_samples`` is not given (indices are cheap: nothing is stored)."""


def get_dataset(
    name: str,
    split: str,
    *,
    seq_len: int | None = None,
    image_size: int = 32,
    channels: int = 3,
    num_samples: int | None = None,
    vocab_size: int = 256,
    seed: int = 0,
    num_classes: int = 10,
) -> Dataset:
    """Build dataset ``name`` (one of :data:`DATASETS`) for ``split`` ("train" or "val").

    Text sets use ``seq_len`` (default :data:`DEFAULT_SEQ_LEN`) and ``vocab_size``: the shipped
    text needs ``vocab_size >= 256`` (byte tokens); synthetic tokens are drawn from
    ``0..vocab_size-1``. Image sets use ``image_size`` and ``channels``; synthetic images also
    ``num_classes`` (digits always have 10). ``num_samples`` caps a real set to its first
    ``num_samples`` samples and sizes a synthetic one (default :data:`DEFAULT_SYNTHETIC_SAMPLES`).
    ``seed`` only affects synthetic data; the validation split draws from a separate stream.
    """
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    if num_samples is not None and num_samples < 1:
        raise UserError(f"num_samples must be a positive integer, got {num_samples}")
    seq = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    stream = SPLITS.index(split)

    if name == "synthetic-text":
        n = num_samples or DEFAULT_SYNTHETIC_SAMPLES[split]
        return SyntheticTokens(vocab_size, seq, n, seed, stream=stream)
    if name == "synthetic-images":
        n = num_samples or DEFAULT_SYNTHETIC_SAMPLES[split]
        return SyntheticImages(channels, image_size, num_classes, n, seed, stream=stream)

    dataset: Dataset
    if name == "shakespeare":
        if vocab_size < TextDataset.vocab_size:
            raise UserError(
                f"dataset 'shakespeare' uses byte tokens 0..255, so the model's vocab_size must be "
                f">= 256, got {vocab_size}"
            )
        dataset = TextDataset(split, seq)
    else:  # digits
        dataset = DigitsDataset(split, image_size=image_size, channels=channels)
    if num_samples is not None and num_samples < len(dataset):  # type: ignore[arg-type]
        return Slice(dataset, 0, num_samples)
    return dataset


class Slice(Dataset):
    """Samples ``start..stop-1`` of ``dataset`` (a ``data.num_samples`` cap, a ``data.val_fraction`` split);
    other attributes (``kind``, ``vocab_size``, ``num_classes``, ``seq_len``...) read through."""

    def __init__(self, dataset: Dataset, start: int, stop: int) -> None:
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int):  # noqa: ANN204 - same sample type as the wrapped set
        n = self.stop - self.start
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        return self.dataset[self.start + index]

    def __getattr__(self, attr: str):  # noqa: ANN204
        if attr.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(attr)
        return getattr(self.__dict__["dataset"], attr)
