"""Discrete-event simulation of a pipeline :class:`~.schedules.Schedule`.

Each rank executes its action list in order (see the execution model in
:mod:`.schedules`). Compute passes take their stage's time; a send posts a transfer on the
directed link (sender → receiver), which carries one message at a time (FIFO by post time)
and delivers it ``latency + bytes / bandwidth`` seconds after it starts; a receive waits for
that arrival. On a blocking link (:class:`Link`: gloo on a CPU) the transfer instead runs on
the receiver's clock once both sides have posted. Events are processed in start-time order, so
link FIFO order is real time order.

Definitions used in every report (units: seconds, bytes):

* **step time** — synchronous schedules: the makespan of one step (first action starts at 0,
  step ends when the last rank finishes its optimizer step), divided by ``n_steps`` when
  several steps were laid out. Asynchronous schedules (no flush): the steady-state period,
  per rank the time between the end of its update closing window 1 and the one closing
  window ``n_steps - 1``, divided by ``n_steps - 2``; the step time is the slowest rank's
  (with fewer than 3 steps laid out, the makespan / ``n_steps``, warm-up and drain included).
* **busy** — time in compute passes (F, B, I, W, OPT). Waiting on a receive or a gradient
  sync is idle: that is the pipeline bubble plus exposed communication.
* **bubble fraction of rank r** = (step time − busy_r) / step time (for async, measured in the
  steady-state window). **bubble fraction** (overall) = Σ_r idle_r / (P × step time), i.e. the
  mean of the per-rank fractions — the quantity the GPipe/1F1B closed form (P−1)/(M+P−1) is about.
* **in-flight micro-batches** on a rank — stage-activation sets alive at once: an activation
  set (one micro-batch on one stage) is alive from the start of its F until the end of its
  last backward piece (B, or W when the backward is split — W still reads part of it).
  Because a rank executes sequentially, the peak depends only on the order, not on costs.
* **peak memory** of a rank — max over its action list of Σ(stage weight copies) +
  Σ(optimizer state) + live gradients + live activation bytes (+ W-stash bytes between I and
  W) + sent tensors not yet released + the running pass's transient (see :func:`_memory`:
  what the runtime holds, copy for copy). A weight version is live while it is the newest or
  some in-flight micro-batch was forwarded with it (PipeDream weight stashing; 2BW's double
  buffer; 1 for flushed schedules); the runtime keeps one copy per stashed version plus the
  live weights. Chimera ranks hold two stage replicas, each counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from scaletrain.errors import UserError

from .actions import (B, COMPUTE_KINDS, F, GRAD_SYNC, I, OPT, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule,
                      message_key, overtaken, send_releases)


class Event(NamedTuple):
    """One timed interval on one rank. The first five fields are the measured-event format
    ``(rank, kind, microbatch, start_s, end_s)`` a runtime records; ``stage``/``pipe`` are
    optional extras."""

    rank: int
    kind: str
    mb: int
    start_s: float
    end_s: float
    stage: int = -1
    pipe: int = 0


@dataclass
class StageCosts:
    """Per-stage costs for one micro-batch (lists indexed by stage 0..S-1).

    ``bwd_s`` is the whole backward (input + weight gradients). For split-backward schedules
    ``igrad_s`` (input-gradient part) defaults to half of it and the weight-gradient part is
    the rest. ``boundary_bytes[s]`` is the size of stage s's output activation (its gradient,
    sent back, has the same size). ``act_bytes[s]`` is kept from F until B (or I);
    ``wstash_bytes[s]`` from I until W (default: ``act_bytes``, conservative).
    """

    fwd_s: list[float]
    bwd_s: list[float]
    igrad_s: list[float] | None = None
    boundary_bytes: list[float] | None = None
    act_bytes: list[float] | None = None
    wstash_bytes: list[float] | None = None
    weight_bytes: list[float] | None = None
    """Bytes of the parameters a weight version holds (stashed per version)."""
    state_bytes: list[float] | None = None
    """Bytes of optimizer state per stage replica (not versioned), gradients included when
    ``grad_bytes`` is None."""
    opt_s: list[float] | None = None
    grad_bytes: list[float] | None = None
    """Bytes of a stage replica's gradients, modelled with their lifetime (first backward after
    an update until the update); None: counted in ``state_bytes``, always alive."""
    fwd_temp_bytes: list[float] | None = None
    """Transient bytes during a forward pass, above the micro-batch's activation set."""
    bwd_temp_bytes: list[float] | None = None
    """Transient bytes during a backward (B or I) pass, above the micro-batch's activation set
    and the gradients: the received output gradient, backward temporaries, the input gradient."""
    bwd_first_temp_bytes: list[float] | None = None
    """``bwd_temp_bytes`` of a stage's first backward after an update, whose gradients are made as
    it runs (the gradients its blocks have made by the pass's peak included); None: ``bwd_temp_bytes``.
    Not used with ``grads_from_backward_start`` (the gradients then count from the pass's start)."""
    opt_temp_bytes: list[float] | None = None
    """Transient bytes of the optimizer step over the stage's parameters."""
    wgrad_temp_bytes: list[float] | None = None
    """Transient bytes of a W pass (zb1p) above its micro-batch's kept inputs and output gradients:
    one weight-gradient GEMM's result before it is added to ``.grad``."""
    grads_from_backward_start: bool = False
    """Gradients count from the *start* of a stage's first backward piece, not its end: torch DDP's
    ``gradient_as_bucket_view`` writes every ``.grad`` into bucket storage the reducer keeps, so the
    first gradient of a backward brings all its bucket bytes (measured: gpt2-tiny, dp=2)."""
    sync_s: list[float] | None = None
    """Time of the all-reduce of a stage's gradients between its two replicas (Chimera's
    GRAD_SYNC) once both have arrived; None: ``weight_bytes`` over the link."""

    @classmethod
    def unit(cls, schedule: Schedule) -> "StageCosts":
        """The closed-form costs: one rank's share of the model forwards in 1 time unit
        (a stage of an interleaved schedule in 1/v), B = 2F, and I = W = F when split."""
        f = schedule.n_ranks / schedule.n_stages
        S = schedule.n_stages
        return cls(fwd_s=[f] * S, bwd_s=[2 * f] * S, igrad_s=[f] * S)

    def _get(self, name: str, s: int, default: float = 0.0) -> float:
        vals = getattr(self, name)
        return default if vals is None else float(vals[s])

    def check(self, n_stages: int) -> None:
        for name in ("fwd_s", "bwd_s", "igrad_s", "boundary_bytes", "act_bytes", "wstash_bytes",
                     "weight_bytes", "state_bytes", "opt_s", "grad_bytes", "fwd_temp_bytes", "bwd_temp_bytes",
                     "bwd_first_temp_bytes", "opt_temp_bytes", "wgrad_temp_bytes", "sync_s"):
            vals = getattr(self, name)
            if vals is not None and len(vals) != n_stages:
                raise UserError(f"StageCosts.{name} has {len(vals)} entries; the schedule has {n_stages} stages")
            if vals is not None and any(v < 0 or not math.isfinite(v) for v in vals):
                raise UserError(f"StageCosts.{name} must be finite and >= 0 (got {vals})")


