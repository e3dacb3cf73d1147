"""``scaletrain data prepare``: tokenize text once into a memory-mappable token file (:mod:`.tokens`).

Streams file by file and chunk by chunk, so memory stays at one chunk of documents whatever the
corpus size. Everything is written into a temporary sibling directory renamed to ``--out`` only at
the end: a bad file met halfway (not UTF-8, a JSONL line without the field) leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any

from scaletrain.errors import UserError

from .documents import encode_documents, find_files, read_documents, token_dtype
from .hf_tokenizer import describe, load_tokenizer
from .tokens import FORMAT, META_FILE, TOKENS_FILE


def prepare(source: str, out: str | Path, tokenizer: str = "", field: str = "text",
            progress: IO[str] | None = None) -> dict[str, Any]:
    """Write ``out/tokens.bin`` and ``out/meta.json`` from the text ``source`` names; returns the meta.

    ``progress``: a stream for one self-overwriting progress line (bytes read of the total, tokens,
    MB/s), or None for silence.
    """
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {str(out)!r} exists and is not an empty directory; choose a new one")
    files = find_files(source)
    tok = load_tokenizer(tokenizer)
    total = sum(f.stat().st_size for f in files)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        meta = _write(files, tok, field, tmp, total, progress)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _write(files: list[Path], tok: Any, field: str, tmp: Path, total: int, progress: IO[str] | None
           ) -> dict[str, Any]:
    n_tokens, n_docs, done, t0 = 0, 0, 0, time.perf_counter()
    with open(tmp / TOKENS_FILE, "wb") as fh:
        for chunk, chars, ended in encode_documents(read_documents(files, field), tok):
            n_docs += ended
            if len(chunk) and int(chunk.max()) >= tok.vocab_size:  # a tokenizer's ids are below its size
                raise UserError(f"token id {int(chunk.max())} >= the tokenizer's vocabulary {tok.vocab_size}")
            fh.write(chunk.tobytes())
            n_tokens, done = n_tokens + len(chunk), done + chars
            if progress is not None:
                rate = done / max(time.perf_counter() - t0, 1e-9) / 1e6
                progress.write(f"\rprepare: {min(done, total) / 1e6:.1f}/{total / 1e6:.1f} MB "
                               f"({100 * min(done, total) / max(total, 1):.0f} %), {n_tokens:,} tokens, "
                               f"{rate:.1f} MB/s   ")
                progress.flush()
    if progress is not None:
        progress.write("\n")
    if n_tokens == 0:
        raise UserError(f"no text in {', '.join(map(str, files[:3]))}{' ...' if len(files) > 3 else ''} "
                        f"(empty files)")
    meta = {"format": FORMAT, "dtype": token_dtype(tok.vocab_size).name, "num_tokens": n_tokens,
            "vocab_size": tok.vocab_size, "tokenizer": describe(tok), "eos_id": getattr(tok, "eos_id", None),
            "documents": n_docs, "files": len(files), "source_bytes": total}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return meta

