"""Cost terms that describe how a published stack ran (planner.cost.Options): each changes one priced term
by a hand-checkable amount."""

from __future__ import annotations

import pytest

from scaletrain import platform as P
from scaletrain.plan import Plan
from scaletrain.planner import Options, Shape, plan_cost
from scaletrain.planner.cost import _dp_time, layer_times


def test_ddp_without_overlap_exposes_the_whole_all_reduce():
    # Megatron-LM 2021's local DDP all-reduces after the forward-backward: every second of it is exposed
    shape = Shape(layers=4, hidden=1024, heads=16, vocab=51200, positions=1024)
    plat = P.get("a100-80g")
    plan = Plan(dp=16, micro_batch=4, precision="bf16", params_dtype="bf16")
    hidden = plan_cost(shape, plan, plat, global_batch=64, seq=1024)
    after = plan_cost(shape, plan, plat, global_batch=64, seq=1024, options=Options(dp_overlap=False))
    full = _dp_time(plat, shape.params(), 0, 16, 1, 1, 2, blocks=6, bucket_bytes=plan.bucket_mb * 1e6)[0]
    assert after.phases_s["dp_comm"] == pytest.approx(full, rel=1e-12)
    assert hidden.phases_s["dp_comm"] < full
    assert after.step_time_s - hidden.step_time_s == pytest.approx(full - hidden.phases_s["dp_comm"], rel=1e-9)
    # by hand: 8 ranks in one node, NVLink 100 GB/s achieved, no latency: a ring all-reduce of the gradients
    # receives 2 * 7/8 of them, in the parameters' dtype (16-bit parameters: 2 bytes; fp32: 4)
    node = P.Platform(name="t", intra_node_bytes_per_s=100e9, intra_node_efficiency=1.0, intra_node_latency_s=0.0,
                      inter_node_bytes_per_s=25e9, devices_per_node=8, flops_bf16=1e15, device_mem_bytes_per_s=1e12)
    for params_dtype, nbytes in (("bf16", 2), ("fp32", 4)):
        c = plan_cost(shape, plan.with_(dp=8, params_dtype=params_dtype), node, global_batch=32, seq=1024,
                      options=Options(dp_overlap=False))
        assert c.phases_s["dp_comm"] == pytest.approx(2 * 7 / 8 * nbytes * shape.params() / 100e9, rel=1e-12)


def test_all_reduce_across_many_nodes_pays_the_tree_latency():
    # NCCL's double binary tree: 2 * ceil(log2 nodes) latency steps per all-reduce across nodes instead of
    # the ring's 2 (nodes - 1); 64 nodes of 8, one bucket, only latency priced (links made infinitely fast)
    plat = P.Platform(name="t", intra_node_bytes_per_s=1e30, inter_node_bytes_per_s=1e30, intra_node_latency_s=0.0,
                      inter_node_latency_s=1e-5, devices_per_node=8)
    ring_or_tree = _dp_time(plat, 1e6, 0, 512, 1, 1, 4, bucket_bytes=1e9)[0]
    assert ring_or_tree == pytest.approx(2 * 6 * 1e-5, rel=1e-6)  # tree: 12 steps, not the ring's 126
    zero1 = _dp_time(plat, 1e6, 1, 512, 1, 1, 4, bucket_bytes=1e9)[0]  # reduce-scatter + all-gather: rings
    assert zero1 == pytest.approx(2 * 63 * 1e-5, rel=1e-6)