@dataclass
class Link:
    """Point-to-point link between neighbouring ranks: bytes/second and seconds per message.

    ``blocking`` describes a transport whose transfer runs on the receiver's clock (gloo on a CPU: its
    ``isend`` only announces the message, the bytes move once the receive is posted and need the
    sender's progress thread, which shares the cores with the compute — measured by
    :mod:`scaletrain.planner.pipeline_host`): a receive then ends ``latency_s + bytes / bandwidth`` after
    both the send and the receive are posted — plus, when the sender is inside a pass then, the shorter
    of ``busy_latency_s`` (its progress thread gets a core) and the rest of that pass — and a send
    costs its rank ``send_s`` of host time.
    Otherwise (NCCL, the presets) transfers run on the link beside the compute."""

    bandwidth_Bps: float = math.inf
    latency_s: float = 0.0
    blocking: bool = False
    busy_latency_s: float = 0.0
    """Seconds a blocking receive waits beyond ``latency_s`` while the sender computes (``blocking``
    only; at most the rest of the sender's pass)."""
    send_s: float = 0.0
    """Host seconds one posted send costs its rank (``blocking`` only)."""

    def time(self, nbytes: float) -> float:
        """One message: α–β with one step (:func:`scaletrain.cost.collective_seconds`)."""
        from scaletrain.cost import collective_seconds

        return collective_seconds(nbytes, 1, self.bandwidth_Bps, self.latency_s)


