"""The one roofline and the one α–β collective time of scaletrain's cost model.

Both the analytic planner (:mod:`scaletrain.planner.cost`, decoder shapes on paper) and the traced
cost model (:mod:`scaletrain.techniques.time_cost`, every operator of a fake-tensor trace) price
kernels and collectives with these two functions, so a plan's seconds mean the same in ``scaletrain
plan``, ``plan=auto`` and ``scaletrain estimate``. Memory-bound kernels are
:meth:`scaletrain.platform.Platform.memory_bound_seconds`. Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from scaletrain.errors import UserError


def roofline_seconds(plat: Any, flops: float, nbytes: float, *, precision: str = "fp32",
                     unaligned: bool = False, output: tuple[float, float, float] | None = None) -> float:
    """Seconds of one kernel doing ``flops`` FLOPs and moving ``nbytes``: the larger of its FLOPs at
    the platform's peak for ``precision`` times the achieved fraction for a kernel of that size
    (Calculon-style, :meth:`Platform.matmul_fraction`) plus the per-kernel overhead, and its bytes at
    HBM speed (:meth:`Platform.memory_bound_seconds`). ``unaligned``: a 16-bit matmul with a dimension
    not a multiple of 8 runs alignment-1 kernels, capped at ``Platform.unaligned_matmul_fraction``.
    ``output``: a matmul's output shape (m, n, batch): the fraction is then also scaled by its tile and
    wave quantization on the platform's SMs (:meth:`Platform.wave_fraction`; 1 where ``sm_count`` is 0 or
    no shape is given). A kernel without FLOPs is memory-bound only."""
    if flops <= 0:
        return plat.memory_bound_seconds(nbytes)
    fraction = plat.matmul_fraction(flops)
    if output is not None:
        fraction *= plat.wave_fraction(*output)
    if unaligned and precision != "fp32" and plat.unaligned_matmul_fraction:
        fraction = min(fraction, plat.unaligned_matmul_fraction)
    compute = flops / (plat.flops(precision) * fraction) + plat.kernel_overhead_s
    return max(compute, plat.memory_bound_seconds(nbytes))


def optimizer_seconds(plat: Any, nbytes: float) -> float:
    """Seconds of one optimizer step moving ``nbytes`` (its parameters times
    :func:`~scaletrain.techniques.optim.registry.optimizer_step_bytes`): at the measured rate of the
    optimizer's own kernels where the platform has one (``Platform.optimizer_bytes_per_s``), else as
    memory-bound kernels at HBM speed."""
    if nbytes <= 0:
        return 0.0
    rate = getattr(plat, "optimizer_bytes_per_s", 0.0)
    return nbytes / rate if rate > 0 else plat.memory_bound_seconds(nbytes)


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


def zero_comm_factor(plat: Any, zero: int, accum: int = 1) -> float:
    """How much slower the backend runs ZeRO's collectives than the α–β ring prices them: the measured
    :attr:`~scaletrain.platform.Platform.reduce_scatter_factor` and ``all_gather_factor`` weighted by
    the collectives a step issues — ZeRO-1: one reduce-scatter and one all-gather of the same bytes;
    ZeRO-2: a reduce-scatter per micro-batch (``accum``) and one all-gather; ZeRO-3 (FSDP): two
    all-gathers and one reduce-scatter per unit and micro-batch. DDP's all-reduce: 1."""
    rs, ag = plat.reduce_scatter_factor, plat.all_gather_factor
    if zero == 1:
        return (rs + ag) / 2
    if zero == 2:
        return (accum * rs + ag) / (accum + 1)
    if zero == 3:
        return (rs + 2 * ag) / 3
    return 1.0


def all_reduce_steps(ranks: int) -> int:
    """Latency steps (each α) of one all-reduce over ``ranks`` (nodes, for the inter-node level): NCCL
    runs the faster of a ring, 2(n − 1) steps, and a double binary tree, 2·⌈log2 n⌉ steps at the same
    bandwidth (Jeaugey, "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA technical
    blog, 2019), so the fewer. Reduce-scatters and all-gathers have no tree: n − 1 ring steps."""
    if ranks <= 1:
        return 0
    return min(2 * (ranks - 1), 2 * math.ceil(math.log2(ranks)))


