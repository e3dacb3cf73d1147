"""Rematerialization as a mixed-integer program on a general graph (Checkmate, Jain et al. 2020).

Checkmate's idea, in the memory model of :mod:`simulate`: the step is cut into *stages*, one
per backward; stage k ends with the backward of node v_k = N-1-k (reverse topological order)
and before it may (re)compute any not-yet-back-propagated node, each at most once, in
topological order (one "slot" per node). Variables (k stage, w node, p slot):

- ``R[k,w]`` ∈ {0,1}: forward of w without recording in stage k (F^c);
- ``E[k,w]`` ∈ {0,1}: recording forward of w in stage k (F^e); Σ_k E[k,w] = 1, k ≤ stage of B_w,
  so T[k,w] = Σ_{k'<k} E[k',w] says the tape of w is stored at the start of stage k;
- ``S[k,w]`` ∈ [0,1]: plain ``a_w`` stored at the start of stage k (Checkmate's S);
- ``X[k,w,p]`` ∈ [0,1]: plain ``a_w`` stored after slot p of stage k; it may only fall
  (freed, Checkmate's FREE) except at slot w where R[k,w] creates it.

Constraints: a forward at slot p needs each input u stored (X[k,u,p-1] + T[k,u] + E[k,u] ≥
R[k,p] + E[k,p]); the backward of v_k needs its tape and inputs; a tape holds its inputs (a
plain input stays while a successor's tape exists); carried copies were stored at the end of
the previous stage (S[k+1,w] ≤ X[k,w,last]); and the live bytes during every slot and every
backward (stored + the op's own bytes, exactly as ``simulate`` counts them) ≤ budget. The
objective is Σ fwd_time·(R + E). S and X may be continuous: given integral R and E the least
feasible S, X are integral (difference constraints with integral bounds), and memory only
grows with them.

``persistent=True`` adds "a carried copy is kept until no backward needs it" — the class the
dynamic program optimises over; the tests check ``ilp(persistent=True) == optimal`` on chains
and ``ilp == exhaustive`` on small chains and graphs with skip connections.

Solved with ``scipy.optimize.milp`` (HiGHS) under ``time_limit`` seconds; if no integral
solution is found in time, the LP relaxation is rounded (tape stage = argmax_k E, carried
copies = S ≥ threshold, for several thresholds) and the fastest rounded schedule within the
budget is kept. A schedule is read back from (tape stages, carried copies): each stage
computes what they demand, frees plain copies after their last use, then runs its backward.
"""

from __future__ import annotations

import time as _time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from scaletrain.errors import UserError
from scaletrain.techniques.remat.schedule import Graph, Op, Schedule, canonical_chain_ops, fmt_bytes
from scaletrain.techniques.remat.simulate import SimState, make_schedule, simulate


