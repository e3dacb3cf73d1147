"""Optimal rematerialization for heterogeneous chains by dynamic programming.

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova (2019), "Optimal checkpointing for
heterogeneous chains: how to train deep neural networks with limited memory" (Rotor), in the
memory model of :mod:`scaletrain.techniques.remat.simulate` (0-based blocks).

Sub-problem C(s, t, m): back-propagate blocks s..t, starting with ``a_{s-1}`` available
(stored by the caller) and ``δ_t`` stored (``δ_t`` does not exist yet when t is the last
block), ending with ``δ_{s-1}`` stored, using at most ``m`` bytes beyond what the caller
stores; C is the least time. Writing e_i = out_i + saved_i (a tape), g_t = out_t for t < n-1
and 0 for the last block, gd_s = out_{s-1} (0 for s = 0), Bpk_s = out_s + e_s + gd_s + bwd_temp_s
(for the last block e_s + max(loss bytes, out_s + gd_s + bwd_temp_s): the loss runs first):

- s = t: F_t^e, B_t; needs m ≥ max(g_t + e_t + fwd_temp_t, Bpk_t); costs f_t + b_t.
- "tape first": F_s^e, then C(s+1, t, m - e_s), then B_s; needs m ≥ g_t + e_s + fwd_temp_s
  and m ≥ Bpk_s; costs f_s + b_s + C(s+1, t, m - e_s).
- "checkpoint a_j" (s ≤ j < t): F_s^c, F_{s+1}^n .. F_j^n, then C(j+1, t, m - out_j) (which
  ends by freeing ``a_j``), then C(s, j, m); needs m ≥ g_t + max(e_s + fwd_temp_s,
  max_{s<k≤j} out_{k-1} + e_k + fwd_temp_k); costs f_s + .. + f_j + C(j+1, t, m - out_j) + C(s, j, m).

The answer is C(0, n-1, budget - input_bytes). The property tests check it equals an
exhaustive search over *all* schedules of the simulator (``exhaustive.py``) on small chains.

Discretisation: memory is counted in units of ``u = ceil(budget / slots)`` bytes (default
500 slots, as Rotor); every size is rounded *up* to units and the budget *down*, so a schedule
feasible in units is feasible in bytes, and the time is optimal up to that rounding. Pass
``unit_bytes=1`` for the exact problem on small integer sizes. The table is n × n × (slots+1)
float64 (100 blocks, 500 slots: 40 MB), filled with numpy over the memory axis and the split
point j, so 100 blocks solve in about a second.

The minimum feasible budget is computed exactly (bytes, no units) by the same recursion with
max in place of +. Between that minimum and the smallest budget feasible in units, the
solver retries with finer units, then falls back to the least-peak schedule.
"""

from __future__ import annotations

import numpy as np

from scaletrain.errors import UserError
from scaletrain.techniques.remat.schedule import Graph, Op, Schedule, fmt_bytes, require_chain
from scaletrain.techniques.remat.simulate import make_schedule, simulate

_MAX_TABLE = 60_000_000  # table elements (n*n*(M+1)) allowed when refining units: ~0.5 GB per table


