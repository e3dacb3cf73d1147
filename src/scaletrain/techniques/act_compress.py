"""Activation-compressed training: tensors saved for backward kept as 8-bit codes (ActNN-style).

Chen et al. 2021, "ActNN: Reducing Training Memory Footprint via 2-Bit Activation Compressed
Training" (ICML), store the activations autograd saves for the backward pass in low precision
and decompress them when the backward needs them; the forward is exact, the gradient sees
quantization noise. This module does the 8-bit variant with PyTorch's public hook
``torch.autograd.graph.saved_tensors_hooks``:

* which tensors: floating-point tensors saved for backward with at least ``min_bytes`` bytes
  that are not leaves. Leaves — parameters and the model's inputs — are alive anyway (the
  module and the training loop hold them), so a compressed copy would *add* memory; integer and
  bool tensors (indices, dropout masks) are left alone.
* how: per-channel affine 8-bit quantization, ``q = round((x - min_c) / s_c)``,
  ``s_c = (max_c - min_c) / 255``, with one fp32 (min, scale) pair per channel. The channel is
  dim 1 for 4-D/5-D tensors (N, C, H, W[, D]: convolution feature maps) and the last dim
  otherwise ([..., hidden]: transformer/MLP features, where outlier channels live); 0-D/1-D
  tensors use one pair for the whole tensor. Worst-case error per element: s_c / 2 (nearest
  rounding, the default, deterministic) or < s_c (``stochastic=True``: unbiased rounding as in
  ActNN, seeded by ``generator`` for reproducibility).
* the same tensor saved by several ops is compressed once (cached by identity and version).

Cost face: :func:`compressed_bytes` — bytes a saved tensor occupies once compressed
(codes + 8 bytes per channel); for fp32 activations ~4x smaller, for bf16/fp16 ~2x.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

DEFAULT_MIN_BYTES = 4096
"""Saved tensors smaller than this many bytes are kept as they are (scales would dominate)."""

_LEVELS = 255  # 8-bit codes 0..255


def channel_dim(shape: tuple[int, ...] | torch.Size) -> int | None:
    """Dimension holding the channels: 1 for 4-D/5-D (NCHW[D]), last for 2-D/3-D, None below."""
    nd = len(shape)
    if nd in (4, 5):
        return 1
    if nd >= 2:
        return nd - 1
    return None


def compressed_bytes(nbytes: int, shape: tuple[int, ...] | torch.Size, *,
                     min_bytes: int = DEFAULT_MIN_BYTES, floating: bool = True) -> int:
    """Bytes a saved tensor of ``shape`` and ``nbytes`` takes under compression (cost face).

    uint8 codes (1 byte per value) + fp32 min and scale per channel; tensors left alone (not
    floating, smaller than ``min_bytes``, empty) keep ``nbytes``.
    """
    numel = math.prod(shape)
    if not floating or numel == 0 or nbytes < min_bytes:
        return nbytes
    cd = channel_dim(shape)
    channels = 1 if cd is None else int(shape[cd])
    return numel + 2 * 4 * channels


def compressed_saved_bytes(saved_bytes: int, element_size: int = 4) -> int:
    """Profile-level estimate: a block's ``saved_bytes`` (see ``BlockProfile``) once compressed.

    Without the individual shapes, the per-channel scales (8 bytes per channel, typically < 2 %
    of the codes) are left out, so this is a lower bound of :func:`compressed_bytes` summed over
    the block's saved tensors; it assumes all of them are floating and above the threshold.
    """
    return -(-saved_bytes // element_size)


@dataclass
class CompressionStats:
    """What the pack hook saw, in bytes (numel * element_size of the tensors involved)."""

    compressed: int = 0
    """Number of tensors stored compressed."""
    original_bytes: int = 0
    """Their bytes before compression."""
    compressed_bytes: int = 0
    """Their bytes after compression (codes + per-channel scales)."""
    reused: int = 0
    """Saves of an already-compressed tensor (no new bytes)."""
    kept: int = 0
    """Non-leaf saved tensors kept as they are (small or not floating)."""
    kept_bytes: int = 0
    leaves: int = 0
    """Saved leaves (parameters, inputs) passed through untouched."""
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """original / compressed bytes of the compressed tensors (4 for fp32, minus scales)."""
        return self.original_bytes / self.compressed_bytes if self.compressed_bytes else 1.0


@dataclass
class _Packed:
    codes: Tensor  # uint8, shape of the original
    lo: Tensor  # fp32, broadcastable per-channel minimum
    scale: Tensor  # fp32, broadcastable per-channel step
    dtype: torch.dtype


def quantize_per_channel(x: Tensor, *, stochastic: bool = False,
                         generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(codes uint8, min, scale) of ``x``, per channel along :func:`channel_dim`."""
    xf = x.detach().float()
    cd = channel_dim(x.shape)
    dims = tuple(d for d in range(x.ndim) if d != cd) if cd is not None else None
    if dims is None:
        lo, hi = xf.amin().reshape([1] * x.ndim), xf.amax().reshape([1] * x.ndim)
    else:
        lo, hi = xf.amin(dim=dims, keepdim=True), xf.amax(dim=dims, keepdim=True)
    scale = ((hi - lo) / _LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
    y = (xf - lo) / scale  # in [0, 255]
    if stochastic:
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        y = torch.floor(y + noise)
    else:
        y = torch.round(y)
    return y.clamp_(0, _LEVELS).to(torch.uint8), lo, scale


def dequantize_per_channel(codes: Tensor, lo: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`quantize_per_channel` (to ``dtype``)."""
    return (codes.float() * scale + lo).to(dtype)


class compress_activations:  # noqa: N801 - used like a function: ``with compress_activations():``
    """Context manager: tensors saved for backward inside it are stored 8-bit (see module doc).

    Args:
        module: optional model whose parameters must never be compressed (leaves are skipped
            anyway; this also catches views of parameters, e.g. a transposed weight).
        min_bytes: smallest saved tensor to compress (default 4096 bytes).
        stochastic: stochastic rounding (unbiased, ActNN) instead of nearest (default).
        generator: random generator for stochastic rounding.

    ``stats`` (a :class:`CompressionStats`) records what was compressed. The backward pass may
    run after the context has exited: the packed tensors live in the autograd graph.
    """

    def __init__(self, module: nn.Module | None = None, *, min_bytes: int = DEFAULT_MIN_BYTES,
                 stochastic: bool = False, generator: torch.Generator | None = None) -> None:
        self.min_bytes = min_bytes
        self.stochastic = stochastic
        self.generator = generator
        self.stats = CompressionStats()
        self._param_ptrs = ({p.untyped_storage().data_ptr() for p in module.parameters()}
                            if module is not None else set())
        self._cache: dict[int, tuple[weakref.ref, int, _Packed]] = {}
        self._hooks: Any = None

    def _pack(self, t: Tensor) -> Any:
        if t.is_leaf or isinstance(t, nn.Parameter):
            self.stats.leaves += 1
            return t
        if t.untyped_storage().data_ptr() in self._param_ptrs:
            self.stats.leaves += 1
            return t
        nbytes = t.numel() * t.element_size()
        if not t.is_floating_point() or nbytes < self.min_bytes or t.numel() == 0:
            self.stats.kept += 1
            self.stats.kept_bytes += nbytes
            return t
        hit = self._cache.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            self.stats.reused += 1
            return hit[2]
        codes, lo, scale = quantize_per_channel(t, stochastic=self.stochastic,
                                                generator=self.generator)
        packed = _Packed(codes, lo, scale, t.dtype)
        self._cache[id(t)] = (weakref.ref(t), t._version, packed)
        self.stats.compressed += 1
        self.stats.original_bytes += nbytes
        self.stats.compressed_bytes += codes.numel() + 4 * (lo.numel() + scale.numel())
        self.stats.shapes.append(tuple(t.shape))
        return packed

    @staticmethod
    def _unpack(obj: Any) -> Tensor:
        if isinstance(obj, _Packed):
            return dequantize_per_channel(obj.codes, obj.lo, obj.scale, obj.dtype)
        return obj

    def __enter__(self) -> "compress_activations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._cache.clear()  # the graph holds the packed tensors it needs
