"""The analytic planner's search covers what the runtime runs: cp, HSDP, pp x ZeRO-3, uneven stage splits
by the runtime partitioner's rule, and every rejected region names its rule (issue 25, deliverable 3)."""

from __future__ import annotations

import pytest

from scaletrain import platform
from scaletrain.errors import UserError
from scaletrain.measure.types import BlockProfile, Profile
from scaletrain.plan import Plan
from scaletrain.planner import stages
from scaletrain.planner.cost import plan_cost
from scaletrain.planner.search import parse_fixed, search
from scaletrain.planner.shape import Shape
from scaletrain.techniques.pipeline.partition import partition

H100 = platform.get("h100")
A100 = platform.get("a100-80g")


def _llama8b() -> Shape:
    """Llama 3.1 8B as Shape.of("llama3.1-8b") reads it, built directly (no transformers import)."""
    return Shape(layers=32, hidden=4096, heads=32, vocab=128256, positions=131072, ffn=14336, kv_heads=8,
                 gated=True, rmsnorm=True, bias=False, rotary=True, tied=False)


def test_cp_is_searched_and_chosen_for_long_sequences():
    # 8 sequences of 64k tokens on 64 GPUs: dp <= 8, so the other 8+ ranks split the model or the sequence
    r = search(_llama8b(), H100, nodes=8, gpus_per_node=8, global_batch=8, seq=65536,
               fixed={"tp": 1, "zero": 3, "remat": "none", "micro_batch": 1})
    assert r.ranked[0].plan.cp > 1
    best = r.ranked[0]
    assert best.phases_s["cp_comm"] >= 0 and best.plan.world() == 64
    # a pinned cp is priced: activations divided by cp, ring traffic on the wire
    one, many = (plan_cost(_llama8b(), Plan(dp=4, cp=c, zero=3, micro_batch=1, precision="bf16"), H100,
                           global_batch=4, seq=65536) for c in (1, 16))
    assert many.peak_bytes["activations"] == pytest.approx(one.peak_bytes["activations"] / 16, rel=1e-6)
    assert many.blocks_s["layer_cp_comm"] > 0 == one.blocks_s["layer_cp_comm"]
    fixed = search(_llama8b(), H100, nodes=8, gpus_per_node=8, global_batch=4, seq=65536,
                   fixed=parse_fixed(["cp=16", "tp=1"]))
    assert fixed.ranked and {c.plan.cp for c in fixed.ranked} == {16}


def test_cp_refusals_name_their_compat_rules():
    r = search(Shape.of("gpt2-medium"), A100, nodes=1, gpus_per_node=8, global_batch=16, seq=1000,
               fixed={"tp": 1, "zero": 0, "remat": "none"})
    reasons = " ".join(x["reason"] for x in r.rejected)
    assert "compat rule cp-seq" in reasons and "compat rule pp-cp" in reasons


def test_hsdp_is_searched_and_priced_for_plain_data_parallelism_and_beside_tp():
    shape = Shape.of("gpt2-medium", vocab_size=50304)  # 16 heads, a vocabulary TP can split
    r = search(shape, A100, nodes=4, gpus_per_node=8, global_batch=256, seq=1024,
               fixed={"tp": 1, "pp": 1, "cp": 1, "micro_batch": 8, "remat": "none"})
    hsdp = [c for c in r.ranked if c.plan.hsdp]
    assert {c.plan.hsdp for c in hsdp} >= {8, 16} and all(c.plan.zero >= 1 for c in hsdp)
    full = next(c for c in r.ranked if c.plan.zero == 3 and not c.plan.hsdp)
    eight = next(c for c in hsdp if c.plan.zero == 3 and c.plan.hsdp == 8)
    # sharded over 8 instead of 32: more model states per rank, a different step time
    assert eight.peak_bytes["params"] == pytest.approx(4 * full.peak_bytes["params"])
    assert eight.step_time_s != full.step_time_s
    with_tp = search(shape, A100, nodes=4, gpus_per_node=8, global_batch=256, seq=1024,
                     fixed={"tp": 2, "pp": 1, "cp": 1, "micro_batch": 8, "remat": "none", "sp": False})
    # beside TP (the world mesh's dp_rep x dp_in x tp): dp = 16, so shard groups of 8 hold twice a flat ZeRO-3's
    full = next(c for c in with_tp.ranked if c.plan.zero == 3 and not c.plan.hsdp)
    eight = next(c for c in with_tp.ranked if c.plan.zero == 3 and c.plan.hsdp == 8)
    assert eight.plan.tp == 2 and eight.peak_bytes["params"] == pytest.approx(2 * full.peak_bytes["params"])
    with_cp = search(shape, A100, nodes=4, gpus_per_node=8, global_batch=256, seq=1024,
                     fixed={"tp": 1, "pp": 1, "cp": 2, "micro_batch": 8, "remat": "none"})
    assert not any(c.plan.hsdp for c in with_cp.ranked)
    assert any("compat rule hsdp-mp" in x["reason"] for x in with_cp.rejected)


