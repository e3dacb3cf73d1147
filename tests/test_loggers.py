"""train.loggers: TensorBoard events and metrics.csv carry the numbers metrics.jsonl carries, across a resume."""

from __future__ import annotations

import contextlib
import csv
import io
import json

import pytest

from scaletrain.cli import main
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = ["train.steps=4", "train.global_batch=4", "data.seq_len=16", "train.eval_batches=1", "train.progress=off",
        "train.log_every=1", "train.eval_every=2", "model.overrides.n_layer=1", "data.name=synthetic-text",
        "data.num_samples=64", "train.checkpoint_every=2", "train.loggers=jsonl,tensorboard,csv"]


def run(out, *extra, resume=False):
    tr = Trainer(load_config(None, BASE + list(extra)), out, resume=resume, log=lambda s: None)
    try:
        tr.fit()
    finally:
        tr.close()


def jsonl_scalars(path):
    from scaletrain.train.loggers import scalars

    out: dict[tuple[str, int], float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out.update({(k, row["step"]): v for k, v in scalars(row).items()})
    return out


def test_tensorboard_and_csv_equal_jsonl_after_a_resume(tmp_path):
    """Interrupted at step 2 (rows of steps 3-4 logged, then lost), resumed: each sink holds every
    step once, with the values of metrics.jsonl, read back by tensorboard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import shutil

    run(tmp_path)
    for ckpt in (tmp_path / "checkpoints").glob("step_4*"):  # as if the run died before step 4's checkpoint
        shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
    run(tmp_path, resume=True)
    want = jsonl_scalars(tmp_path / "metrics.jsonl")
    assert {s for _, s in want} == {1, 2, 3, 4} and ("val_loss", 4) in want and ("loss", 3) in want
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = [(tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    tb = {(tag, step): value for tag, step, value in events}
    assert len(events) == len(tb)  # the reader sees every step once (purge_step drops the first run's 3-4)
    assert tb.keys() == want.keys()
    assert all(tb[k] == pytest.approx(want[k], rel=1e-6) for k in want)  # events store float32
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "name", "value"]
    got = {(n, int(s)): float(v) for s, n, v in rows[1:]}
    assert len(got) == len(rows) - 1 and got == want


def test_unknown_logger_is_one_line(tmp_path):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", *BASE, "train.loggers=jsonl,mlflow", "--out", str(tmp_path / "r")])
    assert code == 2 and "unknown logger 'mlflow'" in err.getvalue() and err.getvalue().count("\n") == 1
    assert not (tmp_path / "r").exists()
