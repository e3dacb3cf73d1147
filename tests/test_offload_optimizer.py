"""ZeRO-Offload (host optimizer, DPU) and weight streaming on the CPU's logical device pool."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.errors import UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.optimizer import CPUAdam
from scaletrain.techniques.offload.runtime import OffloadOptions, OffloadRuntime, options_from_cfg
from scaletrain.techniques.offload.weights import ParamClaims, replay_claims
from scaletrain.techniques.optim.adam8bit import Adam8bit

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
    decay = [p for p in m.parameters() if p.ndim >= 2]
    other = [p for p in m.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=1e-2,
                             weight_decay=0.1, fused=True)


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return models.get("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, n_positions=32)


def batches(n, b=4, s=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (b, s), generator=g), torch.randint(0, 256, (b, s), generator=g)) for _ in range(n)]


def run_baseline(model, factory, data, clip=1.0):
    opt = factory(model)
    losses = []
    for x, y in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def run_offload(model, factory, data, clip=1.0, **kw):
    rt = OffloadRuntime(model, factory, OffloadOptions(**kw), PLAT, lm_loss, data[0])
    losses = []
    for x, y in data:
        losses.append(rt.forward_backward(x, y).item())
        rt.clip_grad_norm_(clip)
        rt.step()
    return losses, rt.full_parameters(), rt


def test_cpu_adam_flat_equals_torch_fused_adamw():
    torch.manual_seed(0)
    shapes = [(33, 7), (7,), (128,), (5, 5, 3)]
    ref = [torch.randn(s) for s in shapes]
    flat = torch.cat([p.reshape(-1) for p in ref])
    views, off = [], 0
    for p in ref:
        views.append(flat[off:off + p.numel()].view(p.shape))
        off += p.numel()
    params = [p.clone() for p in ref]
    opt_ref = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    opt = CPUAdam(views, lr=1e-2, weight_decay=0.1, adamw=True, flat=[flat])
    for step in range(4):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g
        opt_ref.step()
        opt.step(grads=[torch.cat([g.reshape(-1) for g in grads])])
        assert all(torch.equal(a, b) for a, b in zip(views, params)), f"step {step}"


@pytest.fixture(scope="module")
def baseline():
    data = batches(3)
    return data, run_baseline(tiny_gpt(), adamw, data)


@pytest.mark.parametrize("kw", [
    dict(optimizer="host"),
    dict(optimizer="host", activations="all", recompute="none"),
    dict(params="host", optimizer="host", activations="1,2", param_window=0),
    dict(params="host", optimizer="host", recompute="all", param_window=2),
])
def test_offloaded_training_equals_baseline_bitwise(kw, baseline):
    data, (base_losses, base_params) = baseline
    losses, params, rt = run_offload(tiny_gpt(), adamw, data, **kw)
    assert losses == base_losses
    assert all(torch.equal(params[n], base_params[n]) for n in base_params)
    st = rt.last_stats()
    for key in ("h2d_bytes", "d2h_bytes", "host_peak_bytes"):
        assert st[key] == st[f"predicted_{key}"], key
    assert st["device_peak_bytes"] <= st["predicted_device_peak_bytes"]


def test_generic_optimizer_runs_on_the_host_masters():
    data = batches(3)
    factory = lambda m: Adam8bit(m.parameters(), lr=1e-2, fused=False)  # noqa: E731
    base_losses, base_params = run_baseline(tiny_gpt(), factory, data)
    losses, params, rt = run_offload(tiny_gpt(), factory, data, optimizer="host")
    assert losses == base_losses
    assert all(torch.equal(params[n], base_params[n]) for n in base_params)
    assert rt.pools.host.live_bytes >= sum(Adam8bit.state_nbytes(p.numel()) for p in rt.params)


def test_delayed_parameter_update_is_one_step_stale():
    data = batches(4)
    # Reference: the device copy computes gradients; the master is updated with them at once, and the
    # device receives the master's values one step later (ZeRO-Offload's DPU).
    device = tiny_gpt()
    master = copy.deepcopy(device)
    opt = adamw(master)
    ref_losses, pending = [], False
    for x, y in data:
        loss = lm_loss(device(x), y)
        loss.backward()
        ref_losses.append(loss.item())
        if pending:
            with torch.no_grad():
                for d, m in zip(device.parameters(), master.parameters()):
                    d.copy_(m)
        for d, m in zip(device.parameters(), master.parameters()):
            m.grad, d.grad = d.grad, None
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending = True
    rt = OffloadRuntime(tiny_gpt(), adamw, OffloadOptions(optimizer="host", dpu=True), PLAT, lm_loss, data[0])
    losses = []
    for x, y in data:
        losses.append(rt.forward_backward(x, y).item())
        rt.step()
        st = rt.last_stats()  # the update running meanwhile on the host is not device memory
        assert st["device_peak_bytes"] <= st["predicted_device_peak_bytes"]
    assert losses == ref_losses
    params = rt.full_parameters()
    assert all(torch.equal(params[n], p) for n, p in master.named_parameters())


def test_param_claims_refcount_tied_weights_and_window():
    # blocks: 0 uses {0, 1}, 1 uses {2}, 2 uses {3}, 3 uses {4, 0} (tied with block 0)
    blocks = [[0, 1], [2], [3], [4, 0]]
    sizes = [10, 1, 100, 1000, 5]
    log = []
    c = ParamClaims(blocks, 1, lambda p: log.append(("+", p)), lambda p: log.append(("-", p)))
    for i in range(4):
        c.forward_start(i)
        c.forward_end(i)
    for i in reversed(range(4)):
        c.backward_start(i)
    c.finish()
    fetched = sum(sizes[p] for s, p in log if s == "+")
    assert replay_claims(blocks, sizes, 1, [0, 1, 2, 3])[0] == fetched
    assert all(log.count(("+", p)) == log.count(("-", p)) for p in range(5))
    # the last window+1 blocks are not refetched at the turnaround
    assert log.count(("+", 3)) == 1 and log.count(("+", 4)) == 1


def test_model_four_times_the_device_budget_trains():
    torch.manual_seed(0)
    model = models.get("mlp", widths=(48, 256, 256, 256, 256, 256, 10), image_size=4, channels=3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 4, 4, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    n = sum(p.numel() for p in model.parameters())
    budget = 16 * n // 4  # fp32 params + grads + Adam states = 16 B/param = 4x the budget
    opts = OffloadOptions(params="host", optimizer="host", activations="all", param_window=1, device_budget=budget)
    rt = OffloadRuntime(model, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3), opts, PLAT, F.cross_entropy,
                        (x, y))
    losses = []
    for _ in range(12):
        losses.append(rt.forward_backward(x, y).item())
        rt.step()
        st = rt.last_stats()
        assert st["device_peak_bytes"] <= budget
        assert st["h2d_bytes"] == st["predicted_h2d_bytes"] and st["d2h_bytes"] == st["predicted_d2h_bytes"]
    assert losses[-1] < 0.5 * losses[0]


def test_options_validation_and_config_reading():
    with pytest.raises(UserError):
        OffloadOptions(params="host", optimizer="device").validate()
    with pytest.raises(UserError):
        OffloadOptions(optimizer="gpu").validate()

    class Off:
        activations = "all"
        optimizer = "host"
        disk_max_bytes = "1GiB"

    class Mem:
        offload = Off()
        device_budget = "2MiB"

    o = options_from_cfg(type("Cfg", (), {"memory": Mem()})())
    assert (o.activations, o.optimizer, o.device_budget, o.disk_max_bytes) == ("all", "host", 2 << 20, 1 << 30)


@pytest.mark.parametrize("kw", [dict(params="host", optimizer="host", activations="all"), dict(optimizer="host")])
def test_resume_from_state_dict_continues_bitwise(kw):
    data = batches(3)
    whole = OffloadRuntime(tiny_gpt(), adamw, OffloadOptions(**kw), PLAT, lm_loss, data[0])
    first = OffloadRuntime(tiny_gpt(), adamw, OffloadOptions(**kw), PLAT, lm_loss, data[0])
    for rt, steps in ((whole, data), (first, data[:2])):
        for x, y in steps:
            rt.forward_backward(x, y)
            rt.step()
    state = first.state_dict()
    assert set(state["model"]) == set(tiny_gpt().state_dict())
    resumed = OffloadRuntime(tiny_gpt(seed=5), adamw, OffloadOptions(**kw), PLAT, lm_loss, data[0])
    resumed.load_state_dict(state)
    resumed.forward_backward(*data[2])
    resumed.step()
    a, b = whole.full_parameters(), resumed.full_parameters()
    assert all(torch.equal(a[n], b[n]) for n in a)
    plain = tiny_gpt(seed=5)  # an offload checkpoint loads into a plain model and a torch optimizer
    plain.load_state_dict(state["model"])
    adamw(plain).load_state_dict(state["optimizer"])


def test_evaluation_forward_streams_weights():
    x, y = batches(1)[0]
    model = tiny_gpt()
    expected = tiny_gpt()(x)
    rt = OffloadRuntime(model, adamw, OffloadOptions(params="host", optimizer="host"), PLAT, lm_loss, (x, y))
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # nothing resident
    assert torch.equal(rt.forward(x), expected)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_gradient_accumulation_on_the_host():
    data = batches(4)
    base = tiny_gpt()
    opt = adamw(base)
    for k in range(0, 4, 2):
        for x, y in data[k:k + 2]:
            (lm_loss(base(x), y) * 0.5).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rt = OffloadRuntime(tiny_gpt(), adamw, OffloadOptions(params="host", optimizer="host", activations="all"), PLAT,
                        lm_loss, data[0], accum=2)
    for k in range(0, 4, 2):
        for x, y in data[k:k + 2]:
            rt.forward_backward(x, y, 0.5)
        rt.step()
        st = rt.last_stats()
        assert st["h2d_bytes"] == st["predicted_h2d_bytes"] and st["d2h_bytes"] == st["predicted_d2h_bytes"]
    got = rt.full_parameters()
    assert all(torch.equal(got[n], p) for n, p in base.named_parameters())


def test_build_offload_runtime_entry_point():
    from scaletrain.techniques.offload import build_offload_runtime

    data = batches(2)
    rt = build_offload_runtime(tiny_gpt(), adamw, {"optimizer": "host", "activations": "all", "device_budget": "8MiB"},
                               PLAT, loss_fn=lm_loss, example=data[0])
    sched = torch.optim.lr_scheduler.LambdaLR(rt.optimizer, lambda s: 0.5)  # the trainer's scheduler attaches
    for x, y in data:
        loss = rt.forward_backward(x, y, 1.0)
        assert rt.clip_grad_norm_(1.0) > 0
        rt.step()
        sched.step()
        row = rt.last_stats()
        for key in ("device_peak_bytes", "offload_bytes", "predicted_device_peak_bytes", "predicted_offload_bytes",
                    "predicted_step_time_s", "step_time_s"):
            assert key in row
        assert row["device_peak_bytes"] <= 8 << 20
    assert torch.isfinite(loss)
    assert rt.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)
    rt.close()
