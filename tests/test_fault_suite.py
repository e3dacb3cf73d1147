"""Issue 16's fault-injection suite at CI scale (the full matrix: ``benchmarks/faults/suite.py``).

Fast: the injection points (``SCALETRAIN_FAULT_WHERE``) on one process — a death mid-save leaves
only a temp directory that listing ignores and rotation removes, a full disk fails the save in one
line with the previous checkpoint intact, a truncated shard file is named as damaged. Slow: two
faults in one ZeRO-3 job (killed mid-save, then mid-collective) end where an uninterrupted run does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.errors import UserError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import faults
from scaletrain.train import sharded_checkpoint as sharded
from scaletrain.train.shards import Piece

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV_KEYS = ("SCALETRAIN_FAULT_AT_STEP", "SCALETRAIN_FAULT_RANK", "SCALETRAIN_FAULT_KIND", "SCALETRAIN_FAULT_WHERE")


def _save(directory: Path, step: int) -> Path:
    pieces = [Piece(f"model/w{i}", (4, 3), (0, 0), torch.full((4, 3), float(step + i))) for i in range(3)]
    return sharded.save(directory, step, pieces, {"step": step}, rank=0, world=1, keep=3, rotate=ckpt.rotate).wait()


def _arm(monkeypatch, kind: str) -> None:
    """A fault of ``kind`` mid-save of step 4 on rank 0."""
    for k, v in zip(ENV_KEYS, ("4", "0", kind, "save")):
        monkeypatch.setenv(k, v)


def test_armed_places(monkeypatch):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    assert faults.armed() == {}
    faults.maybe_fire(1, 0, None)  # unset: nothing happens
    monkeypatch.setenv("SCALETRAIN_FAULT_AT_STEP", "4,7")
    monkeypatch.setenv("SCALETRAIN_FAULT_WHERE", "save,collective")
    assert faults.armed() == {4: "save", 7: "collective"}
    monkeypatch.setenv("SCALETRAIN_FAULT_WHERE", "async-save")
    assert faults.armed() == {4: "async-save", 7: "async-save"}


def test_death_mid_save_leaves_only_an_ignored_temp_dir(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints"
    d.mkdir()
    first = _save(d, 2)
    _arm(monkeypatch, "raise")  # a kill, without killing pytest
    with pytest.raises(RuntimeError, match="injected fault at step 4"):
        _save(d, 4)
    tmp = [p for p in d.iterdir() if ".tmp-" in p.name]
    assert len(tmp) == 1 and (tmp[0] / sharded.rank_file(0)).stat().st_size > 0  # part of the shard written
    assert ckpt.list_checkpoints(d) == [first] and sharded.problem(first) is None
    assert (tmp_path / "fault-4-save.json").exists()
    _save(d, 4)  # fired once: the retry writes, and rotation removes the leftover
    assert sorted(p.name for p in d.iterdir()) == ["step_00000002", "step_00000004"]


def test_disk_full_fails_in_one_line_previous_intact(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints"
    d.mkdir()
    first = _save(d, 2)
    _arm(monkeypatch, "enospc")
    with pytest.raises(UserError, match="checkpoint of step 4 not written: .*No space left") as e:
        _save(d, 4)
    assert "\n" not in str(e.value)
    assert sorted(d.iterdir()) == [first] and sharded.problem(first) is None


def test_consolidated_disk_full_fails_in_one_line(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints"
    first = ckpt.save(d, 2, {"step": 2, "model": {"w": torch.ones(3)}})
    _arm(monkeypatch, "enospc")
    with pytest.raises(UserError, match="checkpoint of step 4 not written: .*No space left"):
        ckpt.save(d, 4, {"step": 4, "model": {"w": torch.zeros(3)}})
    assert sorted(d.iterdir()) == [first] and torch.load(first, weights_only=True)["model"]["w"].sum() == 3


def test_truncated_shard_is_named_damaged(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    _save(d, 2)
    newest = _save(d, 4)
    f = newest / sharded.rank_file(0)
    f.write_bytes(f.read_bytes()[:10])
    assert sharded.problem(newest) is not None and sharded.problem(d / "step_00000002") is None


COMMON = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=32",
          "data.name=synthetic-text", "train.global_batch=4", "train.steps=6", "train.checkpoint_every=2",
          "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "optim.warmup_steps=2",
          "parallel.zero=3", "train.checkpoint_format=sharded"]


def _start(out: Path, env_faults: dict[str, str]) -> subprocess.Popen:
    """Start a 2-process job (the uninterrupted and the faulted one run side by side: the faulted
    one waits most of its time on detection and restarts)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ENV_KEYS:
        env.pop(k, None)
    env.update(env_faults)
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "2", "--max-restarts", "3",
           "--out", str(out), *COMMON]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _params(run: Path) -> dict[str, torch.Tensor]:
    return sharded.Reader(ckpt.latest(run / "checkpoints")).state(lazy=False)["model"]


@pytest.mark.slow
def test_zero3_killed_mid_save_then_mid_collective(tmp_path):
    hit = _start(tmp_path / "hit", {"SCALETRAIN_FAULT_AT_STEP": "4,5", "SCALETRAIN_FAULT_WHERE": "save,collective",
                                    "SCALETRAIN_FAULT_RANK": "1", "SCALETRAIN_FAULT_KIND": "kill"})
    base = _start(tmp_path / "base", {})
    hit_err, base_err = hit.communicate(timeout=300)[1], base.communicate(timeout=300)[1]
    assert base.returncode == 0, base_err[-2000:]
    assert hit.returncode == 0, hit_err[-2000:]
    assert hit_err.count("rank 1 died (SIGKILL)") == 2 and "Traceback" not in hit_err
    a, b = _params(tmp_path / "base"), _params(tmp_path / "hit")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff
    rows = [json.loads(line) for line in (tmp_path / "hit" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))  # every step logged once
    restarts = [r for r in rows if r.get("event") == "restart"]
    assert [r["resumed_from_step"] for r in restarts] == [2, 4] and all(r["lost_s"] > 0 for r in restarts)
