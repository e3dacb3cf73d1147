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
                      intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9, devices_per_node=2, **kw)


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


def test_fsdp_overhead_is_paid_once_per_zero3_collective_on_both_cost_paths():
    """3 collectives per gather unit and micro-batch (gather, backward re-gather, reduce-scatter), each
    with FSDP2's measured overhead on top of α–β; nothing overlaps on a CPU pool."""
    from scaletrain import models
    from scaletrain.techniques.plan_cost import plan_costs

    shape = Shape.of("gpt2-tiny")
    plan = Plan(dp=2, zero=3, micro_batch=2)
    base, over = _cpu(), _cpu(fsdp_collective_overhead_s=1e-3)
    a = [plan_cost(shape, plan, p, global_batch=8, seq=32).step_time_s for p in (base, over)]
    m, units = 8 // (2 * 2), shape.layers + 2  # micro-batches; the layers and the root's embedding and head
    assert a[1] - a[0] == pytest.approx(3 * m * units * 1e-3)
    model = models.get("mlp", device="meta")
    t = [plan_costs(plan, model, world=2, global_batch=8, seq=0, micro_batch=2, platform=p)[0].step_time_s
         for p in (base, over)]
    n = (t[1] - t[0]) / 1e-3
    assert n > 0 and n == pytest.approx(round(n)) and round(n) % (3 * m) == 0
    assert plan_costs(plan.with_(zero=2), model, world=2, global_batch=8, seq=0, micro_batch=2,
                      platform=over)[0].step_time_s == pytest.approx(
        plan_costs(plan.with_(zero=2), model, world=2, global_batch=8, seq=0, micro_batch=2,
                   platform=base)[0].step_time_s)  # only ZeRO-3 pays it


def test_zero_collectives_pay_the_backends_measured_factors_on_both_cost_paths():
    """gloo's reduce-scatter is slower than a ring: the measured factor multiplies ZeRO's collective
    seconds by the collectives' mix (ZeRO-1: half each); DDP's all-reduce is untouched."""
    from scaletrain import models
    from scaletrain.cost import zero_comm_factor
    from scaletrain.techniques.plan_cost import plan_costs

    slow = _cpu(reduce_scatter_factor=3.0, all_gather_factor=1.0)
    assert zero_comm_factor(slow, 0) == 1.0 and zero_comm_factor(slow, 1) == pytest.approx(2.0)
    assert zero_comm_factor(slow, 2, accum=3) == pytest.approx(10 / 4)
    assert zero_comm_factor(slow, 3) == pytest.approx(5 / 3)
    model = models.get("mlp", device="meta")
    for zero in (0, 1):
        plan = Plan(dp=2, zero=zero, micro_batch=2)
        c = [plan_costs(plan, model, world=2, global_batch=4, seq=0, micro_batch=2, platform=p)[0].time_s
             for p in (_cpu(), slow)]
        assert c[1].comm_s["dp"] == pytest.approx(c[0].comm_s["dp"] * zero_comm_factor(slow, zero))
    shape = Shape.of("gpt2-tiny")
    a = [plan_cost(shape, Plan(dp=2, zero=1, micro_batch=2), p, global_batch=8, seq=32).phases_s["dp_comm"]
         for p in (_cpu(), slow)]
    assert a[0] > 0 and a[1] == pytest.approx(2.0 * a[0])


def test_measured_blocks_replace_the_roofline_for_their_model_only():
    """The measured source of the per-block table: the traced cost model prices the model's compute with
    its blocks' measured seconds (interpolated in the micro-batch), any other model on the roofline."""
    from scaletrain import models
    from scaletrain.measure.block_times import lookup, model_key
    from scaletrain.techniques.plan_cost import plan_costs

    from scaletrain.chain import to_chain

    model = models.get("mlp", device="meta")

    blocks = len(to_chain(model).blocks) + 1  # the loss last
    key = model_key(model)
    table = ((key, "fp32", 0, 2, (1e-3,) * blocks, (2e-3,) * blocks),
             (key, "fp32", 0, 4, (3e-3,) * blocks, (6e-3,) * blocks))
    assert lookup(table, key, "fp32", 0, 3) == ([2e-3] * blocks, [4e-3] * blocks)  # linear between 2 and 4
    assert lookup(table, key, "fp32", 0, 8)[0] == pytest.approx([6e-3] * blocks)  # proportional beyond
    assert lookup(table, "other", "fp32", 0, 2) is None and lookup(table, key, "bf16", 0, 2) is None
    plat = _cpu(measured_blocks=table)
    t = plan_costs(Plan(micro_batch=2), model, world=1, global_batch=4, seq=0, micro_batch=2, platform=plat)[0].time_s
    assert t.compute == pytest.approx(2 * blocks * 3e-3)  # 2 micro-batches of (1 + 2) ms per entry
    other = models.get("vgg-mini", device="meta")
    a = plan_costs(Plan(micro_batch=2), other, world=1, global_batch=2, seq=0, micro_batch=2, platform=plat)
    b = plan_costs(Plan(micro_batch=2), other, world=1, global_batch=2, seq=0, micro_batch=2, platform=_cpu())
    assert a[0].time_s.compute == pytest.approx(b[0].time_s.compute)
    assert P.Platform.from_dict(plat.to_dict()).measured_blocks == table  # a platform file keeps it


