"""Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021) at block granularity.

DTR needs no plan: it runs the program as written — record every block (F_i^e), then
backward — and whenever an operation would push live memory over the budget it evicts the
stored item with the lowest

    h_DTR(t) = c(t) / (m(t) · s(t))

(c: time to rebuild t, including the evicted ancestors it would need — the paper's e*
"evicted neighbourhood" cost, computed exactly by walking the inputs; m: bytes it frees;
s: staleness, seconds of simulated compute since t was last used). Evicted items are rebuilt
on demand when an operation needs them: a plain output by F^c, a tape by F^e, recursively.
The items are a block's tape (evicting it, ``Dt``, frees its saved tensors and keeps its
output) and a plain output (``Dp``); the input batch and gradients are never evicted, nor
the inputs of the operation being prepared.

Because block costs come from the Profile, the runtime's decisions are deterministic: this
module plays the runtime against the simulator and returns the ops it performed, which the
executor then runs (the apply face is the same as for every schedule). If the runtime
cannot fit (everything left is locked), the budget is too small for DTR: the error states the
least budget at which it succeeds, found by bisection.
"""

from __future__ import annotations

import sys

from scaletrain.errors import UserError
from scaletrain.techniques.remat.schedule import Graph, Op, Schedule, fmt_bytes
from scaletrain.techniques.remat.simulate import SimState, make_schedule, simulate


class _Fail(Exception):
    pass


class _Runtime:
    def __init__(self, g: Graph, budget: int):
        self.g, self.budget = g, budget
        self.st = SimState(g)
        self.ops: list[Op] = []
        self.clock = 0.0
        self.last: dict[tuple[str, int], float] = {}
        self.evictions = 0

    # -- bookkeeping -----------------------------------------------------------------
    def touch(self, i: int) -> None:
        if i in self.st.tape:
            self.last[("t", i)] = self.clock
        if i in self.st.plain:
            self.last[("p", i)] = self.clock

    def rebuild_cost(self, i: int, evicted: set[int]) -> float:
        """Forward time to make ``a_i``'s inputs available (evicted ancestors, each once)."""
        cost, stack = 0.0, list(self.g.nodes[i].preds)
        while stack:
            u = stack.pop()
            if u in evicted or self.st.available(u):
                continue
            evicted.add(u)
            cost += self.g.nodes[u].fwd_time_s
            stack.extend(self.g.nodes[u].preds)
        return cost

    def victim(self, avail_locks: set[int], tape_locks: set[int]) -> Op | None:
        best = None
        nd = self.g.nodes
        for i in self.st.tape:
            if i in tape_locks or nd[i].saved_bytes == 0:
                continue
            c = nd[i].fwd_time_s + self.rebuild_cost(i, set())
            s = self.clock - self.last.get(("t", i), 0.0) + 1e-9
            h = c / (nd[i].saved_bytes * s)
            if best is None or h < best[0]:
                best = (h, Op("Dt", i))
        for i in self.st.plain:
            if i in avail_locks or nd[i].out_bytes == 0 or self.st.pinned(i):
                continue
            c = nd[i].fwd_time_s + self.rebuild_cost(i, set())
            s = self.clock - self.last.get(("p", i), 0.0) + 1e-9
            h = c / (nd[i].out_bytes * s)
            if best is None or h < best[0]:
                best = (h, Op("Dp", i))
        return None if best is None else best[1]

    # -- execution -------------------------------------------------------------------
    def execute(self, op: Op, avail_locks: set[int], tape_locks: set[int]) -> None:
        st = self.st
        why = st.check(op)
        if why:
            raise AssertionError(f"dtr runtime: {why}")
        while st.live_during(op) > self.budget:
            v = self.victim(avail_locks, tape_locks)
            if v is None:
                raise _Fail(f"{op}: {st.live_during(op)} B needed, nothing left to evict")
            st.step(v)
            self.ops.append(v)
            self.evictions += 1
        st.step(op)
        self.ops.append(op)
        nd = self.g.nodes[op.index]
        self.clock += nd.bwd_time_s if op.kind == "B" else nd.fwd_time_s
        for p in nd.preds:
            self.touch(p)
        self.touch(op.index)

    def ensure(self, i: int, avail_locks: set[int], tape_locks: set[int], tape: bool = False) -> None:
        """Make ``a_i`` available (or the tape of i, with ``tape=True``), rebuilding on demand."""
        if (i in self.st.tape) if tape else self.st.available(i):
            self.touch(i)
            return
        preds = self.g.nodes[i].preds
        locks = avail_locks | set(preds)
        for p in preds:
            self.ensure(p, locks, tape_locks)
        self.execute(Op("Fe" if tape else "Fc", i), locks, tape_locks)

    def run(self) -> list[Op]:
        g = self.g
        n = len(g)
        for i in range(n):
            self.ensure(i, set(), set(), tape=True)
        for v in reversed(range(n)):
            preds = set(g.nodes[v].preds)
            self.ensure(v, preds, {v}, tape=True)
            for p in g.nodes[v].preds:
                self.ensure(p, preds, {v})
            self.execute(Op("B", v), preds, {v})
        return self.ops


def _attempt(g: Graph, budget: int) -> _Runtime | None:
    rt = _Runtime(g, budget)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * len(g) + 1000))
    try:
        rt.run()
        return rt
    except _Fail:
        return None
    finally:
        sys.setrecursionlimit(limit)


def min_budget_dtr(g: Graph) -> int:
    """Least budget at which the DTR runtime succeeds, by bisection between 0 and the no-remat peak.

    DTR is a heuristic: success is not guaranteed to be monotone in the budget; the value is
    the least budget found by bisection at which it succeeds.
    """
    from scaletrain.techniques.remat.periodic import none_ops

    hi = simulate(g, none_ops(len(g))).peak_bytes
    lo = g.input_bytes - 1
    while hi - lo > max(1, hi // 4096):
        mid = (lo + hi) // 2
        if _attempt(g, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def solve_dtr(graph: Graph, budget: int) -> Schedule:
    """The ops the DTR runtime performs under ``budget`` (bytes)."""
    if budget is None:
        raise UserError("method 'dtr' needs a budget in bytes")
    rt = _attempt(graph, int(budget))
    if rt is None:
        raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible {fmt_bytes(min_budget_dtr(graph))} "
                        f"for method 'dtr' (found by bisection)")
    return make_schedule("dtr", graph, rt.ops, int(budget), evictions=rt.evictions)
