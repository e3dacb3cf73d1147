"""Tensor parallelism inside pipeline stages (``parallel.pp`` × ``parallel.tp``, × dp) trains like one process.

* no processes: what TP × PP refuses is a one-line ConfigError naming the key and what is allowed;
  the rank layout (tp innermost) partitions the world;
* gloo, 4 processes (slow): ``parallel.pp=2 parallel.tp=2`` with 1f1b and 4 micro-batches on a
  small gpt2-tiny — the same losses, validation loss, gradient norm (clipping on), final
  parameters (gathered to the single-process layout) and SGD momentum (renumbered, gathered) as
  a one-process Trainer; then a run resumed at step 2 from the one-process checkpoint (model and
  momentum sharded back) continues with the one-process losses; interleaved, zb1p and chimera give
  the same losses and clipped gradient norms; with sequence parallelism (half the point-to-point
  bytes) the same losses and parameters; the TP traffic measured inside each rank's stages
  equals the per-block prediction; bf16 autocast within 1e-2 of one process's bf16;
* gloo, 2 + 4 processes (slow): the asynchronous schedules (pipedream, pipedream-2bw) at pp=2 x
  tp=2 give the pp=2 pipeline's losses;
* gloo, 8 processes (slow): ``parallel.dp=2 parallel.pp=2 parallel.tp=2`` (1f1b), the same parity.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.techniques.pipeline.tensor_parallel import layouts
from scaletrain.testing import run_distributed
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.config import load_config

# SGD for parameter parity (see tests/test_pipeline_train.py: Adam amplifies round-off-level gradients)
TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=32",
        "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=2", "train.log_every=1",
        "optim.warmup_steps=1", "train.steps=4", "train.eval_every=0", "train.progress=off",
        "train.checkpoint_every=2", "optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0.1"]
M = 4
OTHER_SCHEDULES = ("interleaved", "zb1p", "chimera")



def check_config(cfg, microbatches, offload=False):
    """The compatibility table on ``cfg`` with a meta model (world = pp x tp x cp x max(dp, ep))."""
    from scaletrain import models
    from scaletrain.techniques import compat

    if offload:
        cfg.memory.offload.optimizer = "host"
    p = cfg.parallel
    world = p.pp * p.tp * p.cp * max(p.dp, p.ep, 1)
    model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
    compat.check_config(cfg, model, world=world, microbatches=microbatches)

def pp_tp_cfg(*extra: str):
    return load_config(None, TINY + ["parallel.pp=2", "parallel.tp=2", "parallel.schedule=1f1b",
                                     f"parallel.microbatches={M}", *extra])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _quiet(s: str) -> None:
    pass


# --------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("extra, needle", [
    (["parallel.sequence_parallel=true", "parallel.schedule=zb1p"], "allowed: gpipe, 1f1b"),
    (["parallel.sequence_parallel=true", "data.seq_len=33"], "data.seq_len a multiple of 2"),
    (["parallel.tp=1", "parallel.sequence_parallel=true"], "allowed: parallel.tp > 1"),
    (["parallel.cp=2"], "parallel.pp=2 with parallel.cp=2"),
    (["parallel.schedule=pipedream", "train.precision=fp16"], "allowed: fp32, bf16 with pipedream"),
])
def test_tp_with_pp_refusals_are_one_line(extra, needle):
    with pytest.raises(ConfigError) as e:
        check_config(pp_tp_cfg(*extra), M)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_tp_with_pp_is_accepted():
    check_config(pp_tp_cfg(), M)
    check_config(pp_tp_cfg("parallel.schedule=interleaved"), M)
    check_config(pp_tp_cfg("parallel.sequence_parallel=true"), M)


def test_models_tp_cannot_split_are_refused_before_any_collective():
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques import compat

    plan = Plan.from_config(pp_tp_cfg()).resolved(4)
    for model, needle in ((models.get("gpt2-tiny", n_layer=2, n_embd=32, n_head=1),
                           "parallel.tp=2: it must divide the model's n_head=1"),
                          (models.get("gpt2-tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=255),
                           "vocab_size=255"),
):
        with pytest.raises(ConfigError, match="parallel.tp=2") as e:
            compat.check(plan, compat.Facts.of(model, world=4, device="cpu", seq_len=32, microbatches=M))
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_layouts_put_tp_innermost_and_cover_the_world():
    L = layouts(2, 2, 2)  # (dp, pp, tp): global rank (p·dp + d)·tp + t at position p·dp + d (the world mesh's)
    assert L == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert sorted(r for x in L for r in x) == list(range(8))


# --------------------------------------------------------------------------- processes
def reference(out_dir, *extra: str):
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + [f"train.micro_batch={8 // M}", *extra]), out_dir, log=_quiet)
    res = t.fit()
    out = (res.losses, res.val_loss, t._grad_norm, {k: v.clone() for k, v in t.model.state_dict().items()},
           t.optimizer.state_dict())
    t.close()
    return out


def _worker(rank: int, world: int, one_dir: str, full: bool, extra: tuple = ()) -> dict:
    from scaletrain.train.trainer import Trainer

    t = Trainer(pp_tp_cfg(*extra), None, log=_quiet)
    # this rank keeps 1/tp of its own stages' parameters only; the other blocks' shards are empty
    mine = {id(p) for p in t.parallel.runtime.parameters()}
    held = {n: p._local_tensor.numel() for n, p in t.model.named_parameters()}
    assert all((held[n] > 0) == (id(p) in mine) for n, p in t.model.named_parameters()), held
    assert sum(held.values()) * 2 < sum(p.numel() for p in t.model.parameters())
    res = t.fit()
    metrics = {**t.parallel.metrics(), "comm_bytes": t.comm_bytes}
    out = {"run": (res.losses, res.val_loss, t._grad_norm, t.parallel.model_state_dict(),
                   t.parallel.optimizer_state_dict(t.optimizer), t.parallel.describe(), metrics)}
    t.close()
    if not full:
        return out
    t = Trainer(pp_tp_cfg(), None, log=_quiet)  # resume at step 2 from the one-process checkpoint
    t.load_state_dict(ckpt.load(ckpt.at_step(Path(one_dir) / "checkpoints", 2)))
    out["resumed"] = t.fit().losses
    t.close()
    for s in OTHER_SCHEDULES:  # losses and the clipped norm only
        t = Trainer(pp_tp_cfg(f"parallel.schedule={s}"), None, log=_quiet)
        out[s] = (t.fit().losses, t._grad_norm, t.parallel.metrics())
        t.close()
    t = Trainer(pp_tp_cfg("parallel.sequence_parallel=true"), None, log=_quiet)
    res = t.fit()
    out["sp"] = (res.losses, res.val_loss, t._grad_norm, t.parallel.model_state_dict(), t.parallel.metrics())
    t.close()
    t = Trainer(pp_tp_cfg("train.precision=bf16"), None, log=_quiet)
    res = t.fit()
    out["bf16"] = (res.losses, res.val_loss)
    t.close()
    out["async"] = _async_worker(rank, world, 2)  # checked by test_pp2_tp2_async_schedules_equal_the_pp2_pipeline
    return out


def check(results: list[dict], ref, how: str, full: bool, ref_bf16=None) -> None:
    ref_losses, ref_val, ref_norm, ref_params, ref_opt = ref
    for rank, res in enumerate(results):
        losses, val, norm, params, opt, desc, metrics = res["run"]
        assert how in desc, desc
        check_tp_bytes(metrics)
        assert losses == pytest.approx(ref_losses, rel=1e-5), rank
        assert val == pytest.approx(ref_val, rel=1e-5), rank
        assert norm == pytest.approx(ref_norm, rel=1e-5), rank
        assert params.keys() == ref_params.keys()
        worst = max(rel_err(params[k], ref_params[k]) for k in ref_params)
        assert worst <= 1e-5, (rank, worst)
        assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_opt["param_groups"]]
        assert opt["state"].keys() == ref_opt["state"].keys()
        for i, st in ref_opt["state"].items():
            assert rel_err(opt["state"][i]["momentum_buffer"], st["momentum_buffer"]) <= 1e-4, (rank, i)
        if not full:
            continue
        assert res["resumed"] == pytest.approx(ref_losses[2:], rel=1e-5), rank
        for s in OTHER_SCHEDULES:
            assert res[s][0] == pytest.approx(ref_losses, rel=1e-5), (s, rank)
            assert res[s][1] == pytest.approx(ref_norm, rel=1e-5), (s, rank)
            check_tp_bytes(res[s][2])
        losses, val, norm, params, metrics = res["sp"]  # sequence parallelism: the same parity
        assert losses == pytest.approx(ref_losses, rel=1e-5) and val == pytest.approx(ref_val, rel=1e-5), rank
        assert norm == pytest.approx(ref_norm, rel=1e-5), rank
        assert max(rel_err(params[k], ref_params[k]) for k in ref_params) <= 1e-5, rank
        check_tp_bytes(metrics)
        assert metrics["p2p_bytes"] * 2 == res["run"][6]["p2p_bytes"]  # each TP rank sends its s/2 positions
        losses, val = res["bf16"]  # autocast in every stage: bf16 GEMMs of other shapes may round apart
        assert losses == pytest.approx(ref_bf16[0], rel=1e-2) and val == pytest.approx(ref_bf16[1], rel=1e-2)


def check_tp_bytes(metrics: dict) -> None:
    """DTensor's collectives inside this rank's stages, measured = predicted per local block; and, where
    the ledger's total was recorded, every collective of the step (loss, tied embedding, data-parallel
    reduction or ZeRO-1's reduce-scatter + all-gather, norms, TP) = predicted, to the byte."""
    assert metrics["comm_bytes_intra_layer"] > 0
    assert metrics["comm_bytes_intra_layer"] == pytest.approx(metrics["predicted_comm_bytes_intra_layer"], rel=1e-9)
    if "comm_bytes" in metrics:
        assert metrics["comm_bytes"] == pytest.approx(metrics["predicted_comm_bytes"], rel=1e-12), metrics


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory) -> tuple:
    """The one-process reference (checkpoint at step 2) and one start of 4 processes (pp=2 x tp=2) that
    runs every pp=2 x tp=2 case of this module: two tests read it, one start of torch in 4 processes."""
    one = tmp_path_factory.mktemp("one")
    ref = reference(one)
    return ref, run_distributed(_worker, 4, str(one), True, timeout_s=300)


