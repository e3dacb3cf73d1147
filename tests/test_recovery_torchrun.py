"""Recovery under the user's own ``torchrun --max-restarts`` across "nodes": two torchrun agents on
this machine (node ranks 0 and 1, one process each, c10d rendezvous on localhost) run
``-m scaletrain.cli train``; rank 1 is killed once, the agents restart both workers, the restarted
round resumes from the newest checkpoint of the same run directory, and the job ends with the
parameters of an uninterrupted run (see ``scaletrain.train.elastic``)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.testing import free_port
from test_recovery import COMMON, fault_env, final_parameters_diff, logged_losses


def _two_nodes(out: Path, faults: str | None, backend: str = "c10d") -> tuple[list[subprocess.CompletedProcess], float]:
    """Both agents' results and the job's wall time."""
    port, env = free_port(), fault_env(faults)
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    t0 = time.monotonic()
    for node in (0, 1):
        rdzv = (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", out.name]
                if backend == "c10d" else
                ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "--node-rank", str(node)])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--max-restarts", "2", *rdzv, "-m", "scaletrain.cli", "train", "--out", str(out), *COMMON]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    done = []
    for p in procs:
        stdout, _ = p.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return done, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_torchrun_restart_across_nodes_resumes_with_uninterrupted_parameters(tmp_path, backend, recovery_base):
    base = recovery_base  # the uninterrupted job (tests/conftest.py)
    hit, t_hit = _two_nodes(tmp_path / "hit", "6", backend)  # step 6: one step after step 4's checkpoint
    text = hit[0].stdout + hit[1].stdout
    assert all(r.returncode == 0 for r in hit), text[-6000:]
    assert (tmp_path / "hit" / "fault-6.json").is_file()  # the fault fired
    assert f"resumed from {tmp_path / 'hit' / 'checkpoints' / 'step_00000004'} at step 4" in text
    assert "connectFullMesh" not in text
    diff = final_parameters_diff(base, tmp_path / "hit")
    assert diff <= 1e-6, diff
    losses = logged_losses(tmp_path / "hit")
    assert [s for s, _ in losses] == list(range(1, 9))  # step 5, run twice, is logged once
    assert torch.allclose(torch.tensor(losses), torch.tensor(logged_losses(base)), rtol=0, atol=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "hit" / "metrics.jsonl").read_text().splitlines()]
    restarts = [r for r in rows if r.get("event") == "restart"]
    assert [(r["attempt"], r["failed_at_step"], r["resumed_from_step"], r["recomputed_steps"]) for r in restarts] == [
        (1, 5, 4, 1)]
    parts = sum(restarts[0][k] for k in ("detect_s", "restart_s", "reload_s", "recompute_s"))
    assert restarts[0]["lost_s"] > 0 and parts == pytest.approx(restarts[0]["lost_s"], abs=1e-3)
    print(f"\n{restarts[0]}\ntime lost to one failure under torchrun ({backend}): {restarts[0]['lost_s']:.1f} s "
          f"(job {t_hit:.1f} s)")


def test_agent_store_claim_lets_only_this_job_reuse_its_run_directory(tmp_path, monkeypatch):
    """A run directory that holds a run is reused by a restarted round only when this job (its
    agent store) accepted it before; an earlier job's run is still refused in one line."""
    from torch.distributed import TCPStore

    from scaletrain.errors import ConfigError
    from scaletrain.train import elastic, rundir

    server = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv(elastic.AGENT_STORE_ENV, "True")
    monkeypatch.setattr(elastic, "_STORE", None)
    old, ours = tmp_path / "old", tmp_path / "ours"
    rundir.check_target(ours, resume=False)  # accepted (new): claimed
    for d in (old, ours):
        (d / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.check_target(old, resume=False)
    rundir.check_target(ours, resume=False)
    assert elastic.owns(ours) and not elastic.owns(old)
    assert not elastic.resume_round(ours)  # no checkpoint yet: the round starts over
    (ours / "checkpoints" / "step_00000002.pt").write_bytes(b"")
    assert elastic.resume_round(ours) and not elastic.resume_round(old)
