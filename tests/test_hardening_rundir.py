"""Run directories under attack (issue 27, deliverable 2): no write follows a pre-placed symlink, and
one job at a time holds a run directory (``run.lock``, flock: a dead holder's lock is free)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import runlock

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["model.overrides.n_layer=1", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=4", "train.eval_every=0", "train.eval_batches=1",
        "train.log_every=1", "optim.warmup_steps=1", "train.progress=off", "train.checkpoint_every=2"]


def _err_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scaletrain: error:") and "Traceback" not in err, err
    return err


def test_preplaced_symlinks_never_send_a_write_outside(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, "train.steps=3"]) == 0  # checkpoints at 2 and 3
    ckpt.remove(out / "checkpoints" / "step_00000003.pt")  # the resume trims metrics row 3: a rewrite
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    links = [out / "config.toml.tmp", out / "metrics.jsonl.tmp", out / "checkpoints" / "step_00000004.pt.tmp",
             out / "checkpoints" / "step_00000003.pt.tmp"]
    for link in links:
        link.symlink_to(victim)
    assert main(["train", "--out", str(out), "--resume", "train.steps=4"]) == 0
    capsys.readouterr()
    assert victim.read_text() == "precious"
    assert ckpt.load(ckpt.latest(out / "checkpoints"))["step"] == 4
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    (out / "metrics.jsonl").unlink()  # a symlinked metrics file itself: refused, not followed
    (out / "metrics.jsonl").symlink_to(victim)
    assert "symbolic link" in _err_line(capsys, ["train", "--out", str(out), "--resume", "train.steps=5"])
    assert victim.read_text() == "precious"
    (out / "metrics.jsonl").unlink()
    (out / runlock.LOCK_FILE).symlink_to(victim)  # nor is a symlinked lock file opened
    assert "symbolic link" in _err_line(capsys, ["train", "--out", str(out), "--resume", "train.steps=5"])
    assert victim.read_text() == "precious"


def _holder(out: Path) -> subprocess.Popen:
    """Another process holding ``out``'s lock until killed (says 'held' once it does)."""
    code = ("import sys, time; from pathlib import Path; from scaletrain.train import runlock; "
            "runlock.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_job_on_a_busy_run_directory_refuses_and_a_dead_holders_lock_is_free(tmp_path, capsys):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        for argv in (["train", "--out", str(out), *TINY, "train.steps=1"],
                     ["train", "--out", str(out), "--resume", *TINY, "train.steps=1"],
                     ["train", "--nproc-per-node", "2", "--out", str(out), *TINY, "train.steps=1"]):
            line = _err_line(capsys, argv)
            assert f"is in use by pid {holder.pid} on host " in line, line
        assert sorted(os.listdir(out)) == [runlock.LOCK_FILE]  # the refused jobs wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel releases the flock
        holder.wait()
    assert main(["train", "--out", str(out), *TINY, "train.steps=1"]) == 0
    assert not (out / runlock.LOCK_FILE).exists() and (out / "config.toml").is_file()
    lock = runlock.acquire(tmp_path / "fresh" / "dir")  # a fresh directory made for the lock...
    lock.release()
    assert not (tmp_path / "fresh").exists()  # ...is removed when the job ends before writing anything


def test_a_restart_row_only_in_a_restarted_round(tmp_path, monkeypatch):
    """Under a torchrun agent store, rank 0's first round (a --resume of a finished run included)
    logs no restart; a later round of the same job does."""
    from torch.distributed import TCPStore

    from scaletrain.train import elastic

    server = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv(elastic.AGENT_STORE_ENV, "True")
    monkeypatch.setattr(elastic, "_STORE", None)
    monkeypatch.setattr(elastic, "_ROUND", {})
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 20, "loss": 1.0}\n')  # a finished run
    elastic.claim(out)
    assert elastic.restart_clock(out, 20) is None
    elastic.claim(out)  # the next round's rank 0
    clock = elastic.restart_clock(out, 18)
    assert clock is not None and (clock.attempt, clock.failed_step, clock.start_step) == (1, 20, 18)


def test_a_full_disk_during_a_consolidated_save_is_one_line_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """torch.save's zip writer reports a disk that fills mid-record as a RuntimeError ("unexpected pos",
    seen on a 1.5 MB tmpfs): the save is a one-line UserError, its temp file is gone, older files stay."""
    import torch

    old = ckpt.save(tmp_path, 1, {"w": torch.zeros(4)})

    def full(obj, f, *a, **k):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1336576 vs 1336464")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.UserError, match="checkpoint of step 2 not written.*unexpected pos"):
        ckpt.save(tmp_path, 2, {"w": torch.zeros(4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]
