"""``scaletrain train plan=auto``: properties, never timings (the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from scaletrain.cli import main
from scaletrain.errors import ConfigError
from scaletrain.plan import Plan
from scaletrain.planner import auto
from scaletrain.platform import GiB, Platform
from scaletrain.techniques import compat
from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config

TINY = ["model.overrides.n_layer=2", "train.global_batch=8", "data.seq_len=32", "train.eval_every=0",
        "train.eval_batches=1", "train.progress=off", "train.log_every=1"]


def _platform(world: int) -> Platform:
    """A made-up CPU (no measurement): only properties of the choice are asserted."""
    return Platform(name="test", device_memory_bytes=4 * GiB, flops_fp32=5e10, flops_bf16=5e10,
                    device_mem_bytes_per_s=5e9, intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9,
                    intra_node_efficiency=1.0, inter_node_efficiency=1.0, intra_node_latency_s=5e-5,
                    inter_node_latency_s=5e-5, devices_per_node=world, matmul_efficiency=((0.0, 0.5),),
                    mem_efficiency=((0.0, 0.5),))


def test_plan_is_a_top_level_key_of_the_one_schema(tmp_path):
    assert load_config(None, ["plan=auto"]).plan == "auto"
    (tmp_path / "c.toml").write_text('plan = "auto"\n[train]\nsteps = 3\n')
    assert load_config(tmp_path / "c.toml").plan == "auto"
    with pytest.raises(ConfigError, match="allowed: manual, auto"):
        load_config(None, ["plan=fast"])
    with pytest.raises(ConfigError, match="must name a section"):
        load_config(None, ["steps=3"])


def test_pins_and_refusals():
    cfg = load_config(None, ["plan=auto", "parallel.tp=2", "train.micro_batch=2", "memory.remat.blocks=all"])
    assert auto.check(cfg) == {"tp": 2, "micro_batch": 2, "remat": "full"}
    assert auto.check(load_config(None, ["plan=auto", "train.precision=bf16", "optim.name=sgd"])) == {}
    assert auto.check(load_config(None, ["plan=auto", "parallel.cp=2", "parallel.balance=equal"])) == {
        "cp": 2, "pp_split": "equal"}
    for bad in ("memory.offload.params=host", "parallel.compression=powersgd",
                "memory.remat.method=optimal", "parallel.microbatches=4"):
        with pytest.raises(ConfigError, match="plan=auto does not plan"):
            auto.check(load_config(None, ["plan=auto", bad]))
    with pytest.raises(ConfigError, match="synchronous schedules"):
        auto.check(load_config(None, ["plan=auto", "parallel.pp=2", "parallel.schedule=pipedream"]))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_choice_is_runnable_and_fits(world):
    """The chosen plan passes the compatibility table for the real model on this device, fits by
    plan_costs, and its keys round-trip through the config (what the trainer runs)."""
    cfg = load_config(None, ["plan=auto", *TINY])
    got = auto._plan_on_rank0(cfg, world, {}, _platform(world), torch.device("cpu"))
    plan = Plan.from_flat(got["plan"])
    assert plan.world() == world and plan.precision == "fp32" and plan.optimizer == "adamw"
    from scaletrain import models

    model = models.get("gpt2-tiny", device="meta", n_layer=2)
    m = plan.microbatches if plan.pp > 1 else 8 // (plan.dp * plan.micro_batch)
    assert not compat.violations(plan, compat.Facts.of(model, world=world, device="cpu", seq_len=32, microbatches=m))
    assert 0 < got["predicted_peak_bytes"] < 4 * GiB and got["predicted_step_time_s"] > 0
    assert (got["predicted_comm_bytes"] > 0) == (world > 1)
    applied = auto.apply(cfg, plan)
    assert applied.plan == "manual" and Plan.from_config(applied) == plan


def test_pins_are_honoured_and_impossible_pins_fail_in_one_line():
    cfg = load_config(None, ["plan=auto", "parallel.pp=2", *TINY])
    got = auto._plan_on_rank0(cfg, 2, auto.check(cfg), _platform(2), torch.device("cpu"))
    assert Plan.from_flat(got["plan"]).pp == 2
    cfg = load_config(None, ["plan=auto", "parallel.tp=3", *TINY])
    with pytest.raises(ConfigError, match="no runnable plan .* with tp=3"):
        auto._plan_on_rank0(cfg, 2, auto.check(cfg), _platform(2), torch.device("cpu"))


def test_cli_conflicts_exit_2_in_one_line(tmp_path, capsys):
    assert main(["train", "plan=auto", "memory.offload.optimizer=host"]) == 2
    (tmp_path / "p.toml").write_text("[parallel]\nzero = 1\n")
    assert main(["train", "--plan", str(tmp_path / "p.toml"), "plan=auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "does not plan memory.offload.optimizer" in err[0] and "give one of them" in err[1]


def _choose(rank: int, world: int) -> dict:
    from scaletrain.planner import local

    # rank 1 "measures" a machine whose all-reduce is 1000x slower: planning on its own it would choose
    # differently; the plan it runs must still be rank 0's
    slow = _platform(world).with_(intra_node_bytes_per_s=1e6, inter_node_bytes_per_s=1e6, intra_node_latency_s=0.1)
    local.measure = lambda w, precision="fp32", model=None, optimizer="adamw", **kw: _platform(w) if rank == 0 else slow
    cfg = load_config(None, ["plan=auto", *TINY])
    own = auto._plan_on_rank0(cfg, world, {}, local.measure(world), torch.device("cpu"))["plan"]
    return {"chosen": auto.choose(cfg, world, rank, torch.device("cpu")).plan.to_flat(), "own": own}


def test_all_ranks_pick_rank0s_plan():
    """Every rank measures its own timings; the plan is rank 0's, broadcast."""
    r0, r1 = run_distributed(_choose, 2)
    assert r0["own"] != r1["own"]  # the ranks would disagree on their own
    assert r0["chosen"] == r1["chosen"] == r0["own"]


