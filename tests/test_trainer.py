"""The training loop: loss goes down, resume is bitwise identical, outputs are where promised."""

import json

import pytest
import torch

from scaletrain.data.text import byte_unigram_entropy
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer, batch_arithmetic
from scaletrain.errors import ConfigError, UserError

TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2",
        "data.seq_len=32", "train.global_batch=8", "train.eval_batches=2", "train.log_every=1",
        "optim.warmup_steps=2"]


def _run(tmp_path, extra, resume=False, name="run"):
    cfg = load_config(None, TINY + extra)
    return Trainer(cfg, tmp_path / name, resume=resume, log=lambda s: None).fit()


def _rows(path):
    return [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]


def test_loss_decreases_and_metrics_written(tmp_path):
    r = _run(tmp_path, ["train.steps=40", "train.eval_every=20", "optim.lr=3e-3"])
    assert r.steps == 40
    assert sum(r.losses[-5:]) / 5 < 0.8 * sum(r.losses[:5]) / 5
    rows = _rows(tmp_path / "run")
    train = [x for x in rows if "loss" in x]
    val = [x for x in rows if "val_loss" in x]
    assert [x["step"] for x in train] == list(range(1, 41))
    assert [x["step"] for x in val] == [20, 40]
    assert all(x["tok_per_s"] > 0 and x["rss_peak_bytes"] > 0 for x in train)
    assert (tmp_path / "run" / "config.toml").is_file()
    assert ckpt.latest(tmp_path / "run" / "checkpoints").name == "step_00000040.pt"


@pytest.mark.parametrize("extra", [
    ["model.overrides.dropout=0.1"],
    ["train.micro_batch=2", "optim.name=sgd", "optim.lr=0.05"],
])
def test_resume_is_bitwise_identical(tmp_path, extra):
    common = ["train.steps=6", "train.eval_every=0", "train.checkpoint_every=3", "train.keep_checkpoints=5"] + extra
    full = _run(tmp_path, common, name="full")
    part = _run(tmp_path, common, name="part")
    assert part.losses == full.losses
    # Throw away the end of the run and continue from the step-3 checkpoint.
    (tmp_path / "part" / "checkpoints" / "step_00000006.pt").unlink()
    resumed = _run(tmp_path, common, resume=True, name="part")
    assert resumed.losses == full.losses[3:]
    a = ckpt.load(tmp_path / "full" / "checkpoints" / "step_00000006.pt")["model"]
    b = ckpt.load(tmp_path / "part" / "checkpoints" / "step_00000006.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_is_atomic_and_safe(tmp_path):
    _run(tmp_path, ["train.steps=2", "train.eval_every=0"])
    d = tmp_path / "run" / "checkpoints"
    (d / "step_00000009.pt.tmp").write_bytes(b"half-written")  # a crash mid-write
    assert ckpt.latest(d).name == "step_00000002.pt"
    bad = d / "step_00000010.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot be loaded"):
        ckpt.load(bad)


@pytest.mark.parametrize("model,data", [("resnet-mini", "digits"), ("mlp", "digits"), ("vgg-mini", "synthetic-images")])
def test_vision_models_train(tmp_path, model, data):
    r = _run(tmp_path, [f"model.name={model}", "model.overrides={}", f"data.name={data}", "train.steps=3",
                        "train.eval_every=0", "optim.lr=1e-3"])
    assert "val_acc" in r.val_metrics and 0 <= r.val_metrics["val_acc"] <= 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_runs(tmp_path, precision):
    r = _run(tmp_path, [f"train.precision={precision}", "train.steps=3", "train.eval_every=0"])
    assert all(torch.isfinite(torch.tensor(r.losses)))


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    """An inf gradient at step 2 (forced by a hook): that update is skipped — every parameter unchanged —
    and the loss scale halves (GradScaler backoff); the steps around it update and keep the scale."""
    t = Trainer(load_config(None, TINY + ["train.precision=fp16", "train.steps=3", "train.eval_every=0"]), None,
                log=lambda s: None)
    first = next(t.model.parameters())
    first.register_hook(lambda g: torch.full_like(g, float("inf")) if t.step == 1 else g)
    seen, inner = [], t.parallel.optimizer_step

    def step(optimizer, scaler):
        before = [q.detach().clone() for q in t.model.parameters()]
        scale = scaler.get_scale()
        inner(optimizer, scaler)
        unchanged = all(torch.equal(a, q) for a, q in zip(before, t.model.parameters()))
        seen.append((unchanged, scaler.get_scale() / scale))

    t.parallel.optimizer_step = step
    r = t.fit()
    t.close()
    assert seen == [(False, 1.0), (True, 0.5), (False, 1.0)]
    assert all(torch.isfinite(torch.tensor(r.losses)))


def test_batch_arithmetic():
    assert batch_arithmetic(16, 0, 1) == (16, 1)
    assert batch_arithmetic(16, 4, 2) == (4, 2)
    with pytest.raises(ConfigError, match="allowed micro_batch: 1, 2, 4, 8"):
        batch_arithmetic(16, 3, 2)


@pytest.mark.slow
def test_default_run_beats_unigram_entropy(tmp_path, capsys):
    """`scaletrain train` with no other argument than a shorter schedule: the default job (the one
    `make run` runs: gpt2-tiny on the shipped text) cut from 800 to 150 steps, so that the suite
    stays short. Measured 2026-11-28: 2.5115 nats/byte at step 150 (76 % of the byte-unigram
    entropy; 2.4605, 74 %, at step 250); the full job reaches 2.0671 (62 %, README). 80 % leaves
    room for other CPUs' rounding without letting a job that does not learn pass. In-process (the
    command's ``main``, as the ``scaletrain`` script calls it): a subprocess would add only the
    interpreter's start and torch's import (the `python -m scaletrain.cli` path: tests/test_config.py)."""
    from scaletrain.cli import main

    assert main(["train", "--out", str(tmp_path / "d"), "train.steps=150"]) == 0
    out = capsys.readouterr().out
    assert "val_loss" in out and "unigram entropy" in out
    val = [x for x in _rows(tmp_path / "d") if "val_loss" in x][-1]["val_loss"]
    h = byte_unigram_entropy("val")
    assert 3.0 < h < 3.6
    assert val < 0.80 * h, (val, h)


def test_checkpoint_format_none_writes_no_checkpoint(tmp_path):
    """Benchmark runs (train.checkpoint_format=none) train and log but never write a checkpoint."""
    r = _run(tmp_path, ["train.steps=3", "train.eval_every=0", "train.checkpoint_every=1",
                        "train.checkpoint_format=none"])
    assert r.steps == 3 and len(_rows(tmp_path / "run")) >= 3
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
