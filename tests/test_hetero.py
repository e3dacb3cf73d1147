"""Heterogeneous devices: the planner's uneven splits (scaletrain.planner.hetero) and uneven per-rank
batches keeping the global-batch mean (scaletrain.techniques.data_parallel.uneven)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scaletrain.errors import UserError
from scaletrain.planner import hetero
from scaletrain.planner.shape import Shape
from scaletrain.platform import get
from scaletrain.techniques.data_parallel.uneven import loss_weight, rank_slice
from scaletrain.testing import run_distributed


def test_min_max_split_is_optimal_and_capped():
    # brute force over every split of 7 units on 3 devices: the greedy reaches the least slowest time
    unit, fixed = [1.0, 2.5, 4.0], [0.5, 0.0, 1.0]
    got = hetero.min_max_split(7, unit, fixed, caps=[4, 7, 7])
    best = min(hetero.slowest([a, b, 7 - a - b], unit, fixed) for a in range(5) for b in range(8 - a))
    assert sum(got) == 7 and got[0] <= 4
    assert hetero.slowest(got, unit, fixed) == pytest.approx(best)
    with pytest.raises(UserError):
        hetero.min_max_split(9, unit, caps=[2, 3, 3])


def test_faster_device_gets_more_layers_and_samples():
    plats = hetero.parse_cluster("a100-80g:2,v100:2", get)
    plans = {p.kind: p for p in hetero.plan_cluster(Shape.of("gpt2-xl"), plats, global_batch=64, seq=1024)}
    for kind in ("data", "pipeline"):
        h = plans[kind]
        assert min(h.split[:2]) > max(h.split[2:]), (kind, h.split)  # the A100s take more than the V100s
        assert h.even_step_s > h.step_s and h.margin > 1.1
        assert all(b <= c for b, c in zip(h.peak_bytes, h.device_bytes))
    assert sum(plans["data"].split) == 64 and sum(plans["pipeline"].split) == 48


def test_cli_cluster_and_bad_counts(tmp_path, capsys):
    from scaletrain.cli import main

    f = tmp_path / "c.json"
    f.write_text(json.dumps({"devices": [{"platform": "h100", "count": 1}, {"platform": "v100", "count": 1}]}))
    assert main(["plan", "--model", "gpt2-medium", "--platform", str(f), "--global-batch", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {o["kind"] for o in out} == {"data", "pipeline"} and all(o["split"][0] > o["split"][1] for o in out)
    f.write_text(json.dumps({"devices": [{"platform": {"flops_bf16": 1e12}, "count": 1}, {"platform": "v100",
                                                                                     "count": 2.5}]}))
    for bad in ("a100-80g:0,v100:2", "a100-80g:2,nope:1", "v100:1", "a100-80g:1.5,v100:1", str(f)):
        assert main(["plan", "--model", "gpt2-medium", "--platform", bad, "--global-batch", "16"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err


def _uneven_grads(rank: int, world: int, split: list[int]) -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(sum(split), 6, generator=g), torch.randint(0, 3, (sum(split),), generator=g)
    part = rank_slice(split, rank)
    loss = torch.nn.functional.cross_entropy(ddp(x[part]), y[part]) * loss_weight(split, rank)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_uneven_ddp_matches_one_process():
    split = [5, 2]
    grads = run_distributed(_uneven_grads, 2, split, timeout_s=120)
    ref = _uneven_grads_single(split)
    for rank_grads in grads:
        for a, b in zip(rank_grads, ref):
            assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def _uneven_grads_single(split: list[int]) -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(sum(split), 6, generator=g), torch.randint(0, 3, (sum(split),), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_loss_weights_sum():
    split = [5, 2, 1]
    assert math.isclose(sum(loss_weight(split, r) for r in range(3)), 3.0)
    assert math.isclose(sum(loss_weight(split, r, averaged=False) for r in range(3)), 1.0)