@pytest.mark.slow
def test_pp2_tp2_1f1b_equals_one_process(pp2_tp2):
    ref, results = pp2_tp2
    assert ref[2] > 0.1  # the clipping scales the gradients
    check(results, ref, "pipeline 1f1b over 2 stages x 1 dp x 2 tp, 4 micro-batches", True,
          reference(None, "train.precision=bf16"))


@pytest.mark.slow
def test_dp2_pp2_tp2_zero1_remat_equals_one_process(tmp_path):
    """8 processes, Megatron's 3-D with recompute: each of the 2 data-parallel replicas is a pp=2 x tp=2
    pipeline whose stages run their blocks under nested checkpoints, optimizer states sharded over the
    replicas (ZeRO-1). Losses, clipped norm, parameters and the consolidated momentum = one process."""
    ref = reference(None)
    extra = ("parallel.zero=1", "memory.remat.method=periodic")
    results = run_distributed(_worker, 8, "", False, extra, timeout_s=300)
    check(results, ref, "pipeline 1f1b over 2 stages x 2 dp x 2 tp, 4 micro-batches", False)


def _async_worker(rank: int, world: int, tp: int) -> dict:
    from scaletrain.train.trainer import Trainer

    out = {}
    for s in ("pipedream", "pipedream-2bw"):
        t = Trainer(pp_tp_cfg(f"parallel.schedule={s}", f"parallel.tp={tp}"), None, log=_quiet)
        out[s] = (t.fit().losses, t._grad_norm)
        t.close()
    return out


@pytest.mark.slow
def test_pp2_tp2_async_schedules_equal_the_pp2_pipeline(pp2_tp2):
    """Weight stashing works on TP shards: pipedream and 2BW at pp=2 x tp=2 (run by the module's
    4-process start) give the pp=2 pipeline's losses and norms (they differ from one process by design)."""
    plain = run_distributed(_async_worker, 2, 1, timeout_s=240)[0]
    for rank, res in enumerate(r["async"] for r in pp2_tp2[1]):
        for s, (losses, norm) in plain.items():
            assert res[s][0] == pytest.approx(losses, rel=1e-5), (s, rank)
            assert res[s][1] == pytest.approx(norm, rel=1e-5), (s, rank)
