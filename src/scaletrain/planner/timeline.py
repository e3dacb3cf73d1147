"""One step of a priced plan as a timeline: per pipeline rank, its forward, recompute and backward
blocks per micro-batch in schedule order, the bubble, the exposed tensor-parallel, point-to-point
and data-parallel communication and the optimizer step — each with the duration :mod:`.cost`
predicts — drawn with the pipeline timeline (:func:`scaletrain.techniques.pipeline.timeline.draw`).

How the planner's figures become blocks (units: seconds):

* The order and the start of every pass come from the pipeline schedule and its simulator
  (:func:`~scaletrain.techniques.pipeline.schedules.build`, :func:`~scaletrain.techniques.pipeline.
  simulate.simulate`); a plan without a pipeline is the 1F1B schedule on one rank (F, B, F, B, ...:
  gradient accumulation).
* Every stage costs what the planner prices a pipeline rank at: the slowest rank's micro-batch,
  T_mb = L/p layers + the larger of the embedding and the head (:func:`.cost.plan_cost`:
  step = (m + (p − 1)/v)·(T_mb + 2v·p2p) + DP + optimizer), split over the v chunks of an interleaved
  rank. With equal stages the simulator's makespan is that closed form exactly, so the bubble drawn is
  the bubble priced.
* A forward block is the layers' forward (+ ⅓ of the embedding / head: the cost model's backward = 2 ×
  forward), then its TP collectives, then the p2p send; a backward block is the recompute, the
  backward (+ ⅔ of the embedding / head, the per-micro-batch weight-gradient and cast traffic), its TP
  collectives, the p2p send. TP time is split between the passes as :func:`.cost.layer_times` splits it.
* After the flush, on every rank: the exposed DP communication, then the optimizer step, then any other
  phase the planner prices (a host-side update, say) under its own name.

Each kind maps to one of the planner's phases (:data:`KINDS`), so every rank's row sums to the
predicted step and, kind by kind, to :attr:`.cost.PlanCost.phases_s`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scaletrain.planner.context import ring_layer_times
from scaletrain.planner.cost import Options, PlanCost, layer_times
from scaletrain.planner.shape import Shape
from scaletrain.platform import Platform
from scaletrain.techniques.pipeline import schedules
from scaletrain.techniques.pipeline.simulate import Event, StageCosts, simulate

KINDS: dict[str, tuple[str, str, str]] = {
    # kind: (the planner's phase, colour, legend label); F, B and OPT keep the pipeline timeline's colours
    "F": ("compute", "", "forward"),
    "RC": ("recompute", "#C44E52", "recompute"),
    "B": ("compute", "", "backward"),
    "TP": ("tp_comm", "#DA8BC3", "TP comm"),
    "CP": ("cp_comm", "#937860", "CP ring (exposed)"),
    "P2P": ("p2p", "#8C8C8C", "p2p send"),
    "BUBBLE": ("pipeline_bubble", "#CCB974", "pipeline bubble"),
    "DP": ("dp_comm", "#64B5CD", "DP comm (exposed)"),
    "OPT": ("optimizer", "", "optimizer"),
}


_DRAWN = {phase for phase, _, _ in KINDS.values()}
OTHER_COLOUR = "#7F7F7F"
"""A phase without a kind of its own here is drawn after the optimizer, in grey, under its own name."""


@dataclass
class StepTimeline:
    """The segments of one predicted step, as pipeline-timeline events ``(rank, kind, mb, start_s,
    end_s, stage, pipe)``; rank = pipeline rank, times from the step's start."""

    segments: list[Event]
    n_ranks: int
    step_time_s: float
    """The plan's predicted step (:attr:`.cost.PlanCost.step_time_s`)."""
    title: str

    def row_total(self, rank: int) -> float:
        """Seconds of all segments drawn on ``rank``'s row."""
        return sum(e.end_s - e.start_s for e in self.segments if e.rank == rank)

    def by_phase(self, rank: int) -> dict[str, float]:
        """Seconds on ``rank``'s row per planner phase (compute, recompute, tp_comm, ...)."""
        out: dict[str, float] = {}
        for e in self.segments:
            if e.rank == rank:
                phase = KINDS[e.kind][0] if e.kind in KINDS else e.kind
                out[phase] = out.get(phase, 0.0) + e.end_s - e.start_s
        return out


