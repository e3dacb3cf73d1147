"""The shipped datasets a model trains on, sized by its adapter (vocabulary, image side, channels,
classes) — so the trainer can take any model the adapters understand."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from scaletrain import models as model_registry
from scaletrain.data import get_dataset
from scaletrain.errors import ConfigError
from scaletrain.models.adapters import Adapter
from scaletrain.train.config import Config


class MappedDataset(Dataset):
    """``base`` with the adapter's per-sample transform applied (e.g. masked-LM masking)."""

    def __init__(self, base: Dataset, fn: Any):
        self.base, self.fn = base, fn

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        return self.fn(x, y)

    def __getattr__(self, name: str) -> Any:  # tokens_per_sample etc. of the base set
        if name in ("base", "fn"):
            raise AttributeError(name)
        return getattr(self.base, name)


def build_datasets(cfg: Config, adapter: Adapter, user_model: bool) -> tuple[str, Dataset, Dataset]:
    """(dataset name, train split, validation split) for ``cfg`` and the model ``adapter`` drives.

    ``data.name`` empty: the named model's default; a model passed from Python trains on the
    shipped text (language models with a byte vocabulary) or the digits (classifiers).
    """
    if cfg.data.name:
        name = cfg.data.name
    elif user_model:
        name = "digits" if adapter.task != "lm" else ("shakespeare" if (adapter.vocab_size or 256) >= 256
                                                       else "synthetic-text")
    else:
        name = model_registry.default_data(cfg.model.name, adapter.model)
    kw: dict[str, Any] = dict(seed=cfg.train.seed)
    if adapter.task == "lm":
        vocab = adapter.vocab_size or 256
        kw.update(seq_len=cfg.data.seq_len, vocab_size=vocab)
        if name == "shakespeare" and vocab < 256:
            raise ConfigError(f"data.name='shakespeare' needs a byte vocabulary (256); model vocab_size={vocab}")
    else:
        kw.update(image_size=cfg.data.image_size or adapter.image_size, channels=adapter.channels)
        if name.startswith("synthetic"):
            kw["num_classes"] = adapter.num_classes or 10
    if cfg.data.num_samples:
        kw["num_samples"] = cfg.data.num_samples
    train, val = get_dataset(name, "train", **kw), get_dataset(name, "val", **kw)
    if adapter.sample_transform is not None and adapter.task == "lm":
        train, val = MappedDataset(train, adapter.sample_transform), MappedDataset(val, adapter.sample_transform)
    return name, train, val