def test_one_process_run_logs_predicted_next_to_measured(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    from scaletrain.train import host_work, trainer

    seen = {}
    real = trainer.plan_auto.choose
    monkeypatch.setattr(trainer.plan_auto, "choose", lambda *a, **k: seen.update(k) or real(*a, **k))
    assert main(["train", "--out", str(out), "--json", "plan=auto", "train.steps=3", "train.measure_memory=true",
                 *TINY]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(rows) == 3 and all(r["predicted_step_time_s"] > 0 and r["predicted_peak_bytes"] > 0 for r in rows)
    # within 2 %: with accumulation the embedding's new gradient is held while it is added (not modelled)
    assert rows[-1]["tracked_peak_bytes_max"] == pytest.approx(rows[-1]["predicted_peak_bytes"], rel=0.02)
    for k in ("plan", "predicted_step_time_s", "step_time_s", "predicted_peak_bytes", "tracked_peak_bytes_max"):
        assert k in summary
    assert 'plan = "manual"' in (out / "config.toml").read_text()  # resume runs the chosen plan as is
    assert seen["host_work"].func is host_work.host_seconds  # the trainer hands plan=auto its own host measurement
    assert seen["host_work"].keywords["trainer_cls"] is trainer.Trainer


@pytest.mark.slow
def test_two_processes_run_the_choice_with_its_traffic_and_peak(tmp_path):
    out = tmp_path / "run"
    # dp=2 pinned: the rest (ZeRO stage, micro-batch, remat) is the planner's. This 2-layer model's first choice
    # used to be a 2-stage zb1p (measured 27-31 ms against dp=2's 20 ms, both predicted ~13 ms); the pipeline's
    # host time per action and gloo's blocking receive are now priced (Platform.pipeline_action_s, p2p_recv_s)
    # and at load it picks dp=2, but the choice depends on the calibration of the moment, and a zb1p's peak is
    # bounded from above (+5 %: the I pass's kept output gradients) — this test proves the run equals its
    # prediction, benchmarks/planner/measured_models.py measures which plan is fastest.
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "2", "--out", str(out),
                        "plan=auto", "parallel.dp=2", "train.steps=3", "train.measure_memory=true", *TINY],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("plan=auto: ") == 1 and "predicted vs measured" in r.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert all(x["comm_bytes"] == x["predicted_comm_bytes"] for x in rows)
    assert rows[-1]["tracked_peak_bytes_max"] == pytest.approx(rows[-1]["predicted_peak_bytes"], rel=0.02)


def test_plan_auto_on_a_gpu_points_to_scaletrain_plan():
    """plan=auto measures CPU kernels; on a CUDA device it refuses in one line, before measuring anything, and
    names the on-paper route (scaletrain plan --platform ... --out, then train --plan)."""
    from scaletrain.train.config import load_config

    cfg = load_config(None, ["plan=auto", "model.name=gpt2-mini"])
    with pytest.raises(ConfigError) as e:
        auto.choose(cfg, 2, 0, torch.device("cuda", 0))
    msg = str(e.value)
    assert "\n" not in msg and "scaletrain plan --model gpt2-mini" in msg and "--gpus-per-node 2" in msg
