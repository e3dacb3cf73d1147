"""The one cost interface against measured runs: :func:`scaletrain.techniques.plan_cost.plan_costs`
(what ``scaletrain estimate`` with plan flags reports) predicts the bytes every rank receives per step
to the byte, and each rank's peak (the tracker's, ``train.measure_memory``) within the stated margin."""

from __future__ import annotations

import pytest

from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config

BASE = ["model.overrides.n_layer=4", "model.overrides.n_embd=64", "model.overrides.n_head=4", "data.seq_len=64",
        "train.global_batch=16", "train.steps=3", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
        "train.progress=off", "train.measure_memory=true"]
MARGIN = 0.10
"""Peak prediction's measured error on these runs (2026-11-25): +5.9 % (DDP with periodic remat), -4.2 % (ZeRO-2:
the peak at the loss, activations 1.5 MB above the block profile's), -5.0 % (ZeRO-3; -9.6 % before FSDP2's
backward was priced as the current block whole, the previous one prefetched, the current block's unsharded
gradient and gloo's copy of it), -7 % / -0.01 % (pp x tp x dp x ZeRO-1 with remat, pipeline ranks 0 / 1; rank 0's peak is
inside a recomputed block, whose TP all-reduce buffers the stage profile does not hold). On gpt2-mini with
the done-when plan both pipeline ranks are within 0.001 % (benchmarks/compose/done_when.py)."""


def _run(rank: int, world: int, runs: list[list[str]]) -> list:
    from scaletrain.train.trainer import Trainer

    out = []
    for extra in runs:
        t = Trainer(load_config(None, BASE + extra), None, log=lambda s: None)
        t.fit()
        out.append((t.comm_bytes, t.tracked))
        t.close()
    return out


def _predict(extra: list[str], world: int):
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import plan_costs

    cfg = load_config(None, BASE + extra)
    model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
    return plan_costs(Plan.from_config(cfg), model, world=world, global_batch=cfg.train.global_batch,
                      seq=cfg.data.seq_len, micro_batch=cfg.train.micro_batch)


@pytest.mark.slow
def test_data_parallel_plans_predicted():
    runs = [["parallel.zero=0", "memory.remat.method=periodic"], ["parallel.zero=0"],
            ["parallel.zero=0", "train.micro_batch=4"], ["parallel.zero=2"], ["parallel.zero=3"]]
    # torch DDP (plan_cost._bucket_views): +7.1 % here without accumulation, +4.9 % with it (-0.05 % and -5.1 %
    # before its bucket rules); on the measured benchmark's models the same rules took DDP from -7.5..-15.4 % to
    # within 1.7 % (benchmarks/planner/README.md, quiet run of 2026-11-28): the simulator's one backward piece
    # per stage cannot tell when each bucket's first gradient arrives, so both stay under MARGIN
    margins = [MARGIN] * len(runs)
    res = run_distributed(_run, 2, runs)
    for i, extra in enumerate(runs):
        (cost,) = _predict(extra, 2)
        comm, tracked = res[0][i]
        assert comm == cost.comm_bytes, (extra, comm, cost.comm_bytes)
        assert tracked["tracked_peak_bytes_max"] == pytest.approx(cost.peak_bytes, rel=margins[i]), (extra, tracked, cost)


@pytest.mark.slow
def test_pp_tp_dp_zero1_remat_predicted():
    """Megatron's 3-D with recompute on 8 processes: every pipeline rank's traffic to the byte (loss,
    tied embedding, ZeRO-1 buckets, TP collectives with the stages' recomputations) and its peak."""
    extra = ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "parallel.microbatches=4",
             "memory.remat.method=optimal", "memory.remat.budget=800KiB"]
    costs = _predict(extra, 8)
    res = run_distributed(_run, 8, [extra], timeout_s=300)
    for rank, ((comm, tracked),) in enumerate(res):
        pipe_rank = rank // 4  # the world mesh: global rank (p D + d) T + t, D = T = 2
        if rank == 0:
            for r, c in enumerate(costs):
                assert tracked["tracked_peak_bytes_ranks"][4 * r] == pytest.approx(c.peak_bytes, rel=MARGIN), (r, c)
        assert comm == costs[pipe_rank].comm_bytes, (rank, comm, costs[pipe_rank].comm_bytes)


def test_tp_remat_traffic_replays_the_recomputed_forwards():
    """Without a pipeline, a TP plan with checkpointed blocks receives each recomputed forward's TP bytes
    again in the backward — what the runtime predicts (and its ledger measured: 1,771,016 B per step on
    gpt2-tiny tp=2 with every block checkpointed, 2026-11-26)."""
    from scaletrain import models
    from scaletrain.techniques.cost import local_param_counts, mesh_predictions
    from scaletrain.techniques.cost import MeshShape

    plain = _predict(["parallel.tp=2"], world=2)[0].comm_bytes
    remat = _predict(["parallel.tp=2", "memory.remat.blocks=all"], world=2)[0].comm_bytes
    cfg = load_config(None, BASE + ["parallel.tp=2", "memory.remat.blocks=all"])
    from scaletrain.plan import Plan

    model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
    from scaletrain.chain import to_chain

    n = len(to_chain(model).blocks)  # memory.remat.blocks=all: every Chain block recomputed once
    runtime = mesh_predictions(model.config, MeshShape(Plan.from_config(cfg)), stage=0, micro_batch=16, accum=1,
                               seq=64, counts=local_param_counts(model, tp=2, ep=1), grad_clip=True, world=2,
                               recomputes=[1] * n)["predicted_comm_bytes"]
    assert remat > plain and remat == runtime


