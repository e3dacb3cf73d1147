"""Cost terms that describe how a published stack ran (planner.cost.Options): each changes one priced term
by a hand-checkable amount."""

from __future__ import annotations

import pytest

from scaletrain import platform as P
from scaletrain.plan import Plan
from scaletrain.planner import Options, Shape, plan_cost
from scaletrain.planner.cost import _dp_time, layer_times


def test_ddp_without_overlap_exposes_the_whole_all_reduce():
    # Megatron-LM 2021's local DDP all-reduces after the forward-backward: every second of it is exposed
    shape = Shape(layers=4, hidden=1024, heads=16, vocab=51200, positions=1024)
    plat = P.get("a100-80g")
    plan = Plan(dp=16, micro_batch=4, precision="bf16", params_dtype="bf16")
    hidden = plan_cost(shape, plan, plat, global_batch=64, seq=1024)
    after = plan_cost(shape, plan, plat, global_batch=64, seq=1024, options=Options(dp_overlap=False))
    full = _dp_time(plat, shape.params(), 0, 16, 1, 1, 4, blocks=6, bucket_bytes=plan.bucket_mb * 1e6)[0]
    assert after.phases_s["dp_comm"] == pytest.approx(full, rel=1e-12)
    assert hidden.phases_s["dp_comm"] < full
    assert after.step_time_s - hidden.step_time_s == pytest.approx(full - hidden.phases_s["dp_comm"], rel=1e-9)
