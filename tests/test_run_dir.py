"""Bad input is one line (exit 2) and writes nothing; run directories are never damaged."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.errors import ERROR_DIR_ENV, ConfigError, read_reports, report, summarize
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.rundir import trim_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only add contention

TINY = ["model.overrides.n_layer=1", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=4", "train.eval_every=0", "train.eval_batches=1",
        "train.log_every=1", "optim.warmup_steps=1", "train.progress=off"]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["train", *argv])
    return rc, capsys.readouterr().err


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _one_line(rc: int, err: str) -> str:
    assert rc == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--config", "bad.toml"], "not UTF-8"),
    (["--out", "a_file"], "existing file"),
    (["data.seq_len=300", "data.name=synthetic-text"], "positions"),
    (["model.name=resnet-mini", "data.name=shakespeare"], "holds text"),
    (["model.name=mlp", "data.name=synthetic-text"], "holds text"),
    (["data.name=digits"], "holds images"),
    (["data.name=synthetic-text", "data.num_samples=3"], "too small"),
    ([*TINY, "memory.remat.method=optimal", "memory.remat.budget=1KiB"], "budget"),
    (["model.name=gpt2-tiny", "model.overrides.n_head=0"], "model.overrides"),
    (["model.name=mlp", "data.name=digits", "train.params_dtype=fp16"], "autocast"),
    (["model.name=resnet-mini", "data.name=digits", "train.params_dtype=bf16", "train.precision=bf16"], "batch-norm"),
    (["model.name=mlp", "data.name=synthetic-images", "data.image_size=4"], "data.image_size=4"),
    (["model.name=vgg-mini", "data.name=synthetic-images", "data.image_size=7"], "cannot take 3x7x7"),
    (["--reset-optimizer"], "--resume"),
    (["--max-restarts", "2"], "--nproc-per-node"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_bytes(b"\xff\xfe[train]\nsteps = 1\n")
    (tmp_path / "a_file").write_text("keep me")
    before = _snapshot(tmp_path)
    line = _one_line(*_cli(capsys, *argv, "train.steps=1"))
    assert words in line
    assert _snapshot(tmp_path) == before and not (tmp_path / "runs").exists()


def test_existing_run_and_failed_resume_change_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(capsys, "--out", str(out), *TINY, "train.steps=4", "train.checkpoint_every=2")[0] == 0
    before = _snapshot(out)
    line = _one_line(*_cli(capsys, "--out", str(out), *TINY, "train.steps=6"))  # no --resume: refused
    assert "already holds a run" in line and "--resume" in line
    line = _one_line(*_cli(capsys, "--out", str(out), "--resume", "train.steps=6", "optim.name=sgd"))
    assert "--reset-optimizer" in line and "'adamw'" in line
    assert _snapshot(out) == before  # config.toml was not rewritten: a plain --resume still works
    # --reset-optimizer: the weights and step from the checkpoint, fresh SGD states; the run's config follows
    assert _cli(capsys, "--out", str(out), "--resume", "--reset-optimizer", "train.steps=6", "optim.name=sgd")[0] == 0
    assert 'name = "sgd"' in (out / "config.toml").read_text()
    state = ckpt.load(ckpt.latest(out / "checkpoints"))
    assert state["step"] == 6 and "momentum_buffer" in json.dumps(list(state["optimizer"]["state"].values())[0],
                                                                  default=str)
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_resume_skips_a_corrupt_newest_checkpoint_and_logs_no_step_twice(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--out", str(out), *TINY, "train.steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=3"]
    assert _cli(capsys, *args)[0] == 0
    newest = ckpt.latest(out / "checkpoints")
    newest.write_bytes(newest.read_bytes()[:100])  # truncated step 6; steps 3..6 must be run (and logged) again
    (ckpt.list_checkpoints(out / "checkpoints")[-2]).unlink()  # step 4 gone: resume from step 2
    rc = main(["train", *args, "--resume"])
    captured = capsys.readouterr()
    assert rc == 0 and f"skipping damaged checkpoint {newest}" in captured.out + captured.err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert newest.with_name(newest.name + ".corrupt").is_file()  # kept for a look, out of rotation's count
    assert ckpt.load(ckpt.latest(out / "checkpoints"))["step"] == 6


def test_trim_metrics_drops_later_and_torn_rows_keeps_events(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"event": "restart", "step": 3}\n{"step": 3}\n{"step": 4, "lo')
    assert trim_metrics(p, 2) == 2
    assert [json.loads(line) for line in p.read_text().splitlines()] == [
        {"step": 1}, {"step": 2}, {"event": "restart", "step": 3}]


def test_validation_reads_the_same_samples_with_accumulation(tmp_path, capsys):
    """eval_batches counts global batches: micro-batches of 1 x 4 accumulation see what 4 x 1 sees."""
    vals = []
    for mb in (0, 1):
        out = tmp_path / f"mb{mb}"
        assert _cli(capsys, "--out", str(out), *TINY, "train.steps=1", f"train.micro_batch={mb}")[0] == 0
        vals += [r["val_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                 if "val_loss" in r]
    assert vals[0] == pytest.approx(vals[1], rel=1e-6)


def test_several_ranks_give_one_line(tmp_path, monkeypatch, capsys):
    """Each rank writes its one line for the launcher; the launcher says the cause once."""
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        report(ConfigError("data.seq_len=300 exceeds the 256 positions"))
    assert capsys.readouterr().err == ""
    reports = read_reports(tmp_path)
    line, restartable = summarize(reports + [{"rank": 2, "message": "rank 2: lost its peer", "restartable": True}])
    assert line == "rank 0: data.seq_len=300 exceeds the 256 positions (and 1 more rank with the same error)"
    assert not restartable
    line, restartable = summarize([{"rank": 0, "message": "rank 0: lost its peer", "restartable": True}],
                                  {"rank": 1, "exitcode": -9, "signal": "SIGKILL"})
    assert line == "rank 1 died (SIGKILL)" and restartable
    os.environ.pop("RANK", None)


def test_resuming_a_finished_run_says_there_is_nothing_to_train(tmp_path, capsys):
    """--resume of a run already at train.steps trains nothing, says so in one line and exits 0."""
    out = str(tmp_path / "run")
    assert _cli(capsys, "--out", out, "train.steps=2", *TINY)[0] == 0
    code = main(["train", "--out", out, "--resume", "train.steps=2", *TINY])
    cap = capsys.readouterr()
    assert code == 0 and "nothing to train: the run is already at step 2" in cap.out + cap.err
