"""Platform presets, serialisation and calibration."""

from __future__ import annotations

import pytest

from scaletrain import platform as P
from scaletrain.errors import UserError


def test_presets_are_sourced_and_consistent():
    assert set(P.names()) >= {"h100", "a100", "v100"}
    for name in P.names():
        p = P.get(name)
        assert p.device_type == "cuda" and p.source
        assert p.flops_bf16 > p.flops_fp32 > 0
        assert p.device_mem_bytes_per_s > p.h2d_bytes_per_s > 0
        assert p.copy_overlaps_compute
    # generations are ordered as their data sheets say
    h, a, v = P.get("h100"), P.get("a100"), P.get("v100")
    assert h.flops_bf16 > a.flops_bf16 > v.flops_bf16
    assert h.h2d_bytes_per_s > a.h2d_bytes_per_s > v.h2d_bytes_per_s
    assert h.flops_bf16 == pytest.approx(989.4e12) and a.flops_bf16 == pytest.approx(312e12)


def test_round_trip_and_errors():
    p = P.get("a100").with_(device_memory_bytes=123)
    assert P.Platform.from_dict(p.to_dict()) == p
    with pytest.raises(UserError, match="unknown platform field"):
        P.Platform.from_dict({"name": "x", "warp_speed": 9})
    with pytest.raises(UserError, match="unknown platform"):
        P.get("tpu-v9")
    assert p.h2d_time(p.h2d_bytes_per_s) == pytest.approx(1.0)
    assert p.flops("bf16") == p.flops_bf16 and p.flops("fp32") == p.flops_fp32


def test_calibrate_measures_this_machine(tmp_path):
    p = P.calibrate(disk_dir=str(tmp_path), quick=True)
    assert p.device_type in ("cpu", "cuda")
    for field in ("host_memcpy_bytes_per_s", "disk_read_bytes_per_s", "disk_write_bytes_per_s",
                  "cpu_adam_params_per_s", "flops_fp32", "h2d_bytes_per_s", "host_memory_bytes"):
        assert getattr(p, field) > 0, field
    if p.device_type == "cpu":
        assert not p.copy_overlaps_compute and p.h2d_bytes_per_s == p.host_memcpy_bytes_per_s
    assert "calibrate()" in p.source
    assert not list(tmp_path.iterdir())  # the probe file is removed
