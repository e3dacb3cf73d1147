"""The README's "bring your own model" command line runs as written (`examples/mymodels.py`)."""

from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

from scaletrain.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_the_py_factory_line_runs(tmp_path, monkeypatch):
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "py:mymodels:make_classifier" in x
                and x.lstrip().startswith("PYTHONPATH="))
    words = shlex.split(line, comments=True)
    env, argv = words[0], words[words.index("scaletrain") + 1:]
    assert env == "PYTHONPATH=examples"
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    fast = ["train.steps=2", "train.eval_batches=1", "train.progress=off"]  # the line's run, shortened
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([argv[0], "--out", str(tmp_path / "run"), *argv[1:], *fast]) == 0
    assert "on digits" in out.getvalue() and "accuracy" in out.getvalue()
