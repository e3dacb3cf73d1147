"""The joint planner: its plans fit the budgets when run, train like the baseline, and its
predictions match the counted transfers."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.chain import to_chain
from scaletrain.errors import UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.planner import _knapsack, plan_offload, predict
from scaletrain.techniques.offload.probe import probe_chain
from scaletrain.techniques.offload.runtime import OffloadOptions, OffloadRuntime

CPU = Platform("cpu-test", device_type="cpu", h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9, flops_fp32=2e10,
               cpu_adam_params_per_s=2e8, copy_overlaps_compute=False)
GPU = Platform("gpu-test", device_type="cuda", h2d_bytes_per_s=2e10, d2h_bytes_per_s=2e10, flops_fp32=1e13,
               cpu_adam_params_per_s=1e9, copy_overlaps_compute=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a shared, oversubscribed CI machine OpenMP barriers make small ops
    10x slower with more; these tests check bytes and equality, never speed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def lm_loss(o, t):
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)


def gpt(seed=0):
    torch.manual_seed(seed)
    return models.get("gpt2-tiny", n_layer=3, n_embd=96, n_head=2, n_positions=16)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
            for _ in range(n)]


def test_knapsack_is_optimal_on_small_instances():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 5)
        mem = [[rng.randint(0, 30) for _ in range(3)] for _ in range(n)]
        cost = [[rng.random() for _ in range(3)] for _ in range(n)]
        cap = rng.randint(0, 60)
        best = None
        for pick in itertools.product(range(3), repeat=n):
            if sum(mem[i][k] for i, k in enumerate(pick)) <= cap:
                c = sum(cost[i][k] for i, k in enumerate(pick))
                best = c if best is None or c < best else best
        got = _knapsack(mem, cost, cap, slots=10**6)
        if best is None:
            assert got is None
        else:
            assert sum(mem[i][k] for i, k in enumerate(got)) <= cap
            assert sum(cost[i][k] for i, k in enumerate(got)) == pytest.approx(best)


def test_prediction_is_monotone_in_what_is_offloaded():
    x, y = batches(1)[0]
    costs = probe_chain(to_chain(gpt()), x, y, lm_loss)
    costs.estimate_times(CPU.flops_fp32, CPU.device_mem_bytes_per_s)
    keep = predict(costs, OffloadOptions(optimizer="host"), CPU)  # (states on the host: activations dominate)
    half = predict(costs, OffloadOptions(optimizer="host", activations="1,2"), CPU)
    full = predict(costs, OffloadOptions(optimizer="host", activations="all"), CPU)
    assert keep.device_peak_bytes > half.device_peak_bytes > full.device_peak_bytes
    assert keep.offload_bytes < half.offload_bytes < full.offload_bytes
    assert keep.step_time_s < half.step_time_s < full.step_time_s  # no overlap on the CPU
    gpu_full = predict(costs, OffloadOptions(activations="all"), GPU)
    gpu_keep = predict(costs, OffloadOptions(), GPU)
    assert gpu_full.step_time_s >= gpu_keep.step_time_s  # overlap hides at most all of it


@pytest.fixture(scope="module")
def baseline_losses():
    base = gpt()
    opt = adamw(base)
    out = []
    for x, y in batches(3):
        loss = lm_loss(base(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.parametrize("fraction", [0.25, 0.6])
def test_auto_plan_fits_trains_like_the_baseline_and_predicts_the_transfers(fraction, baseline_losses):
    """fraction 0.25: the device holds a quarter of parameters + gradients + Adam states (16 B/param)."""
    data = batches(3)
    model = gpt()
    base_losses = baseline_losses
    budget = int(fraction * 16 * sum(p.numel() for p in model.parameters()))
    rt = OffloadRuntime(model, adamw, OffloadOptions(plan="auto", device_budget=budget), CPU, lm_loss, data[0])
    assert rt.prediction.device_peak_bytes <= budget
    losses = []
    for x, y in data:
        losses.append(rt.forward_backward(x, y).item())
        rt.step()
        st = rt.last_stats()
        assert st["device_peak_bytes"] <= budget
        assert st["h2d_bytes"] == st["predicted_h2d_bytes"]
        assert st["d2h_bytes"] == st["predicted_d2h_bytes"]
    assert losses == base_losses
    if fraction < 0.3:  # parameters + states 4x the budget: they must leave the device
        assert rt.options.optimizer != "device"


def test_no_plan_below_the_floor():
    x, y = batches(1)[0]
    costs = probe_chain(to_chain(gpt()), x, y, lm_loss)
    with pytest.raises(UserError, match="no offload plan"):
        plan_offload(costs, CPU, OffloadOptions(device_budget=10_000))


def test_a_generous_budget_keeps_everything():
    x, y = batches(1)[0]
    costs = probe_chain(to_chain(gpt()), x, y, lm_loss)
    costs.estimate_times(CPU.flops_fp32, CPU.device_mem_bytes_per_s)
    plan = plan_offload(costs, CPU, OffloadOptions(device_budget=1 << 40))
    assert plan.options.modes == ["keep"] * len(costs)
    assert plan.options.params == "device" and plan.options.optimizer == "device"
    assert plan.prediction.offload_bytes == 0
