"""A training step's memory, composed from per-block traces (no whole-model run needed).

The step is replayed event by event: the blocks' forward traces in order, the loss, the
backward traces in reverse, the optimizer step, ``zero_grad``. Each block's trace was taken in
isolation (:mod:`scaletrain.measure.blocks`); what differs inside a whole step is decided here:

- the output of block i is the input of block i+1: an activation if either block saves it, else
  a temporary; it is freed where block i+1's trace frees its input (after the forward, or when
  its saving node ran in the backward), unless block i saved it too (then block i's backward
  frees it);
- parameter gradients: in the first micro-batch a new gradient becomes ``param.grad``; in later
  micro-batches (gradient accumulation) it is added in place and freed at once;
- a parameter used by several blocks (tied embeddings) gets its first gradient in the last
  user's backward; the engine holds it (a temporary) until the other users' gradients arrive
  and are summed out of place (pending + new + sum live at once), the sum becoming the gradient;
- autocast's cached 16-bit weight copies that are not saved live until the forward (and loss)
  of the micro-batch ends;
- the optimizer step adds its transient (see :mod:`scaletrain.measure.optimizers`) above
  parameters + gradients + states; ``zero_grad(set_to_none=True)`` frees the gradients.

Categories follow :class:`~scaletrain.measure.tracker.MemoryTracker` (a storage's final role),
so a composed step and a tracked step can be compared category by category.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields

from torch import nn

from scaletrain.measure.blocks import BlockTrace
from scaletrain.measure.tracker import CATEGORIES, MemoryTracker
from scaletrain.measure.types import Profile


class _Sim:
    """Running bytes per category with the peak and its breakdown."""

    def __init__(self) -> None:
        self.cur = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = -1
        self.peak_breakdown: dict[str, int] = {}
        self.peak_phase = ""
        self.phase = ""
        self.timeline: list[tuple[str, dict[str, int]]] = []
        self.maxes = dict.fromkeys(CATEGORIES, 0)
        """Largest bytes of each category over the step."""
        self.points: list[dict[str, int]] = []
        """Bytes per category after every replayed event (for plots)."""
        self.marks: list[tuple[int, str]] = []
        """(index into ``points``, phase) where each phase starts."""

    def add(self, cat: str, delta: int) -> None:
        if delta == 0:
            return
        self.cur[cat] += delta
        self.total += delta
        if self.cur[cat] > self.maxes[cat]:
            self.maxes[cat] = self.cur[cat]
        self.points.append(dict(self.cur))
        if self.total > self.peak:
            self.peak = self.total
            self.peak_breakdown = dict(self.cur)
            self.peak_phase = self.phase

    def at(self, phase: str) -> None:
        self.phase = phase
        self.timeline.append((phase, dict(self.cur)))
        self.marks.append((len(self.points), phase))


@dataclass
class StepEstimate:
    """Memory (bytes) of one training step, estimated or measured, and its per-block table."""

    model: str
    batch: int
    seq: int
    precision: str
    optimizer: str
    accum: int = 1
    params_dtype: str = "fp32"
    device: str = "cpu"
    parameters: int = 0
    """Number of parameter elements (tied parameters once)."""
    bytes: dict[str, int] = field(default_factory=dict)
    """parameters, gradients, optimizer_states, activations: the largest bytes of each category
    during the step (activations: saved for backward, largest at the end of a micro-batch's
    forward and loss; gradients: with 16-bit parameters, includes the fp32 master gradients made
    at the optimizer step); peak: the largest total."""
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes per tracker category at the peak."""
    peak_phase: str = ""
    """Where the peak happens, e.g. "backward 0: h.3" or "optimizer step"."""
    measured: bool = False
    profile: Profile | None = None
    timeline: list = field(default_factory=list)
    """(phase, bytes per category) at phase boundaries."""
    points: list = field(default_factory=list)
    """(x, bytes per category) at every event (estimate: replayed events; measured: tracker events)."""
    marks: list = field(default_factory=list)
    """(x, phase label) where phases start, for plots."""
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        skip = ("profile", "timeline", "points", "marks")
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        d["blocks"] = [asdict(b) for b in self.profile.blocks] if self.profile is not None else []
        if self.profile is not None:
            d["loss_block"] = self.profile.meta.get("loss")
        return d


