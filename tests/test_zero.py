"""ZeRO stages 0-3: the cost face's formulas, and the real thing against one process and the formulas.

The multi-process tests run every stage inside one ``run_distributed`` call per world size (a
spawn costs seconds on a loaded machine) on a 2-layer, 64-wide GPT-2 with synthetic text.
"""

import math

import pytest
import torch

from scaletrain.techniques.data_parallel import cost as zero
from scaletrain.testing import run_distributed

TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=32",
        "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=1", "train.log_every=1",
        "optim.warmup_steps=2", "train.steps=5", "train.eval_every=0", "train.progress=off"]
BF16 = ["train.precision=bf16", "train.steps=2"]


# --------------------------------------------------------------------------- cost face


@pytest.mark.parametrize("N", [1, 2, 4, 8, 64])
def test_published_zero_formulas(N):
    """ZeRO section 5 (mixed-precision Adam, K = 12) and the fp32 analogues (Megatron README)."""
    psi = 1e9
    mixed = [zero.model_state_bytes(psi, s, N, precision="mixed").total / psi for s in range(4)]
    assert mixed == pytest.approx([16, 4 + 12 / N, 2 + 14 / N, 16 / N])
    fp32 = [zero.model_state_bytes(psi, s, N).total / psi for s in range(4)]
    assert fp32 == pytest.approx([16, 8 + 8 / N, 4 + 12 / N, 16 / N])
    # 8-bit Adam: K = 2 (+ scales) for the states; masters stay 4 bytes in mixed precision
    assert zero.model_state_bytes(psi, 1, N, precision="mixed", optim_state_bytes=2).total / psi == \
        pytest.approx(4 + 6 / N)


@pytest.mark.parametrize("N", [2, 4, 8])
def test_traffic_formulas(N):
    psi = 1e6
    ring = (N - 1) / N
    assert [zero.comm_bytes_per_step(psi, s, N, grad_bytes=1, param_bytes=1) / psi for s in range(4)] == \
        pytest.approx([2 * ring, 2 * ring, 2 * ring, 3 * ring])
    # accumulation: stage 0/1 reduce once per step, stage 2 every micro-batch, stage 3 gathers too
    assert zero.comm_bytes_per_step(psi, 0, N, accum=4) == zero.comm_bytes_per_step(psi, 0, N)
    assert zero.comm_bytes_per_step(psi, 1, N, accum=4) == zero.comm_bytes_per_step(psi, 1, N)
    assert zero.comm_bytes_per_step(psi, 2, N, accum=4, grad_bytes=1, param_bytes=1) == pytest.approx(5 * ring * psi)
    assert zero.comm_bytes_per_step(psi, 3, N, accum=4, grad_bytes=1, param_bytes=1) == pytest.approx(12 * ring * psi)
    assert zero.comm_bytes_per_step(psi, 3, 1) == 0
    # the units FSDP keeps gathered from forward into backward are gathered once a micro-batch, not twice
    assert zero.comm_bytes_per_step(psi, 3, N, accum=4, grad_bytes=1, param_bytes=1, kept=psi / 4) == \
        pytest.approx(4 * (3 - 1 / 4) * ring * psi)


def test_hsdp_traffic():
    """Shard in groups of G, all-reduce the Psi/G shards across the R = N/G replicas."""
    psi, N, G = 1e6, 8, 4
    got = zero.comm_bytes_per_step(psi, 3, N, hsdp=G, grad_bytes=1, param_bytes=1)
    assert got == pytest.approx(3 * (G - 1) / G * psi + 2 * (2 - 1) / 2 * psi / G)
    with pytest.raises(Exception, match="must divide"):
        zero.comm_bytes_per_step(psi, 3, 8, hsdp=3)


def test_shard_layout_covers_every_row_once():
    shapes = [(256, 64), (192,), (5, 3), (), (7,)]
    for N in (1, 2, 3, 4, 8):
        total = sum(zero.shard_numel(shapes, N, r) for r in range(N))
        assert total == sum(math.prod(s) for s in shapes)
        for rows in (1, 5, 7, 256):
            spans = [zero.shard_rows(rows, N, r) for r in range(N)]
            assert sum(n for _, _, n in spans) == rows
            assert all(c == math.ceil(rows / N) for c, _, _ in spans)  # torch.chunk / DTensor Shard(0)


def test_bad_stage():
    with pytest.raises(Exception, match="parallel.zero=4"):
        zero.model_state_bytes(10, 4, 2)


