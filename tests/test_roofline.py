"""`scaletrain profile --roofline`: operators on a platform's roofline (scaletrain.measure.roofline)."""

from __future__ import annotations

import json

import pytest

from scaletrain import platform
from scaletrain.cli import main
from scaletrain.cost import roofline_seconds
from scaletrain.measure.census import Op
from scaletrain.measure.roofline import ridge_point, rows

pytestmark = pytest.mark.usefixtures("one_thread")


def test_roofline_json_bounds_and_png(capsys, tmp_path) -> None:
    png = tmp_path / "roof.png"
    assert main(["profile", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--roofline",
                 "--platform", "a100-80g", "--json", "--png", str(png)]) == 0
    d = json.loads(capsys.readouterr().out)
    plat = platform.get("a100-80g")
    assert d["ridge_flops_per_byte"] == pytest.approx(plat.flops_fp32 / plat.device_mem_bytes_per_s)
    ops = {r["op"]: r for r in d["ops"]}
    mm, gelu = ops["mm"], ops["gelu"]
    assert mm["bound"] == "compute" and mm["intensity"] > d["ridge_flops_per_byte"]  # matmul-heavy
    assert gelu["bound"] == "memory" and gelu["flops"] == 0 and "fusion" in gelu["hint"]  # elementwise
    for r in (mm, gelu):  # measured here: achieved rates are the op's FLOPs and bytes over its measured time
        assert r["measured_s"] > 0
        assert r["achieved_bytes_per_s"] == pytest.approx(r["nbytes"] / r["measured_s"])
    assert mm["achieved_flops_per_s"] == pytest.approx(mm["flops"] / mm["measured_s"])
    assert mm["intensity"] == pytest.approx(mm["flops"] / mm["nbytes"])
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_roofline_rows_use_the_cost_roofline() -> None:
    plat = platform.get("a100-80g")
    small_mm = Op("mm", flops=2 * 64 * 8 * 8, nbytes=4 * (64 * 8 + 8 * 8 + 64 * 8))  # intensity 1.6 < ridge 9.6
    big_mm = Op("mm", flops=2 * 4096**3, nbytes=4 * 3 * 4096**2)
    (small,) = rows([small_mm], plat)
    assert small.bound == "memory" and "micro-batch" in small.hint  # a matmul under the ridge: feed it more rows
    (big,) = rows([big_mm], plat)
    assert big.bound == "compute" and big.intensity > ridge_point(plat)
    assert big.platform_s == roofline_seconds(plat, big_mm.flops, big_mm.nbytes)
    (bf16,) = rows([Op("mm", big_mm.flops, big_mm.nbytes, half=True)], plat, "bf16")
    assert bf16.platform_s < big.platform_s  # 16-bit matmuls price at the tensor-core peak


def test_roofline_bad_platform(capsys, tmp_path) -> None:
    png = tmp_path / "x.png"
    assert main(["profile", "--model", "gpt2-tiny", "--roofline", "--platform", "tpu9", "--png", str(png)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tpu9" in err[0] and "a100-80g" in err[0]
    assert not png.exists()
