"""Launching under torchrun, the traffic ledger, config conflicts, and hangs that end with a message."""

import json
import subprocess
import sys
import time

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.measure import comm as ledger
from scaletrain.techniques.data_parallel import launch as dp
from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config

TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=32",
        "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=1", "train.log_every=1",
        "optim.warmup_steps=2", "train.steps=4", "train.eval_every=0", "train.progress=off"]


def test_launch_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert dp.launch_env() == dp.LaunchEnv(0, 1, 0, 1)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    env = dp.launch_env()
    assert (env.rank, env.world, env.local_rank, env.local_world, env.distributed) == (5, 8, 1, 4, True)
    monkeypatch.setenv("RANK", "9")
    with pytest.raises(ConfigError, match="RANK=9"):
        dp.launch_env()


def test_backend_and_command():
    assert dp.backend_for(torch.device("cpu")) == "gloo"
    assert dp.backend_for(torch.device("cuda", 1)) == "nccl"
    from scaletrain.train.agent import torchrun_command

    cmd = torchrun_command(4, ["train", "parallel.zero=3"])
    assert cmd[0] == sys.executable and "--nproc-per-node=4" in cmd and "--standalone" in cmd
    assert cmd[-4:] == ["-m", "scaletrain.cli", "train", "parallel.zero=3"]


def test_ledger_counts_ring_bytes(monkeypatch):
    """Bytes received per rank by ring algorithms (the convention of REFERENCES.md)."""
    monkeypatch.setattr(ledger, "_ledger_group_size", lambda g: 4)
    led = ledger.CommLedger()
    t = torch.zeros(1000)  # 4000 bytes
    led.record("all_reduce", {"tensor": t}, None)
    led.record("reduce_scatter_single", {"output": t[:250], "input": t}, None)
    led.record("all_gather_single", {"output_tensor": t, "input_tensor": t[:250]}, None)
    assert led.bytes == {"all_reduce": 6000.0, "reduce_scatter_single": 3000.0, "all_gather_single": 3000.0}
    with led.paused():
        led.record("all_reduce", {"tensor": t}, None)
    assert led.total() == 12000.0 and led.calls["all_reduce"] == 1
    assert led.last == ("all_reduce", 4000, 4)


@pytest.mark.parametrize("extra,needle", [
    (["parallel.dp=2"], "parallel.dp=2 but 1 process(es) were started"),
    (["parallel.compression=topk", "parallel.zero=2"], "allowed: parallel.compression with parallel.zero=0"),
    (["parallel.hsdp=2"], "parallel.hsdp=2 with parallel.zero=0"),
    (["parallel.zero=4"], "must be <= 3"),
])
def test_parallel_config_conflicts(extra, needle):
    from scaletrain.train.trainer import Trainer

    with pytest.raises(ConfigError) as e:
        Trainer(load_config(None, TINY + extra), None, log=lambda s: None)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_comm_failure_message():
    class Timeout(RuntimeError):
        pass

    ledger.LEDGER.last = ("reduce_scatter_single", 3 * 2**20, 4)
    f = dp.explain_comm_failure(Timeout("[gloo] Timed out waiting 3000ms for recv operation"), 2, 6, 3.0)
    assert str(f).startswith("rank 2: reduce_scatter_single of 3.00 MiB over 4 ranks at step 7 timed out after 3 s")
    assert dp.explain_comm_failure(ValueError("unrelated"), 0, 0, 3.0) is None


@pytest.mark.slow
def test_cli_nproc_per_node_equals_one_process(tmp_path, capfd, monkeypatch):
    """The issue's command, `scaletrain train --nproc-per-node 4 parallel.zero=3`, on the default model
    (gpt2-tiny, shipped Shakespeare; only the step count shortened): one log, one metrics file, the
    same losses and final parameters as one process."""
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train.trainer import Trainer

    short = ["train.steps=6", "train.log_every=1", "train.eval_every=0", "train.progress=off"]
    trainer = Trainer(load_config(None, short), None, log=lambda s: None)
    one = trainer.fit().losses
    one_params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.close()
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "4", "--out",
                        str(tmp_path / "run"), "parallel.zero=3", *short], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("scaletrain: training") == 1 and "ZeRO stage 3" in r.stdout
    for bad in ("terminate called", "Traceback", "abort", "ProcessGroup"):
        assert bad not in r.stderr, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in rows if "loss" in x]
    assert losses == pytest.approx(one, rel=1e-5)
    four = ckpt.load(ckpt.latest(tmp_path / "run" / "checkpoints"))["model"]
    for k, v in one_params.items():
        assert torch.allclose(four[k], v, rtol=1e-5, atol=1e-6), k
    assert all(x["comm_bytes"] > 0 for x in rows if "loss" in x)
    # a config conflict is reported once, before any process starts (in-process: no process to start)
    from scaletrain.cli import main

    (tmp_path / "conflict").mkdir()
    monkeypatch.chdir(tmp_path / "conflict")
    capfd.readouterr()
    assert main(["train", "--nproc-per-node", "2", "parallel.dp=4"]) == 2
    err = capfd.readouterr().err  # the file descriptor: a worker's line would be here too
    assert err.strip().count("\n") == 0 and "conflicts with --nproc-per-node" in err, err
    assert not any((tmp_path / "conflict").iterdir())  # nothing written


def _hang(rank, world):
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + ["parallel.timeout_s=2"]), None, log=lambda s: None)
    if rank == 1:  # this rank stops taking part
        time.sleep(4)
        return None
    t0 = time.perf_counter()
    try:
        t.fit()
    except dp.CommFailure as e:
        return str(e), time.perf_counter() - t0
    return "no failure", 0.0


@pytest.mark.slow
def test_hang_ends_with_one_line_naming_rank_and_collective():
    msg, waited = run_distributed(_hang, 2, timeout_s=2)[0]
    assert msg.startswith("rank 0: all_reduce of") and "timed out after 2 s" in msg, msg
    assert "\n" not in msg and waited < 30
