"""Trainer(callbacks=[...], eval_fn=...): hooks see every step, evaluation and checkpoint; a raise is one line."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.errors import UserError
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = ["train.steps=4", "train.global_batch=4", "data.seq_len=16", "train.eval_batches=1", "train.progress=off",
        "train.log_every=1", "train.eval_every=2", "model.overrides.n_layer=1", "data.name=synthetic-text",
        "data.num_samples=64", "train.checkpoint_every=2"]


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_step_end(self, trainer, step, metrics):
        self.seen.append(("step", step, metrics["loss"]))

    def on_eval(self, trainer, step, metrics):
        self.seen.append(("eval", step, metrics["val_loss"], metrics["top1"]))

    def on_checkpoint(self, trainer, step, path):
        self.seen.append(("ckpt", step, path.exists()))


def top1(model, batches):
    """Share of next tokens predicted exactly (the user's own metric)."""
    right = total = 0
    for x, y in batches:
        right += int((model(x).argmax(-1) == y).sum())
        total += y.numel()
    return {"top1": right / total}


def test_hooks_see_steps_evals_checkpoints_and_eval_fn_is_logged(tmp_path):
    rec = Recorder()
    tr = Trainer(load_config(None, BASE), tmp_path, log=lambda s: None, callbacks=[rec], eval_fn=top1)
    try:
        res = tr.fit()
    finally:
        tr.close()
    assert [s[1] for s in rec.seen if s[0] == "step"] == [1, 2, 3, 4]
    assert [s[2] for s in rec.seen if s[0] == "step"] == res.losses
    assert [(s[0], s[1]) for s in rec.seen if s[0] != "step"] == [("eval", 2), ("ckpt", 2), ("eval", 4), ("ckpt", 4)]
    assert all(s[2] for s in rec.seen if s[0] == "ckpt")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "top1" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(0 <= r["top1"] <= 1 for r in evals)
    assert evals[-1]["top1"] == res.val_metrics["top1"] == rec.seen[-2][3]


def test_a_callback_that_raises_ends_the_run_in_one_line():
    class Boom:
        def on_step_end(self, trainer, step, metrics):
            if step == 2:
                raise RuntimeError("disk full\nsecond line")

    tr = Trainer(load_config(None, BASE), log=lambda s: None, callbacks=[Boom()])
    try:
        with pytest.raises(UserError, match=r"^callback Boom.on_step_end raised RuntimeError at step 2: disk full "
                                            r"second line$"):
            tr.fit()
        assert tr.step == 2
    finally:
        tr.close()
    with pytest.raises(UserError, match="has none of the methods"):
        Trainer(load_config(None, BASE), log=lambda s: None, callbacks=[object()])
    bad = Trainer(load_config(None, BASE), log=lambda s: None, eval_fn=lambda m, b: torch.tensor([1.0, 2.0]))
    try:
        with pytest.raises(UserError, match="eval_fn <lambda> raised TypeError at step 2"):
            bad.fit()
    finally:
        bad.close()
