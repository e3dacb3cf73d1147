"""The user's own data: ``data.name=text:…``, ``tokens:…``, ``images:…``, ``py:…``, ``hf-disk:…``, and
datasets or lists of texts passed from Python (``Trainer(..., train_data=...)``).

Every source becomes a (train, val) pair of ordinary datasets, so the shipped sets' guarantees carry
over unchanged: map-style sets go through :class:`~.loader.ResumableDistributedSampler` (per-rank
shards, reshuffled per epoch, exact resume from ``steps x global_batch``); iterable sets through
:mod:`.iterable` (rank ``r`` takes every ``W``-th item, a resume skips the items already consumed).

Splits: by key where the source has them (``train/`` + ``val/`` directories, a ``DatasetDict``'s
``train`` + ``validation``, a ``py:`` factory taking ``split=``), else the last ``data.val_fraction``
(of the token stream for text; of each class for images; of the samples for a map-style set; every
``round(1 / val_fraction)``-th item of an iterable set).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from scaletrain.errors import UserError

from .documents import find_files, read_documents, tokenize_all, whole
from .hf_tokenizer import load_tokenizer
from .registry import Slice
from .tokens import TokenWindows, is_prepared, open_prepared, split_stream

PREFIXES = ("text:", "tokens:", "images:", "py:", "hf-disk:")
"""``data.name`` prefixes of user data."""


def is_user(name: str) -> bool:
    return name.startswith(PREFIXES)


def _check_fraction(f: float) -> None:
    if not 0.0 < f < 1.0:
        raise UserError(f"data.val_fraction={f}: allowed 0 < val_fraction < 1")


def text_vocab(name: str, tokenizer: str) -> int | None:
    """Vocabulary the text source ``name`` needs from a language model (None: not a token source)."""
    kind, _, path = name.partition(":")
    if kind == "tokens" or (kind == "text" and is_prepared(path)):
        _, meta = open_prepared(path)
        if tokenizer and load_tokenizer(tokenizer).vocab_size != meta["vocab_size"]:
            raise UserError(f"data.tokenizer={tokenizer!r} has {load_tokenizer(tokenizer).vocab_size} tokens but "
                            f"{path!r} was prepared with {meta['tokenizer']!r} ({meta['vocab_size']} tokens)")
        return int(meta["vocab_size"])
    if kind in ("text", "hf-disk") or tokenizer:
        return load_tokenizer(tokenizer).vocab_size
    return None


def user_datasets(name: str, *, seq_len: int, tokenizer: str = "", field: str = "text", val_fraction: float = 0.1,
                  image_size: int = 32, channels: int = 3) -> tuple[Dataset, Dataset]:
    """(train, val) of the source ``name`` (one of :data:`PREFIXES` + its argument)."""
    _check_fraction(val_fraction)
    kind, _, arg = name.partition(":")
    if not arg:
        raise UserError(f"data.name={name!r}: write {kind}:PATH" + (":factory" if kind == "py" else ""))
    if kind == "images":
        from .image_folder import ImageFolderDataset, image_splits

        classes, train, val = image_splits(arg, val_fraction)
        if not train or not val:
            raise UserError(f"data.name={name!r}: too few images for a train and a validation split "
                            f"({len(train)} and {len(val)})")
        return (ImageFolderDataset(train, classes, image_size, channels),
                ImageFolderDataset(val, classes, image_size, channels))
    if kind == "py":
        return _py_factory(arg, val_fraction, seq_len, tokenizer)
    if kind == "tokens" or (kind == "text" and is_prepared(arg)):
        tokens, meta = open_prepared(arg)
        return _windows(tokens, seq_len, int(meta["vocab_size"]), val_fraction, name)
    tok = load_tokenizer(tokenizer)
    if kind == "hf-disk":
        return _hf_disk(arg, field, seq_len, val_fraction, tokenizer)
    val_dir = next((Path(arg) / n for n in ("val", "validation") if (Path(arg) / n).is_dir()), None)
    if (Path(arg) / "train").is_dir() and val_dir is not None:  # split by key
        train = tokenize_all(read_documents(find_files(str(Path(arg) / "train")), field), tok)
        val = tokenize_all(read_documents(find_files(str(val_dir)), field), tok)
        return (TokenWindows(_nonempty(train, name), seq_len, tok.vocab_size, f"{name} (train/)"),
                TokenWindows(_nonempty(val, name), seq_len, tok.vocab_size, f"{name} ({val_dir.name}/)"))
    tokens = tokenize_all(read_documents(find_files(arg), field), tok)
    return _windows(_nonempty(tokens, name), seq_len, tok.vocab_size, val_fraction, name)


def texts_dataset(texts: list[str], *, seq_len: int, tokenizer: str = "", what: str = "train_data") -> TokenWindows:
    """A list of texts from Python as packed windows (documents joined as in :mod:`.documents`)."""
    if not all(isinstance(t, str) for t in texts):
        raise UserError(f"{what}: a list must hold texts (str); pass a Dataset for other samples")
    tok = load_tokenizer(tokenizer)
    return TokenWindows(_nonempty(tokenize_all(whole(iter(texts)), tok), what), seq_len, tok.vocab_size, what)


def _nonempty(tokens: np.ndarray, what: str) -> np.ndarray:
    if len(tokens) == 0:
        raise UserError(f"data.name={what!r}: no text (empty files)")
    return tokens


def _windows(tokens: np.ndarray, seq_len: int, vocab: int, f: float, what: str) -> tuple[Dataset, Dataset]:
    train, val = split_stream(tokens, f)
    return (TokenWindows(train, seq_len, vocab, f"{what} (train: first {1 - f:.0%})"),
            TokenWindows(val, seq_len, vocab, f"{what} (validation: last {f:.0%} = data.val_fraction)"))


class EveryKth(IterableDataset):
    """Items of an iterable set whose position ``j`` has ``j % k == k - 1`` (``val``) or not (train)."""

    def __init__(self, dataset: IterableDataset, k: int, val: bool) -> None:
        self.dataset, self.k, self.val = dataset, k, val

    def __iter__(self):
        for j, item in enumerate(self.dataset):
            if (j % self.k == self.k - 1) == self.val:
                yield item


def split_fraction(ds: Any, f: float, what: str) -> tuple[Any, Any]:
    """(train, val) of one set by ``data.val_fraction`` (see the module docstring)."""
    if isinstance(ds, IterableDataset):
        k = max(2, round(1 / f))
        return EveryKth(ds, k, False), EveryKth(ds, k, True)
    n = len(ds)
    cut = int(n * (1 - f))
    if cut < 1 or cut >= n:
        raise UserError(f"{what}: {n} samples are too few to split by data.val_fraction={f}")
    return Slice(ds, 0, cut), Slice(ds, cut, n)


def check_dataset(ds: Any, what: str) -> Any:
    """``ds`` as a dataset the loaders take: a map-style ``Dataset`` with a length, or an ``IterableDataset``."""
    if isinstance(ds, IterableDataset):
        return ds
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise UserError(f"{what}: got a {type(ds).__name__}; allowed: a torch Dataset (with __len__), an "
                        f"IterableDataset, or a list of texts")
    if len(ds) == 0:
        raise UserError(f"{what}: the dataset is empty")
    return ds


def _py_factory(spec: str, f: float, seq_len: int, tokenizer: str) -> tuple[Any, Any]:
    mod_name, _, attr = spec.partition(":")
    what = f"data.name='py:{spec}'"
    if not mod_name or not attr:
        raise UserError(f"{what}: write py:package.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the user's module, next to where they run scaletrain
    try:
        factory = getattr(importlib.import_module(mod_name), attr, None)
    except ImportError as e:
        raise UserError(f"{what}: cannot import {mod_name!r} ({e})") from None
    if not callable(factory):
        raise UserError(f"{what}: {mod_name!r} has no callable {attr!r}")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if "split" in params:  # split by key
        train, val = factory(split="train"), factory(split="val")
    else:
        train, val = split_fraction(check_dataset(_texts_or(factory(), seq_len, tokenizer, what), what), f, what)
    return (check_dataset(_texts_or(train, seq_len, tokenizer, what), what),
            check_dataset(_texts_or(val, seq_len, tokenizer, what), what))


def _texts_or(ds: Any, seq_len: int, tokenizer: str, what: str) -> Any:
    return texts_dataset(list(ds), seq_len=seq_len, tokenizer=tokenizer, what=what) if (
        isinstance(ds, (list, tuple)) and ds and isinstance(ds[0], str)) else ds


def _hf_disk(path: str, field: str, seq_len: int, f: float, tokenizer: str = "") -> tuple[Dataset, Dataset]:
    what = f"data.name='hf-disk:{path}'"
    try:
        import datasets
    except ImportError:
        raise UserError(f"{what} needs the datasets package: pip install 'scaletrain[hf]' (or datasets)") from None
    if not Path(path).expanduser().is_dir():
        raise UserError(f"{what}: no such directory")
    try:
        loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"{what}: not a datasets save_to_disk directory ({str(e).splitlines()[0][:120]})") from None
    tok = load_tokenizer(tokenizer)

    def stream(ds: Any) -> np.ndarray:
        if field not in ds.column_names:
            raise UserError(f"{what}: no column {field!r} (data.field); columns: {', '.join(ds.column_names)}")
        return _nonempty(tokenize_all(whole(iter(ds[field])), tok), what)

    if isinstance(loaded, datasets.DatasetDict):
        val_key = next((k for k in ("validation", "val", "test") if k in loaded), None)
        if "train" in loaded and val_key:
            return (TokenWindows(stream(loaded["train"]), seq_len, tok.vocab_size, f"{what} train"),
                    TokenWindows(stream(loaded[val_key]), seq_len, tok.vocab_size, f"{what} {val_key}"))
        loaded = loaded[next(iter(loaded))]
    return _windows(stream(loaded), seq_len, tok.vocab_size, f, what)

