"""fp16 with dynamic loss scaling wherever gradients are sharded or staged: tensor parallelism and
pipelines train like one process in fp16, with the same loss-scale history (an inf/NaN found on any
rank skips the step on every rank: the scaler's check is all-reduced over the job)."""

from __future__ import annotations

import pytest

from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config

TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=8", "train.steps=4", "train.eval_every=0",
        "train.eval_batches=1", "train.log_every=1", "train.progress=off", "optim.warmup_steps=1",
        "optim.name=sgd", "optim.lr=0.5", "train.precision=fp16"]


def _fit(extra: list[str]) -> tuple[list[float], list[float]]:
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + extra), None, log=lambda s: None)
    scales = []
    step = t._train_step

    def recorded(it):
        loss = step(it)
        scales.append(float(t.scaler.get_scale()))
        return loss

    t._train_step = recorded
    losses = t.fit().losses
    t.close()
    return losses, scales


def _worker(rank: int, world: int, runs: list[list[str]]) -> list:
    return [_fit(extra) for extra in runs]


@pytest.mark.slow
def test_fp16_under_tp_and_pipelines_matches_one_process():
    ref_losses, ref_scales = _fit(["train.micro_batch=2"])
    runs = [["parallel.tp=2"], ["parallel.pp=2", "parallel.microbatches=4"]]
    for rank_out in run_distributed(_worker, 2, runs):
        for extra, (losses, scales) in zip(runs, rank_out):
            assert scales == ref_scales, extra  # the same skipped / grown steps
            assert losses == pytest.approx(ref_losses, rel=2e-2), extra
