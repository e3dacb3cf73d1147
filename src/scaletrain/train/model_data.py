"""The shipped datasets a model trains on, sized by its adapter (vocabulary, image side, channels,
classes) — so the trainer can take any model the adapters understand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from scaletrain import models as model_registry
from scaletrain.data import get_dataset
from scaletrain.data import sources as user_sources
from scaletrain.errors import ConfigError, UserError, one_line
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


def build_datasets(cfg: Config, adapter: Adapter, user_model: bool, train_data: Any = None, eval_data: Any = None,
                   collate_fn: Any = None) -> tuple[str, Dataset, Dataset]:
    """(dataset name, train split, validation split) for ``cfg`` and the model ``adapter`` drives.

    ``train_data`` / ``eval_data`` (``Trainer(...)``): the user's Dataset, IterableDataset or list of
    texts (name ``python``); without ``eval_data`` the last ``data.val_fraction`` of ``train_data`` validates.
    ``data.name`` empty: the named model's default; a model passed from Python trains on the
    shipped text (language models with a byte vocabulary) or the digits (classifiers).
    """
    if train_data is not None and cfg.data.name:
        raise ConfigError(f"both data.name={cfg.data.name!r} and Trainer(train_data=...) name the data; give one")
    if train_data is not None or cfg.data.name.startswith(user_sources.PREFIXES):
        name, train, val = _user_data(cfg, adapter, train_data, eval_data)
        if collate_fn is not None:
            for ds in (train, val):
                ds.collate_fn = collate_fn  # build_loader batches with it
        return name, train, val
    if eval_data is not None or collate_fn is not None:
        raise ConfigError("Trainer(eval_data=..., collate_fn=...) need train_data=... too")
    if cfg.data.tokenizer:
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r} tokenizes your own text; the shipped "
                          f"data.name={cfg.data.name or 'default'!r} has its own tokens; allowed with it: data.name="
                          f"text:PATH, tokens:DIR, hf-disk:PATH, py:module:factory, or Trainer(train_data=[texts])")
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


_INPUTS = ("input_ids", "pixel_values")
_LABELS = ("labels", "label")


def dict_to_pair(sample: Mapping[str, Any], task: str, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One dict sample (what tokenizers and ``datasets`` give) as the trainer's (inputs, targets).

    Causal LM, Hugging Face's convention: ``labels`` (default ``input_ids``) are the tokens themselves
    and the model predicts ``labels[t + 1]`` at ``t``; the trainer's targets are already shifted,
    so ``y = labels[1:] + [-100]``, and positions whose ``attention_mask`` is 0 (right padding) are
    ignored (-100): a causal model's real positions never see the padding after them. Masked LM:
    ``labels`` as they are. Classifier: ``label``/``labels`` as a class index.
    """
    key = next(k for k in _INPUTS if k in sample)
    x = torch.as_tensor(sample[key])
    label = next((sample[k] for k in _LABELS if k in sample), None)
    if task != "lm":
        return x, torch.as_tensor(label).long().reshape(())
    y = torch.as_tensor(label if label is not None else x).long().clone()
    if "attention_mask" in sample:
        mask = torch.as_tensor(sample["attention_mask"]).bool()
        if causal and bool((mask[1:] & ~mask[:-1]).any()):
            raise ConfigError("a dict sample has left padding (attention_mask 0 before 1); allowed: right padding "
                              "(tokenizer padding_side='right') or none")
        y[~mask] = -100
    if causal:
        y = torch.cat([y[1:], torch.full((1,), -100, dtype=y.dtype)])
    return x.long(), y


class DictPairs(Dataset):
    """A dataset of dict samples seen as (inputs, targets) pairs (:func:`dict_to_pair`)."""

    def __init__(self, base: Dataset, task: str, causal: bool):
        self.base, self.task, self.causal = base, task, causal

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dict_to_pair(self.base[i], self.task, self.causal)

    def __getattr__(self, name: str) -> Any:
        if name in ("base", "task", "causal"):
            raise AttributeError(name)
        return getattr(self.base, name)


def as_pairs(dataset: Dataset, adapter: Adapter) -> Dataset:
    """``dataset`` as the (inputs, targets) pairs every runtime reads: pairs as they are, dict samples
    through :class:`DictPairs`; anything else is one line naming what is allowed. A stream
    (``IterableDataset``) is passed as it is: its samples are checked as they come (the collate step)."""
    if (isinstance(dataset, (DictPairs, MappedDataset, IterableDataset)) or getattr(dataset, "collate_fn", None)
            or not len(dataset)):  # type: ignore[arg-type]  (the user's collate_fn makes the batches itself)
        return dataset
    try:
        first = dataset[0]
    except Exception as e:  # noqa: BLE001 - the user's dataset: say it in one line
        raise ConfigError(f"the dataset's first sample cannot be read ({type(e).__name__}: "
                          f"{one_line(e)[:120]})") from None
    if isinstance(first, (tuple, list)) and len(first) == 2:
        return dataset
    if isinstance(first, Mapping) and any(k in first for k in _INPUTS) and (
            adapter.task == "lm" or any(k in first for k in _LABELS)):
        return DictPairs(dataset, adapter.task, causal=adapter.family != "hf-masked")
    what = f"dict with keys {sorted(first)}" if isinstance(first, Mapping) else type(first).__name__
    raise ConfigError(f"a training sample is a {what}; allowed: (inputs, targets) pairs, or dicts with input_ids "
                      f"(+ labels, attention_mask) for language models or input_ids/pixel_values + label(s) for "
                      f"classifiers")


