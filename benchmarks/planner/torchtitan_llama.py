"""On paper against torchtitan's Llama 3.1 8B on 8 H100s: FSDP + selective activation checkpointing, bf16,
5,762 tokens/s per GPU (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1).

The published setting (facts from that file and the torchtitan commit it names, 9dec370): Llama 3.1 8B
(the planner's ``llama3.1-8b`` shape: 32 layers, h = 4096, 32 heads, 8 KV heads, SwiGLU f = 14336,
V = 128,256, untied head), sequence 8192, local batch 2, global batch 16 on 8 GPUs (FSDP2 over all 8 =
ZeRO-3, bf16 gathers, fp32 sharded parameters and reductions), AdamW, selective AC with the ``op`` policy
(save every other matmul's output and the attention's; :class:`~scaletrain.planner.Options` ``selective="op"``),
no torch.compile, no Float8. Their H100s are not the data-sheet SXM5: 96 GB HBM2e at 2.4 TB/s, a 500 W
power limit, "peak TFLOPs between SXM and NVL". So two platforms are priced: the ``h100`` preset (SXM5
figures) and the same with the published memory, HBM bandwidth and the H100 NVL's dense bf16 peak (the low
end of their stated range). The published figure is only compared with; it never enters a prediction.

Writes ``benchmarks/results/planner_torchtitan_llama.json``; run from the repository root:
``PYTHONPATH=src python benchmarks/planner/torchtitan_llama.py`` (a few seconds, nothing runs on a GPU).
"""

from __future__ import annotations

import sys

from on_paper import write_result

from scaletrain import platform as platforms
from scaletrain.plan import Plan, RematPlan
from scaletrain.planner import Options, Shape, plan_cost, search

PUBLISHED_TPS_PER_GPU = 5762
PUBLISHED_MEMORY_GIB = 82.4
GPUS, LOCAL_BATCH, SEQ = 8, 2, 8192
TORCHTITAN = Options(selective="op", fp32_norm_rotary=True, autocast_residual_fp32=False)
GB = 10**9


def platforms_priced() -> dict[str, platforms.Platform]:
    """The preset, and the preset with the benchmark's stated hardware (96 GB HBM2e, 2.4 TB/s) and the
    H100 NVL data sheet's bf16 peak (1,671 TFLOPS with sparsity = 835.5 dense)."""
    h100 = platforms.get("h100")
    published = h100.with_(name="h100-96g-hbm2e", device_memory_bytes=96 * GB, device_mem_bytes_per_s=2.4e12,
                           flops_bf16=835.5e12,
                           source="torchtitan benchmark's H100: 96 GB HBM2e, 2.4 TB/s; bf16 peak of the H100 NVL "
                                  "data sheet (the low end of 'between SXM and NVL')")
    return {"h100": h100, "h100-96g-hbm2e": published}


def published_plan() -> Plan:
    return Plan(dp=GPUS, zero=3, micro_batch=LOCAL_BATCH, remat=RematPlan(selective="attention"),
                precision="bf16", optimizer="adamw")


def attention_scores_bytes_s(shape: Shape, plat: platforms.Platform) -> dict[str, float]:
    """What the s x s scores' bytes add to one layer's attention core as priced. Each of its two batched
    matmuls is a roofline whose bytes include the b·a·s² scores matrix, which FlashAttention never writes
    to HBM. So the priced time is compared with the same FLOPs at the matmul efficiency alone."""
    from scaletrain.planner.cost import Options as _O
    from scaletrain.planner.cost import layer_times

    lt = layer_times(shape, plat, seq=SEQ, b=LOCAL_BATCH, tp=1, sp=False, precision="bf16", opts=_O())
    d = shape.hidden // shape.heads
    flops = 2 * SEQ * SEQ * d * LOCAL_BATCH * shape.heads  # QK^T, and AV the same
    only = 2 * flops / (plat.flops("bf16") * plat.matmul_fraction(flops))
    return {"attention_core_fwd_s": lt["attn_core"], "flops_only_fwd_s": only}


