"""scaletrain sweep: runs trained together in spilled shards equal their solo runs bitwise (CPU),
device peaks stay within the budget, bytes moved equal the prediction; the scheduler and its
simulator; the grid; bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.errors import ConfigError
from scaletrain.sweep import grid
from scaletrain.sweep.options import SweepOptions
from scaletrain.sweep.policy import Pending, Policy, Resources, assign
from scaletrain.sweep.run import Run, run_sweep
from scaletrain.sweep.simulate import Durations, RunProgram, simulate
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

BASE = ["model.name=gpt2-tiny", "model.overrides.dropout=0.1", "train.steps=3", "train.global_batch=4",
        "train.micro_batch=2", "data.seq_len=32", "train.eval_batches=1", "train.eval_every=2", "train.log_every=1",
        "train.progress=off", "optim.grad_clip=1.0"]
LRS = ["1e-3", "1e-2"]


def _solo(lr: str) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    tr = Trainer(load_config(None, BASE + [f"optim.lr={lr}"]), None, log=lambda s: None)
    try:
        res = tr.fit()
        return res.losses, res.val_loss, {k: v.clone() for k, v in tr.model.state_dict().items()}
    finally:
        tr.close()


@pytest.mark.slow
def test_sweep_trains_each_run_bitwise_as_its_solo_run(tmp_path: Path) -> None:
    """Two gpt2-tiny runs (dropout on, 2 micro-batches per step, clipping, the tied embedding in the
    first and last shard) in 4 shards on 2 devices whose 4 MiB budget cannot hold the model's states
    (~13 MiB): losses, validation and final parameters equal the one-process runs bit for bit;
    every device phase stayed within the budget; bytes moved equal the cost face's."""
    runs = [Run(f"lr={lr}", load_config(None, BASE + [f"optim.lr={lr}", "memory.device_budget=4MiB"])) for lr in LRS]
    opts = SweepOptions(devices=2, shards=4, repeats=1)
    res = run_sweep(runs, opts, tmp_path / "sw", log=lambda s: None)
    torch.set_num_threads(1)  # the devices compute with one thread each
    s = res.summary
    assert all(0 < p <= s["budget_bytes"] for p in s["device_peak_bytes"]), s["device_peak_bytes"]
    assert s["bytes_moved"] == s["predicted_bytes_moved"]
    assert s["shards"]["lr=1e-3"] == s["shards"]["lr=1e-2"] and len(s["shards"]["lr=1e-3"]) == 4
    for r, lr in zip(res.runs, LRS):
        losses, val, params = _solo(lr)
        assert r["losses"] == losses
        assert r["val_loss"] == val
        state = ckpt.load(ckpt.latest(Path(r["out_dir"]) / "checkpoints"))
        assert state["step"] == 3
        for k, v in params.items():
            assert torch.equal(state["model"][k], v), k
        rows = [json.loads(x) for x in (Path(r["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows if "loss" in x] == [1, 2, 3]
        assert [x["loss"] for x in rows if "loss" in x] == losses
    assert (tmp_path / "sw" / "timeline.png").is_file()
    assert s["predicted_makespan_s"] > 0 and len(s["timeline"]) > 0


# -- the scheduler and its simulator --------------------------------------------------------------


def test_lrtf_runs_the_longest_remaining_model_first_and_backward_waits_for_its_device() -> None:
    res = Resources(devices=2, cores=2)
    pol = Policy("lrtf", 3, 2)
    ready = [Pending(0, "F", 0, seq=0), Pending(1, "F", 0, seq=1), Pending(2, "B", 1, pin=1, seq=2)]
    placed = assign(ready, res, pol, {0: 1.0, 1: 5.0, 2: 3.0})
    assert [(t.model, d) for t, d in placed] == [(1, 0), (2, 1)]
    res = Resources(devices=2, cores=2)
    res.take(1)  # device 1 busy: the pinned backward waits, another model takes device 0
    placed = assign(ready, res, Policy("lrtf", 3, 2), {0: 1.0, 1: 0.5, 2: 3.0})
    assert [(t.model, d) for t, d in placed] == [(0, 0)]


def test_a_host_step_holds_a_core_that_a_device_task_then_lacks() -> None:
    res = Resources(devices=2, cores=2, device_holds_core=True)
    placed = assign([Pending(0, "H", 0, seq=0), Pending(1, "F", 0, seq=1), Pending(2, "F", 0, seq=2)], res,
                    Policy("round_robin", 3, 2), {})
    assert len(placed) == 2 and sum(d is None for _, d in placed) == 1
    assert res.free_cores == 0 and len(res.free_devices) == 1


def test_simulator_makespans_follow_the_policies() -> None:
    d = Durations({("F", 0): 1.0, ("FB", 1): 2.0, ("B", 0): 1.5, ("E", 0): 0.0, ("E", 1): 0.0}, host=0.5,
                  checkpoint=0.25)
    prog = RunProgram(shards=2, steps=2, accum=1, checkpoint_steps=[2])
    one = prog.total(d)
    assert one == pytest.approx(2 * (1.0 + 2.0 + 1.5 + 0.5) + 0.25)
    seq = simulate([prog] * 4, [d] * 4, devices=1, cores=1, policy="sequential")
    assert seq.makespan_s == pytest.approx(4 * one)  # the next run starts when the last has written its checkpoint
    mp = simulate([prog] * 4, [d] * 4, devices=2, cores=2, policy="sequential")
    assert mp.makespan_s == pytest.approx(4 * one)  # a model's tasks are sequential: the second device idles
    for policy in ("lrtf", "round_robin", "task"):
        sa = simulate([prog] * 4, [d] * 4, devices=2, cores=2, policy=policy)
        assert sa.makespan_s <= 2 * one + 1e-9  # two models at a time at least, both devices busy
        device_work = 4 * 2 * (1.0 + 2.0 + 1.5)  # host steps hold a core but no device; checkpoints neither
        assert sum(sa.utilisation) * sa.makespan_s == pytest.approx(device_work)
        assert all(f > 0 for f in sa.finish_s)


# -- the grid and bad input ----------------------------------------------------------------------


def test_grid_is_the_product_of_its_axes_named_by_what_varies() -> None:
    runs = grid.expand(["optim.lr=1e-3,3e-3", "model.overrides.n_layer=[2,4]", "train.steps=5"])
    assert [n for n, _ in runs] == ["lr=1e-3+n_layer=2", "lr=1e-3+n_layer=4", "lr=3e-3+n_layer=2",
                                    "lr=3e-3+n_layer=4"]
    assert runs[1][1] == ["optim.lr=1e-3", "model.overrides.n_layer=4", "train.steps=5"]
    with pytest.raises(ConfigError, match="twice"):
        grid.expand(["optim.lr=1,1"])
    with pytest.raises(ConfigError, match="not of the form"):
        grid.expand(["optim.lr"])


@pytest.mark.parametrize("argv, says", [
    ([], "nothing to sweep"),
    (["--grid", "optim.lr=1e-3,3e-3", "train.precision=fp16"], "fp16"),
    (["--grid", "optim.lr=1e-3,3e-3", "parallel.tp=2"], "parallel"),
    (["--grid", "optim.lr=1e-3,3e-3", "memory.device_budget=4MiB", "memory.offload.params=host"], "memory.offload"),
    (["--grid", "optim.lr=1e-3,oops"], "run lr=oops"),
    (["--grid", "optim.lr=1e-3,3e-3", "--policy", "fastest"], "sweep.policy"),
    (["--runs", "missing.toml"], "does not exist"),
])
def test_bad_sweep_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys, argv, says) -> None:
    out = tmp_path / "sw"
    assert main(["sweep", "--out", str(out), "model.name=gpt2-tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scaletrain: error: ") and says in err[0], err
    assert not out.exists()


def test_runs_file_sets_options_base_and_runs(tmp_path: Path) -> None:
    f = tmp_path / "runs.toml"
    f.write_text('[sweep]\ndevices = 3\npolicy = "round_robin"\n[base]\nmodel.name = "gpt2-tiny"\n'
                 '[[run]]\nname = "a"\noptim.lr = 1e-3\n[[run]]\noptim.lr = 3e-3\ntrain.steps = 7\n')
    table, runs = grid.file_runs(str(f), ["train.seed=5"])
    assert table == {"devices": 3, "policy": "round_robin"}
    assert [n for n, _, _ in runs] == ["a", "run1"]
    assert runs[1][1].optim.lr == 3e-3 and runs[1][1].train.steps == 7 and runs[0][1].train.seed == 5


@pytest.mark.slow
def test_predict_only_plans_the_sweep_and_writes_nothing(tmp_path: Path, capsys) -> None:
    """policy=auto: every policy simulated on the profiled shard times, the fastest chosen; nothing trained."""
    out = tmp_path / "sw"
    argv = ["sweep", "--predict-only", "--json", "--out", str(out), "--nproc-per-node", "2", "--device-budget", "4MiB",
            "--grid", "optim.lr=1e-3,3e-3,1e-2", "model.name=gpt2-tiny", "train.steps=2", "train.global_batch=2",
            "data.seq_len=32", "train.eval_batches=1"]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    by = s["predicted_makespan_by_policy"]
    assert set(by) == {"lrtf", "round_robin", "sequential", "task"}
    assert s["policy"] == min(by, key=by.get) and s["predicted_makespan_s"] == by[s["policy"]]
    assert by["sequential"] > by["lrtf"]  # one model at a time leaves a device idle
    assert not out.exists()


@pytest.mark.slow
def test_a_resumed_sweep_continues_each_run_as_its_resumed_solo_run(tmp_path: Path) -> None:
    """Two steps, then --resume to four: the model's own RNG stream (dropout), data position and
    optimizer states come back from each run's checkpoint, as in a solo run resumed the same way."""
    first = BASE + ["train.steps=2", "optim.schedule=constant"]
    more = BASE + ["train.steps=4", "optim.schedule=constant"]
    opts = SweepOptions(devices=2, shards=4, device_budget="4MiB", repeats=1, policy="round_robin")
    runs = lambda over: [Run(f"lr={lr}", load_config(None, over + [f"optim.lr={lr}"])) for lr in LRS]  # noqa: E731
    run_sweep(runs(first), opts, tmp_path / "sw", log=lambda s: None)
    res = run_sweep(runs(more), opts, tmp_path / "sw", log=lambda s: None, resume=True)
    torch.set_num_threads(1)
    for r, lr in zip(res.runs, LRS):
        solo_dir = tmp_path / f"solo-{lr}"
        for over, resume in ((first, False), (more, True)):
            tr = Trainer(load_config(None, over + [f"optim.lr={lr}"]), solo_dir, resume=resume, log=lambda s: None)
            try:
                losses = tr.fit().losses
            finally:
                tr.close()
        assert r["steps"] == 4 and r["losses"] == losses and len(losses) == 2
        a = ckpt.load(ckpt.latest(Path(r["out_dir"]) / "checkpoints"))
        b = ckpt.load(ckpt.latest(solo_dir / "checkpoints"))
        assert all(torch.equal(a["model"][k], v) for k, v in b["model"].items())
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])


@pytest.mark.slow
def test_a_run_that_fails_does_not_stop_the_others(tmp_path: Path, capsys) -> None:
    """One run diverges (lr 1e12): the other trains to its end, sweep.json says which failed and why,
    and the command ends with one line, exit 2."""
    out = tmp_path / "sw"
    argv = ["sweep", "--out", str(out), "--nproc-per-node", "2", "--device-budget", "4MiB", "--policy", "round_robin",
            "--grid", "optim.lr=1e-3,1e12", "model.name=gpt2-tiny", "train.steps=4", "train.global_batch=2",
            "data.seq_len=32", "train.eval_batches=1", "optim.grad_clip=0", "optim.warmup_steps=0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("scaletrain: error: 1 of 2 runs failed: lr=1e12: training diverged"), err[-1]
    runs = {r["name"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert runs["lr=1e-3"]["status"] == "ok" and runs["lr=1e-3"]["steps"] == 4
    assert runs["lr=1e12"]["status"] == "failed"
