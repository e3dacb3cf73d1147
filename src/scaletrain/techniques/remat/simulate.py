"""Replay a schedule over a Graph: its peak memory and its time. The cost face shared by all solvers.

Memory model (bytes, all on the device; parameters, parameter gradients and optimizer state
are *not* counted — the budget is for activations):

What is **stored** between operations:

- the graph input ``a_-1`` (``Graph.input_bytes``), held by the caller for the whole step;
- every *plain* output ``a_i`` kept by an ``Fn``/``Fc`` (``out_bytes``);
- every *tape* of block i made by ``Fe`` and not yet consumed by ``B_i``:
  ``out_bytes + saved_bytes`` (output with its graph + tensors saved for backward);
- every activation gradient ``δ_i`` that exists (``out_bytes``): created by the first
  backward of a successor of i, freed by ``B_i``. The input gets no gradient.

What is **live during** an operation = stored before it, plus:

- ``Fn_i``/``Fc_i``/``Fe_i``: ``out_bytes + saved_bytes + fwd_temp_bytes`` of block i. A
  forward without recording frees its intermediates as it goes, so its real peak is at most
  that of the recording forward; we charge both the same (an upper bound, never an
  underestimate). Inputs forgotten by ``Fn`` are freed only *after* the forward.
- ``B_i``: ``bwd_temp_bytes`` of block i, plus the new gradient buffers it creates
  (``out_bytes`` of each predecessor that has no gradient yet); for the sink, whose
  backward first runs the loss, the larger of the loss's peak (``Graph.loss_bytes``) and
  ``δ`` of its output (``out_bytes``, made by the loss) plus the above.
- ``Dp``/``Dt``: nothing (they only free).
- in one backward (nested checkpoints), a shared parameter's gradient the engine holds from its
  last user's backward through its first's (``Graph.pending``).

A tape holds its block's input (autograd saves it, and the executor keeps it to read its
gradient), so the plain copy of ``a_i`` cannot be dropped while the tape of a successor of i
exists: ``Dp_i`` is then invalid and ``Fn`` keeps that input.

After ``B_i`` the tape of i, ``δ_i`` and the plain copy of every predecessor whose successors
have all done their backward are freed. The peak of a schedule is the maximum over its
operations of the live bytes during the operation (stored bytes after any operation never
exceed that operation's live bytes). Time = Σ ``fwd_time_s`` over forwards + Σ
``bwd_time_s`` over backwards (recording or not, a forward is charged the same time).

Where the executor frees earlier than this model says, the model is an upper bound: it lets
go of the sink's output (the logits) once the loss is computed, as plain autograd does, while
the model counts the sink's tape until its backward ends.

A valid schedule ends with every backward done and nothing stored but the input; the
simulator raises ``ValueError`` naming the first invalid operation otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from scaletrain.techniques.remat.schedule import FORWARD_KINDS, Graph, Op, Profile, Schedule, as_graph


@dataclass
class Replay:
    """Result of replaying a schedule: peak live bytes, total time and the per-op trace."""

    peak_bytes: int
    time_s: float
    during: list[int] = field(default_factory=list)
    """Live bytes during each op."""
    after: list[int] = field(default_factory=list)
    """Stored bytes after each op."""


class SimState:
    """The stored items of a schedule in progress; ``step`` applies one op (see module doc)."""

    def __init__(self, graph: Graph):
        self.g = graph
        self.plain: set[int] = set()
        self.tape: set[int] = set()
        self.grad: set[int] = set()
        self.done: set[int] = set()
        self.stored = graph.input_bytes
        self.time_s = 0.0

    # -- queries -------------------------------------------------------------------------
    def available(self, i: int) -> bool:
        return i in self.plain or i in self.tape

    def pinned(self, i: int) -> bool:
        """True while the tape of a successor of ``i`` exists: that tape holds ``a_i`` (its input)."""
        return any(s in self.tape for s in self.g.succs[i])

    def copy(self) -> "SimState":
        s = SimState.__new__(SimState)
        s.g, s.stored, s.time_s = self.g, self.stored, self.time_s
        s.plain, s.tape, s.grad, s.done = set(self.plain), set(self.tape), set(self.grad), set(self.done)
        return s

    def check(self, op: Op) -> str | None:
        """Why ``op`` cannot run now, or None if it can."""
        g, i = self.g, op.index
        if not 0 <= i < len(g):
            return f"{op}: no node {i}"
        nd = g.nodes[i]
        if op.kind in FORWARD_KINDS or op.kind == "B":
            if i in self.done:
                return f"{op}: backward of {i} already done"
            missing = [p for p in nd.preds if not self.available(p)]
            if missing:
                return f"{op}: input(s) {missing} not available"
        if op.kind == "Fe" and i in self.tape:
            return f"{op}: tape of {i} already exists"
        if op.kind in ("Fn", "Fc") and self.available(i):
            return f"{op}: output of {i} already available"
        if op.kind == "B":
            if i not in self.tape:
                return f"{op}: no tape of {i} (run F{i}^e first)"
            if any(s not in self.done for s in g.succs[i]):
                return f"{op}: backward of a successor of {i} not done"
        if op.kind == "Dp" and i not in self.plain:
            return f"{op}: no plain copy of {i}"
        if op.kind == "Dp" and self.pinned(i):
            return f"{op}: a tape of a successor of {i} holds it (drop that tape first)"
        if op.kind == "Dt" and i not in self.tape:
            return f"{op}: no tape of {i}"
        if op.kind not in ("Fn", "Fc", "Fe", "B", "Dp", "Dt"):
            return f"unknown op kind {op.kind!r}"
        return None

    def pending_bytes(self, op: Op) -> int:
        """Shared parameters' gradients the engine holds during ``op`` (``Graph.pending``): from the
        backward of their last user (after it) through that of their first."""
        return sum(n for lo, hi, n in self.g.pending
                   if hi in self.done and lo not in self.done)

    def live_during(self, op: Op) -> int:
        """Bytes live while ``op`` runs (assumes ``check(op)`` passed)."""
        return self._live(op) + (self.pending_bytes(op) if self.g.pending else 0)

    def _live(self, op: Op) -> int:
        nd = self.g.nodes[op.index]
        if op.kind in FORWARD_KINDS:
            return self.stored + nd.out_bytes + nd.saved_bytes + nd.fwd_temp_bytes
        if op.kind == "B":
            extra = nd.bwd_temp_bytes + sum(self.g.nodes[p].out_bytes for p in nd.preds if p not in self.grad)
            if not self.g.succs[op.index]:  # the loss runs first and makes δ of the output
                extra = max(self.g.loss_bytes, nd.out_bytes + extra)
            return self.stored + extra
        return self.stored

    # -- transition ----------------------------------------------------------------------
    def step(self, op: Op) -> int:
        """Apply ``op``; return the live bytes during it. Raises ValueError if invalid."""
        why = self.check(op)
        if why:
            raise ValueError(why)
        g, i = self.g, op.index
        nd = g.nodes[i]
        during = self.live_during(op)
        if op.kind in ("Fn", "Fc"):
            self._add_plain(i)
            self.time_s += nd.fwd_time_s
            if op.kind == "Fn":
                for p in nd.preds:
                    if not self.pinned(p):
                        self._drop_plain(p)
        elif op.kind == "Fe":
            self._drop_plain(i)
            self.tape.add(i)
            self.stored += nd.tape_bytes
            self.time_s += nd.fwd_time_s
        elif op.kind == "B":
            self.tape.discard(i)
            self.stored -= nd.tape_bytes
            if i in self.grad:
                self.grad.discard(i)
                self.stored -= nd.out_bytes
            self.done.add(i)
            for p in nd.preds:
                if p not in self.grad:
                    self.grad.add(p)
                    self.stored += g.nodes[p].out_bytes
                if all(s in self.done for s in g.succs[p]):
                    self._drop_plain(p)
            self.time_s += nd.bwd_time_s
        elif op.kind == "Dp":
            self._drop_plain(i)
        elif op.kind == "Dt":
            self.tape.discard(i)
            self.stored -= nd.tape_bytes
            self._add_plain(i)
        return during

    def _add_plain(self, i: int) -> None:
        if i not in self.plain:
            self.plain.add(i)
            self.stored += self.g.nodes[i].out_bytes

    def _drop_plain(self, i: int) -> None:
        if i in self.plain:
            self.plain.discard(i)
            self.stored -= self.g.nodes[i].out_bytes

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.g) and not (self.plain or self.tape or self.grad)


def simulate(graph: Graph | Profile, ops: Iterable[Op]) -> Replay:
    """Replay ``ops`` over ``graph``; peak live bytes and time (see the module doc for the model)."""
    g = as_graph(graph)
    st = SimState(g)
    rep = Replay(peak_bytes=g.input_bytes, time_s=0.0)
    for k, op in enumerate(ops):
        try:
            d = st.step(op)
        except ValueError as e:
            raise ValueError(f"op #{k}: {e}") from None
        rep.during.append(d)
        rep.after.append(st.stored)
        rep.peak_bytes = max(rep.peak_bytes, d)
    if not st.finished:
        raise ValueError(
            f"schedule incomplete: backward missing for {sorted(set(range(len(g))) - st.done)}; "
            f"still stored plain={sorted(st.plain)} tape={sorted(st.tape)} grad={sorted(st.grad)}"
        )
    rep.time_s = st.time_s
    return rep


def make_schedule(method: str, graph: Graph, ops: Sequence[Op], budget: int | None, **meta) -> Schedule:
    """Build a Schedule whose predictions are the simulator's replay of ``ops``."""
    rep = simulate(graph, ops)
    if budget is not None and rep.peak_bytes > budget:
        raise AssertionError(f"{method}: schedule peak {rep.peak_bytes} B exceeds budget {budget} B (solver bug)")
    return Schedule(method, list(ops), len(graph), budget, rep.peak_bytes, rep.time_s, dict(meta))


def baseline_time(graph: Graph) -> float:
    """Time of one forward + backward without rematerialization (Σ fwd + Σ bwd)."""
    return sum(n.fwd_time_s + n.bwd_time_s for n in graph.nodes)
