"""Reports a user reads: one byte unit per report, repeated blocks on one row, and checkpoint info
of a one-process run (`measure/report.py`, `train/export.py`)."""

from __future__ import annotations

import contextlib
import io
import re

from scaletrain.cli import main
from scaletrain.measure.report import fold_rows, unit_for


def test_fold_and_unit():
    rows = [("embed", "1"), ("h.0", "2"), ("h.1", "2"), ("h.2", "2"), ("head", "2"), ("loss", "3")]
    assert fold_rows(rows) == [("embed", "1"), ("h.0–head ×4", "2"), ("loss", "3")]
    assert unit_for(3 * 2**30)[0] == "GiB" and unit_for(5 * 2**20)[0] == "MiB" and unit_for(10)[0] == "KiB"


def test_estimate_prints_one_unit_and_folds_blocks():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq", "16", "--dp", "2",
                     "--zero", "1"]) == 0
    text = buf.getvalue()
    assert set(re.findall(r"\b[KMG]iB\b", text)) == {"MiB"}, text
    assert not re.search(r"\d B\b", text), text
    assert "h.0–h.3 ×4" in text and "\nh.1 " not in text


def test_checkpoint_info_of_one_process(tmp_path):
    """One process: dp=1 (not the config's 0 = "every process"), the tied head counted once."""
    import json

    from scaletrain import models

    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--out", str(run), "train.steps=1", "model.overrides.n_layer=1", "data.seq_len=16",
                     "train.global_batch=2", "train.eval_batches=1", "train.progress=off"]) == 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["checkpoint", "info", str(run), "--json"]) == 0
    d = json.loads(buf.getvalue())
    assert d["plan"]["dp"] == 1
    assert d["parameters"] == models.count_params(models.get("gpt2-tiny", n_layer=1, device="meta"))


def test_compare_time_axis_is_set_by_the_measured_figures():
    """A prediction 8.7x off no longer sets the axis: it is clipped to the edge (and noted); the page renders."""
    from scaletrain.compare import figures
    from test_compare import synthetic

    (lo, hi), shown = figures.clip_to_measured([1.0, 2.0], [(1, 1.5), (4, 17.4)])
    assert (lo, hi) == (1.0 / figures.MARGIN, 2.0 * figures.MARGIN)
    assert shown == [(1, 1.5, False), (4, hi, True)]
    cells = synthetic()
    cells[2]["predicted_step_time_s"] *= 8.7 / 0.8
    assert figures.scaling(cells)[:4] == b"\x89PNG"
