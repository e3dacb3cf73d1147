"""The user's text as documents: a file, a directory or a glob of ``.txt`` / ``.jsonl``, read as UTF-8.

A ``.txt`` file is one document (read in pieces, :data:`PIECE_BYTES`); a ``.jsonl`` file holds one
document per line, the string under ``data.field`` (default ``text``). Files are read in sorted path
order, so the token stream — and with it every sample index, the split and a resumed run's position —
is the same on every rank and every run. Packing: documents are tokenized and concatenated into one
stream, joined by the tokenizer's end-of-document token when it has one (bytes have none). Attention is *not* masked at
document boundaries: the reference and ``hf:`` models attend over the whole window, as nanoGPT and
GPT-2 pre-training do; the separator token is what tells the model a document ended.

Bad input is one line (:class:`UserError`): no such path, no ``.txt``/``.jsonl`` file, a file that
is not UTF-8 (naming the byte offset), a JSONL line without the field, no text at all.
"""

from __future__ import annotations

import glob as globbing
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from scaletrain.errors import UserError

SUFFIXES = (".txt", ".jsonl")
"""File types read as text."""


def find_files(spec: str) -> list[Path]:
    """Files ``spec`` names: a file, a directory (searched recursively) or a glob; sorted."""
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in globbing.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise UserError(f"data.name=text:{spec}: the pattern matches no file")
    else:
        p = Path(spec).expanduser()
        if not p.exists():
            raise UserError(f"data.name=text:{spec}: no such file or directory")
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
    bad = [f for f in files if f.suffix not in SUFFIXES]
    if bad:
        raise UserError(f"data.name=text:{spec}: {str(bad[0])!r} is not a .txt or .jsonl file; allowed: "
                        f"{', '.join(SUFFIXES)}")
    if not files:
        raise UserError(f"data.name=text:{spec}: the directory holds no .txt or .jsonl file")
    return files


PIECE_BYTES = 1 << 16
"""A ``.txt`` file is read in pieces of about this many bytes, cut where a line ends on a word
(:func:`_cut`), so a file larger than memory streams through ``scaletrain data prepare``."""
_LINE_END = re.compile(rb"[^\s]\n")


def _decode(path: Path, raw: bytes, offset: int = 0) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{str(path)!r} is not UTF-8 text (byte {offset + e.start}: {raw[e.start:e.start + 1]!r}); "
                        f"convert it, e.g. iconv -t UTF-8") from None


def _cut(data: bytes) -> int:
    """Just before the last newline that follows a non-space byte (0 if none): the next piece starts with
    the whole whitespace run, so a tokenizer that splits words from whitespace (byte-level BPE,
    whitespace) encodes the two pieces as it would the whole, and a UTF-8 character is never cut."""
    match = None
    for match in _LINE_END.finditer(data, max(0, len(data) - PIECE_BYTES // 4)):
        pass
    if match is None and len(data) > PIECE_BYTES // 4:
        for match in _LINE_END.finditer(data):
            pass
    return match.start() + 1 if match is not None else 0


def _pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """The text of a ``.txt`` file in pieces (see :data:`PIECE_BYTES`), the last one flagged."""
    offset, rest = 0, b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(PIECE_BYTES)
            data = rest + block
            cut = _cut(data) if block else len(data)
            if block and cut == 0:  # no newline yet: keep reading
                rest = data
                continue
            piece, rest = data[:cut], data[cut:]
            if piece or (not block and offset):  # the last piece closes the document (an empty file has none)
                yield _decode(path, piece, offset), not block
            offset += len(piece)
            if not block:
                return


def read_documents(files: list[Path], field: str = "text") -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces of every document of ``files`` in order (see the module docstring)."""
    for path in files:
        if path.suffix == ".txt":
            yield from _pieces(path)
            continue
        text = _decode(path, path.read_bytes())
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise UserError(f"{str(path)!r} line {number} is not JSON") from None
            value = row.get(field) if isinstance(row, dict) else None
            if not isinstance(value, str):
                keys = ", ".join(sorted(row)) if isinstance(row, dict) else "none"
                raise UserError(f"{str(path)!r} line {number} has no string field {field!r} (data.field); "
                                f"its keys: {keys}")
            yield value, True


def whole(texts: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """Texts that are each a whole document (a list from Python, a dataset column)."""
    return ((t, True) for t in texts)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type holding ids below ``vocab_size`` (2 or 4 bytes per token)."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def encode_documents(docs: Iterator[tuple[str, bool]], tokenizer, batch: int = 256
                     ) -> Iterator[tuple[np.ndarray, int, int]]:
    """Chunks of the packed token stream: (tokens, characters consumed, documents ended) per chunk."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = getattr(tokenizer, "eos_id", None)
    many = getattr(tokenizer, "encode_batch", None)
    pending: list[tuple[str, bool]] = []

    def flush() -> tuple[np.ndarray, int, int]:
        chars, ended = sum(len(t) for t, _ in pending), sum(e for _, e in pending)
        if many is None:  # bytes: the UTF-8 encoding is the token stream (no separator)
            flat = np.frombuffer("".join(t for t, _ in pending).encode("utf-8"), dtype=np.uint8).astype(dtype)
            pending.clear()
            return flat, chars, ended
        ids: list[int] = []
        for doc, (_, end) in zip(many([t for t, _ in pending]), pending):
            ids += doc
            ids += [eos] if eos is not None and end else []
        pending.clear()
        return np.asarray(ids, dtype=dtype), chars, ended

    for piece in docs:
        pending.append(piece)
        if len(pending) >= batch:
            yield flush()
    if pending:
        yield flush()


def tokenize_all(docs: Iterator[tuple[str, bool]], tokenizer) -> np.ndarray:
    """The whole packed token stream in memory (``scaletrain data prepare`` streams it to disk instead)."""
    chunks = [c for c, _, _ in encode_documents(docs, tokenizer)]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=token_dtype(tokenizer.vocab_size))