def main() -> int:
    shape = Shape.of("llama3.1-8b")
    gb = GPUS * LOCAL_BATCH
    rows = {}
    for name, plat in platforms_priced().items():
        c = plan_cost(shape, published_plan(), plat, global_batch=gb, seq=SEQ, options=TORCHTITAN)
        tps = c.tokens_per_s / GPUS
        err = tps / PUBLISHED_TPS_PER_GPU - 1
        res = search(shape, plat, nodes=1, gpus_per_node=GPUS, global_batch=gb, seq=SEQ, options=TORCHTITAN)
        top = res.ranked[0] if res.ranked else None
        att = attention_scores_bytes_s(shape, plat)
        # forward, backward (2x) of every layer, once per micro-batch; the op policy recomputes no attention
        m = gb // (GPUS * LOCAL_BATCH)
        att["step_without_scores_bytes_s"] = c.step_time_s - 3 * shape.layers * m * (
            att["attention_core_fwd_s"] - att["flops_only_fwd_s"])
        att["tokens_per_s_per_gpu"] = gb * SEQ / att["step_without_scores_bytes_s"] / GPUS
        rows[name] = {
            "platform": plat.to_dict(),
            "published_plan": {**c.to_dict()["plan"], "selective_policy": "op"},
            "predicted_tokens_per_s_per_gpu": tps, "error": err, "within_15pct": abs(err) <= 0.15,
            "predicted_step_s": c.step_time_s, "predicted_mfu": c.mfu, "phases_s": c.phases_s, "blocks_s": c.blocks_s,
            "predicted_peak_bytes": c.peak_bytes, "predicted_peak_gib": c.peak_bytes["total"] / 2**30,
            "fits": c.fits, "attention_without_scores_bytes": att,
            "planner": None if top is None else {
                "describe": top.plan.describe(), "plan": top.to_dict()["plan"],
                "tokens_per_s_per_gpu": top.tokens_per_s / GPUS, "mfu": top.mfu, "step_s": top.step_time_s,
                "peak_gib": top.peak_bytes["total"] / 2**30, "fits": top.fits,
                "plans_priced": res.evaluated, "plans_fit": len(res.ranked), "planning_s": res.seconds},
        }
        print(f"{name}: published plan predicted {tps:,.0f} tokens/s/GPU (published {PUBLISHED_TPS_PER_GPU:,}, "
              f"error {err:+.1%}), MFU {c.mfu:.1%}, peak {c.peak_bytes['total'] / 2**30:.1f} GiB "
              f"(published {PUBLISHED_MEMORY_GIB}), fits {c.fits}")
        print(f"  attention core {att['attention_core_fwd_s'] * 1e3:.2f} ms per layer forward as priced, "
              f"{att['flops_only_fwd_s'] * 1e3:.2f} ms without the scores' bytes: "
              f"{att['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU "
              f"({att['tokens_per_s_per_gpu'] / PUBLISHED_TPS_PER_GPU - 1:+.1%})")
        if top is not None:
            print(f"  planner's top plan: {top.plan.describe()}, micro-batch {top.plan.micro_batch}: "
                  f"{top.tokens_per_s / GPUS:,.0f} tokens/s/GPU, {top.peak_bytes['total'] / 2**30:.1f} GiB")
    write_result("planner_torchtitan_llama", "torchtitan Llama 3.1 8B, 8 H100, FSDP + selective AC (op), bf16, on "
                 "paper", {
        "shape": {**shape.__dict__, "params": shape.params(), "flops_per_token": shape.flops_per_token(SEQ)},
        "published": {"tokens_per_s_per_gpu": PUBLISHED_TPS_PER_GPU, "memory_gib": PUBLISHED_MEMORY_GIB,
                      "gpus": GPUS, "local_batch": LOCAL_BATCH, "global_batch": gb, "seq": SEQ,
                      "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1"},
        "options": TORCHTITAN.__dict__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
