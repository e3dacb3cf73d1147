"""`scaletrain train --nproc-per-node 4` with tensor (+ sequence), context and expert parallelism:
the same losses, validation loss and final parameters as the one-process trainer, the measured
traffic (``comm_bytes``) and per-rank model-state bytes equal to the cost faces' predictions, and
one-line errors for the layouts that do not compose.

The optimizer is SGD with momentum (lr 0.5) because it is linear in the gradients: with AdamW a
gradient that is zero in exact arithmetic (the attention key bias: softmax ignores it) is rounding
noise of ~1e-10, which Adam normalises into +-lr/100 steps whose sign differs between layouts —
measured 6e-6 absolute (4e-4 relative) on ``c_attn.bias`` after 4 steps of these runs, so a
parameter check with Adam would test rounding, not the technique.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.config import load_config

TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=32",
        "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=1", "train.log_every=1",
        "optim.warmup_steps=2", "train.steps=4", "train.eval_every=0", "train.progress=off",
        "optim.name=sgd", "optim.lr=0.5", "optim.momentum=0.9"]
# capacity_factor = n_experts / top_k: no token is dropped at any layout (capacities are per rank)
MOE = ["model.name=gpt2-moe", "model.overrides.capacity_factor=2.0", "model.overrides.aux_loss_coef=0.1"]


def one_process(extra: list[str], out: Path | None = None) -> dict:
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + extra), out, log=lambda s: None)
    try:
        r = t.fit()
        return {"losses": r.losses, "val_loss": r.val_loss,
                "params": {k: v.detach().clone() for k, v in t.model.state_dict().items()}}
    finally:
        t.close()


def cli(out: Path, *extra: str) -> tuple[list[dict], dict, str]:
    flags = [a for a in extra if a.startswith("--")]
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "4", "--out", str(out),
                        *flags, *TINY, *(a for a in extra if a not in flags)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for bad in ("Traceback", "terminate called", "abort"):
        assert bad not in r.stderr, r.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, ckpt.load(ckpt.latest(out / "checkpoints")), r.stdout


def check_parity(rows: list[dict], state: dict, ref: dict, first_step: int = 1) -> None:
    steps = [x for x in rows if "loss" in x]
    assert [x["step"] for x in steps] == list(range(first_step, 5))
    assert [x["loss"] for x in steps] == pytest.approx(ref["losses"][first_step - 1:], rel=1e-5)
    val = [x["val_loss"] for x in rows if "val_loss" in x]
    assert val == pytest.approx([ref["val_loss"]], rel=1e-5)
    for k, v in ref["params"].items():  # per tensor, relative L2 (SGD: no rounding amplification)
        assert float((state["model"][k] - v).norm() / v.norm().clamp_min(1e-30)) <= 1e-5, k


def check_costs(rows: list[dict]) -> None:
    """Measured = predicted, to the byte (all local row counts divide the shard groups here)."""
    steps = [x for x in rows if "loss" in x]
    for x in steps:
        assert x["comm_bytes"] > 0 and x["comm_bytes"] == pytest.approx(x["predicted_comm_bytes"], rel=1e-12), x
        assert x["comm_bytes_intra_layer"] == pytest.approx(x["predicted_comm_bytes_intra_layer"], rel=1e-12), x
        assert x["comm_bytes_intra_layer"] > 0
    measured = [x["model_state_bytes"] for x in steps if "model_state_bytes" in x]
    assert measured and all(m == steps[-1]["predicted_model_state_bytes"] for m in measured), steps[-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The one-process run, with a checkpoint after every step."""
    out = tmp_path_factory.mktemp("one")
    ref = one_process(["train.checkpoint_every=1", "train.keep_checkpoints=10"], out)
    ref["checkpoints"] = ckpt.list_checkpoints(out / "checkpoints")
    return ref