class _Costs:
    """Per-block arrays (0-based) in a given unit (bytes rounded up to units)."""

    def __init__(self, graph: Graph, unit: int):
        nd = graph.nodes
        n = len(nd)
        c = lambda x: -(-int(x) // unit)  # ceil division
        self.n = n
        self.out = np.array([c(x.out_bytes) for x in nd], dtype=np.int64)
        self.e = np.array([c(x.out_bytes) + c(x.saved_bytes) for x in nd], dtype=np.int64)
        self.ft = np.array([c(x.fwd_temp_bytes) for x in nd], dtype=np.int64)
        self.bt = np.array([c(x.bwd_temp_bytes) for x in nd], dtype=np.int64)
        self.f = np.array([x.fwd_time_s for x in nd], dtype=np.float64)
        self.b = np.array([x.bwd_time_s for x in nd], dtype=np.float64)
        self.inp = c(graph.input_bytes)
        self.g = np.concatenate([self.out[:-1], [0]])            # δ_t stored during sub(s, t)
        self.gd = np.concatenate([[0], self.out[:-1]])           # δ_{s-1} created by B_s
        self.bpk = self.out + self.e + self.gd + self.bt         # live during B_s beyond the caller
        # the last backward runs the loss first: the larger of its peak and the block's backward
        self.bpk[-1] = self.e[-1] + max(c(graph.loss_bytes), self.out[-1] + self.gd[-1] + self.bt[-1])
        self.h0 = self.e + self.ft                               # F_s with an external input
        self.h = np.concatenate([[0], self.out[:-1]]) + self.e + self.ft  # F_k^n reading plain a_{k-1}
        self.fcum = np.concatenate([[0.0], np.cumsum(self.f)])   # f_s + .. + f_j = fcum[j+1] - fcum[s]


def min_peak_table(graph: Graph, store_tapes: bool = True):
    """Exact least peak (bytes, beyond the input) of each sub-problem, and the choices reaching it.

    Returns (P, choice) with P[s, t] in bytes; choice -2 base, -1 tape first, j checkpoint a_j.
    Among options with the least peak, the one with least time (given the sub-choices) is kept.
    """
    k = _Costs(graph, 1)
    n = k.n
    P = np.zeros((n, n), dtype=np.int64)
    T = np.zeros((n, n), dtype=np.float64)
    ch = np.full((n, n), -2, dtype=np.int64)
    for t in range(n):
        P[t, t] = max(k.g[t] + k.h0[t], k.bpk[t])
        T[t, t] = k.f[t] + k.b[t]
    for d in range(1, n):
        for s in range(n - d):
            t = s + d
            js = np.arange(s, t)
            sweep = k.g[t] + np.maximum.accumulate(np.concatenate([[k.h0[s]], k.h[s + 1:t]]))
            peaks = np.maximum(np.maximum(sweep, k.out[js] + P[js + 1, t]), P[s, js])
            times = (k.fcum[js + 1] - k.fcum[s]) + T[js + 1, t] + T[s, js]
            opts_p, opts_t, opts_c = list(peaks), list(times), list(js)
            if store_tapes:
                opts_p.append(max(k.g[t] + k.h0[s], k.bpk[s], k.e[s] + P[s + 1, t]))
                opts_t.append(k.f[s] + k.b[s] + T[s + 1, t])
                opts_c.append(-1)
            opts_p, opts_t = np.array(opts_p), np.array(opts_t)
            best = opts_p.min()
            i = int(np.argmin(np.where(opts_p == best, opts_t, np.inf)))
            P[s, t], T[s, t], ch[s, t] = best, opts_t[i], opts_c[i]
    return P, ch


def min_budget_optimal(graph: Graph, store_tapes: bool = True) -> int:
    """Exact minimum feasible budget (bytes) over all schedules (checked against exhaustive search)."""
    require_chain(graph, "optimal")
    P, _ = min_peak_table(graph, store_tapes)
    return int(graph.input_bytes + P[0, len(graph) - 1])


def _time_table(k: _Costs, M: int, store_tapes: bool):
    """C[s, t, m] least time, choice[s, t, m] as in :func:`min_peak_table`; m in 0..M units."""
    n = k.n
    inf = np.inf
    ms = np.arange(M + 1)
    C = np.full((n, n, M + 1), inf)
    ch = np.full((n, n, M + 1), -3, dtype=np.int16)
    for t in range(n):
        ok = ms >= max(k.g[t] + k.h0[t], k.bpk[t])
        C[t, t, ok] = k.f[t] + k.b[t]
        ch[t, t, ok] = -2
    for d in range(1, n):
        for s in range(n - d):
            t = s + d
            js = np.arange(s, t)
            # checkpoint a_j: C(j+1, t, m - out_j) + C(s, j, m) + f_s..f_j, for all j at once
            idx = ms[None, :] - k.out[js][:, None]                      # [d, M+1]
            later = np.where(idx >= 0, C[js + 1, t][np.arange(d)[:, None], np.clip(idx, 0, None)], inf)
            cand = later + C[s, s:t] + (k.fcum[js + 1] - k.fcum[s])[:, None]
            sweep = k.g[t] + np.maximum.accumulate(np.concatenate([[k.h0[s]], k.h[s + 1:t]]))
            cand[ms[None, :] < sweep[:, None]] = inf
            jbest = np.argmin(cand, axis=0)
            best = cand[jbest, ms]
            choice = (s + jbest).astype(np.int16)
            if store_tapes:
                w = k.e[s]
                tape = np.full(M + 1, inf)
                if w <= M:
                    tape[w:] = C[s + 1, t, : M + 1 - w] + k.f[s] + k.b[s]
                tape[ms < max(k.g[t] + k.h0[s], k.bpk[s])] = inf
                better = tape < best
                best = np.where(better, tape, best)
                choice = np.where(better, np.int16(-1), choice)
            C[s, t] = best
            ch[s, t] = np.where(np.isfinite(best), choice, np.int16(-3))
    return C, ch


def _ops_from_choices(shift, n: int, choice_at, m0) -> list[Op]:
    """Rebuild the op list from ``choice_at(s, t, m)``; ``shift(i, m, tape)`` is the memory left
    to the rest of the chain once block i's tape (``tape=True``) or plain output is stored."""
    ops: list[Op] = []
    # explicit stack of work items: ("sub", s, t, m) or ("op", Op)
    stack: list = [("sub", 0, n - 1, m0)]
    while stack:
        item = stack.pop()
        if item[0] == "op":
            ops.append(item[1])
            continue
        _, s, t, m = item
        c = choice_at(s, t, m)
        if c == -2:
            ops += [Op("Fe", t), Op("B", t)]
        elif c == -1:
            ops.append(Op("Fe", s))
            stack += [("op", Op("B", s)), ("sub", s + 1, t, shift(s, m, tape=True))]
        elif c >= 0:
            j = int(c)
            ops.append(Op("Fc", s))
            ops += [Op("Fn", i) for i in range(s + 1, j + 1)]
            stack += [("sub", s, j, m), ("sub", j + 1, t, shift(j, m, tape=False))]
        else:
            raise AssertionError(f"infeasible sub-problem ({s}, {t}) reached in reconstruction")
    return ops


def solve_optimal(graph: Graph, budget: int, slots: int = 500, unit_bytes: int | None = None,
                  store_tapes: bool = True) -> Schedule:
    """Least-time schedule whose peak (simulator replay) is ≤ ``budget`` bytes.

    ``store_tapes=False`` forbids keeping a tape across other blocks' work (checkpoints are plain
    activations only: the model of ``revolve``). Raises UserError below the minimum budget.
    """
    require_chain(graph, "optimal")
    if budget is None:
        raise UserError("method 'optimal' needs a budget in bytes")
    budget = int(budget)
    lowest = min_budget_optimal(graph, store_tapes)
    if budget < lowest:
        raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible {fmt_bytes(lowest)} "
                        f"for method 'optimal' on this chain ({len(graph)} blocks)")
    n = len(graph)
    from scaletrain.techniques.remat.periodic import none_ops

    store_all = none_ops(n)
    if store_tapes and simulate(graph, store_all).peak_bytes <= budget:  # no recomputation fits: fastest
        return make_schedule("optimal", graph, store_all, budget, store_tapes=store_tapes, shortcut="none fits")
    unit = int(unit_bytes) if unit_bytes else max(1, -(-budget // slots))
    for attempt in range(4):
        k = _Costs(graph, unit)
        M = budget // unit - k.inp
        if M >= 0 and n * n * (M + 1) <= _MAX_TABLE:
            C, ch = _time_table(k, M, store_tapes)
            if np.isfinite(C[0, n - 1, M]):
                def shift(i, m, tape, k=k):
                    return m - int(k.e[i] if tape else k.out[i])
                ops = _ops_from_choices(shift, n, lambda s, t, m: int(ch[s, t, m]), M)
                return make_schedule("optimal", graph, ops, budget, unit_bytes=unit, slots=M,
                                     store_tapes=store_tapes, dp_time_s=float(C[0, n - 1, M]))
        if unit == 1 or n * n * (2 * (M + 1)) > _MAX_TABLE:
            break
        unit = max(1, unit // 4)
    # Feasible in bytes but not in units at any affordable resolution: the least-peak schedule.
    _, chp = min_peak_table(graph, store_tapes)
    ops = _ops_from_choices(lambda i, m, tape: m, n, lambda s, t, m: int(chp[s, t]), 0)
    return make_schedule("optimal", graph, ops, budget, unit_bytes=unit, fallback="least-peak",
                         store_tapes=store_tapes)
