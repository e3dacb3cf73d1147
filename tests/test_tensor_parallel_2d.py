"""Composition on one 4-rank DeviceMesh from the library's pieces (what the stack does):
:func:`build_mesh` + :func:`apply_model_parallel`, gradients reduced by :class:`GradSync`, the global
norm from its squares — TP=2 (+SP) x DP=2, CP=2 x DP=2, and EP=2 x CP=2 on ``gpt2-moe``, each with
the losses and final parameters of the single-device model trained on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.techniques.mesh import apply_model_parallel, build_mesh
from scaletrain.testing import run_distributed

GPT = ("gpt2-tiny", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
MOE = ("gpt2-moe", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, n_experts=4, top_k=2,
                        capacity_factor=2.0, moe_every=2, aux_loss_coef=0.1))
CASES = {
    "tp2_sp_dp2": (GPT, dict(tp=2, sequence_parallel=True)),
    "cp2_dp2": (GPT, dict(cp=2)),
    "ep2_cp2": (MOE, dict(ep=2, cp=2)),
}
DP_BATCH, SEQ, STEPS = 2, 32, 2  # samples per data-parallel rank
CLIP = 0.5  # below the gradient norms here, so clipping acts (and must use the global norm)


def build(spec) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.get(spec[0], **spec[1])


def global_batches(dp: int):
    g = torch.Generator().manual_seed(1)
    n = DP_BATCH * dp
    return [(torch.randint(0, 256, (n, SEQ), generator=g), torch.randint(0, 256, (n, SEQ), generator=g))
            for _ in range(STEPS)]


def optimizer(m):
    return torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)


def reference(spec, dp: int):
    m = build(spec)
    opt = optimizer(m)
    losses = []
    for x, y in global_batches(dp):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        if hasattr(m, "aux_loss"):
            loss = loss + m.aux_loss()
        loss.backward()
        assert float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)) > CLIP  # clipping acts
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.clone() for k, v in m.state_dict().items()}


def _train(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from scaletrain.measure.comm import CommCounter

    # the traffic counter must see sub-groups' sizes (c10d ops carry them boxed)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    with CommCounter() as comm:
        dist.all_gather_single(torch.empty(4), torch.ones(2), group=groups[rank // 2])
        dist.all_reduce(torch.ones(3), group=groups[rank // 2])
    out: dict = {"comm": [(r.kind, r.group_size, r.wire_bytes) for r in comm.records]}
    from scaletrain.techniques.data_parallel.zero import GradSync
    from scaletrain.techniques.experts import is_expert_param

    for name, (spec, par) in CASES.items():
        m = build(spec)
        mp = build_mesh(world=world, **par)
        apply_model_parallel(m, mp)
        groups = mp.sync_groups()
        sync = GradSync([(n, p, "expert" if is_expert_param(p) else "dense", mp.replicas(p))
                         for n, p in m.named_parameters()], groups, stage=0, device=torch.device("cpu"))
        opt = optimizer(m)
        losses = []
        for x, y in global_batches(mp.dp):
            sl = slice(mp.dp_rank * DP_BATCH, (mp.dp_rank + 1) * DP_BATCH)
            x, y = mp.shard_batch(x[sl], y[sl])
            sync.begin_micro_batch(last=True)
            with mp.loss_context():
                loss = mp.loss(m, m(x), y)
                loss.backward()
            sync.end_micro_batch(last=True)
            sync.prepare_step()
            sq = sync.square_norm()
            dist.all_reduce(sq)
            sync.scale_grads(CLIP / (float(sq.sqrt()) + 1e-6))
            for e in sync.entries:  # the optimizer below steps the parameters: hand the clipped grads back
                if e.param.grad is not None:
                    local = e.param.grad.to_local() if hasattr(e.param.grad, "to_local") else e.param.grad
                    local.copy_(e.proxy.grad.view_as(local))
            ls = torch.tensor(float(loss.detach().to_local() if hasattr(loss, "to_local") else loss.detach()),
                              dtype=torch.float64)
            dist.all_reduce(ls, group=mp.dense_group)
            losses.append(float(ls) / mp.dense_size)
            opt.step()
            opt.zero_grad()
        state = {}
        full = {n: mp.globalize(m, n, p, p.to_local() if hasattr(p, "to_local") else p.detach())
                for n, p in m.named_parameters()}
        for k, v in m.state_dict().items():
            state[k] = full.get(k, v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        state["head.lm_head.weight"] = state["embed.wte.weight"]
        sync.close()
        out[name] = (losses, state)
    return out


@pytest.mark.slow
def test_intralayer_compositions_match_single_device():
    res = run_distributed(_train, 4)
    for out in res:  # ring model on groups of 2: all-gather (n-1)/n of 16 B, all-reduce 2(n-1)/n of 12 B
        assert out["comm"] == [("all_gather", 2, 8.0), ("all_reduce", 2, 12.0)]
    for name, (spec, par) in CASES.items():
        ref_losses, ref_state = reference(spec, 4 // (par.get("tp", 1) * par.get("cp", 1)))
        for r, out in enumerate(res):
            losses, state = out[name]
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (name, r, losses, ref_losses)
            for k, v in ref_state.items():
                assert float((state[k] - v).norm() / v.norm().clamp_min(1e-30)) <= 1e-5, (name, r, k)


def test_bad_layouts_are_user_errors():
    from scaletrain.errors import UserError

    with pytest.raises(UserError, match="must divide"):
        build_mesh(tp=3, world=4)
    with pytest.raises(UserError, match="must divide the data-parallel size"):
        build_mesh(ep=4, tp=2, world=4)