# The layouts below train in ONE 4-process group, one Trainer after another (each launch of
# ``scaletrain train --nproc-per-node 4`` pays ~10-30 s of torchrun and torch start-up on 2 cores for ~2 s
# of training); the CLI launch itself is proved once, by the resume test after them.
GROUP = {
    "tp_sp_zero2_remat": ["parallel.tp=2", "parallel.dp=2", "parallel.zero=2", "parallel.sequence_parallel=true",
                          "memory.remat.method=periodic", "memory.remat.selective=attention"],
    "tp_zero3": ["parallel.tp=2", "parallel.dp=2", "parallel.zero=3"],
    # HSDP beside TP on the world mesh: replicate over dp_rep (2), shard over dp_in (1), TP innermost
    "tp_hsdp_zero3": ["parallel.tp=2", "parallel.zero=3", "parallel.hsdp=1"],
    "tp_hsdp_zero1": ["parallel.tp=2", "parallel.zero=1", "parallel.hsdp=1"],
    "tp2_cp2": ["parallel.tp=2", "parallel.cp=2"],
    "cp4_accumulation": ["parallel.cp=4", "train.micro_batch=4"],  # eval: 1 global batch
    "moe_ep2_tp2": MOE + ["parallel.ep=2", "parallel.tp=2"],
    "moe_ep2_dp4_zero2": MOE + ["parallel.ep=2", "parallel.zero=2"],
    "moe_ep2_resumed": MOE + ["parallel.ep=2"],  # resumes the one-process step-3 checkpoint (see the fixture)
}


def _group_worker(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> dict:
    """Each run on this rank: ("ok", its log lines and layout) or ("error", the traceback)."""
    import traceback

    from scaletrain.train.trainer import Trainer

    out = {}
    for name, extra in runs.items():
        lines: list[str] = []
        try:
            t = Trainer(load_config(None, TINY + extra), Path(root) / name, resume=name.endswith("resumed"),
                        log=lines.append)
            try:
                lines.append(t.parallel.describe())  # the layout the CLI prints in its first line
                t.fit()
            finally:
                t.close()
            out[name] = ("ok", lines)
        except Exception:  # noqa: BLE001 - reported by the run's own test
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    """The one-process MoE run, with a checkpoint after every step."""
    out = tmp_path_factory.mktemp("one_moe")
    ref = one_process(MOE + ["train.checkpoint_every=1", "train.keep_checkpoints=10"], out)
    ref["checkpoints"] = ckpt.list_checkpoints(out / "checkpoints")
    return ref


@pytest.fixture(scope="module")
def group(moe, tmp_path_factory) -> dict:
    """Every layout of :data:`GROUP` on one 4-process group: name -> (metrics rows, final checkpoint,
    rank 0's log)."""
    from scaletrain.testing import run_distributed

    root = tmp_path_factory.mktemp("group")
    (root / "moe_ep2_resumed" / "checkpoints").mkdir(parents=True)
    shutil.copy(moe["checkpoints"][2], root / "moe_ep2_resumed" / "checkpoints")
    ranks = run_distributed(_group_worker, 4, str(root), GROUP, timeout_s=600)
    runs = {}
    for name in GROUP:
        failed = [f"rank {r}: {out[name][1]}" for r, out in enumerate(ranks) if out[name][0] != "ok"]
        if failed:
            runs[name] = "\n".join(failed)
            continue
        value = ranks[0][name][1]
        rows = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = rows, ckpt.load(ckpt.latest(root / name / "checkpoints")), "\n".join(value)
    return runs


def run_of(group: dict, name: str) -> tuple[list[dict], dict, str]:
    """One layout's outputs, or the test fails with that run's traceback."""
    if isinstance(group[name], str):
        pytest.fail(f"{name} failed:\n{group[name]}")
    return group[name]


@pytest.mark.slow
def test_tp_sp_zero2_with_remat_and_selective_recompute(tiny, group):
    """Megatron's recompute on a TP x DP mesh: the blocks under nested checkpoints (periodic: two
    segments) and the attention core recomputed selectively inside them, with sequence parallelism and
    ZeRO-2 — the one-process losses and parameters, and the traffic predicted to the byte (the
    recomputed blocks replay their forward collectives in the backward)."""
    rows, state, stdout = run_of(group, "tp_sp_zero2_remat")
    assert "remat: periodic" in stdout and "selective" in stdout, stdout
    check_parity(rows, state, tiny)
    check_costs(rows)


@pytest.mark.slow
def test_tp_zero3_fsdp_2d(tiny, group):
    """torchtitan's 2-D: tensor parallelism over pairs, FSDP2 (ZeRO-3) over the data-parallel pairs of
    the same mesh — one-process losses and parameters, traffic and per-rank model states predicted
    (ZeRO-3's 3 Psi on the TP-local parameters plus the TP collectives)."""
    rows, state, stdout = run_of(group, "tp_zero3")
    assert "tp=2 x dp=2, zero=3" in stdout, stdout
    check_parity(rows, state, tiny)
    check_costs(rows)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [3, 1])