def users_of(traces: list[BlockTrace]) -> dict[int, list[int]]:
    """Parameter id -> indices of the traces (blocks) that use it, in forward order."""
    users: dict[int, list[int]] = {}
    for i, tr in enumerate(traces):
        for pid in dict.fromkeys(tr.param_ids):
            users.setdefault(pid, []).append(i)
    return users


def compose_step(traces: list[BlockTrace], *, param_bytes: int, state_bytes: int, step_transient: int,
                 accum: int = 1, buffer_bytes: int = 0, master_grad_bytes: int = 0) -> _Sim:
    """Replay a step; ``traces`` are the chain's blocks followed by the loss (see module doc).

    ``param_bytes`` / ``state_bytes`` / ``buffer_bytes`` (buffers that are in no block) exist
    throughout; ``master_grad_bytes`` are fp32 copies of the gradients made at the optimizer step
    (16-bit parameters).
    """
    sim = _Sim()
    n = len(traces)
    loss = traces[-1]
    users = users_of(traces)
    y_cat = [
        "activations" if (tr.y_saved or (i + 1 < n and traces[i + 1].x_saved)) else "temporaries"
        for i, tr in enumerate(traces)
    ]
    sim.at("start")
    sim.add("parameters", param_bytes)
    sim.add("optimizer_states", state_bytes)
    sim.add("other", buffer_bytes)  # buffers outside the blocks
    for tr in traces:
        sim.add("activations", tr.buffer_saved_bytes)
        sim.add("other", tr.buffer_bytes - tr.buffer_saved_bytes)
    for _ in range(accum):  # every micro-batch's input and target exist for the whole step
        sim.add("activations" if traces[0].x_saved else "other", traces[0].x_bytes)
        for b, saved in zip(loss.aux_bytes, loss.aux_saved):
            sim.add("activations" if saved else "other", b)
    grads = 0
    for m in range(accum):
        first = m == 0
        cache = 0
        for i, tr in enumerate(traces):
            sim.at(f"forward {m}: {tr.name}")
            for kind, _, d in tr.events[: tr.fwd_end]:
                if kind == "x":
                    if not traces[i - 1].y_saved:  # else the previous block's saved output decides
                        sim.add(y_cat[i - 1], d)
                elif kind == "y":
                    if d > 0:
                        sim.add(y_cat[i], d)
                elif kind == "saved":
                    sim.add("activations", d)
                elif kind == "cache" and d < 0:
                    cache -= d  # freed only when the autocast region ends
                else:
                    sim.add("temporaries", d)
        sim.add("temporaries", -cache)
        pending: dict[int, int] = {}
        held: set[int] = set()
        for i in range(n - 1, -1, -1):
            tr = traces[i]
            sim.at(f"backward {m}: {tr.name}")
            if i == n - 1:
                sim.add("temporaries", tr.g_bytes)  # loss.backward() creates d(loss) = 1
            bwd = tr.events[tr.fwd_end:] if first or tr.accum_bwd_events is None else tr.accum_bwd_events
            due: list[tuple[int, int]] = []  # shared-parameter sums waiting for their node to finish
            for kind, j, d in bwd:
                pid = tr.param_ids[j] if kind == "pgrad" else -1
                if due and (d > 0 or any(p == pid for p, _ in due)):
                    grads += sum(_sum_pending(sim, p, dd, i, users, pending, held, first) for p, dd in due)
                    due.clear()
                if kind == "saved":
                    sim.add("activations", d)
                elif kind == "x":
                    if not traces[i - 1].y_saved:
                        sim.add(y_cat[i - 1], d)
                elif kind == "y":
                    sim.add(y_cat[i], d)
                elif kind == "g" and i == n - 1:
                    pass  # torch.autograd.backward holds d(loss) until the whole backward returns
                elif kind == "pgrad":
                    if d > 0 and pid in pending:
                        sim.add("temporaries", d)  # the new contribution; summed once its node is done
                        due.append((pid, d))
                    else:
                        grads += _param_grad(sim, pid, d, i, users, pending, held, first)
                else:  # g, gin, temp, cache
                    sim.add("temporaries", d)
            grads += sum(_sum_pending(sim, p, dd, i, users, pending, held, first) for p, dd in due)
        sim.add("temporaries", -loss.g_bytes - loss.y_bytes)  # d(loss) and the loss value, after backward
    sim.at("optimizer step")
    sim.add("gradients", master_grad_bytes)
    sim.add("temporaries", step_transient)
    sim.add("temporaries", -step_transient)
    sim.add("gradients", -master_grad_bytes)
    sim.at("zero_grad")
    sim.add("gradients", -grads)
    sim.at("end")
    sim.grads = grads  # type: ignore[attr-defined]
    return sim


