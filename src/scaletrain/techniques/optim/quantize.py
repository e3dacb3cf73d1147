"""Block-wise dynamic 8-bit quantization of optimizer states.

Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization" (ICLR 2022), §2:
a tensor is cut into blocks of ``BLOCK_SIZE`` consecutive values; each block is divided by its
own absolute maximum (one fp32 scale per block, so an outlier only hurts its own block), and
each normalised value in [-1, 1] is replaced by the index of the nearest entry of a fixed,
non-linear 256-entry *dynamic* map.

The dynamic map (the paper's "dynamic tree quantization", §2.2 and Fig. 2) spends the 8 bits as
  sign bit (signed map only) | E zero bits (exponent: scale 10^-E) | one indicator bit | fraction bits
so the map is dense near 1 and reaches down to 10^-6 (signed) / 10^-7 (unsigned), i.e. it keeps
*relative* precision over seven decades — which is what Adam's small moments need.
Level ``k`` (scale 10^-k) has ``N_k = 2^(K-k)`` values, evenly spaced on (0.1, 1] x 10^-k with the
top one exactly 10^-k:  ``10^-k * (0.1 + 0.9 * i / N_k)`` for i = 1..N_k; the last level K has the
single value 10^-K. ``K = 6`` for the signed map (first moment m, which has a sign bit) and
``K = 7`` for the unsigned map (second moment v >= 0, which uses the sign bit as one more
fraction bit), as in the paper.

Codes are stored in *rank order* (a bijection of the paper's bit layout): for the unsigned map
code r is the r-th smallest value (r = 0 is 0.0); for the signed map code ``127 + s*r`` is
``s * magnitude(r)``. Code 255 of the signed map is the paper's second zero (sign bit set, all
other bits clear) and is never produced by the encoder.

Why the encoder is arithmetic rather than a binary search: inside level k the map is an evenly
spaced grid whose coordinate ``t = (f - 0.1) * N_k / 0.9`` (f = y * 10^k in (0.1, 1]) puts the
values on the integers 1..N_k — and t = 0 is exactly the top value of level k+1. So
``round(t)`` is the nearest entry, across level boundaries too, with a handful of compares and
multiplies per element, which vectorises (eager torch and torch.compile alike); a 256-entry
binary search costs eight dependent gathers per element.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

BLOCK_SIZE = 2048
"""Values per block sharing one fp32 absmax scale (Dettmers et al. 2021 use 2048)."""

SIGNED_LEVELS = 6
"""K for the signed map: exponent levels 10^0 .. 10^-6 (7 non-sign bits)."""

UNSIGNED_LEVELS = 7
"""K for the unsigned map: exponent levels 10^0 .. 10^-7 (8 bits, no sign)."""

_TINY = 1e-30  # absmax floor: an all-zero block normalises to 0, never NaN.


def _magnitude(rank: int, levels: int) -> float:
    """Value of magnitude rank ``rank`` (0 .. 2^(levels+1)-1) of the dynamic map, in float64."""
    if rank == 0:
        return 0.0
    e = int(math.floor(math.log2(rank)))  # rank in [N, 2N-1] with N = 2^e, level k = K - e
    n = 1 << e
    k = levels - e
    if e == 0:
        return 10.0 ** (-levels)
    return 10.0 ** (-k) * (0.1 + 0.9 * (rank - n + 1) / n)


def dynamic_map(signed: bool, device: torch.device | str | None = None) -> Tensor:
    """The 256-entry dynamic quantization map as float32, indexed by code (see module doc)."""
    dev = torch.device(device or "cpu")
    if dev.type == "cpu":
        return _CPU_MAPS[signed]
    if in_fake_mode():  # never cache a fake tensor: it would poison later real calls
        return _CPU_MAPS[signed].to(dev)
    return _device_map(signed, str(dev))


def in_fake_mode() -> bool:
    """True inside ``FakeTensorMode`` (the estimator runs optimizers on fake tensors)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


@functools.lru_cache(maxsize=None)
def _device_map(signed: bool, device: str) -> Tensor:
    return _CPU_MAPS[signed].to(device)


def _build_map(signed: bool) -> Tensor:
    if signed:
        mags = [_magnitude(r, SIGNED_LEVELS) for r in range(128)]  # rank 0 is zero
        values = [-m for m in reversed(mags[1:])] + [0.0] + mags[1:] + [0.0]
    else:
        values = [_magnitude(r, UNSIGNED_LEVELS) for r in range(256)]
    assert len(values) == 256
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


_CPU_MAPS = {True: _build_map(True), False: _build_map(False)}


def max_abs_error(signed: bool) -> float:
    """Worst-case |x - dequant(quant(x))| / absmax(block) for nearest rounding: half the largest gap.

    The largest gap is in the top level (spacing 0.9 / N_0 with N_0 = 2^K): 0.9/128 = 0.70 % of
    absmax for the signed map and 0.9/256 = 0.35 % for the unsigned map.
    """
    q = dynamic_map(signed).double()
    q = torch.unique(q)  # sorted, duplicates (the spare zero) removed
    return float((q[1:] - q[:-1]).max() / 2)