def test_tp_with_hsdp(tiny, group, zero):
    """HSDP beside tensor parallelism (FSDP2 on the (replicate, shard) dims of the world mesh, or ZeRO-1's
    shard groups all-reduced across replicas, over TP-sharded parameters): one-process losses and
    parameters, traffic predicted to the byte."""
    rows, state, stdout = run_of(group, f"tp_hsdp_zero{zero}")
    assert f"tp=2 x dp=2 (HSDP shard groups of 1), zero={zero}" in stdout, stdout
    check_parity(rows, state, tiny)
    check_costs(rows)


@pytest.mark.slow
def test_tp2_cp2(tiny, group):
    """Tensor x context parallelism: ring attention over this rank's heads and sequence chunks (the
    ring carries 1/tp of the keys and values) — one-process losses and parameters, traffic predicted."""
    rows, state, stdout = run_of(group, "tp2_cp2")
    assert "tp=2 x cp=2 x dp=1, zero=0" in stdout, stdout
    check_parity(rows, state, tiny)
    check_costs(rows)


@pytest.mark.slow
def test_moe_ep2_tp2(moe, group):
    """Expert x tensor parallelism on ``gpt2-moe``: attention split over the TP pairs, each MoE layer
    whole on every TP rank with its experts split over the EP pairs (all-to-alls within each TP index)
    — one-process losses and parameters, traffic and model states predicted."""
    rows, state, stdout = run_of(group, "moe_ep2_tp2")
    assert "tp=2 x ep=2 x dp=2, zero=0" in stdout, stdout
    check_parity(rows, state, moe)
    check_costs(rows)


@pytest.mark.slow
def test_cp4_with_accumulation(tiny, group):
    """`parallel.cp=4`: every rank holds 8 of the 32 tokens; 2 micro-batches per step."""
    rows, state, stdout = run_of(group, "cp4_accumulation")
    assert "cp=4 x dp=1, zero=0" in stdout, stdout
    check_parity(rows, state, tiny)
    check_costs(rows)


@pytest.mark.slow
def test_moe_ep2_dp4_zero2_and_resume(moe, group):
    """`model.name=gpt2-moe parallel.ep=2`: 2 of the 4 experts per rank, dp=4, gradients sharded
    (ZeRO-2); then, with zero=0, the last step again from the one-process step-3 checkpoint (the
    experts' weights and momentum sliced back, the full momentum gathered again)."""
    rows, state, stdout = run_of(group, "moe_ep2_dp4_zero2")
    assert "ep=2 x dp=4, zero=2" in stdout, stdout
    check_parity(rows, state, moe)
    check_costs(rows)
    rows, state, stdout = run_of(group, "moe_ep2_resumed")
    assert "resumed from" in stdout, stdout
    check_parity(rows, state, moe, first_step=4)
    check_momentum(state, ckpt.load(moe["checkpoints"][-1])["optimizer"])


