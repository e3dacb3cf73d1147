"""Activation offloading on the CPU's logical device pool: gradients equal the baseline bitwise,
the measured device peak stays under the budget, and the bytes moved equal the prediction."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain import models
from scaletrain.chain import to_chain
from scaletrain.errors import UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.activations import ActivationOffloader, offload_bytes, parse_blocks
from scaletrain.techniques.offload.planner import predict
from scaletrain.techniques.offload.pools import DeviceOutOfMemory, HostOutOfMemory, LogicalPools
from scaletrain.techniques.offload.probe import probe_chain
from scaletrain.techniques.offload.runtime import OffloadOptions, OffloadRuntime

PLAT = Platform("test")


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


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return models.get("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, n_positions=32)


def batch(seed=1, b=4, s=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, s), generator=g), torch.randint(0, 256, (b, s), generator=g)


def baseline_grads(model, x, y):
    m = copy.deepcopy(model)
    lm_loss(m(x), y).backward()
    return [p.grad for p in m.parameters()]


@pytest.fixture(scope="module")
def reference():
    """Baseline gradients and the measured device peak with everything kept (computed once)."""
    model = tiny_gpt()
    x, y = batch()
    keep = OffloadRuntime(copy.deepcopy(model), adamw, OffloadOptions(), PLAT, lm_loss, (x, y))
    keep.forward_backward(x, y)
    keep.step()
    return baseline_grads(model, x, y), keep.last_stats()["device_peak_bytes"]


# ----------------------------------------------------------------------------- pools


def test_logical_pool_counts_copies_and_keeps_host_out_of_the_device_peak():
    pools = LogicalPools(budget_bytes=10_000, host_budget_bytes=1 << 20)
    with pools.phase():
        a = torch.ones(1000)  # 4000 B on the device
        host, _ = pools.d2h_storage(a.untyped_storage(), "activations")
        big_host = pools.host.empty(200_000)  # 800 kB on the host: not device memory
        del a
        dev, _ = pools.h2d_storage(host, "activations")
        back = torch.empty(0).set_(dev)
    assert torch.equal(back, torch.ones(1000))  # (outside: a tensor used in a phase counts as device memory)
    assert pools.device_peak_bytes == 4000
    assert pools.stats.total("d2h") == 4000 and pools.stats.total("h2d") == 4000
    assert pools.host.live_bytes == 4000 + 800_000
    del big_host, host
    assert pools.host.live_bytes == 0


def test_logical_pool_enforces_budgets():
    pools = LogicalPools(budget_bytes=4096, host_budget_bytes=1000)
    with pytest.raises(DeviceOutOfMemory):
        with pools.phase():
            torch.ones(2048) + 1  # 8 kB
    with pytest.raises(HostOutOfMemory):
        pools.host.empty(1000)


def test_parse_blocks():
    names = ["embed", "h.0", "h.1", "head"]
    assert parse_blocks("all", names) == [0, 1, 2, 3]
    assert parse_blocks("none", names) == []
    assert parse_blocks("h.1, 0", names) == [0, 2]
    with pytest.raises(UserError):
        parse_blocks("7", names)
    with pytest.raises(UserError):
        parse_blocks("nope", names)


# ----------------------------------------------------------------------------- offloading


@pytest.mark.parametrize("kw", [
    dict(activations="all", prefetch=1),
    dict(activations="all", prefetch=0),
    dict(activations="1,2", prefetch=3),
    dict(activations="0,2", recompute="1"),
])
def test_activation_offload_matches_baseline_and_prediction(kw, reference):
    ref, keep_peak = reference
    model = tiny_gpt()
    x, y = batch()
    costs = probe_chain(to_chain(model), x, y, lm_loss)
    budget = predict(costs, OffloadOptions(**kw), PLAT).device_peak_bytes  # the budget is the prediction
    rt = OffloadRuntime(model, adamw, OffloadOptions(device_budget=budget, **kw), PLAT, lm_loss, (x, y), costs=costs)
    rt.forward_backward(x, y)
    got = [p.grad.clone() for p in model.parameters()]
    rt.step()
    st = rt.last_stats()
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), "gradients differ from the baseline"
    assert st["device_peak_bytes"] <= budget
    assert st["h2d_bytes"] == st["predicted_h2d_bytes"] > 0
    assert st["d2h_bytes"] == st["predicted_d2h_bytes"]
    assert st["host_peak_bytes"] == st["predicted_host_peak_bytes"]
    assert st["late_fetches"] == 0
    assert st["device_peak_bytes"] < keep_peak  # offloading saved device memory


def test_offloaded_bytes_are_the_distinct_saved_storages():
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(5, 16)
    y = torch.randint(0, 8, (5,))
    costs = probe_chain(to_chain(model), x, y, F.cross_entropy)
    # Linear 2 saves its input = Tanh's output, which Tanh also saves: one storage, counted once.
    tanh_out = costs.blocks[1].out_storage
    assert tanh_out in costs.blocks[1].saved and tanh_out in costs.blocks[2].saved
    assert offload_bytes([b.saved for b in costs.blocks], costs.storage_bytes, [1, 2]) == \
        costs.saved_bytes(1) + costs.saved_bytes(2) - 5 * 32 * 4
    pools = LogicalPools()
    off = ActivationOffloader(pools, [1, 2], prefetch=1)
    chain = to_chain(model)
    off.begin_step([x, y, *model.parameters()])
    h = x
    for i, blk in enumerate(chain.blocks):
        ctx = off.hooks(i)
        if ctx is None:
            h = blk(h)
        else:
            with ctx:
                h = blk(h)
            off.end_block(i)
    F.cross_entropy(h, y).backward()
    assert pools.stats.total("d2h") == offload_bytes([b.saved for b in costs.blocks], costs.storage_bytes, [1, 2])
    assert pools.stats.total("h2d") == pools.stats.total("d2h")


def test_in_place_change_of_a_saved_tensor_is_reported():
    class Bad(nn.Module):
        def forward(self, x):
            y = x.exp()   # exp saves its output
            y.mul_(2)     # ... which is then modified in place
            return y

    model = nn.Sequential(nn.Linear(4, 4), Bad())
    x = torch.randn(2, 4)
    rt = OffloadRuntime(model, adamw, OffloadOptions(activations="1"), PLAT, lambda o, t: (o - t).pow(2).mean(),
                        (x, torch.zeros(2, 4)))
    with pytest.raises(RuntimeError, match="modified in place"):
        rt.forward_backward(x, torch.zeros(2, 4))


def test_a_budget_below_the_need_fails_like_a_gpu():
    model = tiny_gpt()
    x, y = batch()
    rt = OffloadRuntime(model, adamw, OffloadOptions(device_budget=500_000), PLAT, lm_loss, (x, y))
    with pytest.raises(DeviceOutOfMemory):
        rt.forward_backward(x, y)


def test_conv_net_with_batch_norm_offloads_exactly():
    """BatchNorm buffers are persistent (never moved); the probe must not confuse their storages."""
    torch.manual_seed(0)
    model = models.get("resnet-mini")
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    rt = OffloadRuntime(model, adamw, OffloadOptions(activations="all"), PLAT, F.cross_entropy, (x, y))
    rt.forward_backward(x, y)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))  # running stats too
    rt.step()
    st = rt.last_stats()
    assert st["d2h_bytes"] == st["predicted_d2h_bytes"] > 0 and st["h2d_bytes"] == st["predicted_h2d_bytes"]
    assert st["device_peak_bytes"] <= st["predicted_device_peak_bytes"]