@dataclass
class SimResult:
    schedule: str
    n_ranks: int
    n_microbatches: int
    step_time_s: float
    makespan_s: float
    busy_s: list[float]
    """Per rank compute time inside the measured window, seconds."""
    bubble_per_rank: list[float]
    bubble_fraction: float
    peak_inflight: list[int]
    peak_inflight_equiv: list[float]
    """Peak live activations in micro-batch equivalents: each set weighs P/S (1/v for
    interleaved, whose stages are 1/v of a rank's share; 1 otherwise)."""
    peak_inflight_stage: dict[tuple[int, int], int]
    """(pipe, stage) -> peak live activation sets of that stage replica."""
    peak_weight_versions: list[int]
    peak_memory_bytes: list[float]
    events: list[Event] = field(repr=False, default_factory=list)

    def to_dict(self, events: bool = False) -> dict:
        keys = ("schedule", "n_ranks", "n_microbatches", "step_time_s", "makespan_s", "busy_s", "bubble_per_rank",
                "bubble_fraction", "peak_inflight", "peak_inflight_equiv", "peak_weight_versions", "peak_memory_bytes")
        d = {k: getattr(self, k) for k in keys}
        if events:
            d["events"] = [list(e) for e in self.events]
        return d


class DeadlockError(RuntimeError):
    """The action lists cannot all complete: every unfinished rank waits on a peer."""


