"""An image tree laid out as torchvision's ``ImageFolder`` (``data.name=images:PATH``), decoded with Pillow.

``PATH/<class>/<image>``: one sub-directory per class, classes numbered in sorted name order. When
``PATH`` holds ``train/`` and ``val/`` (or ``validation/``) trees, those are the splits; otherwise
each class's files, in a permutation fixed by a seed of 0, give their last ``data.val_fraction``
(at least one image for classes of two or more) to validation — the split is the same on every
run and rank.

Per sample: decode (RGB, or grey for one channel), resize to ``image_size`` x ``image_size``
(bilinear), scale to [0, 1] and normalise to [-1, 1] by ``(x - 0.5) / 0.5``; labels int64.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from scaletrain.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise UserError("data.name=images: needs Pillow to decode images: pip install 'scaletrain[images]' "
                        "(or pillow)") from None
    return Image


def _scan(root: Path, spec: str) -> tuple[list[str], list[tuple[Path, int]]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise UserError(f"data.name=images:{spec}: {str(root)!r} has no class sub-directories; allowed: "
                        f"PATH/<class>/<image> (an ImageFolder tree)")
    samples = [(f, i) for i, c in enumerate(classes) for f in sorted((root / c).rglob("*"))
               if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    if not samples:
        raise UserError(f"data.name=images:{spec}: no image files ({', '.join(IMAGE_SUFFIXES)}) under {str(root)!r}")
    return classes, samples


def image_splits(spec: str, val_fraction: float) -> tuple[list[str], list[tuple[Path, int]], list[tuple[Path, int]]]:
    """(class names, train samples, val samples) of the tree ``spec`` names (see the module docstring)."""
    root = Path(spec).expanduser()
    if not root.is_dir():
        raise UserError(f"data.name=images:{spec}: no such directory")
    val_dir = next((root / n for n in ("val", "validation") if (root / n).is_dir()), None)
    if (root / "train").is_dir() and val_dir is not None:
        classes, train = _scan(root / "train", spec)
        val_classes, val = _scan(val_dir, spec)
        if val_classes != classes:
            raise UserError(f"data.name=images:{spec}: train/ and {val_dir.name}/ name different classes")
        return classes, train, val
    classes, samples = _scan(root, spec)
    train, val = [], []
    for c in range(len(classes)):
        mine = [s for s in samples if s[1] == c]
        order = torch.randperm(len(mine), generator=torch.Generator().manual_seed(0)).tolist()
        n_val = max(1, round(val_fraction * len(mine))) if len(mine) > 1 else 0
        val += [mine[i] for i in sorted(order[len(mine) - n_val:])]
        train += [mine[i] for i in sorted(order[: len(mine) - n_val])]
    return classes, train, val


class ImageFolderDataset(Dataset):
    """Sample ``i`` → (x: float32 [channels, image_size, image_size] in [-1, 1], y: int64 class)."""

    kind = "image"

    def __init__(self, samples: list[tuple[Path, int]], classes: list[str], image_size: int, channels: int) -> None:
        if image_size < 1 or channels not in (1, 3):
            raise UserError(f"images: need image_size >= 1 and 1 or 3 channels, got {image_size} and {channels}")
        self.samples, self.classes = samples, classes
        self.num_classes, self.image_size, self.channels = len(classes), image_size, channels
        self._image = _pil()
        if samples:
            self[0]  # an undecodable first file is one line now, not a traceback in the first step

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, label = self.samples[index]
        try:
            with self._image.open(path) as img:
                img = img.convert("L" if self.channels == 1 else "RGB")
                img = img.resize((self.image_size, self.image_size), self._image.Resampling.BILINEAR)
                pixels = np.asarray(img, dtype=np.float32) / 255.0
        except (OSError, ValueError) as e:
            raise UserError(f"image {str(path)!r} cannot be decoded ({str(e).splitlines()[0][:100]})") from None
        x = torch.from_numpy(pixels.reshape(self.image_size, self.image_size, -1)).permute(2, 0, 1)
        return ((x - 0.5) / 0.5).contiguous(), torch.tensor(label, dtype=torch.int64)

    def __repr__(self) -> str:
        return f"ImageFolderDataset(samples={len(self)}, classes={self.num_classes}, size={self.image_size})"
