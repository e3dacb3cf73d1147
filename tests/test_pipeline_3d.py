"""Pipelines composed with tensor parallelism, ZeRO-3 and a mixture of experts, against one process.

* no processes: the compatibility table runs pp × tp × zero=3 and pp × tp on the MoE model, and Chimera × zero=3
  on a model without tied parameters (refused, one line, on GPT-2's tied embedding);
* gloo, 8 processes (slow), gpt2-moe (a dense layer, then a MoE layer), 1f1b, ``parallel.dp=2 parallel.pp=2
  parallel.tp=2``: with ``parallel.zero=3`` (FSDP2 over the dp dimension of the world mesh on stages whose
  parameters are TP DTensors) and without ZeRO (the MoE layer's replicated DTensors stepped beside the
  attention's sharded ones), each gives one process's losses, clipped gradient norm, final parameters
  (gathered to the single-process layout) and SGD momentum (fp32, 1e-5 / 1e-4), and every rank's collectives
  equal the runtime's prediction and the planner's cost face to the byte; the ZeRO-3 layout resumes a one-process
  checkpoint to its losses;
* gloo, 4 processes (slow), Chimera at dp=2: ``parallel.zero=3`` on the untied ``mlp`` model (each stage's two
  replicas FSDP2-sharded, their shards summed at the update), and ``parallel.ep=2`` on gpt2-moe with zero 0 and 1;
  1f1b with ``parallel.ep=2`` and a remat schedule recomputing the MoE layer: the same parity; PipeDream with
  ``parallel.ep=2`` = PipeDream without EP.
"""

from __future__ import annotations

import pytest
import torch

from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config

# SGD for parameter parity (Adam amplifies round-off-level gradients); clipping on (the norm is compared)
TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=1", "train.log_every=1",
        "optim.warmup_steps=1", "train.steps=2", "train.eval_every=0", "train.progress=off", "optim.name=sgd",
        "optim.lr=0.5", "optim.momentum=0.9", "optim.grad_clip=0.1"]
PIPE = ["parallel.pp=2", "parallel.tp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"]
ZERO3 = ["parallel.dp=2", "parallel.zero=3"]
MOE = ["model.name=gpt2-moe", "model.overrides.n_experts=4"]


def _quiet(s: str) -> None:
    pass


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _run(flags: list[str], out_dir: str | None = None, resume: str | None = None) -> dict:
    """Train; ``out_dir``: write a checkpoint each step there; ``resume``: first load the step-1 checkpoint
    under it (single-process layout, sharded back onto this layout) and report only the losses after it."""
    from pathlib import Path

    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, flags + (["train.checkpoint_every=1"] if out_dir else [])), out_dir, log=_quiet)
    if resume:
        t.load_state_dict(ckpt.load(ckpt.at_step(Path(resume) / "checkpoints", 1)))
        losses = t.fit().losses
        t.close()
        return {"resumed": losses}
    res = t.fit()
    out = {"losses": res.losses, "norm": t._grad_norm, "comm": t.comm_bytes}
    if t.parallel.name == "pipeline":
        out.update(model=t.parallel.model_state_dict(), opt=t.parallel.optimizer_state_dict(t.optimizer),
                   how=t.parallel.describe(), metrics=t.parallel.metrics())
    else:
        out.update(model={k: v.clone() for k, v in t.model.state_dict().items()}, opt=t.optimizer.state_dict())
    t.close()
    return out


def _worker(rank: int, world: int, runs: list[list[str]], resume: str | None = None) -> list[dict]:
    return [_run(flags) for flags in runs] + ([_run(runs[0], resume=resume)] if resume else [])


def _check(results: list[dict], one: dict, how: str, flags: list[str]) -> None:
    """Parity with one process, and every rank's collectives = the runtime's prediction = the planner's cost
    face (:func:`~scaletrain.techniques.plan_cost.plan_costs`), to the byte."""
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import plan_costs

    cfg = load_config(None, flags)
    p = cfg.parallel
    costs = plan_costs(Plan.from_config(cfg), models.get(cfg.model.name, device="meta", **cfg.model.overrides),
                       world=len(results), global_batch=8, seq=16)
    assert one["norm"] > 0.1  # the clipping scales the gradients
    for rank, r in enumerate(results):
        assert how in r["how"], r["how"]
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5), rank
        assert r["norm"] == pytest.approx(one["norm"], rel=1e-5), rank
        assert r["model"].keys() == one["model"].keys()
        worst = max(_rel(r["model"][k], v) for k, v in one["model"].items() if v.is_floating_point())
        assert worst <= 1e-5, (rank, worst)
        assert r["opt"]["state"].keys() == one["opt"]["state"].keys()
        for i, st in one["opt"]["state"].items():  # the consolidated momentum, in the one-process numbering
            assert _rel(r["opt"]["state"][i]["momentum_buffer"], st["momentum_buffer"]) <= 1e-4, (rank, i)
        m = r["metrics"]
        if p.tp > 1:
            assert m["comm_bytes_intra_layer"] == pytest.approx(m["predicted_comm_bytes_intra_layer"], rel=1e-9)
        assert r["comm"] == pytest.approx(m["predicted_comm_bytes"], rel=1e-12), (rank, r["comm"], m)
        pipe = rank // (max(p.dp, 1) * p.tp)  # the world mesh: global rank (pipeline rank · dp + d) · tp + t
        assert r["comm"] == pytest.approx(costs[pipe].comm_bytes, rel=1e-12), (rank, r["comm"], costs[pipe])


