"""``scaletrain remat``: JSON fields, measured peak within budget, one-line errors."""

from __future__ import annotations

import json
import re

import pytest

from scaletrain.cli import main


def run_json(capsys, *argv) -> list[dict]:
    assert main(["remat", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plans_every_method(capsys):
    rows = run_json(capsys, "--model", "mlp", "--batch", "4", "--budget", "50KiB")
    assert [r["method"] for r in rows] == ["none", "periodic", "revolve", "optimal", "ilp", "dtr"]
    for r in rows:
        assert {"method", "budget_bytes", "predicted_peak_bytes", "measured_peak_bytes", "step_time_s",
                "grads_match"} <= set(r)
        assert r["budget_bytes"] == 50 * 1024
        if r.get("error"):
            assert r["predicted_peak_bytes"] is None and "minimum feasible" in r["error"]
        else:
            assert r["predicted_peak_bytes"] <= r["budget_bytes"]
    assert any(not r.get("error") for r in rows)


def test_measure_within_budget_and_grads_equal(capsys):
    rows = run_json(capsys, "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--budget", "3MiB",
                    "--methods", "optimal", "periodic", "dtr", "--measure", "--repeats", "1")
    planned = [r for r in rows if r["method"] != "autograd" and not r.get("error")]
    assert planned
    for r in planned:
        assert r["grads_match"] is True, r
        assert r["measured_peak_bytes"] <= r["predicted_peak_bytes"] <= r["budget_bytes"], r
        assert 0 < r["step_time_min_s"] <= r["step_time_s"] <= r["step_time_max_s"], r  # interleaved rounds
    ref = [r for r in rows if r["method"] == "autograd"][0]
    assert ref["measured_peak_bytes"] > 0 and ref["grads_match"] is True


def test_budget_below_minimum_is_one_line(capsys):
    assert main(["remat", "--model", "mlp", "--batch", "4", "--budget", "1KiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert re.search(r"below the minimum feasible \d+ B \([0-9.e+-]+ GiB\)", err), err


@pytest.mark.parametrize("argv", [["--budget", "lots"], ["--budget", "1GiB", "--model", "nope"]])
def test_bad_input(capsys, argv):
    args = ["remat", "--model", "mlp", *argv] if "--model" not in argv else ["remat", *argv]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("scaletrain: error:")
