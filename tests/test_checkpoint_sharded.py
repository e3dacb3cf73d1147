"""Sharded checkpoints: pieces of the single-process tensors written by every rank, atomically, read
back under any layout.

Fast tests (one process): the pieces of permuted / transposed / row-windowed local tensors rebuild
the canonical tensor; replicated boxes are split between their holders; a one-process sharded
checkpoint equals the consolidated state bitwise and resumes bitwise; interrupted saves and damaged
checkpoints are ignored or skipped with a warning naming them; ``scaletrain checkpoint info`` and
``export`` (streamed safetensors = the model's state) and ``import`` (a run starts from the weights).

Slow test (4 processes): written at ``parallel.tp=2 parallel.pp=2`` (asynchronously), resumed at ``parallel.zero=3``
on 4 processes and in one process with the uninterrupted run's losses; every rank writes about 1/4
of the bytes and no rank writes any whole tensor of more than a few rows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import sharded_checkpoint as sharded
from scaletrain.train.config import load_config
from scaletrain.train.shards import Piece, View, assign, coverage_errors

TINY = ["model.name=gpt2-tiny", "data.seq_len=32", "train.global_batch=8", "train.eval_every=0",
        "train.progress=off", "train.log_every=1", "optim.warmup_steps=1", "train.steps=4",
        "train.checkpoint_every=2"]


def _train(out: Path | None, *extra: str, resume: bool = False) -> tuple[list[float], dict]:
    from scaletrain.train.trainer import Trainer

    logs: list[str] = []
    t = Trainer(load_config(None, TINY + list(extra)), out, resume=resume, log=logs.append)
    try:
        r = t.fit()
        return r.losses, {"state": t.state_dict(), "logs": logs}
    finally:
        t.close()


def _assemble(pieces: list[Piece], shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.full(shape, float("nan"))
    for p in pieces:
        out[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.data.shape))] = p.data
    return out


def test_views_rebuild_canonical_tensors():
    """A TP shard of a row-permuted (fused QKV), transposed (Conv1D) tensor, then ZeRO's owned rows of
    it: the pieces land where the single-process tensor has those values."""
    full = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4)  # canonical [rows, cols]
    perm = torch.tensor([0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11])  # tp layout row r = canonical row perm[r]
    tp_full = full[perm]
    for r in range(2):  # TP rank r holds rows [6r, 6r+6) of the TP layout; owned rows 1..4 of them
        v = View("w", (6 * r, 0), (12, 4), perm).rows(1, 4)
        got = _assemble(v.pieces("model/w", tp_full[6 * r + 1:6 * r + 5]), (12, 4))
        rows = perm[6 * r + 1:6 * r + 5]
        assert torch.equal(got[rows], full[rows]) and got.isnan().sum() == 4 * (12 - 4)
    tp_t = full.t().contiguous()  # Conv1D: the TP layout is the transpose, sharded along its dim 1
    v = View("w", (0, 6), (4, 12), None, transposed=False)
    got = _assemble(View("w", (0, 6), (4, 12), None, transposed=True).pieces("model/w", tp_t[:, 6:]), (12, 4))
    assert torch.equal(got[6:], full[6:]) and v.tp_shape == (4, 12)


def test_replicas_split_rows_and_cover_once():
    box = ("model/w", (0, 0), (10, 3))
    offers = [[box, ("optim/w/step", (), ())]] * 3
    shares = [assign(offers, r) for r in range(3)]
    assert [s[box] for s in shares] == [(0, 4), (4, 4), (8, 2)]
    assert [s[("optim/w/step", (), ())][1] for s in shares] == [1, 0, 0]
    index = {"model/w": {"shape": [10, 3], "pieces": [{"size": [4, 3]}, {"size": [4, 3]}, {"size": [2, 3]}]}}
    assert coverage_errors(index) == []
    index["model/w"]["pieces"].pop()
    assert coverage_errors(index) == ["model/w: 24 of 30 elements"]


def test_a_save_that_cannot_write_fails_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    pieces = [Piece("model/w", (4, 2), (0, 0), torch.ones(4, 2))]
    meta = {"param_groups": [], "scheduler": {}}
    assert sharded.save(tmp_path, 1, pieces, meta, rank=0, world=1, keep=2).wait() == tmp_path / "step_00000001"

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "write_pieces", full)
    with pytest.raises(ckpt.UserError, match="step 2 not written: rank 0 could not write .*No space left on device"):
        sharded.save(tmp_path, 2, pieces, meta, rank=0, world=1, keep=2).wait()
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert torch.equal(sharded.Reader(tmp_path / "step_00000001").read("model/w"), torch.ones(4, 2))


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """4 steps with sharded checkpoints at steps 2 and 4, and the consolidated state at the end."""
    out = tmp_path_factory.mktemp("one") / "run"
    losses, res = _train(out, "train.checkpoint_format=sharded")
    return out, losses, res["state"]


def test_one_process_sharded_equals_consolidated_and_resumes_bitwise(one_process_run, tmp_path):
    out, losses, state = one_process_run
    found = ckpt.list_checkpoints(out / "checkpoints")
    assert [p.name for p in found] == ["step_00000002", "step_00000004"] and all(p.is_dir() for p in found)
    loaded = ckpt.load(found[-1])
    assert loaded["step"] == 4 and loaded["scheduler"] == json.loads(json.dumps(state["scheduler"]))
    assert sorted(loaded["model"]) == sorted(state["model"])
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    so, lo = state["optimizer"], loaded["optimizer"]
    assert lo["param_groups"] == so["param_groups"] and sorted(lo["state"]) == sorted(so["state"])
    assert all(torch.equal(lo["state"][i][k], v) for i, st in so["state"].items() for k, v in st.items())
    run = tmp_path / "resumed"
    shutil.copytree(out, run)
    ckpt.remove(run / "checkpoints" / "step_00000004")
    again, _ = _train(run, "train.checkpoint_format=sharded", resume=True)
    assert again == losses[2:]  # bitwise, RNG and data position included


def test_interrupted_and_damaged_checkpoints_are_skipped(one_process_run, tmp_path):
    out, losses, _ = one_process_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    d = run / "checkpoints"
    (d / "step_00000006.tmp-1-2").mkdir()  # a save killed before its rename: not a checkpoint
    (d / "step_00000006.tmp-1-2" / "rank_00000.bin").write_bytes(b"partial")
    assert [p.name for p in ckpt.list_checkpoints(d)] == ["step_00000002", "step_00000004"]
    (d / "step_00000005").mkdir()  # a directory without a manifest
    newest = d / "step_00000004" / "rank_00000.bin"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte flipped: only the CRC32 sees it
    newest.write_bytes(bytes(raw))
    assert "CRC32" in sharded.problem(d / "step_00000004") and sharded.problem(d / "step_00000002") is None
    with open(newest, "r+b") as f:
        f.truncate(1000)
    assert "1000 bytes" in sharded.problem(d / "step_00000004", crc_files=[])
    again, res = _train(run, "train.checkpoint_format=sharded", resume=True)
    warnings = [s for s in res["logs"] if s.startswith("warning: skipping damaged checkpoint")]
    assert len(warnings) == 2 and "step_00000005" in warnings[0] and "no manifest.json" in warnings[0]
    assert "step_00000004" in warnings[1] and "1000 bytes" in warnings[1] and "\n" not in "".join(warnings)
    assert any("resumed from" in s and "step_00000002" in s for s in res["logs"])
    assert again == losses[2:]
    assert not (d / "step_00000006.tmp-1-2").exists()  # rotation removed the leftover


def test_checkpoint_info_and_streamed_export(one_process_run, tmp_path, capsys):
    out, _, state = one_process_run
    assert main(["checkpoint", "info", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["format"], d["step"], d["world"], d["problem"]) == ("sharded", 4, 1, None)
    assert d["parameters"] == 858_880 and d["plan"]["tp"] == 1
    assert main(["checkpoint", "info", str(out)]) == 0
    assert "integrity: ok" in capsys.readouterr().out
    target = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", str(out), "--to", "safetensors", "--out", str(target)]) == 0
    from safetensors.torch import load_file

    got = load_file(target)
    aliases = {k: v for k, v in state["model"].items() if k not in got}
    assert list(aliases) == ["head.lm_head.weight"]  # the tied weight once
    assert all(torch.equal(got[k], v) for k, v in state["model"].items() if k in got)
    assert main(["checkpoint", "import", str(target), "--out", str(tmp_path / "imported")]) == 0
    imported = ckpt.load(tmp_path / "imported" / "checkpoints" / "step_00000000")
    assert imported["weights_only"] and all(torch.equal(imported["model"][k], v) for k, v in state["model"].items())
    _, res = _train(tmp_path / "imported", "train.steps=1", resume=True)  # starts from the weights, fresh AdamW
    assert any("resumed from" in s and "step 0" in s for s in res["logs"])
    capsys.readouterr()
    for argv in (["checkpoint", "info", str(tmp_path / "nope")],
                 ["checkpoint", "export", str(out), "--to", "hf", "--out", str(out / "config.toml")],
                 ["checkpoint", "info", str(tmp_path / "imported" / "metrics.jsonl")],
                 ["checkpoint", "import", str(target), "--out", str(tmp_path / "imported")],
                 ["checkpoint", "import", str(out / "config.toml"), "--out", str(tmp_path / "x")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("scaletrain: error:"), err


def _written_then_resumed(rank: int, world: int, root: str) -> None:
    """On one 4-process group: tp=2 x pp=2 (the step-2 checkpoint saved in the background while step 3
    trains), then ZeRO-3 resumed from that step-2 checkpoint (one start of the processes, not two);
    rank 0 logs both runs' losses to their metrics.jsonl."""
    import torch.distributed as dist

    from scaletrain.train.trainer import Trainer

    def fit(out: Path, *extra: str, resume: bool = False) -> None:
        t = Trainer(load_config(None, TINY + list(extra)), out, resume=resume, log=lambda s: None)
        try:
            t.fit()
        finally:
            t.close()

    root_ = Path(root)
    fit(root_ / "tp2pp2", "parallel.tp=2", "parallel.pp=2", "train.checkpoint_async=true")
    step2 = root_ / "tp2pp2" / "checkpoints" / "step_00000002"
    if rank == 0:
        for name in ("zero3", "one"):
            (root_ / name / "checkpoints").mkdir(parents=True)
            shutil.copytree(step2, root_ / name / "checkpoints" / step2.name)
            shutil.copy(root_ / "tp2pp2" / "config.toml", root_ / name / "config.toml")
    dist.barrier()
    # as `--resume` would run it: the run's config.toml with the new layout
    fit(root_ / "zero3", "parallel.tp=1", "parallel.pp=1", "parallel.zero=3", "train.checkpoint_async=true",
        resume=True)


