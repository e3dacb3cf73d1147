"""Block profiler: every BlockProfile field measured; measured bytes == estimated bytes; no side effects."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scaletrain import models
from scaletrain.chain import to_chain
from scaletrain.measure.estimate import estimate_chain
from scaletrain.measure.profiler import profile_chain
from scaletrain.measure.step import make_batch


pytestmark = pytest.mark.usefixtures("one_thread")

BYTES = ("param_bytes", "param_count", "input_bytes", "output_bytes", "saved_bytes", "fwd_temp_bytes",
         "bwd_temp_bytes", "flops_fwd", "flops_bwd")


def test_profile_fills_every_field_and_equals_the_estimate() -> None:
    torch.manual_seed(0)
    m = models.get("gpt2-tiny")
    x, y = make_batch(m, 2, 64)
    prof = profile_chain(to_chain(m), x, target=y, repeats=3, warmup=1, precision="bf16")
    est = estimate_chain(to_chain(m), x, target=y, precision="bf16")
    assert prof.measured and not est.measured
    assert len(prof) == len(to_chain(m))
    for bp, be in zip(prof.blocks, est.blocks):
        assert bp.fwd_time_s > 0 and bp.bwd_time_s > 0
        assert bp.fwd_time_spread_s >= 0 and bp.bwd_time_spread_s >= 0
        for f in BYTES:  # fake tensors see exactly the storages the real run allocates
            assert getattr(bp, f) == getattr(be, f), (bp.name, f)
    assert all(bp.saved_bytes > 0 for bp in prof.blocks[1:-1])
    assert prof.meta["loss"]["fwd_time_s"] > 0
    assert {f.name for f in dataclasses.fields(prof.blocks[0])} >= set(BYTES)


def test_profile_restores_gradients_and_buffers() -> None:
    torch.manual_seed(0)
    m = models.get("resnet-mini")
    x, y = make_batch(m, 2)
    p0 = next(m.parameters())
    p0.grad = torch.full_like(p0, 3.0)
    stats = {k: v.clone() for k, v in m.state_dict().items() if "running" in k}
    prof = profile_chain(m, x, target=y, repeats=1, warmup=0)
    assert torch.equal(p0.grad, torch.full_like(p0, 3.0))
    assert all(q.grad is None for q in list(m.parameters())[1:])
    for k, v in m.state_dict().items():
        if k in stats:
            assert torch.equal(v, stats[k]), k
    assert prof.blocks[0].name == "stem" and prof.blocks[-1].name == "head"
