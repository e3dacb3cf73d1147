"""Pipelines on the mixture-of-experts model, and expert parallelism inside the stages
(:mod:`scaletrain.techniques.pipeline.experts`).

* no processes: the MoE forward has static shapes (fake and meta tensors: the partitioner and the stage
  estimate run it) and its dispatch / combine stay bitwise the masked gather; the compatibility table runs
  pp (and pp × tp) on the MoE model and pp × ep with zero 0 or 1 (any schedule, remat), and refuses the
  rest in one line; the cost face keeps 1/ep of a stage's experts and prices their all-to-alls;
* gloo (slow): pp=2 × dp=2 × ep=2 × 1f1b with zero 0 and 1 (4 processes) and pp=2 × zb1p (2 processes)
  through the Trainer equal one process run with the same micro-batches (losses with each stage's load-balancing term,
  gradient norms, final parameters, the consolidated momentum; fp32 relative 1e-5); every rank's traffic
  equals the runtime's and the cost face's prediction to the byte, its peak the cost face's within the
  margin of :mod:`test_plan_cost`; the sharded checkpoint (expert slices) resumes to the same losses.
"""

from __future__ import annotations


import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config

from pipeline_worker import train_and_resume  # tests/: the spawned ranks import it by name

# 4 blocks (embed, dense layer, MoE layer, head): stage 0 = embed + dense layer, stage 1 = MoE layer + head
TINY = ["model.name=gpt2-moe", "model.overrides.n_layer=2", "model.overrides.n_embd=32", "model.overrides.n_head=2",
        "model.overrides.capacity_factor=1.0", "model.overrides.aux_loss_coef=0.1", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=1", "train.log_every=1",
        "optim.warmup_steps=1", "train.steps=3", "train.eval_every=0", "train.progress=off", "optim.name=sgd",
        "optim.lr=0.5", "optim.momentum=0.9"]  # SGD for parameter parity (see test_pipeline_train)
# capacity_factor 1.0 < n_experts / top_k = 2: some choices are dropped, so capacity is exercised
EP = ["parallel.pp=2", "parallel.ep=2", "parallel.schedule=1f1b", "parallel.microbatches=4"]
MARGIN = 0.10
"""As test_plan_cost's."""


def _plan(*extra: str):
    from scaletrain.plan import Plan

    return Plan.from_config(load_config(None, TINY + list(extra)))


def _check(*extra: str) -> None:
    from scaletrain.techniques import compat

    plan = _plan(*EP, *extra)
    compat.check(plan.resolved(4), compat.Facts(world=4, moe=True, n_experts=4, n_blocks=4, microbatches=4))


