"""Exhaustive search over *all* schedules of the simulator, for small graphs (the tests' oracle).

A state is what is stored (plain copies, tapes, which backwards are done; the gradients
follow from the latter). Every valid op of :mod:`simulate` is an edge — ``Fn``, ``Fc``,
``Fe``, ``B``, ``Dp``, ``Dt`` — allowed when its live bytes are within the budget. Dijkstra
gives the least total time (``solve``) or, with max in place of +, the least peak
(``min_peak``). The number of states grows like 3^n: use it up to ~8 nodes.

``persistent=True`` restricts the search to *persistent* schedules, the class the dynamic
program of Beaumont et al. optimises over: no tape is dropped before its backward (no
``Dt``), and a plain copy may be dropped (``Dp`` or ``Fn``) only in the *stage* that computed
it (a stage = the ops between two backwards); a plain copy that survives a backward is a
checkpoint, kept until the backward that needs it frees it. Without the restriction the
search finds schedules that drop a checkpoint after a recomputation and rebuild it later from
an earlier one, which can be faster at tight budgets (see tests/test_remat_optimality.py).
"""

from __future__ import annotations

import heapq
import itertools

from scaletrain.errors import UserError
from scaletrain.techniques.remat.schedule import Graph, Op, Schedule, fmt_bytes
from scaletrain.techniques.remat.simulate import make_schedule


class _Space:
    def __init__(self, g: Graph):
        self.g = g
        n = self.n = len(g)
        self.out = [nd.out_bytes for nd in g.nodes]
        self.tape = [nd.tape_bytes for nd in g.nodes]
        self.predmask = [sum(1 << p for p in nd.preds) for nd in g.nodes]
        self.succmask = [sum(1 << s for s in g.succs[i]) for i in range(n)]
        self.full = (1 << n) - 1

    def stored(self, plain: int, tape: int, done: int) -> int:
        g = self.g
        b = g.input_bytes
        for i in range(self.n):
            bit = 1 << i
            if plain & bit:
                b += self.out[i]
            if tape & bit:
                b += self.tape[i]
            if not done & bit and self.succmask[i] & done:
                b += self.out[i]  # δ_i exists
        return b

    def moves(self, plain: int, tape: int, done: int, fresh: int, persistent: bool):
        """Yield (op, live bytes during, time, next state); ``fresh``: plain copies made this stage."""
        g = self.g
        avail = plain | tape
        base = self.stored(plain, tape, done)
        for i in range(self.n):
            bit = 1 << i
            if done & bit:
                continue
            nd = g.nodes[i]
            ready = (self.predmask[i] & avail) == self.predmask[i]
            fpk = base + nd.out_bytes + nd.saved_bytes + nd.fwd_temp_bytes
            if ready and not avail & bit:
                yield Op("Fc", i), fpk, nd.fwd_time_s, (plain | bit, tape, done, fresh | bit)
                drop = sum(1 << p for p in nd.preds if plain >> p & 1 and not self.succmask[p] & tape)
                if persistent and drop & ~fresh:
                    drop = 0
                if drop:
                    yield Op("Fn", i), fpk, nd.fwd_time_s, ((plain | bit) & ~drop, tape, done, (fresh | bit) & ~drop)
            if ready and not tape & bit:
                yield Op("Fe", i), fpk, nd.fwd_time_s, (plain & ~bit, tape | bit, done, fresh & ~bit)
            if ready and tape & bit and (self.succmask[i] & done) == self.succmask[i]:
                ndone = done | bit
                extra = nd.bwd_temp_bytes + sum(self.out[p] for p in nd.preds if not self.succmask[p] & done)
                if not self.succmask[i]:
                    extra = max(g.loss_bytes, nd.out_bytes + extra)
                nplain = plain
                for p in nd.preds:
                    if (self.succmask[p] & ndone) == self.succmask[p]:
                        nplain &= ~(1 << p)
                yield Op("B", i), base + extra, nd.bwd_time_s, (nplain, tape & ~bit, ndone, 0)
            if plain & bit and not self.succmask[i] & tape and not (persistent and not fresh & bit):
                yield Op("Dp", i), base, 0.0, (plain & ~bit, tape, done, fresh & ~bit)
            if tape & bit and not persistent:
                yield Op("Dt", i), base, 0.0, (plain | bit, tape & ~bit, done, fresh | bit)


def _search(g: Graph, budget: float, minimax: bool, persistent: bool):
    sp = _Space(g)
    start = (0, 0, 0, 0)
    tie = itertools.count()
    best = {start: 0.0}
    parent: dict = {start: None}
    heap = [(0.0, next(tie), start)]
    while heap:
        cost, _, st = heapq.heappop(heap)
        if cost > best.get(st, float("inf")):
            continue
        if st[2] == sp.full:
            ops = []
            while parent[st] is not None:
                st, op = parent[st]
                ops.append(op)
            return cost, ops[::-1]
        for op, live, dt, nxt in sp.moves(*st, persistent):
            if live > budget:
                continue
            if not persistent:
                nxt = nxt[:3] + (0,)
            nc = max(cost, live) if minimax else cost + dt
            if nc < best.get(nxt, float("inf")):
                best[nxt] = nc
                parent[nxt] = (st, op)
                heapq.heappush(heap, (nc, next(tie), nxt))
    return None, None


def solve(graph: Graph, budget: int, persistent: bool = False) -> Schedule:
    """Least-time schedule over all (or all persistent) schedules with peak ≤ ``budget``.

    Exponential in the number of nodes: small graphs only.
    """
    if len(graph) > 10:
        raise UserError(f"exhaustive search is for graphs of ≤ 10 nodes, got {len(graph)}")
    cost, ops = _search(graph, budget, minimax=False, persistent=persistent)
    if ops is None:
        raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible "
                        f"{fmt_bytes(min_peak(graph, persistent))} (exhaustive search)")
    return make_schedule("exhaustive", graph, ops, budget, persistent=persistent)


def min_peak(graph: Graph, persistent: bool = False) -> int:
    """Least peak over all (or all persistent) schedules (bytes)."""
    peak, _ = _search(graph, float("inf"), minimax=True, persistent=persistent)
    return int(max(peak, graph.input_bytes))
