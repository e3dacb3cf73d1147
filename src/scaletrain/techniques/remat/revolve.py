"""Binomial checkpointing (Griewank & Walther 2000, "Algorithm 799: revolve").

Revolve treats the chain as l identical steps and memory as c checkpoint slots holding plain
activations; it is optimal in that model (the fewest forward steps), so optimal for
homogeneous chains whose tapes are not worth keeping across other blocks' work. In our ops,
with ``a_{s-1}`` stored by the caller and c free slots, blocks s..t (l = t - s + 1) are
reversed by

- l = 1: F_s^e, B_s;
- c = 0: for k = t down to s: F_s^c, F_{s+1}^n .. F_{k-1}^n, F_k^e, B_k  (l(l+1)/2 forwards);
- otherwise advance j steps storing ``a_{s+j-1}`` (F_s^c, F_{s+1}^n .. F_{s+j-1}^n), reverse
  s+j..t with c-1 slots, then s..s+j-1 with c slots, j minimising
  p(l, c) = min_j j + p(l - j, c - 1) + p(j, c), p(1, c) = 1.

p(l, c) counts every forward (the l recording ones included) and equals
l + r·l - β(c+2, r-1) with β(a, r) = C(a + r, a) and r the least integer with
β(c+1, r) ≥ l — Griewank & Walther's binomial bound with c + 1 snapshots (the caller's input
being the first); tests check both against each other.

With a budget in bytes, every slot count 0..n-1 is tried and the fastest schedule whose
simulated peak fits is kept.
"""

from __future__ import annotations

from functools import lru_cache
from math import comb

from scaletrain.errors import UserError
from scaletrain.techniques.remat.schedule import Graph, Op, Schedule, fmt_bytes, require_chain
from scaletrain.techniques.remat.simulate import make_schedule, simulate


@lru_cache(maxsize=None)
def _p(l: int, c: int) -> tuple[int, int]:
    """(least number of forwards, best first advance j) for l steps and c free slots."""
    if l == 1:
        return 1, 0
    if c == 0:
        return l * (l + 1) // 2, 0
    best = None
    for j in range(1, l):
        v = j + _p(l - j, c - 1)[0] + _p(j, c)[0]
        if best is None or v <= best[0]:  # ties: the largest advance
            best = (v, j)
    return best


def forwards(l: int, c: int) -> int:
    """Least number of forward operations to reverse l steps with c free checkpoint slots."""
    return _p(l, c)[0]


def binomial_forwards(l: int, c: int) -> int:
    """Griewank & Walther's closed form for the same count (c + 1 snapshots incl. the input)."""
    s = c + 1
    r = 0
    while comb(s + r, s) < l:
        r += 1
    if r == 0:
        return l  # l = 1
    return l + r * l - comb(s + 1 + r - 1, s + 1)


def revolve_ops(s: int, t: int, c: int) -> list[Op]:
    """Ops reversing blocks s..t (0-based, inclusive) with c free slots."""
    ops: list[Op] = []
    stack: list = [(s, t, c)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            ops.append(item)
            continue
        s, t, c = item
        l = t - s + 1
        if l == 1:
            ops += [Op("Fe", s), Op("B", s)]
        elif c == 0:
            for k in range(t, s - 1, -1):
                if k > s:
                    ops.append(Op("Fc", s))
                    ops += [Op("Fn", i) for i in range(s + 1, k)]
                ops += [Op("Fe", k), Op("B", k)]
        else:
            j = _p(l, c)[1]
            ops.append(Op("Fc", s))
            ops += [Op("Fn", i) for i in range(s + 1, s + j)]
            stack += [(s, s + j - 1, c), (s + j, t, c - 1)]
    return ops


def solve_revolve(graph: Graph, budget: int | None = None, slots: int | None = None) -> Schedule:
    """Fastest binomial schedule within ``budget`` (or with exactly ``slots`` free checkpoint slots)."""
    require_chain(graph, "revolve")
    n = len(graph)
    if slots is not None:
        cs = [min(max(0, int(slots)), n - 1)]
    else:
        cs, last = [], None
        for c in range(n):  # only slot counts that save forwards
            f = forwards(n, c)
            if f != last:
                cs.append(c)
                last = f
    best, lowest = None, None
    for c in cs:
        ops = revolve_ops(0, n - 1, c)
        rep = simulate(graph, ops)
        lowest = rep.peak_bytes if lowest is None else min(lowest, rep.peak_bytes)
        if budget is not None and rep.peak_bytes > budget:
            continue
        key = (rep.time_s, rep.peak_bytes)
        if best is None or key < best[0]:
            best = (key, c, ops)
    if best is None:
        raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible {fmt_bytes(lowest)} "
                        f"for method 'revolve'")
    _, c, ops = best
    return make_schedule("revolve", graph, ops, budget, slots=c, forwards=forwards(n, c))


def min_budget_revolve(graph: Graph) -> int:
    require_chain(graph, "revolve")
    return min(simulate(graph, revolve_ops(0, len(graph) - 1, c)).peak_bytes for c in range(len(graph)))