# --------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("extra, world", [(ZERO3, 8), (MOE, 4)])
def test_table_runs_the_compositions(extra, world):
    from scaletrain import models
    from scaletrain.techniques import compat

    cfg = load_config(None, TINY + PIPE + extra)
    model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
    compat.check_config(cfg, model, world=world, microbatches=4)


# --------------------------------------------------------------------------- processes
@pytest.mark.slow
def test_dp2_pp2_tp2_moe_with_zero3_and_without_equals_one_process(tmp_path):
    """One start of 8 processes, two runs on gpt2-moe (a dense layer, then a MoE layer): FSDP2 over the dp
    dimension of the world mesh on TP-sharded stages; then the same layout without ZeRO, where the stage
    optimizer steps the MoE layer's replicated DTensors beside the attention's sharded ones. Then the ZeRO-3 layout
    resumes the one-process step-1 checkpoint (model and momentum sharded back over dp x tp, the fused QKV rows
    permuted) and continues with its losses."""
    one_dir = tmp_path / "one"
    one = _run(TINY + MOE + ["train.micro_batch=1"], str(one_dir))
    runs = [TINY + PIPE + ZERO3 + MOE, TINY + PIPE + MOE + ["parallel.dp=2"]]
    results = run_distributed(_worker, 8, runs, str(one_dir), timeout_s=400)
    for i, flags in enumerate(runs):
        _check([r[i] for r in results], one, "pipeline 1f1b over 2 stages x 2 dp x 2 tp, 4 micro-batches", flags)
    for rank, r in enumerate(results):
        assert r[-1]["resumed"] == pytest.approx(one["losses"][1:], rel=1e-5), rank


CHIMERA = ["model.name=mlp", "data.name=digits", "train.global_batch=8", "train.eval_batches=1", "train.log_every=1",
           "optim.warmup_steps=1", "train.steps=2", "train.eval_every=0", "train.progress=off", "optim.name=sgd",
           "optim.lr=0.5", "optim.momentum=0.9", "optim.grad_clip=0.1"]


def test_table_refuses_chimera_zero3_with_tied_parameters_only():
    from scaletrain import models
    from scaletrain.errors import ConfigError
    from scaletrain.techniques import compat

    pipe = ["parallel.pp=2", "parallel.schedule=chimera", "parallel.microbatches=4", "parallel.zero=3"]
    for flags, tied in ((CHIMERA + pipe, False), (TINY + pipe, True)):
        cfg = load_config(None, flags)
        model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
        if not tied:
            compat.check_config(cfg, model, world=4, microbatches=4)
            continue
        with pytest.raises(ConfigError, match="tied parameters") as e:
            compat.check_config(cfg, model, world=4, microbatches=4)
        assert "allowed: parallel.zero=0 or 1 with chimera" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_dp2_pp2_chimera_zero3_and_ep_with_chimera_remat_or_pipedream():
    """One start of 4 processes at pp=2 x dp=2, four runs: Chimera (each stage on two ranks) on ``mlp`` with ZeRO-3 —
    each replica FSDP2-sharded over its dp group, the two replicas' reduce-scattered shards summed at the update
    (GRAD_SYNC deferred); Chimera on gpt2-moe with ep=2, zero 0 then 1 — both replicas of a stage route through the
    same EP group in the same action order and hold the same expert slice, so GRAD_SYNC sums them like any tensor;
    1f1b with ep=2 and a remat schedule that recomputes the MoE layer — its replayed all-to-alls meet in the
    same action order on the EP group (and are priced: traffic = prediction = cost face); and PipeDream's stream
    with ep=2 gives the stream's losses and parameters without EP (its updates inside the stream meet no EP
    collective: expert gradients are summed over their expert-data-parallel group like any other)."""
    pipe = ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4"]
    chimera = pipe + ["parallel.schedule=chimera"]
    ep = TINY + MOE + chimera + ["parallel.ep=2"]
    remat = TINY + MOE + pipe + ["parallel.ep=2", "parallel.schedule=1f1b", "memory.remat.method=optimal",
                                 "memory.remat.budget=100000"]  # stage 1: "(0) 1", the MoE layer recomputed
    stream = TINY + MOE + pipe + ["parallel.schedule=pipedream"]  # weight stashing: not one process's losses
    runs = [CHIMERA + chimera + ["parallel.zero=3"], ep, ep + ["parallel.zero=1"], remat, stream,
            stream + ["parallel.ep=2"]]
    ones = [_run(CHIMERA + ["train.micro_batch=1"]), _run(TINY + MOE + ["train.micro_batch=1"])]
    results = run_distributed(_worker, 4, runs, timeout_s=300)
    for i, flags in enumerate(runs[:4]):
        how = f"pipeline {'1f1b' if flags is remat else 'chimera'} over 2 stages x 2 dp"
        _check([r[i] for r in results], ones[min(i, 1)], how, flags)
    for rank, r in enumerate(results):  # the asynchronous stream (an update per micro-batch) with ep=2 = without
        a, b = r[4], r[5]
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5) and b["norm"] == pytest.approx(a["norm"], rel=1e-5)
        assert max(_rel(b["model"][k], v) for k, v in a["model"].items()) <= 1e-5, rank