def test_pipeline_with_zero3_is_searched_with_and_without_tp():
    """pp x ZeRO-3 runs with TP (FSDP over the dp dimension of the world mesh): both are priced."""
    r = search(Shape.of("gpt2-medium", vocab_size=50304), A100, nodes=1, gpus_per_node=8, global_batch=32, seq=1024,
               fixed={"pp": 4, "zero": 3, "remat": "none", "schedule": "1f1b", "micro_batch": 1})
    assert {(c.plan.tp, c.plan.zero) for c in r.ranked} == {(1, 3), (2, 3)}
    assert not any("pp-zero3" in x["reason"] for x in r.rejected)


def test_70_layers_on_12_stages_is_the_runtime_partitioners_split():
    embed, head = 0.25, 2.5  # forward + backward of the embedding and the head, in layers
    got = stages.split(70, 12, embed_layers=embed, head_layers=head)
    prof = Profile(blocks=[BlockProfile("embed", fwd_time_s=embed / 3, bwd_time_s=2 * embed / 3)]
                   + [BlockProfile(f"h{i}", fwd_time_s=1 / 3, bwd_time_s=2 / 3) for i in range(70)]
                   + [BlockProfile("head", fwd_time_s=head / 3, bwd_time_s=2 * head / 3)])
    runtime = partition(prof, 12, "1f1b", 24)
    assert list(got.bounds) == runtime.bounds
    assert sum(got.layers) == 70 and not got.even and got.layers[-1] < got.layers[1]
    # 126 layers on 16 ranks x 2 chunks (interleaved): each rank's chunks summed
    inter = stages.split(126, 16, 2, embed_layers=0.1, head_layers=1.5)
    assert sum(inter.layers) == 126 and len(inter.layers) == 16 and len(inter.bounds) == 33
    equal = stages.split(70, 12, balance="equal")
    assert sum(equal.layers) == 70 and equal.layers != got.layers


def test_uneven_pipelines_are_searched_and_pp_split_is_pinned():
    shape = Shape.of("gpt2-xl", n_layer=70)
    for split in ("profile", "equal"):
        r = search(shape, A100, nodes=1, gpus_per_node=12, global_batch=96, seq=1024,
                   fixed=parse_fixed(["pp=12", "tp=1", "zero=0", "remat=none", "schedule=1f1b", "micro_batch=1",
                                      f"pp_split={split}"]))
        c = r.ranked[0]
        assert c.plan.pp == 12 and c.plan.balance == split and sum(c.stage_layers) == 70
        assert c.plan.to_config_dict()["parallel"].get("balance", "profile") == split
    with pytest.raises(UserError, match="pp_split=even: allowed: profile, equal"):
        parse_fixed(["pp_split=even"])


def test_peak_rank_follows_the_split_and_in_flight_micro_batches():
    # 1F1B: rank k holds min(p - k, m) micro-batches; with uneven layers a middle rank can be the heaviest
    shape = Shape.of("gpt2-xl", n_layer=70)
    plan = Plan(dp=1, pp=12, micro_batch=1, microbatches=96, precision="bf16")
    c = plan_cost(shape, plan, A100, global_batch=96, seq=1024)
    assert c.heaviest_rank in ("first", "stage 1") and len(c.stage_layers) == 12


def test_every_rejected_region_names_its_rule_and_no_fit_names_nearest_misses():
    r = search(Shape.of("gpt2-xl", n_layer=96, n_embd=12288, n_head=96, vocab_size=51200, n_positions=2048),
               A100, nodes=1, gpus_per_node=8, global_batch=64, seq=2048, fixed={"offload": "none"})
    assert not r.ranked
    for x in r.rejected:
        assert x["reason"] and x["kind"] in ("memory", "batch", "divisibility", "compat", "priced", "runtime")
        if x["kind"] == "compat":
            assert x["reason"].startswith("compat rule ")
    overs = [x["over"] for x in r.rejected if x["kind"] == "memory"]
    assert overs == sorted(overs) and overs  # nearest miss first
    import scaletrain

    with pytest.raises(UserError, match=r"no plan fits: .*nearest misses: .*out of memory by"):
        scaletrain.plan("gpt2-xl", devices=8, global_batch=64, seq=2048, fix={"offload": "none"},
                        overrides=dict(n_layer=96, n_embd=12288, n_head=96, vocab_size=51200, n_positions=2048))