def test_time_blocks_measures_every_block_and_the_loss():
    import torch

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.block_times import time_blocks
    from scaletrain.techniques.plan_cost import _loss

    model = models.get("mlp")
    x = torch.randn(4, *model.input_spec(4).shape[1:])
    f, b = time_blocks(to_chain(model), x, torch.zeros(4, dtype=torch.long), _loss, repeats=1)
    assert len(f) == len(b) == len(to_chain(model).blocks) + 1 and all(t > 0 for t in f)
    assert all(p.grad is None for p in model.parameters())  # nothing left behind


def test_time_blocks_charges_each_block_its_own_pass():
    """In place (inside whole forward and backward passes), the clock between boundaries and the gradient
    hooks give each block its own seconds: a block sleeping 60 ms in its backward, another in its forward."""
    import time

    import torch

    from scaletrain.chain import Chain
    from scaletrain.measure.block_times import time_blocks

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.06)
            return g

    class Slow(torch.nn.Module):
        def __init__(self, where: str):
            super().__init__()
            self.lin, self.where = torch.nn.Linear(4, 4), where

        def forward(self, x):
            if self.where == "fwd":
                time.sleep(0.06)
            y = self.lin(x)
            return SlowBackward.apply(y) if self.where == "bwd" else y

    chain = Chain([Slow("none"), Slow("bwd"), Slow("fwd"), Slow("none")])
    f, b = time_blocks(chain, torch.randn(2, 4), torch.zeros(2, dtype=torch.long),
                       lambda z, y: torch.nn.functional.cross_entropy(z, y), repeats=1)
    assert len(f) == len(b) == 5
    assert b[1] >= 0.06 and f[2] >= 0.06
    assert max(b[0], b[2], b[3], b[4]) < 0.06 and max(f[0], f[1], f[3], f[4]) < 0.06


def test_the_input_pipeline_is_priced_per_sample_on_every_rank():
    """Platform.data_seconds_per_sample x the rank's samples per step (micro-batch x accumulation) is in the
    step; the loader's own cost is measured on real data (positive, per sample)."""
    from scaletrain import models
    from scaletrain.techniques.plan_cost import plan_costs

    model = models.get("mlp", device="meta")
    kw = dict(world=1, global_batch=8, seq=0, micro_batch=2)
    a = plan_costs(Plan(micro_batch=2), model, **kw, platform=_cpu(data_seconds_per_sample=1e-3))[0].time_s
    b = plan_costs(Plan(micro_batch=2), model, **kw, platform=_cpu())[0].time_s
    assert a.data == pytest.approx(8e-3) and a.step_s - b.step_s == pytest.approx(8e-3)


def test_data_rate_measures_the_runs_own_loader():
    from scaletrain.train.config import load_config
    from scaletrain.train.model_data import data_rate

    cfg = load_config(None, ["model.name=mlp", "train.global_batch=8"])
    assert 0 < data_rate(cfg, None, 2) < 0.1  # seconds per sample


def test_pipeline_host_costs_are_paid_per_action_and_per_receive_by_pipelines_only():
    """``pipeline_action_s`` once per F and B of each rank (and per W under zb1p), counted in its compute;
    a measured blocking receive (``p2p_recv_s``) makes the pipeline slower; a plan without a pipeline pays
    neither."""
    from scaletrain import models
    from scaletrain.techniques.plan_cost import plan_costs

    model = models.get("mlp")  # real tensors: zb1p's deferred-gradient trace runs on the model's own device

    def step(plan: Plan, **kw) -> list:
        return [c.time_s for c in plan_costs(plan, model, world=2, global_batch=8, seq=0, micro_batch=0
                                             if plan.pp > 1 else 2, platform=_cpu(**kw))]

    for schedule, pieces in (("1f1b", 2), ("zb1p", 3)):
        plan = Plan(pp=2, micro_batch=2, microbatches=4, schedule=schedule)
        base, slow = step(plan), step(plan, pipeline_action_s=1e-3)
        for b, s in zip(base, slow):
            assert s.compute - b.compute == pytest.approx(4 * pieces * 1e-3)
            assert s.step_s - b.step_s >= 4 * pieces * 1e-3 - 1e-9
        late = step(plan, p2p_recv_s=5e-3, p2p_send_s=1e-4)
        assert all(c.step_s > b.step_s and c.comm_exposed_s["p2p"] > b.comm_exposed_s["p2p"]
                   for c, b in zip(late, base))
    dp = Plan(dp=2, micro_batch=2)
    assert step(dp)[0].step_s == pytest.approx(step(dp, pipeline_action_s=1e-3, p2p_recv_s=5e-3)[0].step_s)
