"""The one overlap rule (scaletrain.cost.exposed_seconds) and ZeRO-3's per-unit prefetch windows."""

from __future__ import annotations

import pytest

from scaletrain import platform as P
from scaletrain.cost import exposed_seconds, prefetch_windows
from scaletrain.plan import Plan
from scaletrain.planner import Shape, plan_cost


def test_buckets_are_one_window_and_a_tail():
    # DDP / ZeRO-1/2: a backlog carries over to the backward's end; the last bucket waits for it
    assert exposed_seconds([3.0, 0.5], [10.0, 0.0]) == pytest.approx(0.5)
    assert exposed_seconds([12.0, 0.5], [10.0, 0.0]) == pytest.approx(2.5)
    assert exposed_seconds([3.0, 0.5], [10.0, 0.0], slowdown=0.1) == pytest.approx(0.5 + 0.3)


def test_prefetch_hides_each_gather_only_behind_the_unit_before_it():
    g, r, f, b = [1.0, 2.0, 1.0], [1.0, 2.0, 1.0], [2.0, 2.0, 2.0], [4.0, 4.0, 4.0]
    comm, win = prefetch_windows(g, r, f, b)
    assert sum(comm) == pytest.approx(2 * sum(g) + sum(r))  # every gather twice, every reduce-scatter once
    assert sum(win) == pytest.approx(sum(f) + sum(b))
    # the step's 12 s of collectives fit in its 18 s of compute, yet the first gather, the backward's first
    # gather and the last reduce-scatter have nothing to hide behind (1 + 1 + 1), and unit 2's gather and
    # reduce-scatter queue inside unit 3's and 2's backward windows: 4 - 4 = 0, (1 + 2) - 4 < 0 -> hidden
    assert exposed_seconds(comm, win) == pytest.approx(3.0)
    # a unit whose gather outlasts the compute before it is exposed by the excess in each pass, though the
    # totals fit: forward 5 - 2 (unit 1's forward), backward 5 - 4 (unit 3's backward)
    comm, win = prefetch_windows([1.0, 5.0, 1.0], [1.0, 1.0, 1.0], f, b)
    assert sum(comm) < sum(win)
    assert exposed_seconds(comm, win) == pytest.approx(3.0 + (5 - 2) + (5 - 4))


def test_zero3_exposes_each_micro_batch_on_paper():
    # compute far above the collectives: the old whole-step window hid all but one collective per step;
    # per micro-batch the first gathers and the last reduce-scatter wait, so m micro-batches expose m x
    shape = Shape(layers=4, hidden=1024, heads=16, vocab=50304, positions=8192)
    plat = P.get("a100-80g")
    plan = Plan(dp=8, zero=3, micro_batch=1, precision="bf16")
    one = plan_cost(shape, plan.with_(microbatches=1), plat, global_batch=8, seq=8192)
    four = plan_cost(shape, plan.with_(microbatches=4), plat, global_batch=32, seq=8192)
    assert one.phases_s["dp_comm"] > 0
    assert four.phases_s["dp_comm"] == pytest.approx(4 * one.phases_s["dp_comm"], rel=1e-9)


def test_zero3_exposes_each_micro_batch_in_the_traced_model():
    # the same rule through scaletrain.cost in `estimate --platform`: per micro-batch, so linear in m
    from scaletrain import models
    from scaletrain.techniques.plan_cost import plan_costs

    exposed = []
    for gb in (2, 8):  # 1 and 4 micro-batches of 1 on 2 ranks
        (c,) = plan_costs(Plan(dp=2, zero=3), models.get("gpt2-tiny", device="meta"), world=2, global_batch=gb,
                          seq=32, micro_batch=1, platform=P.get("h100"))
        assert 0 < c.time_s.comm_exposed_s["dp"] <= c.time_s.comm_s["dp"]
        exposed.append(c.time_s.comm_exposed_s["dp"])
    assert exposed[1] == pytest.approx(4 * exposed[0], rel=1e-9)
