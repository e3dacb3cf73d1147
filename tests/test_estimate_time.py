"""The time half of the cost interface: seconds by phase per rank (scaletrain.techniques.time_cost)."""

from __future__ import annotations

import json

import pytest

from scaletrain import models
from scaletrain.cli import main
from scaletrain.plan import Plan, RematPlan
from scaletrain.platform import Platform
from scaletrain.techniques.plan_cost import plan_costs

PEAK, EFF, BW, ALPHA = 1e12, 0.5, 1e9, 1e-5
# memory-bound kernels free (bandwidth 1e30 B/s, no fixed cost per kernel): every second is a FLOP's
FLOPS_ONLY = Platform(name="flops-only", flops_fp32=PEAK, flops_bf16=PEAK, device_mem_bytes_per_s=1e30,
                      matmul_efficiency=((0.0, EFF),), mem_efficiency=((0.0, 1.0),), intra_node_bytes_per_s=BW,
                      intra_node_efficiency=1.0, intra_node_latency_s=ALPHA, devices_per_node=8)


def _costs(plan: Plan, name: str = "gpt2-tiny", world: int = 1, gb: int = 4, seq: int = 32, plat=FLOPS_ONLY, **over):
    return plan_costs(plan, models.get(name, device="meta", **over), world=world, global_batch=gb, seq=seq,
                      platform=plat)


def _phases(t: dict) -> float:
    return (t["compute"] + t["recompute"] + sum(t["comm_exposed"].values()) + t["bubble"]
            + sum(t["copies_exposed"].values()) + t["optimizer"])


def test_compute_is_flops_over_peak_times_efficiency_one_block() -> None:
    # one Linear(64 -> 32) block on a batch of 8: forward 2·b·in·out FLOPs, backward the weight gradient only
    # (the model's input needs none); the loss has no FLOPs
    (c,) = _costs(Plan(dp=1), "mlp", gb=8, seq=1, widths=(64, 32))
    by_hand = (2 * 8 * 64 * 32 + 2 * 8 * 64 * 32) / (PEAK * EFF)
    assert c.time_s.compute == pytest.approx(by_hand, rel=1e-12)
    assert c.time_s.recompute == 0.0 and c.time_s.comm_s == {} and c.time_s.bubble == 0.0


def test_compute_matches_the_profile_flops_and_phases_sum_to_the_step() -> None:
    from scaletrain.measure.estimate import estimate_chain
    from scaletrain.techniques.plan_cost import _loss

    model = models.get("gpt2-tiny", device="meta")
    (c,) = _costs(Plan(dp=1, micro_batch=2), gb=4)  # 2 micro-batches of 2
    prof = estimate_chain(model, model.input_spec(2, 32), loss_fn=_loss)
    flops = sum(b.flops_fwd + b.flops_bwd for b in prof.blocks) + prof.meta["loss"]["flops_fwd"] \
        + prof.meta["loss"]["flops_bwd"]
    assert c.time_s.compute == pytest.approx(2 * flops / (PEAK * EFF), rel=1e-9)
    d = c.to_dict()
    assert d["step_time_s"] == pytest.approx(_phases(d["time_s"]), rel=1e-12) == d["time_s"]["step"]


def test_one_all_reduce_is_alpha_steps_plus_bytes_over_beta() -> None:
    from scaletrain.cost import collective_seconds

    (c,) = _costs(Plan(dp=2), world=2, gb=4)  # DDP: one bucket all-reduced over 2 ranks
    params = sum(p.numel() for p in dict.fromkeys(models.get("gpt2-tiny", device="meta").parameters()))
    assert params * 4 < 25 * 2**20  # one bucket
    received = 2 * (2 - 1) / 2 * params * 4
    assert c.comm_bytes == pytest.approx(received)
    by_hand = received / BW + 2 * (2 - 1) * ALPHA
    assert c.time_s.comm_s == {"dp": pytest.approx(by_hand, rel=1e-12)}
    assert by_hand == pytest.approx(collective_seconds(received, 2, BW, ALPHA), rel=1e-12)  # the one α–β (planner's too)
    assert c.time_s.comm_exposed_s["dp"] == c.time_s.comm_s["dp"]  # no copy engine: nothing hidden


