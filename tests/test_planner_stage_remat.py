"""Pipeline remat solved per stage (issue 25, deliverable 3): each stage's solver budget comes from its own
rank's memory slack, in the analytic and the traced planner. Where one budget for every stage would have to be
the tightest stage's, per-stage budgets keep every rank under the device memory and recompute less."""

from __future__ import annotations

from scaletrain import models, platform
from scaletrain.plan import RematPlan
from scaletrain.planner.cost import Options, plan_cost
from scaletrain.planner.search import parse_fixed, search
from scaletrain.planner.shape import Shape

A100 = platform.get("a100-80g")


def _one_budget(plan, budget: int):
    return plan.with_(remat=RematPlan(method="optimal", budget=str(budget)))


def test_analytic_planner_gives_each_stage_its_own_slack():
    # 70 layers on 12 stages (1F1B: rank k holds 12 - k micro-batches): nothing fits without recompute
    shape = Shape.of("gpt2-xl", n_layer=70, vocab_size=8192)
    kw = dict(global_batch=192, seq=2048)
    c = search(shape, A100, nodes=1, gpus_per_node=12, **kw,
               fixed=parse_fixed(["pp=12", "tp=1", "zero=0", "schedule=1f1b", "micro_batch=16"])).ranked[0]
    budgets = [int(b) for b in c.plan.remat.stage_budgets.split(",")]
    assert c.plan.remat.method == "optimal" and len(budgets) == 12 and budgets == sorted(budgets)  # least in front
    cap = A100.device_memory_bytes - Options().reserve_bytes
    assert all(r["total"] <= cap for r in c.rank_peaks)  # every case of (layers, kept, in flight) priced
    # one budget for all: the largest puts the front ranks out of memory, so it would have to be the least ...
    assert not plan_cost(shape, _one_budget(c.plan, max(budgets)), A100, **kw).fits
    tight = plan_cost(shape, _one_budget(c.plan, min(budgets)), A100, **kw)
    assert tight.fits
    # ... under which every later stage recomputes layers its own slack would have kept
    assert all(a <= b for a, b in zip(tight.stage_kept, c.stage_kept)) and sum(tight.stage_kept) < sum(c.stage_kept)


def test_traced_planner_fits_each_stage_by_its_solver():
    from scaletrain.measure.estimate import trace_cache
    from scaletrain.planner.traced import Traced, price
    from scaletrain.planner.traced import search as traced_search

    # an nn.Module (priced by its fake-tensor trace); rank 0 holds 2 micro-batches in flight, rank 1 one
    target = Traced.of(models.get("gpt2-tiny", device="meta", n_layer=6, n_embd=64, n_head=2, n_positions=128,
                                  vocab_size=256))
    plat, opts, kw = A100.with_(device_memory_bytes=9 * 2**20), Options(reserve_bytes=0), dict(global_batch=32, seq=128)
    with trace_cache():  # one fake-tensor trace of the model for every plan priced here
        r = traced_search(target, plat, nodes=1, gpus_per_node=2, **kw, precision="fp32", options=opts,
                          fixed={"pp": 2, "tp": 1, "schedule": "1f1b", "micro_batch": 4})
        c = r.ranked[0]
        assert r.out_of_memory and r.out_of_memory[0].plan.remat.method == "none"  # none fits without recompute
        budgets = [int(b) for b in c.plan.remat.stage_budgets.split(",")]
        assert len(set(budgets)) == 2 and all(x["total"] <= plat.device_memory_bytes for x in c.rank_peaks)
        loose = price(target, _one_budget(c.plan, max(budgets)), plat, **kw, options=opts)
        tight = price(target, _one_budget(c.plan, min(budgets)), plat, **kw, options=opts)
    assert not loose.fits and tight.fits and tight.step_time_s > c.step_time_s  # the tightest's: more recompute
