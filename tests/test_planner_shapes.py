"""The planner's Llama shape (SwiGLU, GQA, untied head), torchtitan's op-level selective recompute and
ZeRO-Offload as a search dimension: parameter counts, FLOPs and bytes against hand-written formulas."""

from __future__ import annotations

import json

import pytest

from scaletrain import platform as P
from scaletrain.cli import main
from scaletrain.errors import UserError
from scaletrain.plan import OffloadPlan, Plan, RematPlan
from scaletrain.planner import Options, Shape, plan_cost, search
from scaletrain.planner import memory as mem
from scaletrain.planner.search import parse_fixed

LLAMA = Shape.of("llama3.1-8b")
V100 = P.get("v100")


def test_llama_3_1_8b_parameter_count():
    # Meta's model card: 8.03B; by hand: 32 layers of q, o (h x h), k, v (h x 1024), SwiGLU 3 x h x 14336,
    # two RMSNorms (h each), then embedding and untied head (128256 x h) and the final RMSNorm
    h, kv, f, V, l = 4096, 1024, 14336, 128256, 32
    by_hand = l * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * V * h + h
    assert LLAMA.params() == by_hand
    assert LLAMA.params() == pytest.approx(8.03e9, rel=0.005)
    # the same through hf:llama with --set overrides, and an override on top of the named shape
    same = Shape.of("hf:llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    assert same.params() == LLAMA.params() and not same.tied and same.kv_width == kv
    assert Shape.of("llama3.1-8b", num_hidden_layers=16).params() == by_hand - 16 * (by_hand - 2 * V * h - h) // 32
    assert Shape.of("llama3.1-8b", tie_word_embeddings=True).params() == by_hand - V * h


def test_flops_per_token_is_6n_plus_attention_by_hand():
    h, kv, f, V, l, s = 4096, 1024, 14336, 128256, 32, 8192
    n = l * (2 * h * h + 2 * h * kv + 3 * h * f) + V * h  # the weights a token multiplies: layers and the head
    assert LLAMA.flops_per_token(s) == 6 * n + 12 * l * s * h
    assert LLAMA.flops_per_iteration(2, s, recompute=False) == 2 * s * (6 * n + 12 * l * s * h)
    # full recomputation adds exactly one forward of the layers (not of the head)
    extra = LLAMA.flops_per_iteration(2, s) - LLAMA.flops_per_iteration(2, s, recompute=False)
    assert extra == 2 * s * (2 * (n - V * h) + 4 * l * s * h)


def test_activation_bytes_follow_gqa_and_swiglu():
    s, b, h, kv, f, e = 8192, 2, 4096, 1024, 14336, 2
    # no recompute, flash: two norm inputs, QKV input, MLP input (4h); Q, K, V, projection input
    # (2h + 2kv); SwiGLU's w1 and w3 outputs, silu's output, the product (4f)
    assert mem.layer_activation_bytes(LLAMA, s, b) == e * s * b * (4 * h + 2 * h + 2 * kv + 4 * f)
    # torchtitan's op policy keeps the block input, wq's, wv's, w1's and w2's outputs and the attention's
    assert mem.layer_activation_bytes(LLAMA, s, b, remat="selective", selective="op") == e * s * b * (
        h + (h + kv + f + h) + h)
    # GPT-2's fused QKV: the 1st and 3rd matmuls are QKV (3h) and fc (4h)
    gpt = Shape(layers=2, hidden=256, heads=4, vocab=512)
    assert mem.op_saved_width(gpt) == 3 * 256 + 4 * 256


def test_op_selective_recompute_costs_time_and_saves_memory():
    plan = Plan(dp=8, zero=3, micro_batch=2, remat=RematPlan(selective="attention"), precision="bf16")
    h100 = P.get("h100")
    megatron = plan_cost(LLAMA, plan, h100, global_batch=16, seq=8192)
    op = plan_cost(LLAMA, plan, h100, global_batch=16, seq=8192, options=Options(selective="op"))
    assert op.peak_bytes["activations"] < megatron.peak_bytes["activations"] / 2
    assert op.phases_s["recompute"] > 0 and op.fits and not megatron.fits
    assert sum(op.phases_s.values()) == pytest.approx(op.step_time_s)


def test_offload_moves_the_optimizer_bytes_by_the_formula():
    sh = Shape(layers=12, hidden=2048, heads=16, vocab=50304, positions=1024)
    base = Plan(dp=1, micro_batch=2, precision="bf16")
    on = base.with_(offload={"optimizer": "host"})
    a = plan_cost(sh, base, V100, global_batch=4, seq=1024)
    b = plan_cost(sh, on, V100, global_batch=4, seq=1024)
    n = sh.params()
    # device: fp32 parameters stay (4n); Adam's states (8n) leave; the fp32 gradients (4n) leave but for one
    # block's in flight to the host (the embedding here, the largest block)
    block = max(sh.layer_params(), sh.vocab * sh.hidden)
    assert a.peak_bytes["optimizer"] == pytest.approx(8 * n) and b.peak_bytes["optimizer"] == 0
    assert a.peak_bytes["grads"] == pytest.approx(4 * n) and b.peak_bytes["grads"] == pytest.approx(4 * block)
    assert b.peak_bytes["params"] == a.peak_bytes["params"] == pytest.approx(4 * n)
    assert a.peak_bytes["total"] - b.peak_bytes["total"] == pytest.approx(8 * n + 4 * n - 4 * block)
    # host: fp32 masters, gradients and Adam's two moments, 16 bytes per parameter (offload's cost face)
    assert b.host_bytes == pytest.approx(16 * n, abs=16) and a.host_bytes == 0
    # time: no device optimizer step; the CPU update (n / rate) and the upload of the parameters instead
    assert b.phases_s["optimizer"] == 0 and b.phases_s["offload"] >= n / V100.cpu_adam_params_per_s + \
        4 * n / V100.h2d_bytes_per_s - 1e-6
    assert sum(b.phases_s.values()) == pytest.approx(b.step_time_s)
    dpu = plan_cost(sh, on.with_(offload={"optimizer": "host", "dpu": True}), V100, global_batch=4, seq=1024)
    assert dpu.step_time_s < b.step_time_s
    assert b.to_dict()["plan"]["offload"] == "optimizer" and a.to_dict()["plan"]["offload"] == "none"


def test_search_offloads_only_when_needed():
    small = Shape(layers=12, hidden=1024, heads=16, vocab=50304, positions=1024)
    r = search(small, V100, nodes=1, gpus_per_node=1, global_batch=8, seq=1024)
    assert r.ranked and all(c.plan.offload == OffloadPlan() for c in r.ranked) and not r.notes
    # 4.2B: 16 bytes of model states per parameter do not fit in 32 GiB; 4 bytes of fp32 parameters do
    big = Shape(layers=20, hidden=4096, heads=32, vocab=50304, positions=1024)
    r = search(big, V100, nodes=1, gpus_per_node=1, global_batch=8, seq=1024)
    assert r.ranked and r.notes and all(c.to_dict()["plan"]["offload"] == "optimizer" for c in r.ranked)
    assert not search(big, V100, nodes=1, gpus_per_node=1, global_batch=8, seq=1024, fixed={"offload": "none"}).ranked
    pinned = search(small, V100, nodes=1, gpus_per_node=1, global_batch=8, seq=1024, fixed={"offload": "optimizer"})
    assert pinned.ranked and all(c.plan.offload.optimizer == "host" for c in pinned.ranked)


def test_fix_offload_parse_and_errors():
    assert parse_fixed(["offload=optimizer"]) == {"offload": "optimizer"}
    with pytest.raises(UserError, match="allowed: none, optimizer"):
        parse_fixed(["offload=disk"])
    with pytest.raises(UserError, match="must divide num_attention_heads"):
        Shape.of("hf:llama", num_key_value_heads=3)
    with pytest.raises(UserError, match="no config option"):
        Shape.of("llama3.1-8b", n_layer=2)


def test_cli_plans_llama_by_name(capsys):
    rc = main(["plan", "--model", "llama3.1-8b", "--platform", "h100", "--nodes", "1", "--gpus-per-node", "8",
               "--global-batch", "16", "--seq", "8192", "--json", "--top", "1"])
    assert rc == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["fits"] and best["summary"]["offload"] == "none" and best["peak_bytes"] <= best["device_bytes"]
