"""Seconds of a LayerNorm / RMSNorm on a GPU, priced by the kernel that runs it.

A norm is a row reduction, not a streaming kernel: one thread block per row computes the row's
statistics and then writes it, and its backward needs a second reduction over the rows for the scale's
(and shift's) gradient. Measured, these kernels reach far less of HBM's bandwidth than the streaming
kernels the platform's ``mem_efficiency`` table describes, and the backward is not 2 × the forward. So
the analytic planner prices a norm by the kernel the priced stack runs (:data:`NORM_KERNELS`), each
fraction a published or in-repo measurement. Units: bytes, seconds; fractions of the device's HBM
bandwidth (``Platform.device_mem_bytes_per_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletrain.errors import UserError


@dataclass(frozen=True)
class NormKernel:
    """Achieved fractions of HBM bandwidth of one norm implementation, and where they were measured.

    Bytes counted per element of the normalised tensor (``e`` bytes each): forward reads x and writes y
    (2e); backward reads dy and x and writes dx (3e), and where the scale/shift gradient is its own
    kernel (``bwd_params`` > 0) that one reads dy and x again (2e)."""

    fwd: float
    """Fraction for the forward kernel (2e bytes per element)."""
    bwd_input: float
    """Fraction for the input-gradient kernel (3e bytes per element), or the whole backward where
    ``bwd_params`` is 0 (the measurement timed all of it against 3e bytes)."""
    bwd_params: float
    """Fraction for a separate gamma/beta reduction kernel (2e bytes per element); 0 = inside ``bwd_input``."""
    source: str


NORM_KERNELS: dict[str, NormKernel] = {
    # torch's own layer_norm (vectorized_layer_norm_kernel, layer_norm_grad_input_kernel_vectorized,
    # GammaBetaBackwardCUDAKernelTemplate): what scaletrain's runtime and MPT's low-precision LayerNorm run
    "torch": NormKernel(
        fwd=0.44, bwd_input=0.81, bwd_params=0.35,
        source="measured on one H200 (benchmarks/results/planner_gpu_h200_profile.json, gpt2-medium, "
               "micro-batch 16 x 1024, torch 2.11: per call 63 us for the forward's 134 MB, 52 us for the "
               "input gradient's 201 MB, 79 us for gamma/beta's 134 MB, of 4.8 TB/s); the forward agrees "
               "with torch's LayerNorm on an A100 40GB, 715 of 1,555 GB/s = 0.46 (ecmwf/WeatherGenerator "
               "issue #1546, Nsight, [2048, 2048])"),
    # apex's fused_layer_norm_cuda (Megatron-LM 2021 copies it as MixedFusedLayerNorm)
    "apex": NormKernel(
        fwd=0.576, bwd_input=0.368, bwd_params=0.0,
        source="NVIDIA/apex pull request #1037 (Jan 2021), 'current APEX affine LN kernels' on GA100 at "
               "B = 32, S = 512 (h = 1,024 by the bytes): forward 895.8 GB/s over 4 bytes per element, "
               "backward 572.2 GB/s over 6; of an A100 40GB's 1,555 GB/s (the 80 GB part's 2,039 would "
               "give 0.44 / 0.28: the smaller slowdown is taken)"),
}
"""Norm kernels by name; ``roofline`` (not listed) prices a norm as streaming bytes, the old rule."""


def norm_seconds(plat: Any, kernel: str, elements: float, elem_bytes: float) -> tuple[float, float]:
    """(forward, backward) seconds of one norm over ``elements`` values of ``elem_bytes`` bytes on
    ``plat``. Each kernel's fraction is the named kernel's (:data:`NORM_KERNELS`), never above what the
    platform's size table gives a kernel of those bytes (:meth:`Platform.mem_fraction`: small kernels
    stay as slow as before), plus ``plat.kernel_overhead_s`` per kernel. ``kernel="roofline"``: the
    forward's 2e bytes and the backward as 2 × the forward at the size table's fraction (the rule for
    every other memory-bound kernel). E.g. torch's kernel, 10⁸ bf16 elements on 3.35 TB/s: forward
    4e8 / (3.35e12 · 0.44) = 271 µs, backward 6e8 / (3.35e12 · 0.81) + 4e8 / (3.35e12 · 0.35) = 562 µs."""
    if elements <= 0:
        return 0.0, 0.0
    if kernel == "roofline":
        f = plat.memory_bound_seconds(2 * elem_bytes * elements)
        return f, 2 * f
    if kernel not in NORM_KERNELS:
        raise UserError(f"unknown norm kernel {kernel!r}; allowed: roofline, {', '.join(NORM_KERNELS)}")
    k = NORM_KERNELS[kernel]

    def one(nbytes: float, fraction: float) -> float:
        frac = min(fraction, plat.mem_fraction(nbytes))
        return nbytes / (plat.device_mem_bytes_per_s * frac) + plat.kernel_overhead_s

    fwd = one(2 * elem_bytes * elements, k.fwd)
    bwd = one(3 * elem_bytes * elements, k.bwd_input)
    if k.bwd_params > 0:
        bwd += one(2 * elem_bytes * elements, k.bwd_params)
    return fwd, bwd
