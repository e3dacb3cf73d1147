"""The asynchronous schedules through the trainer (gloo, 2 processes): ``parallel.schedule=pipedream``
and ``pipedream-2bw`` train as one stream over the run's steps — the loss goes down on the
shipped text, evaluation runs mid-stream, checkpoints are written in the single-process layout
and load into a one-process trainer. Their losses differ from one process's by design (weight
stashing), so only training itself is checked here; ``benchmarks/pipeline/async_loss.py``
measures the cost of staleness."""

from __future__ import annotations

import math

import pytest

from scaletrain.testing import run_distributed
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.config import load_config

M = 4
STEPS = 8
CFG = ["model.overrides.n_layer=2", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=32",
       "train.global_batch=8", "train.eval_batches=1", "train.log_every=1", "optim.warmup_steps=1",
       f"train.steps={STEPS}", "train.eval_every=4", "train.progress=off", "train.checkpoint_every=4",
       "optim.name=adamw", "optim.lr=1e-2", "parallel.pp=2", f"parallel.microbatches={M}"]


def _quiet(s: str) -> None:
    pass


def test_async_on_cuda_evaluates_only_at_the_end():
    from scaletrain import models
    from scaletrain.errors import ConfigError
    from scaletrain.techniques.compat import check_config

    def check(cfg, device):
        model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
        check_config(cfg, model, world=cfg.parallel.pp, microbatches=M, device=device)

    cfg = load_config(None, CFG + ["parallel.schedule=pipedream-2bw"])
    check(cfg, "cpu")  # gloo: tagged messages, evaluation between windows is safe
    with pytest.raises(ConfigError, match="allowed: train.eval_every=0") as e:
        check(cfg, "cuda")
    assert "\n" not in str(e.value)
    check(load_config(None, CFG + ["parallel.schedule=pipedream-2bw", "train.eval_every=0"]), "cuda")


def _worker(rank: int, world: int, out_dir: str) -> dict:
    from scaletrain.train.trainer import Trainer

    out = {}
    for schedule in ("pipedream", "pipedream-2bw"):
        t = Trainer(load_config(None, CFG + [f"parallel.schedule={schedule}"]), f"{out_dir}/{schedule}", log=_quiet)
        res = t.fit()
        out[schedule] = (res.losses, res.val_loss, t.parallel.describe())
        t.close()
    return out


@pytest.mark.slow  # > 20 s: kept out of make test-fast
def test_async_schedules_train_and_checkpoint_through_the_trainer(tmp_path):
    from scaletrain.train.trainer import Trainer

    results = run_distributed(_worker, 2, str(tmp_path), timeout_s=240)
    for schedule in ("pipedream", "pipedream-2bw"):
        losses = [r[schedule][0] for r in results]
        assert losses[0] == losses[1] and len(losses[0]) == STEPS  # the same logged loss on every rank
        first, last = losses[0][0], losses[0][-1]
        assert all(math.isfinite(x) for x in losses[0]) and last < first - 0.3, (schedule, losses[0])
        assert math.isfinite(results[0][schedule][1]) and results[0][schedule][2].startswith(f"pipeline {schedule}")
        for step in (4, STEPS):
            state = ckpt.load(ckpt.at_step(tmp_path / schedule / "checkpoints", step))
            assert state["step"] == step
        # the final checkpoint (single-process layout) loads into one process and evaluates near the run's
        t = Trainer(load_config(None, CFG[:-2] + [f"train.micro_batch={8 // M}"]), None, log=_quiet)
        t.load_state_dict(ckpt.load(ckpt.at_step(tmp_path / schedule / "checkpoints", STEPS)))
        assert t.evaluate()["val_loss"] == pytest.approx(results[0][schedule][1], rel=1e-5)
        t.close()
