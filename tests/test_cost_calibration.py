"""Cost terms measured by the local calibration: the optimizer step's own rate, and typical (median) samples."""

from __future__ import annotations

import time

import pytest

from scaletrain import platform as P
from scaletrain.cost import optimizer_seconds
from scaletrain.plan import Plan
from scaletrain.planner import Shape, plan_cost
from scaletrain.planner.local import _typical_time


def _cpu(**kw) -> P.Platform:
    return P.Platform(name="t", device_mem_bytes_per_s=1e9, mem_efficiency=((0.0, 1.0),), kernel_overhead_s=0.0,
                      intra_node_bytes_per_s=1e9, **kw)


def test_optimizer_seconds_uses_the_measured_rate_else_memory_bound():
    assert optimizer_seconds(_cpu(optimizer_bytes_per_s=4e9), 2e9) == pytest.approx(0.5)
    assert optimizer_seconds(_cpu(), 2e9) == pytest.approx(_cpu().memory_bound_seconds(2e9))
    assert optimizer_seconds(_cpu(optimizer_bytes_per_s=4e9), 0.0) == 0.0


def test_both_cost_paths_price_the_optimizer_step_at_its_rate():
    """The analytic planner and the traced cost model: twice the rate, half the optimizer phase."""
    from scaletrain import models
    from scaletrain.techniques.plan_cost import plan_costs

    shape, plan = Shape.of("gpt2-tiny"), Plan(dp=1, micro_batch=2)
    slow, fast = _cpu(optimizer_bytes_per_s=1e9), _cpu(optimizer_bytes_per_s=2e9)
    a = [plan_cost(shape, plan, p, global_batch=2, seq=32).phases_s["optimizer"] for p in (slow, fast)]
    assert a[0] > 0 and a[1] == pytest.approx(a[0] / 2)
    model = models.get("mlp", device="meta")
    t = [plan_costs(plan, model, world=1, global_batch=2, seq=0, micro_batch=2, platform=p)[0].time_s.optimizer
         for p in (slow, fast)]
    assert t[0] > 0 and t[1] == pytest.approx(t[0] / 2)


def test_typical_time_is_the_median_sample_not_the_best():
    durations = iter([0.0, 0.001, 0.03, 0.004])  # warm-up call, then three one-call samples

    def call() -> None:
        time.sleep(next(durations))

    t = _typical_time(call, 3, min_s=0.0)
    assert 0.004 <= t < 0.02  # the median sample; the best would be ~0.001
