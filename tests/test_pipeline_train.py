"""The trainer runs pipelines (``parallel.pp > 1``) with one process's losses and parameters.

* no processes: conflicts (and models without blocks, an input_spec or enough blocks) are one-line
  ConfigErrors naming the key and what is allowed;
* gloo, 2 processes (slow): gpipe, interleaved, zb1p and chimera at pp = 2 through the Trainer —
  the same losses, validation loss, gradient norm, final parameters and optimizer states
  (renumbered to the one-process layout) as a one-process Trainer (SGD; AdamW: losses, norms and
  states; bf16 autocast: losses within 1e-2); a one-process checkpoint and
  the pipeline's own checkpoint both resume to the one-process losses (and the pipeline's on one
  process); conflicts raised on the
  real path (not by the data-parallel checks);
* gloo, 4 processes (slow): the same schedules' parity at pp = 2 × dp = 2;
* CLI, 4 processes (slow): ``scaletrain train --nproc-per-node 4 parallel.pp=4
  parallel.schedule=1f1b parallel.microbatches=8`` on the shipped Shakespeare — metrics losses
  and gradient norms and the final checkpoint's parameters equal a one-process run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.testing import run_distributed
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.config import load_config

# 4 blocks (embed, 2 layers, head): pp = 2 with interleaved's 2 stages per rank still fits
TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=2", "train.log_every=1",
        "optim.warmup_steps=1", "train.steps=4", "train.eval_every=0", "train.progress=off",
        "train.checkpoint_every=2", "optim.name=sgd", "optim.lr=0.5"]
# SGD for parameter parity: Adam divides by the gradient's scale, so it turns the round-off-level
# gradient of attention's key bias (exactly zero in exact arithmetic: softmax ignores a shift
# common to all keys) into ±lr steps that differ between any two summation orders. AdamW is
# checked on losses, gradient norms and its renumbered states (``adamw`` below).
ADAMW = ["optim.name=adamw", "optim.lr=2e-3"]
M = 4
SCHEDULES = ("gpipe", "interleaved", "zb1p", "chimera")



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

def pipe_cfg(schedule: str, *extra: str):
    return load_config(None, TINY + ["parallel.pp=2", f"parallel.schedule={schedule}", f"parallel.microbatches={M}",
                                     *extra])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _quiet(s: str) -> None:
    pass


# --------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("extra, needle", [
    (["parallel.zero=2"], "allowed: parallel.zero=1 with pipelines"),
    (["parallel.sequence_parallel=true"], "allowed: parallel.tp > 1"),
    (["parallel.cp=2"], "parallel.cp=2"),
    (["parallel.compression=topk"], "parallel.compression=topk"),
    (["parallel.schedule=zb1p", "memory.remat.method=periodic"], "memory.remat.* with parallel.schedule=zb1p"),
    (["parallel.schedule=pipedream", "train.precision=fp16"], "allowed: fp32, bf16 with pipedream"),
    (["parallel.schedule=1f1b", "parallel.virtual=2"], "virtual stages only apply"),
])
def test_conflicts_are_one_line_config_errors(extra, needle):
    cfg = pipe_cfg("gpipe", *extra)
    with pytest.raises(ConfigError) as e:
        check_config(cfg, M)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_schedule_constraints_name_the_keys():
    with pytest.raises(ConfigError, match="memory.offload"):
        check_config(pipe_cfg("gpipe"), M, offload=True)
    with pytest.raises(ConfigError, match="rounds of parallel.pp=2"):
        check_config(pipe_cfg("interleaved"), 3)
    with pytest.raises(ConfigError, match="Chimera pairs"):
        check_config(pipe_cfg("chimera"), 3)
    check_config(pipe_cfg("zb1p"), 3)  # 1f1b-like schedules take any count


def test_models_that_cannot_be_cut_are_refused_before_any_collective():
    from torch import nn

    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.techniques import compat

    for model, schedule, pp, needle in (
            (nn.Linear(2, 2), "1f1b", 2, "a pipeline cuts the model's Chain of blocks"),
            (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "1f1b", 2, "needs its input_spec"),
            (models.get("gpt2-tiny", n_layer=2, n_embd=32, n_head=2), "interleaved", 4,
             "the model has 4 blocks; allowed: parallel.pp <= 2")):
        cfg = load_config(None, TINY + [f"parallel.pp={pp}", f"parallel.schedule={schedule}"])
        facts = compat.Facts.of(model, world=pp, device="cpu", seq_len=32, microbatches=M)
        with pytest.raises(ConfigError, match="parallel.pp=") as e:
            compat.check(Plan.from_config(cfg).resolved(pp), facts)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# --------------------------------------------------------------------------- one process reference
def reference(out_dir, micro_batch: int, *extra: str):
    """One-process Trainer on the same global batches; eval micro-batches as large as the
    pipeline's together (so the validation samples are the same); checkpoints every 2 steps."""
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + [f"train.micro_batch={micro_batch}", *extra]), out_dir, log=_quiet)
    res = t.fit()
    out = (res.losses, res.val_loss, t._grad_norm, {k: v.clone() for k, v in t.model.state_dict().items()},
           t.optimizer.state_dict())
    t.close()
    return out


