"""Token streams as training windows, and the prepared-token format read without loading it.

``scaletrain data prepare`` writes a directory with ``tokens.bin`` (the packed stream, uint16 when the
vocabulary fits in 65,536 ids, else uint32, native little-endian) and ``meta.json``
(:data:`FORMAT`, dtype, token count, vocabulary size, tokenizer, documents). ``data.name=tokens:DIR``
(or ``text:DIR`` on such a directory) maps ``tokens.bin`` with ``np.memmap``: pages are read when a
window is indexed, so a corpus larger than memory trains at the cost of its windows only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from scaletrain.errors import UserError

from .text import window_pair

FORMAT = "scaletrain-tokens/1"
TOKENS_FILE, META_FILE = "tokens.bin", "meta.json"


class TokenWindows(Dataset):
    """Windows of a token stream for next-token prediction, like the shipped :class:`TextDataset`.

    Sample ``i`` → ``(x, y) = (t[s : s + seq_len], t[s + 1 : s + seq_len + 1])`` with ``s = i * seq_len``,
    int64 [seq_len]; every token is a target once per epoch. A pure function of ``i``: any sampler,
    rank or resume sees the same sample.
    """

    kind = "text"

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, what: str) -> None:
        if len(tokens) < seq_len + 1:
            raise UserError(f"{what} holds {len(tokens)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                            f"lower data.seq_len or add text")
        self.tokens, self.seq_len, self.vocab_size, self.what = tokens, seq_len, vocab_size, what
        self._len = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return window_pair(self.tokens, index, self._len, self.seq_len, self.seq_len)

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    def __repr__(self) -> str:
        return f"TokenWindows({self.what}, seq_len={self.seq_len}, windows={self._len}, tokens={len(self.tokens)})"


def split_stream(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last ``val_fraction`` of the stream is validation (views, no copy)."""
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def is_prepared(path: str | Path) -> bool:
    """True when ``path`` is a directory ``scaletrain data prepare`` wrote."""
    p = Path(path).expanduser()
    return (p / META_FILE).is_file() and (p / TOKENS_FILE).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.json`` of a prepared directory, checked against ``tokens.bin``."""
    p = Path(path).expanduser()
    if not is_prepared(p):
        raise UserError(f"data.name=tokens:{path}: no {META_FILE} and {TOKENS_FILE} there; write them with "
                        f"`scaletrain data prepare TEXT --out {path}`")
    try:
        meta = json.loads((p / META_FILE).read_text())
    except ValueError:
        raise UserError(f"{str(p / META_FILE)!r} is not JSON") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{str(p / META_FILE)!r}: format {meta.get('format')!r}; allowed: {FORMAT!r}")
    size = (p / TOKENS_FILE).stat().st_size
    if size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize:
        raise UserError(f"{str(p / TOKENS_FILE)!r} holds {size} bytes, not the {meta['num_tokens']} "
                        f"{meta['dtype']} tokens {META_FILE} announces; prepare it again")
    return meta


def open_prepared(path: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    """(the token stream as a read-only memory map, meta)."""
    meta = read_meta(path)
    if meta["num_tokens"] == 0:
        raise UserError(f"data.name=tokens:{path}: the prepared stream holds no tokens")
    tokens = np.memmap(Path(path).expanduser() / TOKENS_FILE, dtype=np.dtype(meta["dtype"]), mode="r",
                       shape=(meta["num_tokens"],))
    return tokens, meta