def test_zero_rings_pay_a_latency_step_per_rank_across_nodes():
    # NCCL's ring reduce-scatter / all-gather (nccl src/graph/tuning.cc): ranks - 1 steps, nodes - 1 of them
    # across nodes, every other rank an NVLink step; DDP's all-reduce keeps the tree's 2(k - 1) + 2*ceil(log2 nodes)
    from scaletrain.cost import collective_steps

    assert collective_steps(512, 8) == (448, 63) and collective_steps(8, 8) == (7, 0)
    assert collective_steps(1, 8) == (0, 0)
    assert collective_steps(512, 8, all_reduce=True) == (14, 12)
    plat = P.Platform(name="t", intra_node_bytes_per_s=1e30, inter_node_bytes_per_s=1e30, intra_node_latency_s=1e-5,
                      inter_node_latency_s=2e-5, devices_per_node=8)
    # ZeRO-3 over 512 ranks, one block, one micro-batch: 3 collectives of 448 NVLink + 63 network steps each
    assert _dp_time(plat, 1e6, 3, 512, 1, 1, 2, blocks=1)[0] == pytest.approx(3 * (448e-5 + 63 * 2e-5), rel=1e-6)
    # within one node nothing changes: 7 NVLink steps per collective
    assert _dp_time(plat, 1e6, 3, 8, 1, 1, 2, blocks=1)[0] == pytest.approx(3 * 7e-5, rel=1e-6)
    assert _dp_time(plat, 1e6, 0, 512, 1, 1, 4, bucket_bytes=1e9)[0] == pytest.approx(14e-5 + 12 * 2e-5, rel=1e-6)
    # the traced cost (estimate, plan=auto) counts the same steps: ZeRO-1 over 512 pipeline-replica ranks, one
    # bucket, a reduce-scatter and an all-gather
    from scaletrain.techniques.time_cost import _comm

    plan = Plan(dp=512, pp=2, zero=1, microbatches=4, schedule="1f1b", bucket_mb=1e3)
    out = _comm(plan, None, None, plat, b=1, seq=16, M=4, world=1024, total=1e6, bounds=[0, 1, 2], rank=0,
                remat=None, rank_param_bytes=1e6, n_blocks=1, tp_steps=0)
    assert out["dp"] == pytest.approx(2 * (448e-5 + 63 * 2e-5), rel=1e-6)


def test_eager_fp32_norm_and_rotary_move_their_counted_bytes():
    # torchtitan's RMSNorm and rotary in eager fp32: 36 and 20 bytes per element in the forward instead of
    # a fused kernel's 2 + 2; on a 1 TB/s device at full efficiency with no per-kernel cost, the forward
    # grows by exactly those bytes and the backward by twice them
    shape = Shape(layers=2, hidden=256, heads=4, kv_heads=2, vocab=1024, ffn=512, gated=True, rmsnorm=True,
                  bias=False, rotary=True, tied=False)
    plat = P.Platform(name="t", device_mem_bytes_per_s=1e12, mem_efficiency=((0.0, 1.0),), flops_bf16=1e15)
    kw = dict(seq=128, b=2, tp=1, sp=False, precision="bf16")
    fused = layer_times(shape, plat, opts=Options(), **kw)
    eager = layer_times(shape, plat, opts=Options(fp32_norm_rotary=True), **kw)
    tokens = 128 * 2
    extra = (2 * (36 - 4) * tokens * 256 + (20 - 4) * tokens * (256 + shape.kv_width)) / 1e12
    assert shape.kv_width == 128
    assert eager["fwd"] - fused["fwd"] == pytest.approx(extra, rel=1e-9)
    assert eager["bwd"] - fused["bwd"] == pytest.approx(2 * extra, rel=1e-9)


def test_autocast_over_fp32_parameters_prices_the_fp32_residual_stream():
    # GPT-2 under autocast with fp32 parameters: per element of the stream, 2 LayerNorms read and write 4
    # bytes (not 2), 2 residual adds read 4 + 2 and write 4 (not 2 + 2 + 2), and the fused QKV and fc
    # each cast a norm's fp32 output (read 4, write 2): 2*4 + 2*4 + 2*6 = 28 bytes more per element
    shape = Shape(layers=2, hidden=256, heads=4, vocab=1024, positions=128)
    plat = P.Platform(name="t", device_mem_bytes_per_s=1e12, mem_efficiency=((0.0, 1.0),), flops_bf16=1e15)
    kw = dict(seq=128, b=2, tp=1, sp=False, precision="bf16", opts=Options())
    bf16 = layer_times(shape, plat, **kw)
    fp32_stream = layer_times(shape, plat, autocast=True, **kw)
    assert fp32_stream["fwd"] - bf16["fwd"] == pytest.approx(28 * 128 * 2 * 256 / 1e12, rel=1e-9)
    # plan_cost turns it on for bf16 over fp32 parameters only, and a 16-bit-stream stack turns it off
    plan = Plan(dp=1, micro_batch=2, precision="bf16")
    on = plan_cost(shape, plan, plat, global_batch=2, seq=128).blocks_s["layer_fwd"]
    off = plan_cost(shape, plan, plat, global_batch=2, seq=128,
                    options=Options(autocast_residual_fp32=False)).blocks_s["layer_fwd"]
    pure = plan_cost(shape, plan.with_(params_dtype="bf16"), plat, global_batch=2, seq=128).blocks_s["layer_fwd"]
    assert on == pytest.approx(fp32_stream["fwd"]) and off == pytest.approx(bf16["fwd"]) == pure


