"""Gradient compression (DDP comm hooks): bit packing, the bytes cost face, and training quality."""

import math

import pytest
import torch

from scaletrain.techniques.data_parallel import compression as C
from scaletrain.testing import run_distributed


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
def test_sign_packing_round_trip(n):
    x = torch.randn(n)
    codes = C.pack_signs(x)
    assert codes.dtype == torch.uint8 and codes.numel() == math.ceil(n / 8)
    assert torch.equal(C.unpack_signs(codes, n), torch.where(x >= 0, 1.0, -1.0))


def test_bytes_cost_face():
    shapes = [(256, 64), (192, 64), (192,), (64,)]
    n = sum(math.prod(s) for s in shapes)
    for N in (2, 4):
        plain = C.bytes_per_step("none", shapes, N)
        assert plain == pytest.approx(2 * (N - 1) / N * 4 * n)
        assert C.bytes_per_step("topk", shapes, N, compressed=False) == plain  # warm-up steps
        # top-k: (value, index) pairs from the N-1 other ranks
        k = sum(math.ceil(0.01 * math.prod(s)) for s in shapes)
        assert C.bytes_per_step("topk", shapes, N, topk_ratio=0.01) == (N - 1) * 8 * k
        # one bit per value + one fp32 scale per tensor, from the N-1 other ranks
        assert C.bytes_per_step("onebit", shapes, N) == (N - 1) * (sum(math.ceil(math.prod(s) / 8) for s in shapes)
                                                                   + 4 * len(shapes))
        # PowerSGD rank 4: P [n, 4] and Q [m, 4] per matrix; 1-D tensors uncompressed
        p = C.bytes_per_step("powersgd", shapes, N, rank=4)
        assert p == pytest.approx(2 * (N - 1) / N * 4 * (4 * (256 + 64) + 4 * (192 + 64) + 192 + 64))
        assert p < plain / 5
    with pytest.raises(Exception, match="allowed: none, powersgd, topk, onebit"):
        C.bytes_per_step("fp8", shapes, 2)


TEXT = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=64",
        "data.name=shakespeare", "train.global_batch=16", "train.eval_batches=4", "train.log_every=1",
        "optim.warmup_steps=10", "optim.lr=3e-3", "train.steps=150", "train.eval_every=0", "train.progress=off",
        "parallel.compression_warmup_steps=30", "parallel.topk_ratio=0.05"]
METHODS = ("none", "powersgd", "topk", "onebit")


def _compressed(rank, world):
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    out = {}
    for m in METHODS:
        t = Trainer(load_config(None, TEXT + [f"parallel.compression={m}"]), None, log=lambda s: None)
        r = t.fit()
        shapes = [tuple(p.shape) for p in t.model.parameters()]
        out[m] = {"loss": sum(r.losses[-5:]) / 5, "val": r.val_loss, "comm": r.comm_bytes_per_step, "shapes": shapes}
    return out


@pytest.mark.slow
def test_compressed_training_on_shipped_text():
    """150 steps on Shakespeare (30 of them uncompressed warm-up), 2 ranks: each compressor ends
    within 5% of uncompressed training, and moves the bytes its cost face predicts (measured by
    the traffic ledger) — a fraction of the uncompressed all-reduce's."""
    res = run_distributed(_compressed, 2)[0]
    base = res["none"]
    shapes = base["shapes"]
    assert base["comm"] == pytest.approx(C.bytes_per_step("none", shapes, 2), rel=0.05)
    for m in METHODS[1:]:
        r = res[m]
        assert abs(r["loss"] - base["loss"]) / base["loss"] < 0.05, (m, r["loss"], base["loss"])
        assert abs(r["val"] - base["val"]) / base["val"] < 0.05, (m, r["val"], base["val"])
        want = C.bytes_per_step(m, shapes, 2, rank=4, topk_ratio=0.05)
        assert r["comm"] == pytest.approx(want, rel=0.05), m
        assert r["comm"] < base["comm"] / 4, m