def _user_data(cfg: Config, adapter: Adapter, train_data: Any, eval_data: Any) -> tuple[str, Any, Any]:
    """The user's data (:mod:`scaletrain.data.sources`), checked against the model's vocabulary / classes."""
    d, lm = cfg.data, adapter.task == "lm"
    seq = dict(seq_len=d.seq_len, tokenizer=d.tokenizer)
    if train_data is None:
        name = d.name
        train, val = user_sources.user_datasets(name, **seq, field=d.field, val_fraction=d.val_fraction,
                                                image_size=d.image_size or adapter.image_size or 32,
                                                channels=adapter.channels or 3)
    else:
        name = "python"

        def own(ds: Any, what: str) -> Any:
            if isinstance(ds, (list, tuple)) and ds and isinstance(ds[0], str):
                return user_sources.texts_dataset(list(ds), **seq, what=what)
            return user_sources.check_dataset(ds, what)

        train = own(train_data, "train_data")
        if eval_data is None:
            train, val = user_sources.split_fraction(train, d.val_fraction, "train_data")
        else:
            val = own(eval_data, "eval_data")
    need = getattr(train, "vocab_size", None) if lm else getattr(train, "num_classes", None)
    have = (adapter.vocab_size if lm else adapter.num_classes)
    if need and have and need > have:
        what = "vocabulary" if lm else "classes"
        key = "vocab_size" if lm else "num_classes"
        raise ConfigError(f"data.name={name!r} has {need} {what} but the model has {have}; allowed: a model with "
                          f"model.overrides.{key} >= {need}" + (" (or a smaller data.tokenizer)" if lm else ""))
    if lm and train_data is None and adapter.sample_transform is not None:
        train, val = MappedDataset(train, adapter.sample_transform), MappedDataset(val, adapter.sample_transform)
    return name, train, val


def _accepts(model: str, key: str) -> bool:
    """Whether model ``model`` (a reference name or an ``hf:`` family) takes the shape option ``key``."""
    from scaletrain.models.external import is_external
    from scaletrain.models.registry import resolve_args
    from scaletrain.models.spec import hf_families

    if model.startswith("hf:"):
        fams = hf_families()
        return model[3:] in fams and key in fams[model[3:]].defaults
    if is_external(model):
        return False
    try:
        resolve_args(model, **{key: 1})
    except UserError:
        return False
    return True


def user_overrides(cfg: Config) -> dict[str, Any]:
    """``model.overrides`` with the vocabulary (text with a tokenizer, prepared tokens) or class count
    (``images:``) of the user's data filled in where the model has that key and the user did not set it."""
    name, model, over = cfg.data.name, cfg.model.name, dict(cfg.model.overrides)
    if name.startswith("images:") and "num_classes" not in over and _accepts(model, "num_classes"):
        from scaletrain.data.image_folder import image_splits

        over["num_classes"] = len(image_splits(name.partition(":")[2], cfg.data.val_fraction)[0])
    elif ((user_sources.is_user(name) or (cfg.data.tokenizer and not name)) and "vocab_size" not in over
          and _accepts(model, "vocab_size")):
        vocab = user_sources.text_vocab(name, cfg.data.tokenizer)
        if vocab is not None:
            from scaletrain.models.spec import hf_families

            fam = hf_families().get(model[3:]) if model.startswith("hf:") else None
            over["vocab_size"] = vocab + (fam.extra_tokens if fam else 0)  # BERT: one mask id past the text's
    return over


def data_rate(cfg: Config, model: Any, world: int, train_data: Any = None, eval_data: Any = None,
              collate_fn: Any = None) -> float:
    """Host seconds per sample of this run's training data through the trainer's loader, for ``plan=auto``
    (:func:`scaletrain.measure.data_time.seconds_per_sample`; the model built on the meta device when the
    caller gave none, only to learn its inputs), at the largest micro-batch a rank could run (at most 32)."""
    from scaletrain import models
    from scaletrain.measure.data_time import seconds_per_sample
    from scaletrain.models.adapters import adapt

    adapter = adapt(model if model is not None else models.get(cfg.model.name, device="meta", **cfg.model.overrides))
    _, train, _ = build_datasets(cfg, adapter, model is not None, train_data, eval_data, collate_fn)
    return seconds_per_sample(as_pairs(train, adapter), max(1, min(cfg.train.global_batch // max(world, 1), 32)))
