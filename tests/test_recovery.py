"""Automatic recovery (`--max-restarts`): a rank killed twice, the job still ends where an
uninterrupted one does. The 4-process pp=2 x ZeRO-1 version is `benchmarks/faults/recovery.py`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.train import checkpoint as ckpt

SRC = str(Path(__file__).resolve().parents[1] / "src")
COMMON = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=32",
          "data.name=synthetic-text", "train.global_batch=4", "train.steps=8", "train.checkpoint_every=2",
          "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "optim.warmup_steps=2"]


def fault_env(faults: str | None) -> dict[str, str]:
    """This environment with ``src`` importable and rank 1 killed at the steps ``faults`` (none: no fault)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("SCALETRAIN_FAULT_AT_STEP", "SCALETRAIN_FAULT_RANK", "SCALETRAIN_FAULT_KIND"):
        env.pop(k, None)
    if faults:
        env.update(SCALETRAIN_FAULT_AT_STEP=faults, SCALETRAIN_FAULT_RANK="1", SCALETRAIN_FAULT_KIND="kill")
    return env


def final_parameters_diff(base: Path, hit: Path) -> float:
    """The largest difference between the newest checkpoints' parameters (both must be at the last step)."""
    a = ckpt.load(ckpt.latest(base / "checkpoints"))
    b = ckpt.load(ckpt.latest(hit / "checkpoints"))
    assert a["step"] == b["step"] == 8
    return max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"])


def logged_losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training row of ``out/metrics.jsonl``."""
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _train(out: Path, faults: str | None) -> subprocess.CompletedProcess:
    env = fault_env(faults)
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "2", "--max-restarts", "3",
           "--out", str(out), *COMMON]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_rank_killed_twice_ends_with_uninterrupted_parameters(tmp_path, recovery_base):
    hit = _train(tmp_path / "hit", "3,6")  # step 3: before any checkpoint but step 2's; step 6: one step after 4's
    assert hit.returncode == 0, hit.stderr[-2000:]
    assert hit.stderr.count("rank 1 died (SIGKILL)") == 2 and "Traceback" not in hit.stderr
    diff = final_parameters_diff(recovery_base, tmp_path / "hit")
    assert diff <= 1e-6, diff
    rows = [json.loads(line) for line in (tmp_path / "hit" / "metrics.jsonl").read_text().splitlines()]
    losses = logged_losses(tmp_path / "hit")
    assert [s for s, _ in losses] == list(range(1, 9))  # no step logged twice after the resumes
    restarts = [r for r in rows if r.get("event") == "restart"]
    assert [r["attempt"] for r in restarts] == [1, 2]
    assert [r["failed_at_step"] for r in restarts] == [2, 5] and [r["recomputed_steps"] for r in restarts] == [0, 1]
    for r in restarts:  # the four parts add up to the time lost
        parts = r["detect_s"] + r["restart_s"] + r["reload_s"] + r["recompute_s"]
        assert r["lost_s"] > 0 and parts == pytest.approx(r["lost_s"], abs=1e-3)
    assert torch.allclose(torch.tensor(losses), torch.tensor(logged_losses(recovery_base)), rtol=0, atol=1e-6)
