"""benchmarks/planner/gpu_check.py --dry-run: what a lent GPU will run is planned and priced here first."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "planner" / "gpu_check.py"


def test_dry_run_plans_and_prices_every_plan_without_running(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--out", str(tmp_path), "--dry-run", "--quick"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "matmul" not in result and "bandwidth" not in result  # nothing measured off the device
    rows = result["plans"]
    assert len(rows) == 3 and all(r["status"] == "planned (dry run)" for r in rows)
    assert all(r["predicted_step_time_s"] > 0 and r["predicted_peak_bytes"] > 0 for r in rows)
    assert not (tmp_path / "runs").exists()  # nothing trained
    assert all((tmp_path / f"{r['name']}.toml").exists() for r in rows)  # the plans a GPU run would train
