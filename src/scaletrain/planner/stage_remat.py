"""Rematerialization inside pipeline stages on paper, as the pipeline runtime runs it: one solver schedule per
stage under one budget (``memory.remat.method=optimal``, ``memory.remat.budget`` = bytes of one micro-batch's
forward + backward of a stage, :func:`scaletrain.techniques.pipeline.stage.stage_remat`).

The budget comes from the stages' memory slack: rank k holds ``live_k`` micro-batches in flight
(:func:`.memory.inflight`) beside ``other_k`` bytes that do not depend on recompute (model states, weight
casts, the logits), so one micro-batch may use ``(device − reserve − other_k − A) / live_k + A`` there (A:
one layer's activations rematerialised during the backward; + the logits on the last stage, whose solver graph
ends with the head and the loss); the plan's budget is the smallest over the ranks, the one every stage's
solver is given, but never below the largest stage's floor (all its layers checkpointed), which the runtime
would refuse. Each stage then keeps the activations of as many of its n
layers as fit and checkpoints the rest (their input kept, their forward run again in the backward):

    kept = ⌊(B − n·a − A) / (A − a)⌋ clamped to [0, n],  a = one layer's input, A = its activations,

so stages with more layers (an uneven split) or less slack recompute more. This is an upper bound on the
solver's recomputation (Beaumont et al.'s DP may nest checkpoints for less). The runtime plans on the
unsharded model before TP shards it, so the budget written to the plan is in its bytes: a TP rank's
budget × A(tp = 1) / A(this tp). Bytes, seconds.
"""

from __future__ import annotations

import math
from typing import Any

from scaletrain.plan import Plan, RematPlan
from scaletrain.techniques.remat.schedule import parse_bytes

METHOD = "optimal"
"""The solver the planner writes for pipelines (homogeneous chains: what the kept-layers rule bounds)."""


def budget_of(plan: Plan) -> float | None:
    """The plan's per-stage budget in its own (unsharded-model) bytes, or None without pipeline remat."""
    if plan.pp <= 1 or plan.remat.method != METHOD or not plan.remat.budget:
        return None
    return float(parse_bytes(plan.remat.budget) or 0)


def kept_layers(n: int, budget: float, full: float, inp: float) -> int:
    """Layers of a stage's ``n`` that keep their activations (``full`` bytes each, ``inp`` their input) within
    ``budget`` bytes of one micro-batch (module docstring)."""
    if n == 0 or budget >= n * full + full:
        return n
    if full <= inp:
        return 0
    return max(0, min(n, math.floor((budget - n * inp - full) / (full - inp))))


def fit_budget(rank_peaks: list[dict[str, Any]], cap: float, full: float, inp: float) -> float:
    """The per-micro-batch budget (this TP rank's bytes) for every priced rank to fit under ``cap`` bytes,
    from each rank's peak without remat (``total``, ``activations``, ``live`` micro-batches in flight,
    ``layers``, ``graph_extra``: what else the stage's solver graph holds, the last stage's logits). Never
    below what a stage needs with every layer checkpointed (n·a + A + extra, the solver's floor): a
    budget that cannot fit is priced, as out of memory, rather than written where the runtime refuses it."""
    out, floor = math.inf, 0.0
    for r in rank_peaks:
        other = r["total"] - r["activations"] - r.get("remat_transient", 0.0)
        extra = r.get("graph_extra", 0.0)
        out = min(out, (cap - other - full) / max(r["live"], 1e-9) + full + extra)
        floor = max(floor, r.get("layers", 0) * inp + full + extra)
    return max(out, floor)


def with_budget(plan: Plan, budget: float, scale: float) -> Plan:
    """``plan`` with the pipeline solver and ``budget`` (a TP rank's bytes) written in the runtime's
    unsharded bytes (× ``scale`` = A(tp=1) / A(tp))."""
    return plan.with_(remat=RematPlan(method=METHOD, budget=str(int(budget * scale))))