# --------------------------------------------------------------------------- the real thing


def _train(extra, out_dir=None, resume=False):
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, TINY + extra), out_dir, resume=resume, log=lambda s: None)
    r = t.fit()
    state = t.parallel.model_state_dict()
    flat = torch.cat([v.detach().float().reshape(-1) for k, v in sorted(state.items())])
    n = sum(p.numel() for p in t.model.parameters())
    return {"losses": r.losses, "params": flat, "comm": r.comm_bytes_per_step, "mem": r.model_state_bytes, "n": n}


def _runs(rank, world, runs):
    return [_train(*r) if isinstance(r, tuple) else _train(r) for r in runs]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _kept(world, stage):
    """ZeRO-3's parameters gathered once a micro-batch (the root's and the last FSDP group's) on TINY."""
    if stage != 3:
        return 0
    from scaletrain import models
    from scaletrain.techniques.data_parallel.fsdp import kept_elements

    model = models.get("gpt2-tiny", device="meta", n_layer=2, n_embd=64, n_head=2)
    return kept_elements(model, "auto", world, 1, "cpu")


def _estimate(world, stage, *extra):
    """`scaletrain estimate --dp world --zero stage --json` for the TINY model: its data-parallel part."""
    import contextlib
    import io
    import json

    from scaletrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["estimate", "--model", "gpt2-tiny", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2",
                   "--seq", "32", "--batch", str(8 // world), "--dp", str(world), "--zero", str(stage), "--json",
                   *extra])
    assert rc == 0
    return json.loads(out.getvalue())["meta"]["data_parallel"]


@pytest.mark.slow
# 4 covers 2: the same assertions at N=4, where N and 2 (or N/2 and 1) no longer coincide
@pytest.mark.parametrize("world", [4])
def test_stages_match_one_process_and_formulas(world):
    """fp32: same losses (5 steps) and parameters as one process; memory and traffic = formulas."""
    ref = _train([])
    runs = [[f"parallel.zero={s}"] for s in range(4)] + [BF16 + [f"parallel.zero={s}"] for s in range(4)]
    if world == 4:  # HSDP: shard within pairs, replicate across the two pairs
        runs += [[f"parallel.zero={s}", "parallel.hsdp=2"] for s in (1, 2, 3)]
    res = run_distributed(_runs, world, runs)
    n = ref["n"]
    for s in range(4):
        for rank in range(world):
            r = res[rank][s]
            assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), (s, rank)
            assert _rel(r["params"], ref["params"]) < 1e-5, (s, rank)
            want = zero.model_state_bytes(n, s, world, precision="fp32")
            for k in ("params", "grads", "optimizer"):
                assert r["mem"][k] == pytest.approx(getattr(want, k), rel=0.05), (s, rank, k)
            assert r["comm"] == pytest.approx(zero.comm_bytes_per_step(n, s, world, kept=_kept(world, s)), rel=0.05), \
                (s, rank)
            est = _estimate(world, s)  # the estimator predicts what was measured
            for k in ("params", "grads", "optimizer"):
                assert r["mem"][k] == pytest.approx(est["model_state_bytes_per_rank"][k], rel=0.05), (s, rank, k)
            assert r["comm"] == pytest.approx(est["comm_bytes_per_step"], rel=0.05), (s, rank)
    for s in range(4):  # mixed precision (bf16): ZeRO's 16, 4 + 12/N, 2 + 14/N, 16/N
        r = res[0][4 + s]
        want = zero.model_state_bytes(n, s, world, precision="mixed")
        assert sum(r["mem"].values()) == pytest.approx(want.total, rel=0.05), s
        if s:  # DDP keeps fp32 weights under autocast: same total, split 4 + 4 + 8 instead of 2 + 2 + 12
            for k in ("params", "grads", "optimizer"):
                assert r["mem"][k] == pytest.approx(getattr(want, k), rel=0.05), (s, k)
        half = 4 if s == 0 else 2
        want_comm = zero.comm_bytes_per_step(n, s, world, grad_bytes=half, param_bytes=half, kept=_kept(world, s))
        assert r["comm"] == pytest.approx(want_comm, rel=0.05), s
        assert all(math.isfinite(x) for x in r["losses"])
    for i, s in enumerate((1, 2, 3) if world == 4 else ()):
        r = res[1][8 + i]
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), s
        assert _rel(r["params"], ref["params"]) < 1e-5, s
        assert sum(r["mem"].values()) == pytest.approx(zero.model_state_bytes(n, s, 2).total, rel=0.05), s
        assert r["comm"] == pytest.approx(zero.comm_bytes_per_step(n, s, 4, hsdp=2, kept=_kept(4, s)), rel=0.05), s


