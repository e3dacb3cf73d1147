"""Ctrl-C and SIGTERM save a checkpoint at the next step boundary, and `--resume` continues exactly;
long runs also save periodically (`train/interrupt.py`)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from scaletrain.cli import main
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.trainer import Trainer

KEYS = ["model.overrides.n_layer=1", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "train.global_batch=4", "train.steps=6", "train.eval_every=0", "train.eval_batches=1", "train.progress=off",
        "train.checkpoint_format=consolidated"]


def _final(run) -> dict:
    state = ckpt.load(ckpt.latest(run / "checkpoints"))
    assert state["step"] == 6
    return state["model"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_then_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, capsys, signum):
    """A signal during step 3 ends the run after it, with step 3's checkpoint; --resume then ends
    with the parameters of a run never interrupted."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN when the suite runs as a background job)
    assert main(["train", "--out", str(whole), *KEYS]) == 0
    step = Trainer._train_step

    def signalled(self, it):
        if self.step == 2:  # during step 3: the step in flight finishes first
            os.kill(os.getpid(), signum)
        return step(self, it)

    monkeypatch.setattr(Trainer, "_train_step", signalled)
    capsys.readouterr()
    assert main(["train", "--out", str(cut), *KEYS]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped after step 3" in err[0] and "--resume" in err[0], err
    assert ckpt.load(ckpt.latest(cut / "checkpoints"))["step"] == 3
    assert signal.getsignal(signal.SIGINT) is before  # handlers put back
    monkeypatch.setattr(Trainer, "_train_step", step)
    assert main(["train", "--out", str(cut), "--resume"]) == 0
    a, b = _final(whole), _final(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_periodic_checkpoints_follow_the_measured_step_time(tmp_path):
    """train.checkpoint_every_s shorter than a step saves at every step once the step time is measured
    (3 steps); 0 saves only at the end."""
    often, never = tmp_path / "often", tmp_path / "never"
    assert main(["train", "--out", str(often), *KEYS, "train.checkpoint_every_s=1e-6", "train.keep_checkpoints=9"]) == 0
    assert main(["train", "--out", str(never), *KEYS, "train.checkpoint_every_s=0", "train.keep_checkpoints=9"]) == 0
    steps = lambda run: sorted(ckpt.load(p)["step"] for p in ckpt.list_checkpoints(run / "checkpoints"))  # noqa: E731
    assert steps(often) == [3, 4, 5, 6] and steps(never) == [6]