def step_timeline(c: PlanCost, shape: Shape, plat: Platform, *, global_batch: int, seq: int,
                  options: Options | None = None) -> StepTimeline:
    """The segments of one step of ``c`` (priced by :func:`.cost.plan_cost` with the same arguments)."""
    plan, blocks, phases = c.plan, c.blocks_s, c.phases_s
    pp = plan.pp
    v = max(plan.virtual, 1) if pp > 1 and plan.schedule == "interleaved" else 1
    m = global_batch // (max(plan.dp, 1) * plan.micro_batch)
    # every slot is priced at the slowest rank's micro-batch: its layers, and the embedding / head it holds
    slow = c.slowest_rank
    L = c.stage_layers[slow] if c.stage_layers else shape.layers / pp
    extra = (blocks["embedding"] if slow == 0 else 0.0) + (blocks["head"] if slow == pp - 1 else 0.0)
    cp = max(plan.cp, 1)
    lt = ring_layer_times(layer_times(shape, plat, seq=seq // cp, b=plan.micro_batch, tp=plan.tp, sp=plan.sp,
                                      precision=plan.precision, opts=options or Options()),
                          shape, plat, seq=seq, b=plan.micro_batch, tp=plan.tp, cp=cp,
                          elem=4 if plan.precision == "fp32" else 2)
    cp_f = lt["cp_fwd"]
    tp_sum = lt["tp_fwd"] + lt["tp_bwd"]
    tp_f = blocks["layer_tp_comm"] * (lt["tp_fwd"] / tp_sum if tp_sum else 0.5)
    p2p = phases["p2p"] / (2 * v * m) if m else 0.0
    # one chunk pass (1/v of the rank's layers) as its parts, in the order they run
    fwd = [("F", (L * blocks["layer_fwd"] + extra / 3) / v), ("TP", L * tp_f / v), ("CP", L * cp_f / v),
           ("P2P", p2p)]
    bwd = [("RC", (L * blocks["layer_recompute"] + blocks.get("stage_recompute", 0.0)) / v),
           ("B", (L * (blocks["layer_bwd"] + blocks["layer_weight_traffic"]) + 2 * extra / 3) / v),
           ("TP", L * (blocks["layer_tp_comm"] - tp_f) / v),
           ("CP", L * (blocks.get("layer_cp_comm", 0.0) - cp_f) / v), ("P2P", p2p)]
    sched = schedules.build(plan.schedule if pp > 1 else "1f1b", pp, m, v)
    S = sched.n_stages
    sim = simulate(sched, StageCosts(fwd_s=[sum(d for _, d in fwd)] * S, bwd_s=[sum(d for _, d in bwd)] * S))
    segments: list[Event] = []
    passes = sorted((e for e in sim.events if e.kind in ("F", "B")), key=lambda e: (e.rank, e.start_s))
    flush = max((e.end_s for e in passes), default=0.0)
    busy_until = [0.0] * pp
    for e in passes:
        if e.start_s > busy_until[e.rank]:  # waiting for a neighbour: the bubble
            segments.append(Event(e.rank, "BUBBLE", -1, busy_until[e.rank], e.start_s))
        t = e.start_s
        for kind, d in (fwd if e.kind == "F" else bwd):
            if d > 0:
                mb = e.mb if kind in ("F", "B", "RC") else -1
                segments.append(Event(e.rank, kind, mb, t, t + d, e.stage, e.pipe))
                t += d
        busy_until[e.rank] = e.end_s
    for r in range(pp):
        t = flush
        if flush > busy_until[r]:
            segments.append(Event(r, "BUBBLE", -1, busy_until[r], flush))
        # then any phase the planner prices after the flush that has no block above (e.g. a host-side update)
        later = [(k, d) for k, d in phases.items() if k not in _DRAWN]
        for kind, d in [("DP", phases["dp_comm"]), ("OPT", phases["optimizer"]), *later]:
            if d > 0:
                segments.append(Event(r, kind, -1, t, t + d))
                t += d
    title = (f"{plan.describe()}\nmicro-batch {plan.micro_batch} x {m}: predicted step "
             f"{c.step_time_s * 1e3:.1f} ms, bubble {c.bubble_fraction:.1%}")
    return StepTimeline(segments=segments, n_ranks=pp, step_time_s=c.step_time_s, title=title)


def draw_step(tl: StepTimeline, path: str | Path, title: str | None = None) -> Path:
    """Write ``tl`` as a PNG (rows = pipeline ranks, axis in ms, a legend of the kinds drawn)."""
    from scaletrain.techniques.pipeline.timeline import draw

    styles = {k: (colour, label) for k, (_, colour, label) in KINDS.items() if colour}
    styles.update({e.kind: (OTHER_COLOUR, e.kind.replace("_", " ")) for e in tl.segments if e.kind not in KINDS})
    return draw(tl.segments, path, title=title or tl.title, n_ranks=tl.n_ranks, time_unit="ms", styles=styles,
                row_label="pp rank")