def test_remat_adds_exactly_the_recomputed_forwards() -> None:
    from scaletrain.chain import to_chain
    from scaletrain.measure.estimate import estimate_chain
    from scaletrain.techniques.plan_cost import _loss
    from scaletrain.techniques.remat.tree import blocks_tree, recompute_counts

    (base,) = _costs(Plan(dp=1))
    (rem,) = _costs(Plan(dp=1, remat=RematPlan(blocks="1,2")))
    model = models.get("gpt2-tiny", device="meta")
    prof = estimate_chain(model, model.input_spec(4, 32), loss_fn=_loss)
    k = recompute_counts(blocks_tree(len(to_chain(model)), "1,2"), len(prof.blocks))
    assert sum(k) == 2
    by_hand = sum(n * b.flops_fwd for n, b in zip(k, prof.blocks)) / (PEAK * EFF)
    assert rem.time_s.recompute == pytest.approx(by_hand, rel=1e-9) and by_hand > 0
    assert rem.time_s.compute == pytest.approx(base.time_s.compute, rel=1e-12)
    assert rem.time_s.step_s - base.time_s.step_s == pytest.approx(by_hand, rel=1e-9)


def test_bubble_is_the_1f1b_closed_form_for_equal_stages() -> None:
    # 4 equal layers on 2 stages; embedding, LayerNorms and loss memory-bound (free here) and a 2-word
    # vocabulary, so the head's matmul is ~0.1 % of a layer: stages equal to that
    p, m = 2, 4
    costs = _costs(Plan(pp=p, microbatches=m, dp=1), world=2, gb=8, seq=32, vocab_size=2)
    spans = []
    for c in costs:
        t = c.time_s
        busy = t.compute + t.recompute + t.comm_exposed_s.get("tp", 0.0)
        spans.append(busy + t.bubble)  # every rank's busy + idle is the simulator's makespan
        assert t.bubble == pytest.approx((p - 1) / (m + p - 1) * (busy + t.bubble), rel=2e-3)
    assert spans[0] == pytest.approx(spans[1], rel=1e-12)


def test_estimate_cli_time_table_and_json(capsys) -> None:
    args = ["estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--pp", "2", "--microbatches", "2",
            "--platform", "h100"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    ranks = d["meta"]["plan"]["ranks"]
    assert len(ranks) == 2 and all(r["time_s"]["step"] == pytest.approx(_phases(r["time_s"])) for r in ranks)
    assert d["meta"]["step_time_s"] == max(r["step_time_s"] for r in ranks) > 0
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "time per optimizer step on h100" in out and "step time:" in out and "by kind: " in out
    # several processes and no platform: no time, and the line says how to get one (this machine's needs N at once)
    assert main(["estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--dp", "2", "--json"]) == 0
    pl = json.loads(capsys.readouterr().out)["meta"]["plan"]
    assert pl["step_time_s"] is None and "--platform" in pl["time_note"]
    assert all(r["time_s"] is None for r in pl["ranks"])


@pytest.mark.parametrize("bad, says", [("nosuch", "unknown platform 'nosuch'"), ("missing.json", "no such file"),
                                       ("bad.json", "unknown platform field 'flops'")])
def test_bad_platform_is_one_line_exit_2(bad, says, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "flops": 1}))
    assert main(["estimate", "--model", "gpt2-tiny", "--seq", "16", "--dp", "2", "--platform", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_optimizer_offload_copies_at_the_platform_rates() -> None:
    from scaletrain.plan import OffloadPlan

    plat = FLOPS_ONLY.with_(h2d_bytes_per_s=2e9, d2h_bytes_per_s=1e9, cpu_adam_params_per_s=1e8)
    (c,) = _costs(Plan(dp=1, offload=OffloadPlan(optimizer="host")), plat=plat)
    p = c.bytes["params"]  # fp32: one rank's gradients down and its parameters up, Adam on the host
    t = c.time_s
    assert t.copies_s == {"d2h": pytest.approx(p / 1e9), "h2d": pytest.approx(p / 2e9),
                          "cpu_update": pytest.approx(p / 4 / 1e8)}
    assert t.copies_exposed_s == t.copies_s and t.optimizer == 0.0
