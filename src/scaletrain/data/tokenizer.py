"""Byte-level tokenizer: one token per UTF-8 byte, vocabulary of 256, no special tokens.

Why bytes: the shipped corpus is plain English, a byte vocabulary needs no training and no
file, every model with ``vocab_size >= 256`` can consume it, and the loss is directly in
nats per byte, comparable with :func:`scaletrain.data.text.byte_unigram_entropy`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ByteTokenizer:
    """Encode text as its UTF-8 bytes (token id = byte value 0..255) and back."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes. Raises ``UnicodeEncodeError`` for lone surrogates
        (a ``str`` that is not valid Unicode has no UTF-8 form)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor, *, errors: str = "strict") -> str:
        """Text of the byte sequence ``ids`` (a list or a 1-D integer tensor).

        ``errors`` is passed to ``bytes.decode``: ``"strict"`` (default) raises on a byte sequence
        that is not valid UTF-8, e.g. a multi-byte character cut in half by a window boundary;
        use ``"replace"`` to print model samples, which may contain such sequences.
        """
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
                raise ValueError(
                    f"decode expects a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
                )
            ids = ids.tolist()
        for i in ids:
            if not 0 <= int(i) < 256:
                raise ValueError(f"token id {i} is outside the byte vocabulary 0..255")
        return bytes(int(i) for i in ids).decode("utf-8", errors=errors)