def _logged_losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in rows if "loss" in x]


def _spread(path: Path) -> tuple[float, int]:
    """(largest rank file / total bytes, rows of the largest whole tensor any rank wrote)."""
    m = sharded.read_manifest(path)
    sizes = [f["bytes"] for f in m["files"].values()]
    whole = [t["shape"][0] for t in m["tensors"].values() if len(t["shape"]) == 2 and len(t["pieces"]) == 1]
    return max(sizes) / sum(sizes), max(whole, default=0)


@pytest.mark.slow
def test_tp2_pp2_checkpoint_resumes_at_zero3_and_in_one_process(tmp_path):
    """The done-when: written at tp=2 x pp=2 (4 processes; the step-2 checkpoint in the background
    while step 3 trains), resumed from step 2 at ZeRO-3 on 4 processes and in one process: the
    uninterrupted run's losses (1e-6); each rank wrote ~1/4. The two 4-process runs share one start
    of the processes (the CLI's ``--nproc-per-node`` launch is proved in tests/test_data_parallel.py)."""
    from scaletrain.testing import run_distributed

    run_distributed(_written_then_resumed, 4, str(tmp_path), timeout_s=300)
    full = _logged_losses(tmp_path / "tp2pp2")
    assert len(full) == 4
    share, whole = _spread(tmp_path / "tp2pp2" / "checkpoints" / "step_00000002")
    assert share < 0.27 and whole <= 4, (share, whole)  # pp x tp: a stage's TP shards only
    z3 = _logged_losses(tmp_path / "zero3")
    assert z3 == pytest.approx(full[2:], rel=1e-6, abs=1e-6)
    share, whole = _spread(tmp_path / "zero3" / "checkpoints" / "step_00000004")
    assert share < 0.26 and whole <= 4, (share, whole)  # ZeRO-3: every tensor's rows over 4 ranks
    one, _ = _train(tmp_path / "one", "parallel.tp=1", "parallel.pp=1", resume=True)
    assert one == pytest.approx(full[2:], rel=1e-6, abs=1e-6)
