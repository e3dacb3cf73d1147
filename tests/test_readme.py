"""The README stays true: its "bring your own model" line runs (`examples/mymodels.py`), every command it
shows exists and answers `--help`, and its cheap commands (models, optimizers, compat) run as written."""

from __future__ import annotations

import contextlib
import io
import re
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


# --- every command the README shows, kept from rotting -------------------------------------------------

CHEAP = {"models", "optimizers", "compat"}  # answer in seconds, write nothing: run as the README writes them


def _readme_commands() -> list[str]:
    """The `scaletrain ...` lines of the README's plain fenced blocks, continuation lines joined."""
    lines, block, fenced = [], "", False
    for raw in (ROOT / "README.md").read_text().splitlines():
        if raw.startswith("```"):
            fenced, block = raw == "```" and not fenced, ""
            continue
        if not fenced:
            continue
        block += raw.rstrip()[:-1] + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            lines.append(block.strip())
            block = ""
    return [x for x in lines if "scaletrain " in x and x.split()[0] in ("scaletrain", "PYTHONPATH=examples")]


def _words(line: str) -> list[str]:
    """After `scaletrain`: the words, comments, placeholders (`...`) and `[optional]` groups dropped."""
    words = shlex.split(re.sub(r"\[[^\[\]]*\]", " ", line), comments=True)
    return [w for w in words[words.index("scaletrain") + 1:] if w != "..."]


def _variants(line: str) -> list[list[str]]:
    """The line without its `[...]` groups, then with each group's each `A | B` alternative in turn."""
    out = [_words(line)]
    for group in re.findall(r"\[([^\[\]]*)\]", line):
        for alt in group.split(" | "):
            out.append(_words(re.sub(r"\[[^\[\]]*\]", " ", line.replace(f"[{group}]", alt, 1))))
    return out


def _command_path(words: list[str]) -> list[str]:
    """The (sub-)command words: `checkpoint info`, `data prepare`, `train`, ..."""
    path = []
    for w in words:
        if not re.fullmatch(r"[a-z]+", w):
            break
        path.append(w)
    return path


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's --help
            rc = e.code
    return rc, out.getvalue()


def test_every_readme_command_exists_and_its_help_answers():
    commands = {tuple(_command_path(_words(x))) for x in _readme_commands()}
    assert len(commands) >= 12, commands  # the README shows most commands; the parser below must know them
    for path in sorted(commands):
        rc, text = _run([*path, "--help"])
        assert rc == 0 and text.startswith(f"usage: scaletrain {' '.join(path)}"), (path, text[:200])


def test_the_cheap_readme_commands_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing they print may need a file; nothing they write may land in the repo
    ran = []
    for line in _readme_commands():
        for argv in _variants(line):
            if argv and argv[0] in CHEAP and argv not in ran:
                rc, text = _run(argv)
                assert rc == 0 and text.strip(), (line, argv, rc)
                ran.append(argv)
    assert {a[0] for a in ran} == CHEAP and ["compat", "--markdown"] in ran, ran
    assert list(tmp_path.iterdir()) == []


def test_the_readme_runs_file_is_valid(tmp_path):
    from scaletrain.sweep import grid
    from scaletrain.sweep.options import SweepOptions

    text = (ROOT / "README.md").read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "runs.toml").write_text(text)
    table, runs = grid.file_runs(str(tmp_path / "runs.toml"), [])
    assert set(table) <= set(SweepOptions.__dataclass_fields__) and table
    assert [n for n, _, _ in runs] == ["small-lr", "large-lr"] and runs[1][1].optim.lr == 1e-2


def test_an_imported_file_resumes_only_with_its_models_keys(tmp_path, capsys):
    """`checkpoint import F --out runs/y`, then `--resume` with another model: one line naming the
    mismatched tensors (the README: resume with the model's keys); with the model's keys it trains on."""
    from safetensors.torch import save_file

    from scaletrain import models

    tensors = {k: v.clone() for k, v in models.get("gpt2-tiny").state_dict().items()}  # as `export` writes them
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert main(["checkpoint", "import", str(tmp_path / "model.safetensors"), "--out", str(tmp_path / "y")]) == 0
    fast = ["train.steps=1", "train.eval_batches=1", "train.progress=off", "train.global_batch=2", "data.seq_len=16"]
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "y"), "--resume", "model.name=gpt2-mini", *fast]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(r"(size mismatch for|Missing key\(s\) in state_dict:) \S", err), err
    assert main(["train", "--out", str(tmp_path / "y"), "--resume", "model.name=gpt2-tiny", *fast]) == 0