def _pipeline_worker(rank: int, world: int, one_dir: str, out_dir: str, full: bool, extra: tuple = ()) -> dict:
    from scaletrain.train.trainer import Trainer

    out: dict = {}
    for s in SCHEDULES:
        t = Trainer(pipe_cfg(s, *extra), f"{out_dir}/{s}", log=_quiet)
        res = t.fit()
        model = {k: v.clone() for k, v in t.parallel.model_state_dict().items()}
        out[s] = (res.losses, res.val_loss, t._grad_norm, model, t.parallel.optimizer_state_dict(t.optimizer),
                  t.parallel.describe())
        t.close()
    if not full:
        return out
    t = Trainer(pipe_cfg("1f1b", *ADAMW), None, log=_quiet)
    res = t.fit()
    out["adamw"] = (res.losses, t._grad_norm, t.parallel.optimizer_state_dict(t.optimizer))
    t.close()
    t = Trainer(pipe_cfg("zb1p", "train.precision=bf16"), None, log=_quiet)
    res = t.fit()
    out["bf16"] = (res.losses, res.val_loss)
    t.close()
    # resume at step 2 from the one-process checkpoint and from the pipeline's own (1f1b)
    for name, path in (("from-one", f"{one_dir}/checkpoints"), ("from-pp", f"{out_dir}/zb1p/checkpoints")):
        t = Trainer(pipe_cfg("1f1b"), None, log=_quiet)
        t.load_state_dict(ckpt.load(ckpt.at_step(Path(path), 2)))
        out[name] = t.fit().losses
        t.close()
    for bad in (["parallel.zero=2"], ["memory.remat.method=periodic", "parallel.schedule=zb1p"]):
        try:
            Trainer(pipe_cfg("1f1b", *bad), None, log=_quiet)
            out[bad[0]] = "no error"
        except ConfigError as e:
            out[bad[0]] = str(e)
    return out


def check(results: list[dict], ref, dp: int) -> None:
    ref_losses, ref_val, ref_norm, ref_params, ref_opt = ref
    for rank, res in enumerate(results):
        for s in SCHEDULES:
            losses, val, norm, params, opt, how = res[s]
            assert how.startswith(f"pipeline {s} over 2 stages") and f"x {dp} dp, {M} micro-batches" in how
            assert losses == pytest.approx(ref_losses, rel=1e-5), (s, rank)
            assert val == pytest.approx(ref_val, rel=1e-5), (s, rank)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (s, rank)
            assert params.keys() == ref_params.keys()
            worst = max(rel_err(params[k], ref_params[k]) for k in ref_params)
            assert worst <= 1e-5, (s, rank, worst)
            check_states(opt, ref_opt, ("momentum_buffer",), (s, rank))


def check_extras(results: list[dict], ref, ref_adamw, ref_bf16) -> None:
    for rank, res in enumerate(results):
        losses, norm, opt = res["adamw"]
        assert losses == pytest.approx(ref_adamw[0], rel=1e-5) and norm == pytest.approx(ref_adamw[2], rel=1e-5)
        check_states(opt, ref_adamw[4], ("exp_avg", "exp_avg_sq", "step"), ("adamw", rank))
        losses, val = res["bf16"]  # autocast around every stage; bf16 GEMMs of other shapes may round apart
        assert losses == pytest.approx(ref_bf16[0], rel=1e-2) and val == pytest.approx(ref_bf16[1], rel=1e-2)
        assert res["from-one"] == pytest.approx(ref[0][2:], rel=1e-5), rank
        assert res["from-pp"] == pytest.approx(ref[0][2:], rel=1e-5), rank
        for key, needle in (("parallel.zero=2", "allowed: parallel.zero=1 with pipelines"),
                            ("memory.remat.method=periodic", "allowed: parallel.schedule=gpipe")):
            assert needle in res[key] and "\n" not in res[key], res[key]


