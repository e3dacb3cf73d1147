"""A local Hugging Face tokenizer (``data.tokenizer=DIR``), read with the ``tokenizers`` library.

Why ``tokenizers`` and not ``transformers.AutoTokenizer``: it reads ``tokenizer.json`` alone, offline,
in milliseconds, and is installed with transformers; nothing is ever downloaded. ``DIR`` is a
directory holding ``tokenizer.json`` (what ``save_pretrained`` writes) or the file itself.

The end-of-document token comes from ``tokenizer_config.json``'s ``eos_token`` when present, else
from the first of :data:`EOS_NAMES` the vocabulary holds; documents are joined with it when packed
(:mod:`.documents`). The byte tokenizer (no ``data.tokenizer``) has none.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

from .tokenizer import ByteTokenizer

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
"""Token strings taken as end-of-document when ``tokenizer_config.json`` names none."""


class HFTokenizer:
    """``encode(text) -> list[int]``, ``vocab_size`` (added tokens included), ``eos_id`` (or None), ``path``."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("data.tokenizer needs the tokenizers package (installed with transformers): "
                            "pip install tokenizers") from None
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise UserError(f"data.tokenizer={path!r}: no tokenizer.json there; allowed: a directory written by a "
                            f"Hugging Face tokenizer's save_pretrained, or its tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the library raises bare Exceptions on bad JSON
            raise UserError(f"data.tokenizer={path!r}: {file.name} cannot be read ({str(e).splitlines()[0][:120]})"
                            ) from None
        self.path = str(p.resolve())
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos(file.parent)

    def _find_eos(self, directory: Path) -> int | None:
        names: list[str] = []
        conf = directory / "tokenizer_config.json"
        if conf.is_file():
            try:
                eos: Any = json.loads(conf.read_text()).get("eos_token")
            except ValueError:
                eos = None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            names += [eos] if isinstance(eos, str) else []
        for name in (*names, *EOS_NAMES):
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added (documents are joined by :mod:`.documents`)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once (the library runs them in parallel)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> HFTokenizer | ByteTokenizer:
    """The tokenizer ``data.tokenizer`` names: empty = bytes (vocabulary 256), else a local HF tokenizer."""
    return HFTokenizer(path) if path else ByteTokenizer()


def describe(tok: Any) -> str:
    """How a tokenizer is recorded (run header, prepared-token meta): its path, or ``bytes``."""
    return getattr(tok, "path", "bytes")
