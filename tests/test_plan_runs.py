"""``scaletrain plan --runs N`` (scaletrain.sweep.plan_runs) and the gh200 preset's host link."""

from __future__ import annotations

import json
import math

from scaletrain.sweep import plan_runs as runs
from scaletrain.planner.shape import Shape
from scaletrain.platform import Platform, get


def test_gh200_states_its_host_link():
    gh, h = get("gh200"), get("h100")
    assert gh.host_link == "NVLink-C2C" and h.host_link.startswith("PCIe")
    assert gh.h2d_bytes_per_s >= 7 * h.h2d_bytes_per_s * 0.99  # NVIDIA: 7x PCIe Gen5
    assert gh.devices_per_host == 1
    assert Platform.from_dict(gh.to_dict()) == gh  # a platform file states the host link and round-trips


def test_spilled_shards_priced_by_the_host_link():
    shape, gh, h = Shape.of("llama3.1-8b"), get("gh200"), get("h100")
    kw = dict(global_batch=8, seq=2048, precision="bf16")
    c2c = runs.alternator(shape, gh, 4, 8, **kw)
    pcie = runs.alternator(shape, gh.with_(h2d_bytes_per_s=h.h2d_bytes_per_s, d2h_bytes_per_s=h.d2h_bytes_per_s),
                           4, 8, **kw)
    assert c2c.step_s < 0.6 * pcie.step_s
    # no schedule beats the devices' total work: 8 runs x 8 samples of forward + backward over 4 devices
    compute = 8 * 8 * shape.flops_per_token(2048) * 2048 / (4 * gh.flops_bf16)
    assert c2c.step_s > compute
    # the host holds every run's states: too many runs for its memory -> does not fit, says why
    big = runs.alternator(shape, h, 4, 40, **kw)
    assert math.isinf(big.step_s) and "host memory" in big.detail


def test_cli_runs_json(capsys):
    from scaletrain.cli import main

    assert main(["plan", "--model", "llama3.1-8b", "--platform", "gh200", "--nodes", "1", "--gpus-per-node", "4",
                 "--runs", "8", "--global-batch", "8", "--seq", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    names = [x["layout"] for x in out["layouts"]]
    assert out["host_link"] == "NVLink-C2C" and len(set(names)) == 4
    steps = [x["step_s"] for x in out["layouts"]]
    assert steps == sorted(steps)
    assert main(["plan", "--model", "gpt2-medium", "--runs", "2", "--global-batch", "8", "--fix", "tp=2"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
