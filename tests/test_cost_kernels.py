"""Kernel-level terms of the GPU cost model (issue #26): each priced from a source, checked by hand."""

import dataclasses

import pytest

from scaletrain.cost.norm import norm_seconds
from scaletrain.errors import UserError
from scaletrain.planner.cost import Options, layer_times
from scaletrain.planner.shape import Shape
from scaletrain.platform import get


def test_torch_norm_is_priced_at_its_measured_fractions():
    """torch's LayerNorm, 10⁸ bf16 elements on the h100 preset (3.35 TB/s), fractions measured on one
    H200 (benchmarks/results/planner_gpu_h200_profile.json): forward reads and writes 2 bytes each,
    4e8 / (3.35e12 · 0.44) = 271.4 µs; backward: the input gradient reads dy, x and writes dx,
    6e8 / (3.35e12 · 0.81) = 221.1 µs, and gamma/beta read dy, x again, 4e8 / (3.35e12 · 0.35) =
    341.2 µs: 562.3 µs, 2.07 × the forward (the old rule said 2 × a streaming kernel at 0.9: 265 µs)."""
    fwd, bwd = norm_seconds(get("h100"), "torch", 1e8, 2)
    assert fwd == pytest.approx(271.4e-6, rel=1e-3)
    assert bwd == pytest.approx(562.3e-6, rel=1e-3)
    old_f, old_b = norm_seconds(get("h100"), "roofline", 1e8, 2)
    assert old_f == pytest.approx(4e8 / (3.35e12 * 0.9)) and old_b == pytest.approx(2 * old_f)


def test_apex_norm_and_small_kernels():
    """apex's fused LayerNorm (Megatron 2021), 10⁸ fp16 elements on the a100 preset (2.039 TB/s), its
    published rates on an A100 40GB (apex PR #1037: 895.8 and 572.2 of 1,555 GB/s): forward
    4e8 / (2.039e12 · 0.576) = 340.6 µs, backward (one measured time over 6 bytes per element)
    6e8 / (2.039e12 · 0.368) = 799.6 µs. A 1 MB kernel is never priced above the size table's 0.6."""
    fwd, bwd = norm_seconds(get("a100"), "apex", 1e8, 2)
    assert fwd == pytest.approx(340.6e-6, rel=1e-3)
    assert bwd == pytest.approx(799.6e-6, rel=1e-3)
    small_f, _ = norm_seconds(get("a100"), "apex", 2.5e5, 2)  # 1 MB forward: min(0.576, 0.6)
    assert small_f == pytest.approx(1e6 / (2.039e12 * 0.576))
    tiny_f, _ = norm_seconds(get("a100"), "apex", 2.5e4, 2)  # 0.1 MB: the table's 0.3 is lower
    assert tiny_f == pytest.approx(1e5 / (2.039e12 * 0.3))
    with pytest.raises(UserError, match="unknown norm kernel 'fast'"):
        norm_seconds(get("a100"), "fast", 1e8, 2)


def test_layer_prices_its_two_norms_by_kernel_on_gpus_only():
    """One GPT layer (h = 1,024, b·s = 8,192, bf16, no autocast stream): switching the norm kernel
    from roofline to torch changes the forward by 2·(f_torch − f_roof) and the backward by
    2·(b_torch − b_roof), the two norms' own seconds, and nothing else; a CPU platform keeps the
    roofline whatever the option says (the fractions are GPU kernels')."""
    shape = Shape(layers=2, hidden=1024, heads=16, vocab=1024, positions=1024)
    plat = get("h100")
    kw = dict(seq=1024, b=8, tp=1, sp=False, precision="bf16")
    roof = layer_times(shape, plat, opts=Options(norm_kernel="roofline"), **kw)
    torch_ = layer_times(shape, plat, opts=Options(norm_kernel="torch"), **kw)
    tf, tb = norm_seconds(plat, "torch", 8192 * 1024, 2)
    rf, rb = norm_seconds(plat, "roofline", 8192 * 1024, 2)
    assert torch_["fwd"] - roof["fwd"] == pytest.approx(2 * (tf - rf))
    assert torch_["bwd"] - roof["bwd"] == pytest.approx(2 * (tb - rb))
    assert torch_["bwd"] > roof["bwd"] > 0
    cpu = dataclasses.replace(plat, device_type="cpu")
    assert layer_times(shape, cpu, opts=Options(norm_kernel="torch"), **kw) == \
        layer_times(shape, cpu, opts=Options(norm_kernel="roofline"), **kw)