def simulate(schedule: Schedule, costs: StageCosts | None = None, link: Link | None = None,
             p2p: str = "eager", durations: dict[tuple, float] | None = None) -> SimResult:
    """Run ``schedule`` under ``costs`` (default :meth:`StageCosts.unit`) and ``link``.

    ``p2p="eager"``: sends never block (the runtime's isend model); ``"rendezvous"``: a send
    blocks until the receiver reaches the matching receive (blocking ``send``). Raises
    :class:`DeadlockError` naming what each stuck rank waits for.

    ``durations`` (seconds, keyed ``(rank, kind, pipe, stage, mb)`` as :class:`Event` names them)
    overrides the per-stage cost of individual passes: a *trace-driven* replay of a measured
    step with each pass's own time. It separates the two ways a prediction from per-stage
    medians can miss: how the simulator composes passes (the replay tests that alone) and the
    spread of pass times, which a pipeline's critical path turns into extra wait (the expected
    makespan of a DAG with random task times exceeds the makespan of its mean times).
    """
    if p2p not in ("eager", "rendezvous"):
        raise UserError(f"p2p must be 'eager' or 'rendezvous' (got {p2p!r})")
    costs = costs or StageCosts.unit(schedule)
    costs.check(schedule.n_stages)
    link = link or Link()
    P = schedule.n_ranks
    acts = schedule.actions
    ptr = [0] * P
    clock = [0.0] * P
    arrival: dict[tuple, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    events: list[Event] = []
    passes: list[list[tuple[float, float]]] = [[] for _ in range(P)]  # each rank's compute intervals
    blocking = link.blocking and p2p == "eager"
    sent_by: dict[tuple, tuple[int, float]] = {}  # blocking: message key -> (sending rank, bytes)

    def dur(r: int, a: Action) -> float:
        if durations is not None:
            d = durations.get((r, a.kind, a.pipe, a.stage, a.mb))
            if d is not None:
                return d
        s = a.stage
        if a.kind == F:
            return costs._get("fwd_s", s)
        if a.kind == OPT:
            return costs._get("opt_s", s)
        bwd = costs._get("bwd_s", s)
        ig = costs._get("igrad_s", s) if costs.igrad_s is not None else bwd / 2
        return {B: bwd, I: ig, W: max(bwd - ig, 0.0)}[a.kind]

    def msg_bytes(a: Action) -> float:
        # forward carries stage s's output; backward carries the gradient of stage s-1's output
        s = a.stage if a.kind == SEND_F else a.stage - 1
        return costs._get("boundary_bytes", s)

    def busy(q: int, t: float) -> float:
        """Seconds left of the compute pass rank ``q`` runs at time ``t`` (the whole next one when it is
        about to start it there); 0 when it waits."""
        if clock[q] <= t:
            nxt = acts[q][ptr[q]] if ptr[q] < len(acts[q]) else None
            return dur(q, nxt) if nxt is not None and nxt.kind in COMPUTE_KINDS else 0.0
        for e in reversed(passes[q]):
            if e[1] <= t:
                return 0.0
            if e[0] <= t:
                return e[1] - t
        return 0.0

    def transfer(src: int, dst: int, post: float, nbytes: float) -> float:
        start = max(post, link_free.get((src, dst), 0.0))
        busy = nbytes / link.bandwidth_Bps if nbytes else 0.0
        link_free[(src, dst)] = start + busy
        return start + busy + link.latency_s

    remaining = sum(len(a) for a in acts)
    while remaining:
        best = None  # (start, rank)
        for r in range(P):
            if ptr[r] >= len(acts[r]):
                continue
            a = acts[r][ptr[r]]
            if a.kind in (RECV_F, RECV_B):
                if p2p == "rendezvous" or message_key(a) not in arrival:
                    continue
            elif a.kind in (SEND_F, SEND_B) and p2p == "rendezvous":
                q = a.peer
                if ptr[q] >= len(acts[q]) or acts[q][ptr[q]].kind not in (RECV_F, RECV_B) \
                        or message_key(acts[q][ptr[q]]) != message_key(a):
                    continue
            elif a.kind == GRAD_SYNC:
                q = a.peer
                if ptr[q] >= len(acts[q]) or acts[q][ptr[q]].kind != GRAD_SYNC or acts[q][ptr[q]].stage != a.stage:
                    continue
            paired = a.kind == GRAD_SYNC or (p2p == "rendezvous" and a.kind in (SEND_F, SEND_B))
            start = max(clock[r], clock[a.peer]) if paired else clock[r]
            if best is None or start < best[0]:
                best = (start, r)
        if best is None:
            stuck = [f"rank {r} waits at {acts[r][ptr[r]]}" for r in range(P) if ptr[r] < len(acts[r])]
            raise DeadlockError(f"{schedule.name} deadlocks ({p2p} p2p): " + "; ".join(stuck))
        start, r = best
        a = acts[r][ptr[r]]
        if a.kind in COMPUTE_KINDS or a.kind == OPT:
            end = start + dur(r, a)
            events.append(Event(r, a.kind, a.mb, start, end, a.stage, a.pipe))
            passes[r].append((start, end))
            clock[r] = end
        elif a.kind in (SEND_F, SEND_B) and blocking:  # posted only; the bytes move when the peer receives
            clock[r] = start + link.send_s
            arrival[message_key(a)] = clock[r]
            sent_by[message_key(a)] = (r, msg_bytes(a))
        elif a.kind in (SEND_F, SEND_B) and p2p == "eager":
            arrival[message_key(a)] = transfer(r, a.peer, start, msg_bytes(a))
        elif a.kind in (SEND_F, SEND_B):  # rendezvous: both sides finish with the transfer
            q = a.peer
            end = transfer(r, q, start, msg_bytes(a))
            clock[r] = clock[q] = end
            ptr[q] += 1
            remaining -= 1
        elif a.kind in (RECV_F, RECV_B) and blocking:
            key = message_key(a)
            t = max(start, arrival.pop(key))
            q, nbytes = sent_by.pop(key)
            left = busy(q, t)  # the sender's progress thread gets the core within busy_latency_s, or once its pass ends
            lat = link.latency_s + min(left, link.busy_latency_s) if left > 0 else link.latency_s
            clock[r] = t + lat + (nbytes / link.bandwidth_Bps if nbytes else 0.0)
        elif a.kind in (RECV_F, RECV_B):
            clock[r] = max(start, arrival.pop(message_key(a)))
        elif a.kind == GRAD_SYNC:  # 2-rank all-reduce of one stage's gradients
            q = a.peer
            sync = costs._get("sync_s", a.stage) if costs.sync_s is not None else \
                link.time(costs._get("weight_bytes", a.stage))
            end = start + sync
            events.append(Event(r, GRAD_SYNC, a.mb, start, end, a.stage, a.pipe))
            events.append(Event(q, GRAD_SYNC, a.mb, start, end, a.stage, 1 - a.pipe))
            clock[r] = clock[q] = end
            ptr[q] += 1
            remaining -= 1
        ptr[r] += 1
        remaining -= 1
    return _summarise(schedule, costs, events)


def summarise(schedule: Schedule, events: Sequence[Event], costs: StageCosts | None = None) -> SimResult:
    """Step time, per-rank bubble, in-flight counts (and, given ``costs``, the memory model) of
    *measured* events — e.g. :attr:`~.runtime.PipelineRuntime.events` of one step, times from the
    step's common origin — with exactly the definitions :func:`simulate` reports, so measurement
    and prediction compare like for like. Events must cover every rank's compute passes."""
    costs = costs or StageCosts.unit(schedule)
    costs.check(schedule.n_stages)
    evs = sorted((Event(*e) for e in events), key=lambda e: (e.start_s, e.end_s))
    return _summarise(schedule, costs, evs)


def _summarise(schedule: Schedule, costs: StageCosts, events: list[Event]) -> SimResult:
    P = schedule.n_ranks
    makespan = max((e.end_s for e in events), default=0.0)
    by_rank: list[list[Event]] = [[] for _ in range(P)]
    for e in events:
        by_rank[e.rank].append(e)
    work = (F, B, I, W, OPT)
    if schedule.asynchronous and schedule.n_steps >= 3:
        M, K = schedule.n_microbatches, schedule.n_steps
        windows = []
        for r in range(P):
            closes = {e.mb // M: e.end_s for e in by_rank[r] if e.kind == OPT and (e.mb + 1) % M == 0}
            windows.append((closes[0], closes[K - 2]))
        periods = [(b - a) / (K - 2) for a, b in windows]
        step = max(periods)
        busy = [sum(_overlap(e, lo, hi) for e in by_rank[r] if e.kind in work) / (K - 2)
                for r, (lo, hi) in enumerate(windows)]
    else:
        step = makespan / schedule.n_steps
        busy = [sum(e.end_s - e.start_s for e in by_rank[r] if e.kind in work) / schedule.n_steps for r in range(P)]
    per_rank = [max(step - b, 0.0) / step if step > 0 else 0.0 for b in busy]
    inflight, inflight_stage, versions, memory = _memory(schedule, costs)
    equiv = [n * P / schedule.n_stages for n in inflight]  # sets on a rank are all 1/v-size
    return SimResult(schedule.name, P, schedule.n_microbatches, step, makespan, busy, per_rank,
                     sum(per_rank) / P, inflight, equiv, inflight_stage, versions, memory, events)


def _overlap(e: Event, lo: float, hi: float) -> float:
    return max(0.0, min(e.end_s, hi) - max(e.start_s, lo))


def _memory(schedule: Schedule, costs: StageCosts):
    """Replay each rank's action list (its execution order, so the result does not depend on
    timing) and track live activation sets, weight versions and copies, gradients, held sends
    and the transients of each pass, as the runtime (:mod:`.runtime`, :mod:`.stage`) holds them:

    * activations: ``act_bytes`` of a (pipe, stage, micro-batch) from its F to its last
      backward piece (``wstash_bytes`` from I to W when the backward is split);
    * weights: one live copy per stage replica, plus — asynchronous schedules — the runtime's
      weight snapshots: a snapshot of the current version is taken at the first forward of a
      micro-batch an update will overtake (:func:`.actions.overtaken`) and dropped once its
      last such backward ran and the live weights moved on. ``peak_weight_versions`` counts
      distinct versions in use (the PipeDream paper's figure), the bytes count copies;
    * gradients (``grad_bytes`` given): alive from the end of a stage's first backward piece
      (W when split) after an update — the pass frees the micro-batch's activations as it
      makes them — until the rank's next update (``zero_grad(set_to_none=True)``);
      a backward with stashed weights allocates the snapshot's gradients (``weight_bytes``)
      and adds them to live ones, so they coexist at the end of that pass;
    * held sends: a sent tensor lives until :func:`.actions.send_releases` lets the rank drop
      it — an input gradient from its SEND_B, a stage output beyond its activation set when its
      release comes after the set's last backward piece;
    * transients: ``fwd_temp_bytes`` during F, ``bwd_temp_bytes`` during B or I (on top of the
      micro-batch's activation set), ``opt_temp_bytes`` (max over the rank's stages) during
      its update.
    """

    g = costs._get
    P = schedule.n_ranks
    peak_n, peak_v, peak_b = [0] * P, [0] * P, [0.0] * P
    peak_stage: dict[tuple[int, int], int] = {}
    last_piece = W if schedule.split_backward else B
    grad_piece = W if schedule.split_backward else B
    model_grads = costs.grad_bytes is not None
    releases = send_releases(schedule)
    for r in range(P):
        acts = schedule.actions[r]
        local = schedule.local_stages(r)
        stash = {ps: overtaken(acts, *ps) if schedule.asynchronous else set() for ps in local}
        current = {ps: 0 for ps in local}               # newest weight version per stage replica
        refs: dict[tuple, dict[int, int]] = {ps: {} for ps in local}  # version -> live micro-batches
        tag: dict[tuple, int] = {}                      # (pipe, stage, mb) -> version it was forwarded with
        snaps: dict[tuple, dict[int, int]] = {ps: {} for ps in local}  # snapshot version -> stashed mbs alive
        snap_of: dict[tuple, int] = {}                  # (pipe, stage, mb) -> snapshot version it uses
        grads = {ps: False for ps in local}
        live_stage = {ps: 0 for ps in local}
        act = held = 0.0
        sent_f: dict[int, tuple] = {}                   # SEND_F index -> (pipe, stage, mb), not yet released
        held_f: dict[tuple, float] = {}                 # (pipe, stage, mb) -> output bytes held past its set
        held_b: dict[int, float] = {}                   # SEND_B index -> input-gradient bytes
        last_opt = None
        static = sum(g("state_bytes", s) for _, s in local)
        opt_temp = max((g("opt_temp_bytes", s) for _, s in local), default=0.0)

        def weights() -> tuple[int, float]:
            nv, wb = 0, 0.0
            for ps in local:
                alive = {current[ps]} | {v for v, c in refs[ps].items() if c > 0}
                nv = max(nv, len(alive))
                wb += (1 + len(snaps[ps])) * g("weight_bytes", ps[1])
            return nv, wb

        def base() -> float:
            gb = sum(g("grad_bytes", ps[1]) for ps in local if grads[ps]) if model_grads else 0.0
            return static + weights()[1] + gb + held + act

        peak_b[r] = base()
        for i, a in enumerate(acts):
            ps, key = (a.pipe, a.stage), (a.pipe, a.stage, a.mb)
            a_bytes = g("act_bytes", a.stage)
            w_bytes = g("wstash_bytes", a.stage, a_bytes)  # kept from I to W; default: all of it
            extra = 0.0  # transient bytes of this pass, on top of base()
            if a.kind == F:
                live_stage[ps] += 1
                peak_stage[ps] = max(peak_stage.get(ps, 0), live_stage[ps])
                act += a_bytes
                tag[key] = current[ps]
                refs[ps][current[ps]] = refs[ps].get(current[ps], 0) + 1
                if a.mb in stash[ps]:
                    v = current[ps]
                    snaps[ps][v] = snaps[ps].get(v, 0) + 1
                    snap_of[key] = v
                extra = g("fwd_temp_bytes", a.stage)
            elif a.kind == W:
                extra = g("wgrad_temp_bytes", a.stage)
            elif a.kind in (B, I):
                extra = g("bwd_temp_bytes", a.stage)
                if model_grads and not grads[ps] and not costs.grads_from_backward_start:
                    extra = g("bwd_first_temp_bytes", a.stage, extra)
                if key in snap_of and model_grads and grads[ps]:
                    extra += g("weight_bytes", a.stage)  # the snapshot's gradients, added to the live ones
            elif a.kind == OPT:
                if a.mb != last_opt:  # one update per rank and window (the runtime's first OPT)
                    last_opt = a.mb
                    peak_b[r] = max(peak_b[r], base() + opt_temp)
                    for q in local:
                        old = current[q]
                        current[q] += 1
                        if snaps[q].get(old) == 0:
                            del snaps[q][old]
                        grads[q] = False
            elif a.kind == SEND_F:
                sent_f[i] = key
            elif a.kind == SEND_B:
                held_b[i] = g("boundary_bytes", a.stage - 1)
                held += held_b[i]
            if a.kind == grad_piece and costs.grads_from_backward_start:
                grads[ps] = True
            if a.kind in COMPUTE_KINDS:  # gradients made by this pass count from its end, when the set is freed
                peak_b[r] = max(peak_b[r], base() + extra)
            if a.kind == grad_piece:
                grads[ps] = True
            if a.kind == I:
                act += w_bytes - a_bytes
            if a.kind == last_piece:  # the bytes were live during the pass; freed at its end
                live_stage[ps] -= 1
                act -= w_bytes if schedule.split_backward else a_bytes
                refs[ps][tag.pop(key)] -= 1
                if key in snap_of:
                    v = snap_of.pop(key)
                    snaps[ps][v] -= 1
                    if snaps[ps][v] == 0 and v != current[ps]:
                        del snaps[ps][v]
                if key in sent_f.values():  # the output outlives its set until the send is released
                    held_f[key] = g("boundary_bytes", a.stage)
                    held += held_f[key]
            for j in releases[r].get(i, ()):  # a receive completed: sends it proves delivered are dropped
                if j in held_b:
                    held -= held_b.pop(j)
                elif j in sent_f:
                    held -= held_f.pop(sent_f.pop(j), 0.0)
            nv, _ = weights()
            peak_n[r] = max(peak_n[r], sum(live_stage.values()))
            peak_v[r] = max(peak_v[r], nv)
            peak_b[r] = max(peak_b[r], base())
    return peak_n, peak_stage, peak_v, peak_b