@pytest.mark.slow
def test_tp_sp_dp_zero1_resumes_a_one_process_checkpoint(tiny, tmp_path):
    """The issue's `scaletrain train --nproc-per-node 4 parallel.tp=2 parallel.dp=2 parallel.zero=1`
    (with sequence parallelism) through the CLI and its launcher, continuing the one-process run
    from its step-1 checkpoint: model and SGD momentum are sharded back (TP shards, fused-QKV
    permutation, ZeRO rows), steps 2-4 equal the one-process ones, and the final checkpoint — model
    and momentum — is the one-process layout again."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny["checkpoints"][0], out / "checkpoints")
    assert ckpt.load(ckpt.latest(out / "checkpoints"))["step"] == 1
    rows, state, stdout = cli(out, "--resume", "parallel.tp=2", "parallel.dp=2", "parallel.zero=1",
                              "parallel.sequence_parallel=true")
    assert "tp=2 (sequence parallel) x dp=2, zero=1" in stdout
    check_parity(rows, state, tiny, first_step=2)
    check_costs(rows)
    check_momentum(state, ckpt.load(tiny["checkpoints"][-1])["optimizer"])


def check_momentum(state: dict, ref_opt: dict) -> None:
    """The saved optimizer state is the one-process layout with the one-process values."""
    assert ref_opt["param_groups"] == state["optimizer"]["param_groups"]
    assert set(ref_opt["state"]) == set(state["optimizer"]["state"])
    for i, st in ref_opt["state"].items():
        buf = state["optimizer"]["state"][i]["momentum_buffer"]
        assert float((buf - st["momentum_buffer"]).norm() / st["momentum_buffer"].norm()) <= 1e-5, i


def test_one_process_loss_includes_the_moe_auxiliary_loss():
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + MOE), None, log=lambda s: None)
    try:
        x, y = next(iter(t._make_train_loader(0)))
        loss = float(t.forward_backward(x, y, 1.0))
        with torch.no_grad():
            ce = float(t.loss_fn(t.model(x), y))
        assert loss == pytest.approx(ce + float(t.model.aux_loss()), rel=1e-6) and loss > ce
    finally:
        t.close()


@pytest.mark.parametrize("extra, needle", [
    (["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel=true with parallel.cp=2"),
    (["parallel.ep=2"], "expert parallelism needs a mixture-of-experts model"),
    (MOE + ["parallel.tp=2", "parallel.sequence_parallel=true"], "sequence_parallel=true on a mixture-of-experts"),
    (["parallel.cp=4", "data.seq_len=36"], "allowed: data.seq_len a multiple of 8"),
    (["parallel.tp=4", "model.overrides.n_head=2"], "parallel.tp=4: it must divide the model's n_head=2"),
    (MOE + ["parallel.ep=2", "parallel.zero=3"], "allowed: parallel.zero=0, 1 or 2 with ep"),
    (MOE + ["parallel.ep=8"], "parallel.ep=8: it must divide the data-parallel size 4"),
    (["parallel.sequence_parallel=true"], "allowed: parallel.tp > 1"),
])
def test_conflicts_are_one_line_config_errors(extra, needle):
    from scaletrain import models
    from scaletrain.techniques.compat import check_config

    cfg = load_config(None, TINY + extra)
    model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
    with pytest.raises(ConfigError) as e:
        check_config(cfg, model, world=4)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_trainer_reports_conflicts_before_any_group(tmp_path):
    """One process: the trainer reaches the strategy and stops there with the message."""
    from scaletrain.train.trainer import Trainer

    for extra, needle in ((["parallel.ep=2"], "mixture-of-experts"), (["parallel.sequence_parallel=true"], "tp > 1")):
        with pytest.raises(ConfigError, match=needle):
            Trainer(load_config(None, TINY + extra), None, log=lambda s: None)
