"""Mixture of experts (routing, capacity, load-balancing loss) and expert parallelism: EP = 2
parity with the single-device ``gpt2-moe`` on the global batch (capacity large enough to drop
nothing), and the all-to-all traffic against the cost face."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.models import moe
from scaletrain.techniques import experts as ep_mod
from scaletrain.testing import run_distributed

# capacity_factor = E / k: capacity >= tokens, so no choice is ever dropped
SHAPE = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, n_experts=4, top_k=2,
             capacity_factor=2.0, moe_every=1, aux_loss_coef=0.1)
BATCH, SEQ, STEPS = 2, 32, 3  # per EP rank


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.get("gpt2-moe", **SHAPE)


def global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = BATCH * world
    return [(torch.randint(0, 256, (n, SEQ), generator=g), torch.randint(0, 256, (n, SEQ), generator=g))
            for _ in range(STEPS)]


def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)


def loss_of(m, x, y) -> torch.Tensor:
    return F.cross_entropy(m(x).flatten(0, 1), y.flatten()) + m.aux_loss()


def reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    m = build()
    opt = optimizer(m)
    losses = []
    for x, y in global_batches(world):
        loss = loss_of(m, x, y)
        loss.backward()
        assert all(layer.dropped == 0 for layer in m.moe_layers())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.clone() for k, v in m.state_dict().items()}


def _train_ep(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.measure.comm import CommCounter

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    m = ep_mod.apply_expert_parallel(build(), mesh["ep"])
    out: dict = {"losses": [], "local_numel": sum(p.numel() for p in m.parameters())}
    opt = optimizer(m)
    for x, y in global_batches(world):
        x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        with CommCounter() as comm:
            loss = loss_of(m, x, y)
            loss.backward()
        out["comm"] = comm.summary()
        out["dropped"] = sum(layer.dropped for layer in m.moe_layers())
        ep_mod.reduce_gradients(m, mesh.get_group())
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(float(total) / world)
        opt.step()
        opt.zero_grad()
    out["state"] = ep_mod.gather_expert_state(m, mesh["ep"])
    return out


# --------------------------------------------------------------------------- routing


def test_routing_capacity_and_priority():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # 4 tokens, top-2, E = 4
    slots = moe.assign_slots(idx, 4, cap=3)
    # first choices take slots first: expert 0 gets tokens 0, 1, 2 (slots 0-2) -> token 3's
    # second choice of expert 0 is dropped; expert 1 gets tokens 0 and 2
    assert slots.tolist() == [[0, 0], [1, 0], [2, 1], [0, -1]]
    assert moe.capacity(4, 4, 2, 1.0) == 2 and moe.capacity(5, 4, 2, 1.25) == 4
    # uniform routing gives an auxiliary loss of exactly 1, collapse onto one expert gives E
    f = torch.full((4,), 0.25)
    assert float(moe.switch_aux_loss(f, torch.full((4,), 0.25))) == pytest.approx(1.0)
    assert float(moe.switch_aux_loss(torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.0, 0, 0, 0]))) == 4.0


def test_moe_layer_matches_per_token_loop():
    torch.manual_seed(0)
    m = build()
    layer = m.moe_layers()[0]
    x = torch.randn(2, 5, 64)
    y = layer(x)
    xf = x.reshape(10, 64)
    idx, gates, probs = moe.top_k_route(layer.router(xf), 2)
    e = layer.experts
    want = torch.stack([
        sum(gates[t, j] * (F.gelu(xf[t] @ e.w1[idx[t, j]] + e.b1[idx[t, j]], approximate="tanh")
                           @ e.w2[idx[t, j]] + e.b2[idx[t, j]]) for j in range(2))
        for t in range(10)])
    torch.testing.assert_close(y.reshape(10, 64), want, rtol=1e-5, atol=1e-6)
    assert layer.dropped == 0
    f, p = moe.load_balance_stats(idx, probs, 4)
    assert float(f.sum()) == pytest.approx(1.0) and float(p.sum().detach()) == pytest.approx(1.0)
    torch.testing.assert_close(layer.aux_loss, 4 * (f * p).sum())
    # with a capacity of 1 slot per expert, most choices are dropped and their output is zero
    layer.capacity_factor = 0.01
    z = layer(x)
    assert layer.dropped == 2 * 10 - 4
    assert (z.reshape(10, 64).abs().sum(-1) == 0).sum() >= 10 - 4


# --------------------------------------------------------------------------- expert parallelism


@pytest.mark.slow
def test_expert_parallel_parity():
    world = 2
    ref_losses, ref_state = reference(world)
    res = run_distributed(_train_ep, world)
    full = build()
    cfg = full.config
    for r, out in enumerate(res):
        assert out["dropped"] == 0
        for a, b in zip(out["losses"], ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (r, out["losses"], ref_losses)
        for k, v in ref_state.items():
            assert float((out["state"][k] - v).norm() / v.norm().clamp_min(1e-30)) <= 1e-5, (r, k)
        assert out["local_numel"] == ep_mod.ep_param_elements(full, world)["total"]
        pred = ep_mod.ep_comm_bytes_per_step(len(full.moe_layers()), BATCH * SEQ, cfg.n_embd, cfg.n_experts,
                                            cfg.top_k, cfg.capacity_factor, world)
        for kind in ("all_to_all", "all_reduce"):
            assert out["comm"][kind]["count"] == pred[kind]["count"], (kind, out["comm"])
            assert out["comm"][kind]["payload_bytes"] == pred[kind]["payload_bytes"], (kind, out["comm"])
        assert sum(v["wire_bytes"] for v in out["comm"].values()) == pytest.approx(pred["wire_bytes"])
