"""Budgeted planning (cost of a training run, deadline, budget, several platforms and node counts) and
the timeline of a plan's predicted step."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain import platform as P
from scaletrain.cli import main
from scaletrain.errors import UserError
from scaletrain.plan import Plan, RematPlan
from scaletrain.planner import Shape, plan_cost
from scaletrain.planner.budget import (Rental, Workload, parse_count, parse_duration, parse_nodes, plan_rentals,
                                       train_cost)
from scaletrain.planner.timeline import KINDS, draw_step, step_timeline

SMALL = Shape.of("gpt2-small")
A100 = P.get("a100-80g").with_(price_per_device_hour=2.0)
BASE = ["plan", "--model", "gpt2-small", "--global-batch", "32", "--seq", "1024"]


def test_cost_is_devices_times_hours_times_price():
    plan = Plan(dp=16, zero=1, micro_batch=2, precision="bf16")
    c = plan_cost(SMALL, plan, A100, global_batch=32, seq=1024)
    r = Rental(c, A100, nodes=2, gpus_per_node=8, steps=Workload(tokens=1e9).steps(32, 1024))
    steps = math.ceil(1e9 / (32 * 1024))  # whole steps of 32 x 1024 tokens
    assert r.steps == steps == 30518
    assert r.train_time_s == pytest.approx(steps * c.step_time_s)
    assert r.train_cost == pytest.approx(16 * steps * c.step_time_s / 3600 * 2.0)
    assert train_cost(16, 3600, 2.0) == 32.0
    assert Workload(samples=100).steps(32, 1024) == 4
    assert Rental(c, A100.with_(price_per_device_hour=0.0), 2, 8, steps).train_cost is None  # unknown price
    assert Rental(c, A100, 2, 8, 0).train_time_s is None  # no run stated


def test_parsers():
    assert parse_duration("2h") == 7200 and parse_duration("3d") == 3 * 86400 and parse_duration("90") == 90
    assert parse_duration("1.5h") == 5400 and parse_duration("90m") == 5400
    assert parse_nodes("1,2,4") == [1, 2, 4] and parse_nodes("4") == [4] and parse_nodes("16,2-4") == [2, 3, 4, 16]
    assert parse_count("--tokens", "300e9") == 300e9
    for bad in (lambda: parse_duration("2x"), lambda: parse_duration("0"), lambda: parse_nodes("0-2"),
                lambda: parse_nodes("4-2"), lambda: parse_nodes("a"), lambda: parse_count("--tokens", "-1")):
        with pytest.raises(UserError):
            bad()


def test_cost_objective_rents_fewer_devices_when_the_speedup_is_sublinear():
    # gpt2-small, global batch 32: 16 A100s step faster than 8, but less than twice as fast
    kw = dict(gpus_per_node=8, global_batch=32, seq=1024, workload=Workload(tokens=1e9))
    fast = plan_rentals(SMALL, [A100], [1, 2], objective="time", **kw).ranked[0]
    cheap = plan_rentals(SMALL, [A100], [1, 2], objective="cost", **kw).ranked[0]
    assert fast.devices == 16 and cheap.devices == 8
    speedup = cheap.cost.step_time_s / fast.cost.step_time_s
    assert 1 < speedup < 2
    assert fast.train_cost / cheap.train_cost == pytest.approx(2 / speedup)  # same price: cost ratio = devices / speed


def test_deadline_rejects_the_slow_rentals_with_the_reason():
    kw = dict(gpus_per_node=8, global_batch=32, seq=1024, workload=Workload(tokens=1e9), objective="cost")
    free = plan_rentals(SMALL, [A100], [1, 2], **kw)
    best8 = min(r.train_time_s for r in free.ranked if r.devices == 8)
    best16 = min(r.train_time_s for r in free.ranked if r.devices == 16)
    deadline = (best8 + best16) / 2  # only 16 devices make it
    res = plan_rentals(SMALL, [A100], [1, 2], deadline_s=deadline, **kw)
    assert res.ranked and all(r.train_time_s <= deadline and r.devices == 16 for r in res.ranked)
    late = [r for r in res.rejected if r["kind"] == "deadline"]
    assert {r["region"] for r in late} >= {"8 x a100-80g"} and "past the deadline" in late[0]["reason"]
    assert sum(r["count"] for r in late) + len(res.ranked) == len(free.ranked)  # nothing lost, nothing twice
    cheapest = res.ranked[0].train_cost
    capped = plan_rentals(SMALL, [A100], [1, 2], deadline_s=deadline, max_cost=cheapest * 1.001, **kw)
    assert all(r.train_cost <= cheapest * 1.001 for r in capped.ranked)
    assert any(r["kind"] == "budget" and "over the budget" in r["reason"] for r in capped.rejected)


@pytest.mark.parametrize("argv, msg", [
    (["--tokens", "1e9", "--objective", "cost"], "platform 'a100-80g' has no price_per_device_hour"),
    (["--objective", "cost", "--price", "a100-80g=2"], "--tokens N or --samples N"),
    (["--tokens", "1e9", "--max-cost", "100"], "price_per_device_hour"),
    (["--deadline", "3 weeks", "--tokens", "1e9"], "--deadline"),
    (["--price", "h100=3"], "no --platform named 'h100'"),
    (["--nodes", "1,x"], "--nodes"),
    (["--tokens", "1e9", "--samples", "5"], "give one"),
    (["--timeline", "step.svg"], "PNG"),
])
def test_bad_budget_input_is_one_line_exit_2(capsys, argv, msg):
    rc = main([*BASE, *argv])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.count("\n") == 1, err


def test_several_platforms_are_ranked_together_by_cost(capsys, tmp_path):
    h100 = tmp_path / "h100.json"  # a price in the platform file; the other one on the command line
    h100.write_text(json.dumps({**P.get("h100").to_dict(), "price_per_device_hour": 4.0}))
    rc = main([*BASE, "--platform", "a100-80g", "--platform", str(h100), "--price", "a100-80g=2",
               "--nodes", "1,2", "--tokens", "1e9", "--objective", "cost", "--top", "400", "--json"])
    ranked = json.loads(capsys.readouterr().out)
    assert rc == 0 and {e["platform"] for e in ranked} == {"a100-80g", "h100"}
    assert {e["devices"] for e in ranked} == {8, 16}
    costs = [e["train_cost"] for e in ranked]
    assert all(a <= b * (1 + 1e-6) for a, b in zip(costs, costs[1:]))  # ties (6 digits) go to the faster
    price = {"a100-80g": 2.0, "h100": 4.0}
    for e in ranked:
        assert e["train_time_s"] == pytest.approx(e["train_steps"] * e["step_time_s"])
        assert e["train_cost"] == pytest.approx(e["devices"] * e["train_time_s"] / 3600 * price[e["platform"]])


def _check_rows(tl, c):
    for r in range(tl.n_ranks):
        row = sorted((e for e in tl.segments if e.rank == r), key=lambda e: e.start_s)
        assert row[0].start_s == 0 and row[-1].end_s == pytest.approx(c.step_time_s, rel=1e-9)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(row, row[1:]))  # no overlap, no gap
        assert tl.row_total(r) == pytest.approx(c.step_time_s, rel=1e-9)
        got = tl.by_phase(r)
        for phase, want in c.phases_s.items():  # kind by kind, the planner's phases
            assert got.get(phase, 0.0) == pytest.approx(want, rel=1e-9, abs=1e-12), phase


@pytest.mark.parametrize("plan", [
    Plan(dp=2, tp=2, pp=2, micro_batch=1, microbatches=8, schedule="interleaved", virtual=2, sp=True,
         remat=RematPlan(blocks="all"), precision="bf16"),
    Plan(dp=2, tp=1, pp=4, micro_batch=2, microbatches=4, schedule="1f1b", remat=RematPlan(selective="attention"),
         precision="bf16", zero=1),
    Plan(dp=8, micro_batch=2, zero=3, precision="bf16"),
])
def test_timeline_segments_add_up_to_the_predicted_step(plan):
    gb = plan.dp * plan.micro_batch * (plan.microbatches or 4)
    c = plan_cost(SMALL, plan, A100, global_batch=gb, seq=1024)
    tl = step_timeline(c, SMALL, A100, global_batch=gb, seq=1024)
    assert tl.n_ranks == plan.pp and {e.kind for e in tl.segments} <= set(KINDS)
    _check_rows(tl, c)
    if plan.pp > 1:
        assert any(e.kind == "BUBBLE" for e in tl.segments) and any(e.kind == "P2P" for e in tl.segments)
    passes = [e for e in tl.segments if e.rank == 0 and e.kind in ("F", "B")]
    v = max(plan.virtual, 1)
    assert len(passes) == 2 * v * (plan.microbatches or 4)  # one forward and one backward per chunk and micro-batch


def test_timeline_png_from_the_cli(capsys, tmp_path):
    png = tmp_path / "step.png"
    rc = main([*BASE, "--nodes", "1", "--fix", "pp=2", "--explain", "2", "--timeline", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out


def test_a_phase_without_a_block_is_drawn_after_the_step(tmp_path):
    # a phase the timeline has no kind for (here a made-up 10 ms host phase) still gets its own segment
    plan = Plan(dp=8, micro_batch=2, zero=1, precision="bf16")
    c = plan_cost(SMALL, plan, A100, global_batch=32, seq=1024)
    c.phases_s["host_update"] = 0.010
    c.step_time_s += 0.010
    tl = step_timeline(c, SMALL, A100, global_batch=32, seq=1024)
    _check_rows(tl, c)
    last = max(tl.segments, key=lambda e: e.end_s)
    assert last.kind == "host_update" and last.end_s - last.start_s == pytest.approx(0.010)
    assert draw_step(tl, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