def encode_magnitude(y: Tensor, levels: int) -> Tensor:
    """Nearest magnitude rank (as an integer-valued float tensor) for ``y`` in [0, 1].

    Elementwise only, no gathers (see module doc). Thresholds 10^-j are compared in float32;
    an element that lands on the wrong side of a threshold by rounding is still mapped to the
    right code because t is continuous across level boundaries (t = 0 of level k is t = N of
    level k+1) and is clamped to [0, N].
    """
    k = torch.zeros_like(y)
    scale = torch.ones_like(y)
    for j in range(1, levels + 1):
        below = y <= 10.0 ** (-j)
        k = k + below
        scale = torch.where(below, 10.0**j, scale)
    f = y * scale  # in (0.1, 1] for k < K, in [0, 1] for k = K
    n = torch.exp2(levels - k)  # N_k = 2^(K-k), exact in float32
    t = torch.where(k < levels, (f - 0.1) * (n / 0.9), f * n)
    return n - 1 + torch.minimum(torch.round(t).clamp_min(0), n)


def encode(y: Tensor, signed: bool, keep_nonzero: bool = False) -> Tensor:
    """Codes (uint8) of the nearest map entries for normalised values ``y`` in [-1, 1].

    ``keep_nonzero`` (unsigned map only): a positive value is never coded as 0 — values below
    half the smallest entry (10^-7 / 2) get the smallest entry instead. Adam's second moment
    needs this: its log-range is twice the first moment's (v ~ m^2), so in a block of 2048 a
    small-gradient element can have v below 10^-7 of the block maximum while m is still
    representable; decoded as v = 0 the next update is m / eps, and training diverges
    (observed on GPT-2 attention weights within 40 steps). Rounding up only damps that element.
    """
    if signed:
        r = encode_magnitude(y.abs(), SIGNED_LEVELS)
        return (127 + torch.sign(y) * r).to(torch.uint8)
    r = encode_magnitude(y, UNSIGNED_LEVELS)
    if keep_nonzero:
        r = torch.where(y > 0, r.clamp_min(1), r)
    return r.to(torch.uint8)


def decode(codes: Tensor, qmap: Tensor) -> Tensor:
    """Map entries (float32) for ``codes`` (uint8, any shape); int32 indices, no bounds issue."""
    return qmap[codes.to(torch.int32)]


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Number of absmax scales for a tensor of ``numel`` values (last block may be partial)."""
    return -(-numel // block_size)


def _blocks(x: Tensor, block_size: int) -> list[Tensor]:
    """Views of flat ``x`` as [full_blocks, block_size] and, if any, [1, tail]; no copies."""
    n = x.numel()
    full = n // block_size * block_size
    parts = []
    if full:
        parts.append(x[:full].view(-1, block_size))
    if n > full:
        parts.append(x[full:].view(1, -1))
    return parts


def quantize_blockwise(
    x: Tensor, signed: bool, block_size: int = BLOCK_SIZE, keep_nonzero: bool = False
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` (any float dtype/shape) to (codes uint8 [numel], absmax float32 [blocks]).

    Vectorised over all blocks at once (at most two tensor calls: full blocks, partial tail).
    ``keep_nonzero``: see :func:`encode`.
    """
    flat = x.detach().reshape(-1).float()
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(num_blocks(flat.numel(), block_size), dtype=torch.float32, device=x.device)
    start = 0
    for xb in _blocks(flat, block_size):  # full blocks, then the tail: two calls, not per block
        nb, width = xb.shape
        a = xb.abs().amax(dim=1, keepdim=True)
        absmax[start // block_size : start // block_size + nb] = a.view(-1)
        y = xb / a.clamp_min(_TINY)
        codes[start : start + nb * width] = encode(y, signed, keep_nonzero).view(-1)
        start += nb * width
    return codes, absmax


def dequantize_blockwise(
    codes: Tensor,
    absmax: Tensor,
    signed: bool,
    shape: torch.Size | tuple[int, ...] | None = None,
    block_size: int = BLOCK_SIZE,
) -> Tensor:
    """Inverse of :func:`quantize_blockwise`: float32 tensor of ``shape`` (default flat)."""
    qmap = dynamic_map(signed, codes.device)
    vals = decode(codes.reshape(-1), qmap)
    out = torch.empty_like(vals)
    start = 0
    for vb in _blocks(vals, block_size):
        nb, width = vb.shape
        first = start // block_size
        out[start : start + nb * width] = (vb * absmax[first : first + nb].view(-1, 1)).view(-1)
        start += nb * width
    return out.view(shape if shape is not None else (-1,))