def test_all_reduce_steps_by_hand():
    from scaletrain.cost import all_reduce_steps

    assert [all_reduce_steps(n) for n in (1, 2, 3, 4, 8, 64)] == [0, 2, 4, 4, 6, 12]  # ring up to 3, tree after


def test_traced_gemms_carry_their_shape_to_the_roofline():
    # the census records a GEMM's output (m, n, batch) and alignment; the traced cost prices it with the
    # planner's tile and wave quantization: 110 tiles of 256x128 on 108 SMs take two waves (0.51 useful)
    import torch

    from scaletrain.cost import roofline_seconds
    from scaletrain.measure.census import Op, gemm_shape
    from scaletrain.techniques.time_cost import op_seconds

    aten = torch.ops.aten
    a, b = torch.empty(4, 24, 8), torch.empty(4, 8, 16)
    assert gemm_shape(aten.bmm, (a, b), torch.empty(4, 24, 16)) == ((24.0, 16.0, 4.0), False)
    assert gemm_shape(aten.addmm, (torch.empty(15), a[0], torch.empty(8, 15)), torch.empty(24, 15)) == \
        ((24.0, 15.0, 1.0), True)  # n = 15: alignment-1 kernels
    assert gemm_shape(aten.add, (a, a), a) == (None, False)
    plat = P.get("a100-80g")
    m, k = 55 * 256, 4096  # x 256 columns: 110 tiles in either orientation

    def mm(n: int) -> Op:
        return Op("mm", 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n), half=True, output=(m, n, 1.0))

    one = op_seconds(mm(256), plat)
    assert plat.wave_fraction(m, 256) == pytest.approx(110 / 216)
    assert one == roofline_seconds(plat, mm(256).flops, mm(256).nbytes, precision="bf16", output=(m, 256, 1.0))
    assert one == pytest.approx(roofline_seconds(plat, mm(256).flops, 0, precision="bf16") * 216 / 110)
    # split over 2 TP ranks: each rank's GEMM is the 256-column one, with its two waves
    assert op_seconds(mm(512), plat, work_split=2) == pytest.approx(one)


def test_flash_attention_backward_is_five_halves_of_its_forward():
    # FlashAttention recomputes the scores in its backward: five matmuls to the forward's two; a materialised
    # attention keeps P, so its backward stays 2 x
    from scaletrain.planner.cost import FLASH_BWD_RATIO

    shape = Shape(layers=2, hidden=256, heads=4, vocab=1024, positions=512)
    kw = dict(seq=512, b=2, tp=1, sp=False, precision="bf16")
    plat = P.get("a100-80g")
    flash = layer_times(shape, plat, opts=Options(norm_kernel="roofline"), **kw)  # norms: 2 x too
    assert FLASH_BWD_RATIO == 2.5 and flash["attn_core"] > 0
    assert flash["bwd"] - 2 * flash["fwd"] == pytest.approx(0.5 * flash["attn_core"], rel=1e-12)
    mat = layer_times(shape, plat, opts=Options(attention="materialized", norm_kernel="roofline"), **kw)
    assert mat["bwd"] == pytest.approx(2 * mat["fwd"], rel=1e-12)


def test_a_stacks_own_loss_and_optimizer_bytes_replace_the_runtimes():
    # Megatron-LM 2021 runs its loss over fp32 logits (52 B per logit) and its fp16 optimizer (60 B per
    # parameter): on a 1 TB/s device at full efficiency, the head and the optimizer move by exactly those bytes
    shape = Shape(layers=2, hidden=256, heads=4, vocab=1024, positions=128)
    plat = P.Platform(name="t", device_mem_bytes_per_s=1e12, mem_efficiency=((0.0, 1.0),), flops_bf16=1e15)
    plan = Plan(dp=1, micro_batch=2, precision="bf16", params_dtype="bf16")
    base = plan_cost(shape, plan, plat, global_batch=2, seq=128)
    own = plan_cost(shape, plan, plat, global_batch=2, seq=128,
                    options=Options(loss_bytes_per_logit=52, optimizer_bytes_per_param=60))
    logits = 128 * 2 * 1024
    assert own.blocks_s["head"] - base.blocks_s["head"] == pytest.approx((52 - 2 * (2 + 8)) * logits / 1e12, rel=1e-9)
    assert own.phases_s["optimizer"] == pytest.approx(60 * shape.params() / 1e12, rel=1e-9)
    assert base.phases_s["optimizer"] == pytest.approx(92 * shape.params() / 1e12, rel=1e-9)