def check_states(opt: dict, ref_opt: dict, keys: tuple[str, ...], where: tuple) -> None:
    """The gathered optimizer state is the one-process optimizer's, numbering and groups included."""
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_opt["param_groups"]], where
    for g, rg in zip(opt["param_groups"], ref_opt["param_groups"]):
        assert g["lr"] == pytest.approx(rg["lr"]) and g["weight_decay"] == rg["weight_decay"], where
    assert opt["state"].keys() == ref_opt["state"].keys(), where
    for i, st in ref_opt["state"].items():
        for k in keys:
            a, b = torch.as_tensor(opt["state"][i][k]), torch.as_tensor(st[k])
            assert a.shape == b.shape and rel_err(a, b) <= 1e-4, (*where, i, k)


def run(tmp_path, world: int, full: bool, extra: tuple = ()) -> tuple[tuple, list[dict]]:
    # per replica 8 / (M dp) samples per micro-batch: 8 / M across the replicas
    ref = reference(tmp_path / "one", 8 // M)
    results = run_distributed(_pipeline_worker, world, str(tmp_path / "one"), str(tmp_path / "pp"), full, extra,
                              timeout_s=240)
    return ref, results


@pytest.mark.slow
def test_trainer_sync_schedules_pp2_equal_one_process(tmp_path):
    ref, results = run(tmp_path, 2, True)
    check(results, ref, 1)
    check_extras(results, ref, reference(None, 8 // M, *ADAMW), reference(None, 8 // M, "train.precision=bf16"))
    # and the pipeline's checkpoint (model and optimizer in the one-process layout) resumes on one process
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY), None, log=_quiet)
    t.load_state_dict(ckpt.load(ckpt.at_step(tmp_path / "pp" / "zb1p" / "checkpoints", 2)))
    assert t.fit().losses == pytest.approx(ref[0][2:], rel=1e-5)
    t.close()


@pytest.mark.slow
def test_trainer_sync_schedules_pp2_dp2_zero1_equal_one_process(tmp_path):
    """Every synchronous schedule on 2 replicas of a pp=2 pipeline with the optimizer states sharded
    over the replicas (ZeRO-1: Megatron's distributed optimizer) — Chimera's replicas and the tied
    embedding held by two stages included; the consolidated momentum is the one-process optimizer's."""
    ref, results = run(tmp_path, 4, False, ("parallel.zero=1",))
    check(results, ref, 2)


# --------------------------------------------------------------------------- the CLI
CLI = ["model.overrides.n_layer=2", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=32",
       "train.global_batch=8", "train.eval_batches=1", "train.log_every=1", "optim.warmup_steps=1", "train.steps=3",
       "train.eval_every=0", "train.progress=off", "optim.name=sgd", "optim.lr=0.5"]  # SGD: see TINY


@pytest.mark.slow
def test_cli_pp4_1f1b_equals_one_process(tmp_path):
    """The issue's command on the default model and data (gpt2-tiny, Shakespeare), a few steps."""
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, CLI + ["train.micro_batch=1"]), None, log=_quiet)
    one = t.fit()
    one_norm, one_params = t._grad_norm, {k: v.clone() for k, v in t.model.state_dict().items()}
    t.close()
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "4", "--out",
                        str(tmp_path / "run"), "parallel.pp=4", "parallel.schedule=1f1b", "parallel.microbatches=8",
                        *CLI], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("scaletrain: training") == 1 and "pipeline 1f1b over 4 stages x 1 dp, 8 micro-batches" \
        in r.stdout, r.stdout
    for bad in ("terminate called", "Traceback", "abort", "ProcessGroup"):
        assert bad not in r.stderr, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "loss" in x]
    assert [x["loss"] for x in steps] == pytest.approx(one.losses, rel=1e-5)
    assert steps[-1]["grad_norm"] == pytest.approx(one_norm, rel=1e-5)
    assert all(x["p2p_bytes"] > 0 and 0 < x["pipeline_bubble_predicted"] < 1 for x in steps)
    assert [x["val_loss"] for x in rows if "val_loss" in x] == pytest.approx([one.val_loss], rel=1e-5)
    state = ckpt.load(ckpt.latest(tmp_path / "run" / "checkpoints"))
    assert state["step"] == 3 and state["model"].keys() == one_params.keys()
    worst = max(rel_err(state["model"][k], one_params[k]) for k in one_params)
    assert worst <= 1e-5, worst
