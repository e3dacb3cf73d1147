"""The one roofline and the one α–β collective time of scaletrain's cost model.

Both the analytic planner (:mod:`scaletrain.planner.cost`, decoder shapes on paper) and the traced
cost model (:mod:`scaletrain.techniques.time_cost`, every operator of a fake-tensor trace) price
kernels and collectives with these two functions, so a plan's seconds mean the same in ``scaletrain
plan``, ``plan=auto`` and ``scaletrain estimate``. Memory-bound kernels are
:meth:`scaletrain.platform.Platform.memory_bound_seconds`. Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from typing import Any

from scaletrain.errors import UserError


def roofline_seconds(plat: Any, flops: float, nbytes: float, *, precision: str = "fp32",
                     unaligned: bool = False) -> float:
    """Seconds of one kernel doing ``flops`` FLOPs and moving ``nbytes``: the larger of its FLOPs at
    the platform's peak for ``precision`` times the achieved fraction for a kernel of that size
    (Calculon-style, :meth:`Platform.matmul_fraction`) plus the per-kernel overhead, and its bytes at
    HBM speed (:meth:`Platform.memory_bound_seconds`). ``unaligned``: a 16-bit matmul with a dimension
    not a multiple of 8 runs alignment-1 kernels, capped at ``Platform.unaligned_matmul_fraction``.
    A kernel without FLOPs is memory-bound only."""
    if flops <= 0:
        return plat.memory_bound_seconds(nbytes)
    fraction = plat.matmul_fraction(flops)
    if unaligned and precision != "fp32" and plat.unaligned_matmul_fraction:
        fraction = min(fraction, plat.unaligned_matmul_fraction)
    compute = flops / (plat.flops(precision) * fraction) + plat.kernel_overhead_s
    return max(compute, plat.memory_bound_seconds(nbytes))


def collective_seconds(nbytes: float, steps: float, bytes_per_s: float, latency_s: float) -> float:
    """α–β: ``nbytes`` received over a link of ``bytes_per_s`` (achieved) plus ``steps`` ring steps of
    α = ``latency_s``. A ring all-reduce of S bytes over n ranks receives 2(n − 1)/n·S in 2(n − 1)
    steps; an all-gather, reduce-scatter or all-to-all (n − 1)/n·S in n − 1 (REFERENCES, α–β)."""
    if nbytes <= 0 and steps <= 0:
        return 0.0
    if bytes_per_s <= 0:
        raise UserError("the platform has no link bandwidth (intra_node_bytes_per_s / inter_node_bytes_per_s = 0); "
                        "a multi-process plan needs them: give a preset or a platform file with both")
    return nbytes / bytes_per_s + steps * latency_s



def exposed_seconds(total_s: float, window_s: float, last_s: float, slowdown: float = 0.0) -> float:
    """The one overlap rule: of ``total_s`` seconds of collectives issued beside ``window_s`` seconds
    of compute (a backward, or ZeRO-3's forward and backward), what outlasts the window is exposed, and
    so is the last collective (``last_s``: issued when the compute ends, and the window's share of the
    link is taken by the ones before it); what hides still slows the compute it runs beside by
    ``slowdown`` of its time (NCCL's kernels take SMs and HBM bandwidth: Calculon's processor usage).
    Returns the seconds the step waits for."""
    return max(0.0, total_s - window_s) + min(last_s, total_s) + slowdown * min(total_s, window_s)
