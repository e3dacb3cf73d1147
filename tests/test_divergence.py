"""Divergence ends a run in every precision with one line naming the step and what to try, and no
checkpoint holds a diverged step (scaletrain.train.divergence)."""

from __future__ import annotations

import pytest

from scaletrain.cli import main
from scaletrain.errors import ConfigError
from scaletrain.train.divergence import FP16_PATIENCE, DivergenceGuard

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["model.overrides={n_layer=1, n_embd=32, n_head=2}", "data.seq_len=16", "data.name=synthetic-text",
        "train.global_batch=2", "train.eval_every=0", "train.eval_batches=1", "train.progress=off",
        "optim.warmup_steps=0", "train.steps=4", "train.checkpoint_every=1", "optim.lr=1e6", "optim.grad_clip=0"]


class Scaler:
    """The two things the guard reads of a GradScaler; ``skip()`` halves the scale as an overflow does."""

    def __init__(self) -> None:
        self.scale = 65536.0

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self.scale

    def skip(self) -> None:
        self.scale /= 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_loss_ends_fp32_and_bf16_at_once(precision):
    g = DivergenceGuard(precision, 1e-3, 1.0)
    g.check(1, 2.5)
    with pytest.raises(ConfigError, match="diverged at step 2") as e:
        g.check(2, float("inf"))
    assert ("train.precision=fp32" in str(e.value)) == (precision == "bf16")  # fp32 is never told to use fp32


def test_fp16_tolerates_overflow_skips_until_patience():
    s = Scaler()
    g = DivergenceGuard("fp16", 1e-3, 0.0, s)
    for step in range(1, 10):  # a few skips, then recovery: the count restarts
        s.skip() if step % 3 else None
        g.check(step, 2.0)
    for step in range(10, 10 + FP16_PATIENCE - 1):
        s.skip()
        g.check(step, float("nan"))
    s.skip()
    with pytest.raises(ConfigError, match=f"step {9 + FP16_PATIENCE} .*skipped.*grad_clip.*bf16"):
        g.check(9 + FP16_PATIENCE, float("nan"))
    with pytest.raises(ConfigError, match="checkpoint step"):  # a save would hold the nan
        DivergenceGuard("fp16", 1e-3, 0.0, Scaler()).check(1, float("nan"), saves=True)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_diverging_run_is_one_line_and_saves_nothing_after(precision, tmp_path, capsys):
    """lr 1e6 without clipping: exit 2, one line naming the step; the checkpoints stop before it."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *BASE, f"train.precision={precision}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "diverged at step" in err[0], err
    step = int(err[0].split("diverged at step ")[1].split()[0])
    saved = sorted(int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("step_*.pt"))
    assert step <= 4 and all(s < step for s in saved), (step, saved)