class _Model:
    """Sparse MILP builder: variables with bounds/cost/integrality, rows lo ≤ a·x ≤ hi."""

    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.ri: list[int] = []
        self.ci: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def var(self, integer: bool, cost: float = 0.0, ub: float = 1.0) -> int:
        self.lb.append(0.0)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(1 if integer else 0)
        return len(self.lb) - 1

    def row(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(self.lo)
        for j, v in terms:
            self.ri.append(r)
            self.ci.append(j)
            self.vals.append(v)
        self.lo.append(lo)
        self.hi.append(hi)

    def solve(self, time_limit: float, relax: bool = False):
        n = len(self.lb)
        A = coo_array((self.vals, (self.ri, self.ci)), shape=(len(self.lo), n)).tocsr()
        integ = np.zeros(n) if relax else np.array(self.integer)
        return milp(np.array(self.cost), integrality=integ, bounds=Bounds(self.lb, self.ub),
                    constraints=LinearConstraint(A, self.lo, self.hi),
                    options={"time_limit": float(time_limit), "disp": False, "mip_rel_gap": 1e-9})


def _build(g: Graph, budget: int | None, persistent: bool):
    """The MILP; with ``budget=None`` the budget is a variable P to minimise (least peak)."""
    N = len(g)
    nd = g.nodes
    # Power-of-two scaling keeps coefficients ≤ ~1e6 and exact in floating point.
    top = max(budget or 0, g.input_bytes + sum(x.tape_bytes + 2 * x.out_bytes + x.fwd_temp_bytes
                                                 + x.bwd_temp_bytes for x in nd), 1)
    scale = 2.0 ** max(0, int(np.ceil(np.log2(top / 2**20))))
    mb = lambda b: b / scale
    m = _Model()
    v = lambda k: N - 1 - k
    R, E, S, X = {}, {}, {}, {}
    for k in range(N):
        for w in range(v(k) + 1):
            cost = nd[w].fwd_time_s if budget is not None else 0.0  # least-peak mode: peak only
            R[k, w] = m.var(True, cost)
            E[k, w] = m.var(True, cost)
            if k > 0:
                S[k, w] = m.var(False)
            for p in range(v(k) + 1):
                X[k, w, p] = m.var(False)
    P = m.var(False, cost=1.0, ub=np.inf) if budget is None else None
    cap = (lambda terms, const: m.row(terms + [(P, -1.0)], -np.inf, -mb(const))) if P is not None else \
          (lambda terms, const: m.row(terms, -np.inf, mb(budget - const)))

    def prev(k, w, p):  # [(var, coef)] for "plain a_w stored before slot p of stage k"
        if p > 0:
            return [(X[k, w, p - 1], 1.0)]
        return [(S[k, w], 1.0)] if (k, w) in S else []

    def tape(k, w):  # tape of w stored at the start of stage k
        return [(E[kk, w], 1.0) for kk in range(k)]

    neg = lambda terms: [(j, -c) for j, c in terms]
    for w in range(N):
        m.row([(E[k, w], 1.0) for k in range(N - w)], 1.0, 1.0)
    for k in range(N):
        vk = v(k)
        done = set(range(vk + 1, N))
        grads = sum(nd[u].out_bytes for u in range(vk + 1) if any(s in done for s in g.succs[u]))
        base = g.input_bytes + grads
        for w in range(vk + 1):
            m.row([(R[k, w], 1.0), (E[k, w], 1.0)], -np.inf, 1.0)
            for p in range(vk + 1):
                terms = [(X[k, w, p], 1.0)] + neg(prev(k, w, p)) + ([(R[k, w], -1.0)] if p == w else [])
                m.row(terms, -np.inf, 0.0)
            m.row([(X[k, w, w], 1.0), (E[k, w], 1.0)], -np.inf, 1.0)
            if k + 1 < N and w <= v(k + 1):
                m.row([(S[k + 1, w], 1.0), (X[k, w, vk], -1.0)], -np.inf, 0.0)
        for p in range(vk + 1):
            for u in nd[p].preds:  # inputs of a forward at slot p
                m.row([(R[k, p], 1.0), (E[k, p], 1.0)] + neg(prev(k, u, p) + tape(k, u) + [(E[k, u], 1.0)]),
                      -np.inf, 0.0)
            # live bytes during slot p
            terms = []
            for w in range(vk + 1):
                terms += [(j, c * mb(nd[w].out_bytes)) for j, c in prev(k, w, p)]
                terms += [(j, c * mb(nd[w].tape_bytes)) for j, c in tape(k, w)]
                if w < p:
                    terms.append((E[k, w], mb(nd[w].tape_bytes)))
            op_bytes = mb(nd[p].out_bytes + nd[p].saved_bytes + nd[p].fwd_temp_bytes)
            cap(terms + [(R[k, p], op_bytes), (E[k, p], op_bytes)], base)
        for u in nd[vk].preds:  # inputs of B_{v_k}
            m.row([(X[k, u, vk], 1.0)] + tape(k, u) + [(E[k, u], 1.0)], 1.0, np.inf)
        terms = []
        for w in range(vk + 1):
            terms.append((X[k, w, vk], mb(nd[w].out_bytes)))
            terms += [(j, mb(nd[w].tape_bytes)) for j, _ in tape(k, w) + [(E[k, w], 1.0)]]
        extra = nd[vk].bwd_temp_bytes + sum(nd[u].out_bytes for u in nd[vk].preds
                                             if not any(s in done for s in g.succs[u]))
        if not g.succs[vk]:  # the sink's backward runs the loss first
            extra = max(g.loss_bytes, nd[vk].out_bytes + extra)
        cap(terms, base + extra)
        # a tape holds its inputs: plain a_u stays while the tape of a successor s exists
        for s in range(vk + 1):
            for u in nd[s].preds:
                if k > 0:
                    m.row([(S[k, u], 1.0)] + tape(k, u) + neg(tape(k, s)), 0.0, np.inf)
                for p in range(vk + 1):
                    terms = [(X[k, u, p], 1.0)] + tape(k, u) + ([(E[k, u], 1.0)] if u <= p else [])
                    terms += neg(tape(k, s) + ([(E[k, s], 1.0)] if s <= p else []))
                    m.row(terms, 0.0, np.inf)
        if persistent and k > 0:
            for w in range(vk + 1):
                if any(s <= vk for s in g.succs[w]):
                    for p in range(vk + 1):
                        m.row([(S[k, w], 1.0), (X[k, w, p], -1.0)], -np.inf, 0.0)
                    if k + 1 < N and any(s <= v(k + 1) for s in g.succs[w]):
                        m.row([(S[k, w], 1.0), (S[k + 1, w], -1.0)], -np.inf, 0.0)
    return m, R, E, S, X, P, scale


def ops_from_decisions(g: Graph, tape_stage: list[int], carry: list[set[int]]) -> list[Op]:
    """Ops of the schedule that tapes w in stage ``tape_stage[w]`` and carries ``carry[k]`` into stage k.

    Each stage computes, in topological order, the nodes it tapes, the carried copies it must
    create and whatever their inputs and its backward need; a plain copy is dropped after its
    last use unless it is carried or held by a tape.
    """
    N = len(g)
    nd = g.nodes
    st = SimState(g)
    ops: list[Op] = []

    def emit(op: Op) -> None:
        st.step(op)
        ops.append(op)

    for k in range(N):
        vk = N - 1 - k
        keep = {w for w in carry[k + 1] if w < vk and any(s < vk for s in g.succs[w])} if k + 1 < N else set()
        taped_here = {w for w in range(vk + 1) if tape_stage[w] == k}
        need = set(taped_here) | {w for w in keep if not st.available(w) and w not in taped_here}
        need |= {u for u in nd[vk].preds if not st.available(u) and u not in taped_here}
        work = list(need)
        while work:
            w = work.pop()
            for u in nd[w].preds:
                if not st.available(u) and u not in taped_here and u not in need:
                    need.add(u)
                    work.append(u)
        order = sorted(need)
        uses: dict[int, int] = {}  # plain copy -> last slot using it (N for the backward)
        for w in order:
            for u in nd[w].preds:
                uses[u] = max(uses.get(u, -1), w)
        for u in nd[vk].preds:
            uses[u] = N
        for u in sorted(st.plain):  # carried copies this stage does not use
            if u not in keep and u not in uses and not st.pinned(u):
                emit(Op("Dp", u))
        for w in order:
            emit(Op("Fe" if w in taped_here else "Fc", w))
            for u in sorted(st.plain):
                if u not in keep and uses.get(u, -1) <= w and not st.pinned(u):
                    emit(Op("Dp", u))
        emit(Op("B", vk))
        for u in sorted(st.plain):
            if u not in keep and not st.pinned(u):
                emit(Op("Dp", u))
    return ops


def ops_from_solution(g: Graph, x: np.ndarray, R, E, S, X) -> list[Op] | None:
    """Checkmate's own read-back: the MILP's solution op for op — stage k runs slot p's forward
    as F^e if E[k,p], F^c if R[k,p], drops a plain copy where X falls to 0 after a slot, runs
    B_{v_k}, and keeps into stage k+1 only the copies S[k+1] carries. Frees exactly where the
    MILP's memory rows free, so its replayed peak is the MILP's. None if the rounded solution
    is not a valid schedule (an LP relaxation)."""
    N = len(g)
    st = SimState(g)
    ops: list[Op] = []
    on = lambda j: x[j] > 0.5

    def emit(op: Op) -> bool:
        if st.check(op):
            return False
        st.step(op)
        ops.append(op)
        return True

    def drop_unless(keep) -> None:
        for w in sorted(st.plain):
            if not keep(w) and not st.pinned(w):
                emit(Op("Dp", w))

    for k in range(N):
        vk = N - 1 - k
        for p in range(vk + 1):
            if on(E[k, p]):
                if not emit(Op("Fe", p)):
                    return None
            elif on(R[k, p]) and not st.available(p):
                if not emit(Op("Fc", p)):
                    return None
            drop_unless(lambda w: w <= vk and on(X[k, w, p]))
        if not emit(Op("B", vk)):
            return None
        drop_unless(lambda w: k + 1 < N and (k + 1, w) in S and on(S[k + 1, w]))
    return ops


def _readback(g: Graph, x: np.ndarray, R, E, S, X) -> list[Op]:
    """The better of two read-backs of a MILP solution, replayed by the simulator (least peak,
    then least time): the literal one (:func:`ops_from_solution`) and the one rebuilt from tape
    stages and carried copies (:func:`ops_from_decisions`, which drops every copy right after its
    last use and so never holds more, but recomputes in its own order). Either alone can miss:
    the rebuilt one once peaked 1 B above a budget the MILP met (a skip-connection graph where
    the MILP's order of recomputation mattered)."""
    cands = [ops_from_decisions(g, *_decisions(g, x, E, S, 0.999))]
    literal = ops_from_solution(g, x, R, E, S, X)
    if literal is not None:
        cands.append(literal)
    reps = [simulate(g, ops) for ops in cands]
    best = min(range(len(cands)), key=lambda i: (reps[i].peak_bytes, reps[i].time_s))
    return cands[best]


def _schedule(g: Graph, ops: list[Op], budget: int, **meta) -> Schedule:
    if g.is_chain:
        ops = canonical_chain_ops(g, ops)
    return make_schedule("ilp", g, ops, budget, **meta)


def _decisions(g: Graph, x: np.ndarray, E, S, thr: float):
    N = len(g)
    tape_stage = [max(range(N - w), key=lambda k: (x[E[k, w]], k)) for w in range(N)]
    carry = [set()] + [{w for w in range(N - k) if x[S[k, w]] >= thr} for k in range(1, N)]
    return tape_stage, carry


def solve_ilp(graph: Graph, budget: int, time_limit: float = 30.0, persistent: bool = False) -> Schedule:
    """Least-time schedule within ``budget`` by Checkmate's MILP (see the module docstring)."""
    if budget is None:
        raise UserError("method 'ilp' needs a budget in bytes")
    budget = int(budget)
    g = graph
    t0 = _time.perf_counter()
    m, R, E, S, X, _, _ = _build(g, budget, persistent)
    res = m.solve(time_limit)
    if res.status == 2:  # infeasible
        lowest = min_budget_ilp(g, time_limit, persistent)
        raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible {fmt_bytes(lowest)} "
                        f"for method 'ilp'")
    if res.x is not None:
        # Carried copies forced by the MILP are 1; fractional ones are not needed (module doc).
        return _schedule(g, _readback(g, res.x, R, E, S, X), budget, status=res.message,
                         optimal=bool(res.status == 0), milp_time_s=float(res.fun),
                         solve_s=_time.perf_counter() - t0, variables=len(m.lb))
    # No integral solution in time: round the LP relaxation.
    lp = m.solve(time_limit, relax=True)
    best = None
    if lp.x is not None:
        for thr in (0.5, 0.25, 0.75, 0.1, 0.9, 1e-3):
            tape_stage, carry = _decisions(g, lp.x, E, S, thr)
            ops = ops_from_decisions(g, tape_stage, carry)
            rep = simulate(g, ops)
            if rep.peak_bytes <= budget and (best is None or rep.time_s < best[0]):
                best = (rep.time_s, ops, thr)
    if best is None:
        raise UserError(f"ilp found no schedule within {fmt_bytes(budget)} in {time_limit:g} s "
                        f"(MILP: {res.message}); raise --time-limit or use method 'optimal' on chains")
    return _schedule(g, best[1], budget, status="lp-rounding", optimal=False, threshold=best[2],
                     solve_s=_time.perf_counter() - t0, variables=len(m.lb))


def min_budget_ilp(graph: Graph, time_limit: float = 30.0, persistent: bool = False) -> int:
    """Least peak (bytes) over the MILP's schedules, read back and replayed by the simulator."""
    m, R, E, S, X, P, scale = _build(graph, None, persistent)
    res = m.solve(time_limit)
    if res.x is None:
        raise UserError(f"ilp could not find the minimum budget in {time_limit:g} s ({res.message})")
    return simulate(graph, _readback(graph, res.x, R, E, S, X)).peak_bytes