def _sum_pending(sim: _Sim, pid: int, d: int, i: int, users: dict[int, list[int]], pending: dict[int, int],
                 held: set[int], first: bool) -> int:
    """The engine sums a shared parameter's held gradient and the new one (``d`` bytes, already
    counted) out of place, after the producing node finished; returns bytes added to .grad."""
    last_user = i == users[pid][0]
    sim.add("gradients" if (first and last_user) else "temporaries", d)  # the sum
    sim.add("temporaries", -pending.pop(pid) - d)
    if not last_user:
        pending[pid] = d
        held.add(pid)
        return 0
    return d if first else 0  # accumulation: the sum is freed at this trace's free event


def _param_grad(sim: _Sim, pid: int, d: int, i: int, users: dict[int, list[int]], pending: dict[int, int],
                held: set[int], first: bool) -> int:
    """Account a gradient event of parameter ``pid`` in block ``i``'s backward; returns bytes added to .grad.

    ``d > 0``: a new gradient arrives. ``d < 0`` (accumulation traces only): AccumulateGrad added
    it into ``.grad`` and freed it. ``pending``: gradients the engine holds for shared parameters
    until every user has contributed; ``held``: parameters whose next free event is not a free.
    """
    last_user = i == users[pid][0]  # the last block reached by the backward that uses this parameter
    if d < 0:
        if pid in held:
            held.discard(pid)
        else:
            sim.add("temporaries", d)
        return 0
    if not last_user:
        sim.add("temporaries", d)  # held by the engine until the other users' gradients arrive
        pending[pid] = d
        held.add(pid)
        return 0
    if first:
        sim.add("gradients", d)
        return d
    sim.add("temporaries", d)  # gradient accumulation: .grad += new, freed at its free event
    return 0


def step_from_tracker(tr: MemoryTracker, model: nn.Module, *, name: str, batch: int, seq: int, precision: str,
                      optimizer: str, accum: int, params_dtype: str, device: str, measured: bool) -> StepEstimate:
    """A StepEstimate from a tracked step (``tr`` entered with model, optimizer and the batches)."""
    maxes = dict.fromkeys(("parameters", "gradients", "optimizer_states", "activations"), 0)
    for _, _, cats in tr.iter_timeline():
        for k in maxes:
            maxes[k] = max(maxes[k], cats[k])
    phase = ""
    for idx, label in tr.marks:
        if idx < tr.peak_event:
            phase = label
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    points = [(i, cats) for i, _, cats in tr.iter_timeline()]
    timeline = [(label, points[idx][1] if 0 <= idx < len(points) else {}) for idx, label in tr.marks]
    return StepEstimate(
        model=name, batch=batch, seq=seq, precision=precision, optimizer=optimizer, accum=accum,
        params_dtype=params_dtype, device=device, parameters=n_params,
        bytes={**maxes, "peak": tr.peak_bytes}, peak_breakdown=tr.peak_breakdown, peak_phase=phase,
        measured=measured, timeline=timeline, points=points, marks=list(tr.marks),
    )