def test_zero1_traffic_counts_the_padding_rows():
    """ZeRO-1/2 shard every tensor by rows padded to dp whole chunks, and the padding travels: hf:bert's
    odd vocabulary (embedding rows, decoder bias) adds 129 elements at dp=2. The ledger measured
    3,505,680 bytes per step on rank 0 (2 processes, micro-batch 4, seq 64; benchmarks/planner/chosen_plans.py)."""
    import math

    from scaletrain.plan import Plan
    from scaletrain.planner.api import target
    from scaletrain.techniques.data_parallel.cost import comm_bytes_per_step
    from scaletrain.techniques.plan_cost import plan_costs

    model = target("hf:bert").model
    rows = [(p.shape[0] if p.ndim else 1, p.numel()) for p in model.parameters()]
    assert any(r % 2 for r, _ in rows)  # something to pad
    padded = sum(math.ceil(r / 2) * 2 * (n // r) for r, n in rows)
    assert padded > sum(n for _, n in rows)
    got = plan_costs(Plan(dp=2, zero=1, micro_batch=4), model, world=2, global_batch=8, seq=64, micro_batch=4)
    norm = 2 * (2 - 1) / 2 * 8  # the fp64 gradient-norm all-reduce
    assert got[0].comm_bytes == comm_bytes_per_step(padded, 1, 2) + norm == 3505680


@pytest.mark.slow
def test_zero1_on_one_data_parallel_rank_holds_the_buckets():
    """ZeRO-1 with pp=2 on 2 processes has one data-parallel rank, yet the stages' GradSync still makes
    every bucket's reduce-scatter input and output before the step (no collective: the output is a copy):
    two stage weights beside the states, which the prediction counts (vgg-mini in the measured benchmark:
    7,399,496 B tracked, 6,209,944 predicted without them, 7,399,488 with them)."""
    small = ["data.seq_len=8", "train.global_batch=4"]  # weights, not activations, decide the peaks
    extra = ["parallel.pp=2", "parallel.zero=1", "parallel.microbatches=2", *small]
    costs = _predict(extra, 2)
    plain = _predict(["parallel.pp=2", "parallel.microbatches=2", *small], 2)
    ((comm, tracked),), _ = run_distributed(_run, 2, [extra])
    for r, c in enumerate(costs):
        assert tracked["tracked_peak_bytes_ranks"][r] == pytest.approx(c.peak_bytes, rel=0.01), (r, tracked, c)
    assert all(c.peak_bytes > p.peak_bytes for c, p in zip(costs, plain))  # the buckets decide both peaks


def _run_args(rank: int, world: int, args: list[str]) -> dict:
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, args), None, log=lambda s: None)
    t.fit()
    t.close()
    return t.tracked


@pytest.mark.slow
def test_zero2_backward_holds_the_later_blocks_gradients():
    """ZeRO-2's GradSync launches a bucket once all its gradients exist: during the backward the gradients of
    the blocks already passed are live beside the activations of the ones to come. vgg-mini (the FC head's
    gradients first, the convolutions' activations last), dp=2, one 16-sample micro-batch: the tracked peak
    is the prediction; without the rule it was 6,311,464 B (-5.7 %; -9.5 % on the measured benchmark's plan)."""
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import plan_costs

    args = ["model.name=vgg-mini", "train.global_batch=32", "train.steps=2", "train.eval_every=0",
            "train.eval_batches=1", "train.log_every=1", "train.progress=off", "train.measure_memory=true",
            "parallel.zero=2"]
    (cost,) = plan_costs(Plan(dp=2, zero=2), models.get("vgg-mini", device="meta"), world=2, global_batch=32, seq=0)
    tracked = run_distributed(_run_args, 2, args)[0]
    assert tracked["tracked_peak_bytes_max"] == pytest.approx(cost.peak_bytes, rel=0.01), (tracked, cost)
    assert tracked["tracked_peak_breakdown"]["gradients"] > cost.bytes["grads"]  # full gradients, not shards alone


@pytest.mark.slow
def test_zero3_per_block_groups_priced_block_by_block():
    """ZeRO-3 with one FSDP2 group per block (fp32): at a block's backward FSDP2 holds the block whole, the
    previous unit's all-gather buffer (prefetch), the next unit's reduce-scatter input (held until the next
    reduce-scatter) and the shards made so far, beside that block's activations (fsdp.block_extras).
    vgg-mini, dp=2, one 32-sample micro-batch: the tracked peak is the prediction within 1 % (the static
    two units and two gradients over the whole backward's activations priced it +5.1 %)."""
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import plan_costs

    args = ["model.name=vgg-mini", "train.global_batch=64", "train.steps=2", "train.eval_every=0",
            "train.eval_batches=1", "train.log_every=1", "train.progress=off", "train.measure_memory=true",
            "parallel.zero=3", "parallel.fsdp_group=block"]
    plan = Plan(dp=2, zero=3, fsdp_group="block")
    (cost,) = plan_costs(plan, models.get("vgg-mini", device="meta"), world=2, global_batch=64, seq=0)
    tracked = run_distributed(_run_args, 2, args)[0]
    assert tracked["tracked_peak_bytes_max"] == pytest.approx(cost.peak_bytes, rel=0.01), (tracked, cost)