@pytest.mark.slow
def test_accumulation_and_8bit_states_at_every_stage():
    """Accumulation (micro-batch 2 of 4 per rank) with clipping active; 8-bit AdamW under every stage."""
    acc = ["train.micro_batch=2", "optim.grad_clip=0.5"]
    ref = _train(acc)
    ref8 = _train(["optim.name=adamw8bit"])
    runs = [acc + [f"parallel.zero={s}"] for s in range(4)] + [["optim.name=adamw8bit", f"parallel.zero={s}"]
                                                               for s in range(4)]
    res = run_distributed(_runs, 2, runs)[0]
    for s in range(4):
        assert res[s]["losses"] == pytest.approx(ref["losses"], rel=1e-5), s
        assert _rel(res[s]["params"], ref["params"]) < 1e-5, s
        # 8-bit blocks are cut per shard, so the updates differ slightly from one process's
        assert res[4 + s]["losses"] == pytest.approx(ref8["losses"], rel=2e-3), s
    want = zero.comm_bytes_per_step(ref["n"], 2, 2, accum=2)
    assert res[2]["comm"] == pytest.approx(want, rel=0.05)  # stage 2 reduce-scatters every micro-batch


def _sharded_8bit_resume(rank, world, out):
    import torch.distributed as dist

    common = ["optim.name=adamw8bit", "parallel.zero=2", "train.steps=6", "train.checkpoint_every=3",
              "train.keep_checkpoints=5"]
    full = _train(common, out)
    if rank == 0:
        (out / "checkpoints" / "step_00000006.pt").unlink()
    dist.barrier()
    return full["losses"], _train(common, out, resume=True)["losses"]


def _ckpt_runs(rank, world, steps):
    return [_train(*s) for s in steps]


@pytest.mark.slow
def test_checkpoints_move_between_world_sizes_and_stages(tmp_path):
    """One process -> 2 ranks ZeRO-2 and 2 ranks ZeRO-3 -> one process continue the same run."""
    import shutil

    from scaletrain.train import checkpoint as ckpt_lib

    common = ["train.steps=6", "train.checkpoint_every=3", "train.keep_checkpoints=5"]
    full = _train(common, tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "z2")  # for the ZeRO-2 resume below (same 2-rank start)
    (tmp_path / "z2" / "checkpoints" / "step_00000006.pt").unlink()
    # a ZeRO-3 run writes sharded checkpoints (each rank its shards: train.checkpoint_format=auto) ...
    sharded, z2 = run_distributed(_ckpt_runs, 2, [(common + ["parallel.zero=3"], tmp_path / "z3"),
                                                  (common + ["parallel.zero=2"], tmp_path / "z2", True)])[0]
    assert sharded["losses"] == pytest.approx(full["losses"], rel=1e-5)
    # ... that one process resumes
    assert ckpt_lib.at_step(tmp_path / "z3" / "checkpoints", 6).is_dir()
    ckpt_lib.remove(ckpt_lib.at_step(tmp_path / "z3" / "checkpoints", 6))
    resumed = _train(common, tmp_path / "z3", resume=True)
    assert resumed["losses"] == pytest.approx(full["losses"][3:], rel=1e-5)
    assert _rel(resumed["params"], full["params"]) < 1e-5
    # and a one-process checkpoint resumes under ZeRO-2 on 2 ranks
    assert z2["losses"] == pytest.approx(full["losses"][3:], rel=1e-5)
    assert _rel(z2["params"], full["params"]) < 1e-5


@pytest.mark.slow
def test_8bit_states_stay_sharded_and_resume_at_the_same_layout(tmp_path):
    """8-bit codes are not row-shaped: checkpoints keep them per rank and say so at another layout."""
    from scaletrain.errors import ConfigError

    full, resumed = run_distributed(_sharded_8bit_resume, 2, tmp_path / "run")[0]
    assert resumed == pytest.approx(full[3:], rel=1e-6)
    with pytest.raises(ConfigError, match="sharded for parallel.dp=2 parallel.zero=2"):
        _train(["optim.name=adamw8bit", "train.steps=6"], tmp_path / "run", resume=True)
