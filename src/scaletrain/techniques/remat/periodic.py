"""The two schedules PyTorch users write by hand: ``none`` and ``periodic``.

- ``none``: record every block, then backward (what plain autograd does): F_i^e for all i,
  then B_{n-1} .. B_0. Fastest, largest peak.
- ``periodic`` (Chen et al. 2016, "Training deep nets with sublinear memory cost"): cut the
  chain into k contiguous segments; in the forward only segment inputs are kept (F^c on a
  segment's first block, F^n on the others), the last segment is recorded directly (as
  ``torch.utils.checkpoint.checkpoint_sequential`` does); in the backward each segment is
  recomputed with recording, then back-propagated. k = √n gives O(√n) memory for about one
  extra forward.

With a budget, ``periodic`` tries every k in 1..n (segments as equal as possible, longer ones
first, like ``numpy.array_split``) and keeps the fastest schedule that fits, breaking ties by
peak; with ``segments`` it uses that k.
"""

from __future__ import annotations

import math

from scaletrain.errors import UserError
from scaletrain.techniques.remat.schedule import Graph, Op, Schedule, fmt_bytes, require_chain
from scaletrain.techniques.remat.simulate import make_schedule, simulate


def none_ops(n: int) -> list[Op]:
    return [Op("Fe", i) for i in range(n)] + [Op("B", i) for i in reversed(range(n))]


def solve_none(graph: Graph, budget: int | None = None) -> Schedule:
    """Store everything. Raises UserError if its peak exceeds ``budget``."""
    ops = none_ops(len(graph))
    peak = simulate(graph, ops).peak_bytes
    if budget is not None and peak > budget:
        raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible {fmt_bytes(peak)} "
                        f"for method 'none' (no rematerialization)")
    return make_schedule("none", graph, ops, budget)


def segment_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """k contiguous segments [start, end) of 0..n-1, lengths differing by at most one."""
    if not 1 <= k <= n:
        raise UserError(f"segments must be in 1..{n}, got {k}")
    q, r = divmod(n, k)
    out, s = [], 0
    for j in range(k):
        e = s + q + (1 if j < r else 0)
        out.append((s, e))
        s = e
    return out


def periodic_ops(n: int, k: int) -> list[Op]:
    """Chen et al.'s schedule with k segments (k=1 is ``none``)."""
    segs = segment_bounds(n, k)
    ops: list[Op] = []
    for s, e in segs[:-1]:
        ops.append(Op("Fc", s))
        ops.extend(Op("Fn", i) for i in range(s + 1, e))
    s, e = segs[-1]
    ops.extend(Op("Fe", i) for i in range(s, e))
    ops.extend(Op("B", i) for i in reversed(range(s, e)))
    for s, e in reversed(segs[:-1]):
        ops.extend(Op("Fe", i) for i in range(s, e))
        ops.extend(Op("B", i) for i in reversed(range(s, e)))
    return ops


def solve_periodic(graph: Graph, budget: int | None = None, segments: int | None = None) -> Schedule:
    """Fastest periodic schedule within ``budget`` (or k = ``segments``; √n when neither is given)."""
    require_chain(graph, "periodic")
    n = len(graph)
    if segments is None and budget is None:
        segments = max(1, round(math.sqrt(n)))
    ks = [segments] if segments is not None else list(range(1, n + 1))
    best = None  # (time, peak, k, ops)
    lowest = None
    for k in ks:
        ops = periodic_ops(n, k)
        rep = simulate(graph, ops)
        lowest = rep.peak_bytes if lowest is None else min(lowest, rep.peak_bytes)
        if budget is not None and rep.peak_bytes > budget:
            continue
        key = (rep.time_s, rep.peak_bytes)
        if best is None or key < best[0]:
            best = (key, k, ops)
    if best is None:
        what = f"with {segments} segments" if segments is not None else "over all segment counts"
        raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible {fmt_bytes(lowest)} "
                        f"for method 'periodic' {what}")
    _, k, ops = best
    return make_schedule("periodic", graph, ops, budget, segments=k)


def min_budget_periodic(graph: Graph) -> int:
    """Smallest peak of any periodic schedule (over all segment counts)."""
    require_chain(graph, "periodic")
    return min(simulate(graph, periodic_ops(len(graph), k)).peak_bytes for k in range(1, len(graph) + 1))