def collective_steps(ranks: int, per_node: int, *, all_reduce: bool = False) -> tuple[int, int]:
    """Latency steps (intra-node, inter-node) of one NCCL collective over ``ranks`` ranks, ``per_node`` of
    them in each node, as NCCL's own tuning model counts them (NVIDIA/nccl ``src/graph/tuning.cc``,
    ``ncclTopoTuneModel``): a ring runs nsteps = ranks − 1 steps (reduce-scatter, all-gather), of which
    nInterSteps = nodes − 1 cross a node and the other nsteps − nInterSteps are NVLink hops — every rank
    of every node is a hop, not one per node, so a ring's latency grows with the ranks (Jeaugey, "Massively
    Scale Your Deep Learning Training with NCCL 2.4", NVIDIA, 2019: "ring latency scales linearly with the
    number of GPUs"). An all-reduce also has NCCL's tree, 2·((per_node − 1) intra + log2(nodes) inter)
    steps, never more than the ring's 2(ranks − 1) (of which 2(nodes − 1) inter), so that is its count
    (:func:`all_reduce_steps` across nodes). Reduce-scatter and all-gather run only as rings (NCCL's tree
    is an all-reduce algorithm)."""
    if ranks <= 1:
        return 0, 0
    k = max(1, min(per_node, ranks))
    nodes = math.ceil(ranks / k)
    if all_reduce:
        return 2 * (k - 1), all_reduce_steps(nodes)
    return ranks - nodes, nodes - 1


def exposed_seconds(comm_s: Sequence[float], window_s: Sequence[float], slowdown: float = 0.0) -> float:
    """The one overlap rule: collectives on one stream beside compute, cut into windows. ``comm_s[k]``
    seconds of collectives must finish before the compute after window ``k`` (``window_s[k]`` seconds)
    may go on, so what outlasts its window is exposed: Σ max(0, c_k − w_k). A window of 0 s is a
    collective nothing hides. What hides still slows the compute it runs beside by ``slowdown`` of its
    time (NCCL's kernels take SMs and HBM bandwidth: Calculon's processor usage). Returns the seconds
    the step waits for.

    DDP's and ZeRO-1/2's buckets are one window (the backward; nothing waits for a bucket, so a backlog
    carries over to the window's end) and a 0 s window for the bucket issued when it ends; ZeRO-3's are
    one window per gather unit and pass (:func:`prefetch_windows`)."""
    return sum(max(0.0, c - w) + slowdown * min(c, w) for c, w in zip(comm_s, window_s, strict=True))


def prefetch_windows(gather_s: Sequence[float], reduce_s: Sequence[float], fwd_s: Sequence[float],
                     bwd_s: Sequence[float], regather_s: Sequence[float] | None = None
                     ) -> tuple[list[float], list[float]]:
    """ZeRO-3's (FSDP's) collectives of one micro-batch as :func:`exposed_seconds` windows. Units
    1..n in forward order, each with one all-gather ``gather_s``, one reduce-scatter ``reduce_s`` and
    its forward / backward compute (recompute included) ``fwd_s`` / ``bwd_s``. FSDP prefetches one unit
    ahead and issues every collective on one communicator, so they run in issue order (Zhao et al.,
    "PyTorch FSDP", VLDB 2023: backward and forward prefetching over one communication stream; PyTorch's
    "FSDP Notes", *FSDP Prefetch Nuances*: "the 1st all-gather will not be able to overlap with
    anything"; scaletrain's FSDP2 prefetches explicitly the same way): unit 1's gather has nothing to hide
    behind; unit k's forward hides unit k+1's gather; the backward's first gather (unit n's, when it was
    resharded after its forward) waits; unit k's backward hides unit k+1's reduce-scatter (issued as k's
    backward starts) and unit k−1's gather, which queues behind it; unit 1's reduce-scatter ends the pass
    exposed. ``regather_s``: each unit's backward all-gather (default ``gather_s``); 0 for a unit kept
    gathered from forward into backward (scaletrain keeps the root's and the last group's without TP/EP,
    as torch's root does: :func:`scaletrain.techniques.data_parallel.fsdp.kept_elements`). Gathers are per
    unit, so a large unit (an embedding) beside little compute is exposed even when the step's collectives
    add up to less than its compute."""
    n = len(gather_s)
    again = list(gather_s if regather_s is None else regather_s)
    comm = [gather_s[0]] + [gather_s[k + 1] for k in range(n - 1)] + [0.0, again[-1]]
    window = [0.0] + list(fwd_s[:-1]) + [fwd_s[-1], 0.0]
    for k in range(n - 1, -1, -1):  # backward: unit n first
        comm.append((reduce_s[k + 1] if k + 1 < n else 0.0) + (again[k - 1] if k > 0 else 0.0))
        window.append(bwd_s[k])
    return comm + [reduce_s[0]], window + [0.0]