def test_moe_forward_has_static_shapes_and_stays_the_masked_gather():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain.models.moe import GPT2MoE, GPT2MoEConfig, assign_slots, capacity, combine, dispatch

    cfg = GPT2MoEConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=8, capacity_factor=0.5)
    with FakeTensorMode():
        m = GPT2MoE(cfg)
        assert m(torch.randint(0, 40, (2, 8))).shape == (2, 8, 40)
        assert m.aux_loss().shape == ()
    with torch.device("meta"):
        GPT2MoE(cfg)(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    m = GPT2MoE(cfg)
    m(torch.randint(0, 40, (2, 8))).sum().backward()  # the last forward's loss is a non-leaf tensor ...
    import copy

    # ... not copied
    assert copy.deepcopy(m).moe_layers()[0].aux_loss is None and m.moe_layers()[0].aux_loss is not None
    # dispatch / combine against the masked gather they replace (capacity 0.5: half the choices dropped)
    torch.manual_seed(0)
    T, E, k, h = 12, 4, 2, 5
    x, idx = torch.randn(T, h), torch.randint(0, E, (T, k))
    gates = torch.rand(T, k)
    cap = capacity(T, E, k, 0.5)
    slots = assign_slots(idx, E, cap)
    keep = slots >= 0
    assert 0 < int(keep.sum()) < T * k
    tok = torch.arange(T).unsqueeze(1).expand(T, k)[keep]
    ref = torch.zeros(E * cap, h).index_add(0, idx[keep] * cap + slots[keep], x[tok]).view(E, cap, h)
    buf = dispatch(x, idx, slots, E, cap)
    assert torch.equal(buf, ref)
    vals = buf.reshape(E * cap, h)[idx[keep] * cap + slots[keep]] * gates[keep].unsqueeze(1)
    assert torch.equal(combine(buf, idx, slots, gates, T), torch.zeros(T, h).index_add(0, tok, vals))


@pytest.mark.parametrize("extra", [[], ["parallel.schedule=zb1p"], ["parallel.schedule=interleaved"],
                                   ["parallel.zero=1"], ["parallel.ep=1", "train.precision=bf16"],
                                   ["parallel.schedule=chimera"], ["parallel.ep=1", "parallel.tp=2"],
                                   ["memory.remat.method=periodic"], ["parallel.schedule=pipedream"]])
def test_table_runs_pp_on_the_moe_model_and_pp_x_ep(extra):
    _check(*extra)


@pytest.mark.parametrize("extra, needle", [
    (["parallel.zero=3"], "zero=3"),
])
def test_table_refuses_what_remains_in_one_line(extra, needle):
    with pytest.raises(ConfigError) as e:
        _check(*extra)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and "allowed:" in msg, msg


def test_cost_face_keeps_one_ep_th_of_the_experts_and_prices_their_all_to_alls():
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques.experts import ep_comm_bytes_per_step
    from scaletrain.techniques.plan_cost import plan_costs

    cfg = load_config(None, TINY)
    model = models.get("gpt2-moe", device="meta", **cfg.model.overrides)
    mc = model.config
    one = plan_costs(Plan.from_config(load_config(None, TINY + EP + ["parallel.ep=1"])), model, world=4,
                     global_batch=8, seq=16)
    two = plan_costs(Plan.from_config(load_config(None, TINY + EP)), model, world=4, global_batch=8, seq=16)
    experts = sum(p.numel() for p in model.h[1].mlp.experts.parameters()) * 4  # the MoE layer, on stage 1
    assert one[0].bytes["params"] == two[0].bytes["params"]  # stage 0 holds no experts
    assert one[1].bytes["params"] - two[1].bytes["params"] == pytest.approx(experts / 2, rel=1e-12)
    assert one[1].bytes["grads"] - two[1].bytes["grads"] == pytest.approx(experts / 2, rel=1e-12)
    assert one[0].comm_bytes == two[0].comm_bytes
    # stage 1: its expert gradients need no data-parallel all-reduce (dp = ep), its squares one over ep,
    # and 4 micro-batches x 4 all-to-alls of the [E, cap, h] buffer, half of which leaves the rank
    a2a = 4 * ep_comm_bytes_per_step(1, 16, mc.n_embd, mc.n_experts, mc.top_k, mc.capacity_factor, 2,
                                     shared_aux=False)["wire_bytes"]
    assert a2a == 4 * 4 * mc.n_experts * 8 * mc.n_embd * 4 / 2  # cap = ceil(1.0 * 2 * 16 / 4) = 8
    assert two[1].comm_bytes == pytest.approx(one[1].comm_bytes - experts + 8.0 + a2a, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("world, pipe, how", [
    (4, EP, "pipeline 1f1b over 2 stages x 2 dp, 4 micro-batches, block bounds [0, 2, 4]"),
    (4, EP + ["parallel.zero=1"], "pipeline 1f1b over 2 stages x 2 dp, 4 micro-batches, block bounds [0, 2, 4]"),
    (2, ["parallel.pp=2", "parallel.schedule=zb1p", "parallel.microbatches=8"],
     "pipeline zb1p over 2 stages x 1 dp, 8 micro-batches, block bounds [0, 2, 4]"),
])
def test_pipeline_on_moe_equals_one_process_and_its_prediction(tmp_path, world, pipe, how):
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import plan_costs
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + ["train.micro_batch=1"]), None, log=lambda s: None)
    one = t.fit()
    one_norm, one_params, one_opt = t._grad_norm, {k: v.clone() for k, v in t.model.state_dict().items()}, \
        t.optimizer.state_dict()
    t.close()
    cfg = load_config(None, TINY + pipe)
    costs = plan_costs(Plan.from_config(cfg), models.get("gpt2-moe", device="meta", **cfg.model.overrides),
                       world=world, global_batch=8, seq=16, optimizer_kw={"momentum": 0.9, "weight_decay": 0.1})
    results = run_distributed(train_and_resume, world, str(tmp_path / "pp"), TINY + pipe, timeout_s=240)
    dp = world // 2
    for rank, r in enumerate(results):
        assert r["how"] == how, r["how"]
        assert r["losses"] == pytest.approx(one.losses, rel=1e-5), rank
        assert r["norm"] == pytest.approx(one_norm, rel=1e-5), rank
        assert r["resumed"] == pytest.approx(one.losses[2:], rel=1e-5), rank
        worst = max(float((r["model"][k] - v).abs().max() / v.abs().max().clamp_min(1e-12))
                    for k, v in one_params.items())
        assert worst <= 1e-5, (rank, worst)
        for i, st in one_opt["state"].items():  # the consolidated momentum (whole experts), one-process numbering
            a, b = r["opt"]["state"][i]["momentum_buffer"], st["momentum_buffer"]
            assert float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) <= 1e-4, (rank, i)
        pipe_rank = rank // dp  # global rank = pipeline rank x dp + dp rank
        assert r["comm"] == r["predicted"] == costs[pipe_rank].comm_bytes, (rank, r["comm"], r["predicted"],
                                                                           costs[pipe_rank])
        peak = r["tracked"]["tracked_peak_bytes_ranks"][rank]
        assert peak == pytest.approx(costs[pipe_rank].peak_bytes, rel=MARGIN), (rank, peak, costs[pipe_rank])


def test_cost_face_of_data_parallel_moe_all_reduces_the_experts_too():
    """ep = 1 on several processes: the experts are replicated, so DDP's all-reduce carries them (measured
    402,240 B per step at dp=4 = 2·3/4 of every gradient byte; the cost face used to leave the experts out)."""
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import plan_costs

    cfg = load_config(None, TINY)
    model = models.get("gpt2-moe", device="meta", **cfg.model.overrides)
    every = sum(p.numel() for p in model.parameters()) * 4
    c = plan_costs(Plan.from_config(cfg), model, world=4, global_batch=8, seq=16)[0]
    assert c.comm_bytes == 2 * 3 / 4 * every == 402240.0