def test_pipeline_remat_is_the_runtimes_solver_under_budgets_from_the_stages_slack():
    from scaletrain.planner import stage_remat

    # each rank's budget is its own slack per in-flight micro-batch (rank 0 of 1F1B holds 4, rank 3 one); a rank
    # not priced holds what the earliest priced rank with as many layers holds, with its own micro-batches
    ranks = [{"rank": 0, "live": 4, "activations": 40.0, "total": 60.0, "layers": 2},
             {"rank": 1, "live": 3, "activations": 30.0, "total": 50.0, "layers": 2},
             {"rank": 3, "live": 1, "activations": 10.0, "total": 30.0, "layers": 2}]
    got = stage_remat.fit_budgets(ranks, cap=100.0, full=2.0, inp=1.0, layers=(2, 2, 2, 2), live=[4, 3, 2, 1])
    assert got == pytest.approx([(100 - 20 - 2) / 4 + 2, (100 - 20 - 2) / 3 + 2, (100 - 20 - 2) / 2 + 2,
                                 (100 - 20 - 2) / 1 + 2])
    # ... but never below what the runtime's solver can reach on the stage (all checkpointed + logits)
    floor = [{**ranks[2], "rank": 0, "layers": 30, "graph_extra": 5.0}]
    assert stage_remat.fit_budgets(floor, cap=40.0, full=2.0, inp=1.0, layers=(30,), live=[1]) == \
        pytest.approx([30 + 2 + 5])
    assert stage_remat.kept_layers(6, 6 * 10 + 10, 10, 1) == 6 and stage_remat.kept_layers(6, 0, 10, 1) == 0
    # nothing fits without recompute: the search writes memory.remat.method=optimal with the budget, and each
    # stage recomputes what its own layers and its slack need (a small vocabulary: the last stage's logits,
    # which its solver's budget must hold too, do not set the one budget)
    shape = Shape.of("gpt2-xl", n_layer=70, vocab_size=8192)
    r = search(shape, A100, nodes=1, gpus_per_node=12, global_batch=192, seq=2048,
               fixed=parse_fixed(["pp=12", "tp=1", "zero=0", "schedule=1f1b", "micro_batch=16"]))
    c = r.ranked[0]
    assert c.plan.remat.method == "optimal" and min(map(int, c.plan.remat.stage_budgets.split(","))) > 0
    assert c.plan.to_config_dict()["memory"]["remat"]["stage_budgets"] == c.plan.remat.stage_budgets
    again = [n - k for n, k in zip(c.stage_layers, c.stage_kept)]
    assert len(set(again)) > 1 and min(again) >= 0 and c.phases_s["recompute"] > 0
    assert any(x["kind"] == "runtime" and "memory.remat.blocks" in x["reason"] for x in r.rejected)


def test_timeline_rows_add_up_for_cp_and_pipeline_remat_plans():
    from scaletrain.planner.timeline import step_timeline

    shape = Shape.of("gpt2-xl", n_layer=70, vocab_size=8192)
    solved = search(shape, A100, nodes=1, gpus_per_node=12, global_batch=192, seq=2048,
                    fixed=parse_fixed(["pp=12", "tp=1", "zero=0", "schedule=1f1b", "micro_batch=16"])).ranked[0]
    ring = plan_cost(_llama8b(), Plan(dp=4, cp=16, zero=3, micro_batch=1, precision="bf16"), H100,
                     global_batch=4, seq=65536)
    for c, s, gb, seq, plat in ((solved, shape, 192, 2048, A100), (ring, _llama8b(), 4, 65536, H100)):
        tl = step_timeline(c, s, plat, global_batch=gb, seq=seq)
        for r in range(tl.n_ranks):
            assert max(e.end_s for e in tl.segments if e.rank == r) == pytest.approx(c.step_time_s, rel=1e-9)


def test_zero_is_not_searched_where_there_is_one_data_parallel_rank():
    """ZeRO shards over the data-parallel ranks: a one-device (or all-model-parallel) plan offers zero=0
    only, not four copies of the same plan; a pinned zero is still priced."""
    r = search(Shape.of("gpt2-medium"), A100, nodes=1, gpus_per_node=1, global_batch=8, seq=1024)
    assert r.ranked and {c.plan.zero for c in r.ranked} == {0}
    pinned = search(Shape.of("gpt2-medium"), A100, nodes=1, gpus_per_node=1, global_batch=8, seq=1024,
                    fixed={"zero": 3})
    assert pinned.ranked and {c.plan.zero for c in pinned.ranked} == {3}
