"""Intra-block rematerialization: ILP over a block's aten ops, executed by PyTorch SAC."""

import pytest
import torch
from torch import nn

from scaletrain import models
from scaletrain.measure.tracker import MemoryTracker
from scaletrain.techniques.remat.intrablock import (
    OpNode, apply_block_plan, brute_force_plan, plain_saved_bytes, plan_block, remove_block_plan, trace_block)
from scaletrain.techniques.remat.measure_run import EXCLUDED


def _gpt2_block():
    torch.manual_seed(0)
    m = models.get("gpt2-tiny")
    return dict(m.chain_blocks())["h.0"], torch.randn(2, 16, 128)


def _mlp_block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32)), \
        torch.randn(8, 32)


def _grads(block, x):
    block.zero_grad(set_to_none=True)
    xx = x.detach().requires_grad_()
    y = block(xx)
    (y.float() ** 2).sum().backward()
    return [p.grad.clone() for p in block.parameters()] + [xx.grad.clone()]


def _saved_bytes(block, x):
    """Bytes live after the forward beyond the output: what the block keeps for backward."""
    xx = x.detach().requires_grad_()
    with MemoryTracker(model=block, track_saved=False) as tr:
        y = block(xx)
        live = sum(d for _, rec, d in tr.events if rec.category not in EXCLUDED)
    # the tracker also registers the (pre-existing) input it sees, which checkpoint holds in any
    # case and the plan does not count; y's storage is allocated by the forward: both subtracted
    return live - y.untyped_storage().nbytes() - xx.untyped_storage().nbytes()


def _check_block(block, x):
    ops = trace_block(block, x)
    total = sum(o.out_bytes for o in ops if o.candidate)
    ref = _grads(block, x)
    times = []
    everything = plan_block(None, None, total, ops=ops)  # the ILP alone: keeps every candidate
    assert len(everything.kept) == sum(o.candidate for o in ops) and everything.predicted_recompute_flops == 0
    plain = plain_saved_bytes(block, x)
    assert plain == _saved_bytes(block, x) < total  # SAC's keep-all holds more than autograd would
    for frac in (1.0, plain / total, 0.6, 0.3, 0.1, 0.0):
        budget = int(total * frac)
        plan = plan_block(block, x, budget, ops=ops)
        assert plan.predicted_saved_bytes <= budget
        assert plan.no_checkpoint == (budget >= plain)
        apply_block_plan(block, plan)
        try:
            got = _grads(block, x)
            measured = _saved_bytes(block, x)
        finally:
            remove_block_plan(block)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        # the SAC cache holds exactly the kept ops' outputs; the block output (if its op is
        # kept) is the same storage as y and is subtracted on both sides
        last = [o for o in ops if o.candidate][-1]
        pred = plan.predicted_saved_bytes - (last.out_bytes if last.key in plan.kept else 0)
        if plan.no_checkpoint:  # plain autograd: nothing recomputed, its own saved tensors kept
            assert plan.predicted_recompute_flops == 0 and pred == plain
        assert measured == pred, (frac, measured, pred)
        times.append(plan.predicted_recompute_time_s)
    assert all(a <= b for a, b in zip(times, times[1:])), times
    assert times[-1] > times[0]
    return times


def test_gpt2_block_plans():
    _check_block(*_gpt2_block())


def test_mlp_block_plans():
    _check_block(*_mlp_block())


def test_ilp_matches_brute_force():
    torch.manual_seed(1)
    ops = trace_block(*_mlp_block())
    cand = [o for o in ops if o.candidate]
    assert 3 <= len(cand) <= 12
    total = sum(o.out_bytes for o in cand)
    for frac in (0.0, 0.2, 0.35, 0.5, 0.7, 0.9, 1.0):
        budget = int(total * frac)
        a = plan_block(None, None, budget, ops=ops)
        b = brute_force_plan(ops, budget)
        gap = abs(a.predicted_recompute_time_s - b.predicted_recompute_time_s)
        assert gap <= 1e-12 + 1e-9 * b.predicted_recompute_time_s


def test_ilp_matches_brute_force_synthetic():
    # a knapsack where greedy by ratio is wrong: the ILP must still be optimal
    ops = [OpNode(("a", i), b, 0, [], False, t) for i, (b, t) in
           enumerate([(60, 6.0), (50, 5.0), (50, 5.0), (10, 0.5), (30, 2.9), (20, 2.1)])]
    for budget in range(0, 230, 10):
        a = plan_block(None, None, budget, ops=ops)
        b = brute_force_plan(ops, budget)
        assert abs(a.predicted_recompute_time_s - b.predicted_recompute_time_s) < 1e-9, budget


# ---------------------------------------------------------------- `scaletrain remat --intra-block`

def _cli(*argv):
    from scaletrain.cli import main
    return main(["remat", "--model", "gpt2-tiny", "--batch", "2", "--seq", "16", *argv])


def test_cli_intra_block_json_measured_equals_predicted(capsys):
    import json
    assert _cli("--intra-block", "1", "--budget", "100KiB", "--measure", "--show-ops", "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["block"] == 1 and r["block_name"] == "h.0" and r["budget_bytes"] == 100 * 1024
    assert 0 < r["budget_bytes"] < r["full_saved_bytes"]  # a budget that forces recomputation
    assert 0 < r["candidate_ops"] <= r["traced_ops"]
    assert isinstance(r["predicted_saved_bytes"], int) and isinstance(r["predicted_recompute_s"], float)
    assert 0 < r["predicted_saved_bytes"] <= r["budget_bytes"]
    assert r["predicted_recompute_s"] > 0
    assert r["measured_saved_bytes"] == r["predicted_saved_bytes"]
    assert r["grads_equal"] is True and r["no_checkpoint"] is False
    assert len(r["kept_ops"]) == r["kept_op_count"] and all(o.startswith("aten.") for o in r["kept_ops"])


def test_cli_intra_block_no_checkpoint_when_autograd_fits(capsys):
    import json
    assert _cli("--intra-block", "1", "--budget", "250KiB", "--measure", "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["measured_plain_saved_bytes"] <= r["budget_bytes"] < r["full_saved_bytes"]
    assert r["no_checkpoint"] is True and r["predicted_recompute_s"] == 0.0 and r["grads_equal"] is True
    assert r["measured_saved_bytes"] == r["predicted_saved_bytes"] == r["measured_plain_saved_bytes"]


def test_cli_intra_block_text_and_last_block(capsys):
    assert _cli("--intra-block", "-1", "--budget", "0") == 0
    out = capsys.readouterr().out
    assert "block 5 (head) of 6" in out
    for label in ("traced ops", "candidate ops", "saved, keep all", "predicted saved      0 B", "predicted recompute"):
        assert label in out, out
    assert "measured" not in out and "kept ops" not in out


@pytest.mark.parametrize("argv, msg", [
    (["--intra-block", "6", "--budget", "1KiB"], "--intra-block 6 is out of range"),
    (["--intra-block", "-7", "--budget", "1KiB"], "allowed 0..5 or -6..-1"),
    (["--intra-block", "1", "--budget", "-1"], "--budget must be ≥ 0 bytes"),
    (["--intra-block", "1", "--budget=-5KiB"], "--budget must be ≥ 0 bytes"),
])
def test_cli_intra_block_errors(capsys, argv, msg):
    assert _cli(*argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert cap.out == "" and "\n" not in err and err.startswith("scaletrain: error:") and msg in err, err
    assert "Traceback" not in err
