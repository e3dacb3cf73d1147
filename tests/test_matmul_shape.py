"""Matmuls priced by shape: tile and wave quantization on the GPU's SMs (platform.wave_fraction), through the
one roofline (scaletrain.cost.roofline_seconds) and the planner's matmuls; CPUs (sm_count 0) unaffected."""

from __future__ import annotations

import pytest

from scaletrain import platform as P
from scaletrain.cost import roofline_seconds
from scaletrain.planner.cost import _mm
from scaletrain.errors import UserError


def test_wave_fraction_by_hand():
    w = P.wave_fraction
    # 108 SMs, 256x128 tiles: 12 x 9 = 108 tiles fill one wave exactly; 10 x 11 = 110 need a second wave
    # doing 2 tiles -> 110/216 (128x256 the other way: 20 x 6 tiles of which the last column is half used,
    # 2 waves, the same useful work)
    assert w(12 * 256, 9 * 128, 1, 108, 256, 128) == pytest.approx(1.0)
    assert w(10 * 256, 11 * 128, 1, 108, 256, 128) == pytest.approx(110 / 216)
    # tile padding: n = 96 in a 128-wide tile (the other way, 96 of a 256-wide one cut to 128): 0.75 of a wave
    assert w(108 * 256, 96, 1, 108, 256, 128) == pytest.approx(0.75)
    # n = 64 runs 64-wide tiles, not half of a 128-wide one: 108 tiles of 256x64, one full wave
    assert w(108 * 256, 64, 1, 108, 256, 128) == pytest.approx(1.0)
    # a batched GEMM's tiles share the waves: 4 heads of 2x2 tiles = 16 tiles on 108 SMs, one wave
    assert w(512, 256, 4, 108, 256, 128) == pytest.approx(16 / 108)
    # the better orientation: 128 x 5120 is 1 x 20 full tiles of 128x256 (one wave on 20 SMs), but
    # 1 x 40 half-empty tiles of 256x128 in two waves (0.5) the other way
    assert w(128, 5120, 1, 20, 256, 128) == pytest.approx(1.0)
    # the published best shapes (ml-engineering MAMF): A100 32 full waves; H100 SXM 3360 tiles in 26 waves
    assert w(6912, 16384, 1, 108, 256, 128) == pytest.approx(1.0)
    assert w(6144, 17920, 1, 132, 256, 128) == pytest.approx(3360 / (26 * 132))
    assert w(10 * 256, 11 * 128, 1, 0, 256, 128) == 1.0  # not priced


def test_presets_carry_sm_counts_and_cpu_is_unaffected():
    assert (P.get("a100").sm_count, P.get("h100").sm_count, P.get("h200").sm_count, P.get("v100").sm_count) == \
        (108, 132, 132, 80)
    # the H100 table is per useful tile: its top row times the best shape's wave fraction is the MAMF 0.80
    h = P.get("h100")
    assert h.matmul_fraction(1e15) * h.wave_fraction(6144, 17920) == pytest.approx(0.80)
    cpu = P.Platform(name="cpu")
    assert cpu.sm_count == 0 and cpu.wave_fraction(10 * 256, 11 * 128) == 1.0
    assert roofline_seconds(cpu, 1e12, 1e6, output=(10 * 256, 11 * 128, 1)) == roofline_seconds(cpu, 1e12, 1e6)
    with pytest.raises(UserError, match="sm_count"):
        P.Platform.from_dict({"name": "x", "sm_count": -1})
    assert P.Platform.from_dict(h.to_dict()) == h


def test_roofline_and_planner_matmul_pay_the_partial_wave():
    a = P.get("a100")
    # a compute-bound bf16 GEMM, 512 x 7040 x 8192: 2 x 55 tiles of 256x128 on 108 SMs, two waves' time for
    # 110 tiles' work (the other orientation, 4 x 28 tiles of 128x256, pads to the same 110/216)
    m, n, k = 512, 7040, 8192
    flops, nbytes = 2 * m * n * k, 2 * (m * k + k * n + m * n)
    one_wave = roofline_seconds(a, flops, nbytes, precision="bf16")
    assert a.memory_bound_seconds(nbytes) < one_wave * 110 / 216
    assert roofline_seconds(a, flops, nbytes, precision="bf16", output=(m, n, 1)) == pytest.approx(one_wave * 216 / 110)
    assert _mm(a, "bf16", m, n, k) == pytest.approx(one_wave * 216 / 110)
    assert _mm(a.with_(sm_count=0), "bf16", m, n, k) == pytest.approx(one_wave)
