"""The launcher owns its process tree (issue 27, deliverable 3).

One slow test, two jobs of 2 ranks: a SIGKILLed torchrun agent's ranks are gone before the next
attempt starts, and a second job on the busy run directory is refused in one line; SIGTERM to the
launcher ends the job quietly (one line, exit 143); SIGKILL to the launcher leaves no process of
the job alive and the run directory's lock free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.train import runlock
from scaletrain.train.job_env import LAUNCHER_PID_ENV

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["model.overrides.n_layer=1", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=4", "train.eval_every=0", "train.eval_batches=1",
        "train.log_every=100", "optim.warmup_steps=1", "train.progress=off", "train.checkpoint_every=0",
        "train.steps=1000000"]


def _job(launcher: int) -> dict[int, bool]:
    """Live processes started for ``launcher`` (pid -> is a rank), found by their environment."""
    marker = f"\0{LAUNCHER_PID_ENV}={launcher}\0".encode()
    found = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = b"\0" + Path(f"/proc/{d}/environ").read_bytes()
            state = Path(f"/proc/{d}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in env and state != b"Z":
            found[int(d)] = b"\0RANK=" in env
    return found


def _wait(cond, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _start(out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "2",
                             "--max-restarts", "1", "--out", str(out), *TINY], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _ranks_up(launcher: int, exclude: set[int] = frozenset()) -> dict[int, bool] | None:
    job = _job(launcher)
    ranks = [p for p, is_rank in job.items() if is_rank and p not in exclude]
    return job if len(ranks) == 2 else None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the job's processes in /proc")
def test_killed_agent_and_launcher_leave_no_process_behind(tmp_path, capsys):
    out = tmp_path / "run"
    a = _start(out)
    try:
        job = _wait(lambda: _ranks_up(a.pid), "the first attempt's ranks")
        agent = next(p for p, is_rank in job.items() if not is_rank)
        ranks = {p for p, is_rank in job.items() if is_rank}
        os.kill(agent, signal.SIGKILL)
        new = _wait(lambda: [p for p, r in _job(a.pid).items() if not r and p != agent], "the second attempt")
        assert not ranks & set(_job(a.pid)), "the killed agent's ranks outlived it into the next attempt"
        assert new
        rc = main(["train", "--out", str(out), "--resume", *TINY])  # a second job on the busy run directory
        assert rc == 2 and f"in use by pid {a.pid} on host" in capsys.readouterr().err
        _wait(lambda: _ranks_up(a.pid, ranks), "the second attempt's ranks")
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=60) == 143
        text = a.stderr.read()
        err = [line for line in text.splitlines() if line.strip()]  # the restart's line, then SIGTERM's
        assert len(err) == 2 and "agent died (SIGKILL)" in err[0] and "restart 1 of 1" in err[0], err
        assert "stopped by SIGTERM" in err[1] and "Traceback" not in text, err
        _wait(lambda: not _job(a.pid), "the job's processes to end after SIGTERM", timeout=15)
    finally:
        a.kill()
        a.wait()
    b = _start(tmp_path / "other")
    try:
        _wait(lambda: _ranks_up(b.pid), "the ranks of the job to SIGKILL")
        b.send_signal(signal.SIGKILL)
        b.wait()
        _wait(lambda: not _job(b.pid), "no process of the SIGKILLed launcher's job", timeout=15)
    finally:
        b.kill()
        b.wait()
    runlock.acquire(tmp_path / "other").release()  # the dead launcher's lock is free
