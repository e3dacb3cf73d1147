"""Rematerialization inside pipeline stages on paper, as the pipeline runtime runs it: one solver schedule per
stage, each under its own budget (``memory.remat.method=optimal``, ``memory.remat.stage_budgets`` = bytes of one
micro-batch's forward + backward of each stage, :func:`scaletrain.techniques.pipeline.stage.stage_remat`).

Each budget comes from its stage's memory slack: rank k holds ``live_k`` micro-batches in flight
(:func:`.memory.inflight`) beside ``other_k`` bytes that do not depend on recompute (model states, weight
casts, the logits), so one micro-batch may use ``(device − reserve − other_k − A) / live_k + A`` there (A:
one layer's activations rematerialised during the backward; + the logits on the last stage, whose solver graph
ends with the head and the loss), never below that stage's floor (all its layers checkpointed), which the
runtime would refuse. Solved jointly with the stage partition: the split fixes each rank's layers, parameters
and in-flight count, hence its slack, hence its budget — the first rank of 1F1B (most in flight) gets the
least, the last the most. One budget for every stage would have to be the tightest stage's; per-stage budgets
let the others keep what they can hold (as Alpa's stage plans carry each stage's own choices, and Megatron's
``--recompute-num-layers`` is set per run, not per device memory). Each stage then keeps the activations of as
many of its n layers as fit and checkpoints the rest (their input kept, their forward run again in the backward):

    kept = ⌊(B − n·a − A) / (A − a)⌋ clamped to [0, n],  a = one layer's input, A = its activations,

so stages with more layers (an uneven split) or less slack recompute more. This is an upper bound on the
solver's recomputation (Beaumont et al.'s DP may nest checkpoints for less). The runtime plans on the
unsharded model before TP shards it, so the budgets written to the plan are in its bytes: a TP rank's
budget × A(tp = 1) / A(this tp). Bytes, seconds.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from scaletrain.plan import Plan, RematPlan
from scaletrain.techniques.remat.schedule import parse_bytes, parse_bytes_list

METHOD = "optimal"
"""The solver the planner writes for pipelines (homogeneous chains: what the kept-layers rule bounds)."""


def stage_ranks(plan: Plan, stage: int) -> tuple[int, ...]:
    """The pipeline ranks that run ``stage`` (rank s mod pp; Chimera's second pipeline runs it on pp − 1 − s too)."""
    k = stage % plan.pp
    return (k, plan.pp - 1 - k) if plan.schedule == "chimera" else (k,)


def budgets_of(plan: Plan) -> list[float] | None:
    """Each stage's budget in the plan's own (unsharded-model) bytes (pp × virtual of them, in stage order),
    or None without pipeline remat by the solver."""
    if plan.pp <= 1 or plan.remat.method != METHOD or not (plan.remat.budget or plan.remat.stage_budgets):
        return None
    if plan.remat.stage_budgets:
        return [float(b) for b in parse_bytes_list(plan.remat.stage_budgets)]
    return [float(parse_bytes(plan.remat.budget) or 0)] * (plan.pp * plan.stages_per_rank)


def rank_budgets(plan: Plan) -> list[float] | None:
    """Each pipeline rank's least budget among the stages it runs (None without pipeline remat)."""
    budgets = budgets_of(plan)
    if budgets is None:
        return None
    out = [math.inf] * plan.pp
    for s, b in enumerate(budgets):
        for k in stage_ranks(plan, s):
            out[k] = min(out[k], b)
    return out


def kept_layers(n: int, budget: float, full: float, inp: float) -> int:
    """Layers of a stage's ``n`` that keep their activations (``full`` bytes each, ``inp`` their input) within
    ``budget`` bytes of one micro-batch (module docstring)."""
    if n == 0 or budget >= n * full + full:
        return n
    if full <= inp:
        return 0
    return max(0, min(n, math.floor((budget - n * inp - full) / (full - inp))))


def fit_budgets(rank_peaks: list[dict[str, Any]], cap: float, full: float, inp: float,
                layers: tuple[int, ...], live: list[float]) -> list[float]:
    """Each pipeline rank's per-micro-batch budget (this TP rank's bytes) to fit under ``cap`` bytes, from the
    priced ranks' peaks without remat (``rank``, ``total``, ``activations``, ``live`` micro-batches in flight,
    ``layers``, ``graph_extra``: what else the stage's solver graph holds, the last stage's logits). Never
    below what the stage needs with every layer checkpointed (n·a + A + extra, the solver's floor): a
    budget that cannot fit is priced, as out of memory, rather than written where the runtime refuses it. A
    rank not priced holds what the earliest priced rank with as many ``layers`` holds beside its activations
    (the same parameters), with its own ``live[k]`` micro-batches in flight."""
    priced = {int(r["rank"]): r for r in rank_peaks}
    out = []
    for k, n in enumerate(layers):
        r = priced.get(k) or priced[layers.index(n)]
        other = r["total"] - r["activations"] - r.get("remat_transient", 0.0)
        extra = r.get("graph_extra", 0.0)
        slack = (cap - other - full) / max(r["live"] if k in priced else live[k], 1e-9) + full + extra
        out.append(max(slack, n * inp + full + extra))
    return out


def with_budgets(plan: Plan, budgets: list[float], scale: float) -> Plan:
    """``plan`` with the pipeline solver and each rank's budget (a TP rank's bytes, per rank) written per stage
    in the runtime's unsharded bytes (× ``scale`` = A(tp=1) / A(tp))."""
    stages = plan.pp * plan.stages_per_rank
    return _written(plan, [min(budgets[k] for k in stage_ranks(plan, s)) * scale for s in range(stages)])


def _written(plan: Plan, per_stage: list[float]) -> Plan:
    """``plan`` with the pipeline solver under ``per_stage`` budgets (bytes): ``memory.remat.budget`` when every
    stage's is the same, else ``memory.remat.stage_budgets``."""
    per = [int(b) for b in per_stage]
    if len(set(per)) == 1:
        return plan.with_(remat=RematPlan(method=METHOD, budget=str(per[0])))
    return plan.with_(remat=RematPlan(method=METHOD, stage_budgets=",".join(map(str, per))))


def fit_traced(plan: Plan, costs: list[Any], graphs: list[Any], cap: float,
               price: Callable[[Plan], list[Any]], rounds: int = 6) -> tuple[Plan, list[Any]]:
    """The traced cost model's per-stage budgets: ``plan`` (no remat) priced rank by rank as ``costs``
    (:class:`~scaletrain.techniques.plan_cost.RankCost`: ``peak_bytes``, ``bytes`` by category) over stages
    whose solver graphs are ``graphs``. Each stage starts from its one micro-batch's peak without recompute
    (``hi``: its solver then keeps everything) scaled by the slack of the rank(s) running it — (cap − model
    states) / (what the rank holds beside them) — never below its solver's least budget; the plan is priced
    again with the stages' schedules replayed, and a rank still over ``cap`` lowers its stages' budgets by its
    slack again, and at least below their current schedule's own peak (the solver's schedules are discrete:
    a smaller budget that the same schedule meets changes nothing), at most ``rounds`` times. Returns the
    solved plan and its rank costs (out of memory when even the solvers' least budgets are)."""
    from scaletrain.techniques.remat import min_budget, solve

    hi = [float(min_budget(g, "none")) for g in graphs]
    lo = [float(min_budget(g, METHOD)) for g in graphs]
    budgets, solved = hi, plan
    for _ in range(rounds):
        slack = []
        for c in costs:
            states = sum(c.bytes.get(k, 0.0) for k in ("params", "grads", "optimizer"))
            held = c.peak_bytes - states
            slack.append(1.0 if c.peak_bytes <= cap else max(0.0, (cap - states) / held) if held > 0 else 0.0)
        if min(slack) >= 1.0:
            break
        new = list(budgets)
        for s, g in enumerate(graphs):
            q = min(slack[k] for k in stage_ranks(plan, s))
            if q < 1.0:
                own = float(solve(g, int(budgets[s]), METHOD).predicted_peak_bytes) if solved is not plan else hi[s]
                new[s] = max(lo[s], min(budgets[s] * q, own - 1))
        if solved is not plan and [int(b) for b in new] == [int(b) for b in budgets]:
            break  # at the solvers' floors: out of memory
        budgets = new
        solved = _written(plan, budgets)
        costs = price(solved)
    return solved, costs
