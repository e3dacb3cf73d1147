"""On paper against llm-foundry's (MosaicML) published MPT throughput tables: the bf16 rows of MPT-7B, 13B,
30B and 70B on H100 80GB, A100 80GB and A100 40GB, each priced with its published plan pinned.

Source of the rows: mosaicml/llm-foundry ``scripts/train/benchmarking/README.md`` at commit 061f2c7ce64e
(tables "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "A100 40GB with 1600 Gbps
node-node interconnect (RoCE)"). Per row: model, sequence, GPUs, MFU, micro-batch, gradient accumulation,
global batch, tokens/s/GPU, FSDP mixed-precision mode, activation checkpointing. Every row is FULL_SHARD
(ZeRO-3), no activation CPU offload. The 125M-3B rows and the H100 FP8 table are left out (the issue asks
for MPT-7B...70B in bf16).

The shapes (mosaicml/llm-foundry ``scripts/train/yamls/pretrain/mpt-{7b,13b,30b,70b}.yaml``): n_layers x
d_model x n_heads = 32 x 4096 x 32, 40 x 5120 x 40, 48 x 7168 x 56, 80 x 8192 x 64; expansion ratio 4
(GELU MLP), vocabulary 50,368, decoupled AdamW, gradient clipping by norm. The yamls name no ``alibi``,
``learned_pos_emb`` or ``no_bias``, so MPT's defaults hold: learned positions of ``max_seq_len`` rows,
biases and LayerNorm shifts, tied embedding. This is confirmed by the tables' own NumParams column, which
the GPT-2-shaped :class:`Shape` (learned positions = seq, biases, tied head) reproduces exactly for every
row (checked below; a mismatch stops the script). The benchmark sweep (``submit_benchmarks.py``) sets
``attn_impl`` triton (FlashAttention's Triton kernel) and a low-precision LayerNorm.

The plan priced for each row, nothing fitted: dp = #GPUs, ZeRO-3, the published micro-batch, accumulation
= global batch / (dp x micro-batch), full recomputation of every block when activation checkpointing is
True, bf16 over fp32 sharded parameters with a bf16 residual stream (``COMPOSER`` below), AdamW, flash
attention. The
presets are used as they are: ``h100`` (its matmul table at 2023's cuBLAS rate, :func:`h100_2023`), ``a100-80g``,
``a100-40g`` (its 40 GiB and 1,555 GB/s; the A100
tables' RoCE 1,600 Gbps per node = 25 GB/s per GPU is the A100 presets' inter-node figure already). The
published tokens/s/GPU only enters the comparison.

Approximations (what the planner cannot express):

* FSDP ``mixed_precision``: the H100 and A100 80GB 7B-30B rows ran Composer's DEFAULT, the rest PURE.
  llm-foundry at 061f2c7 pins ``mosaicml>=0.16.3,<0.17``; Composer 0.16.3's ``get_mixed_precision``
  (``composer/trainer/mosaic_fsdp_utils.py``) sets DEFAULT to ``param_dtype`` and ``buffer_dtype`` bf16 and
  leaves ``reduce_dtype`` None, which FSDP reduces in ``param_dtype``: both collectives move bf16, as PURE
  and as the planner prices ZeRO-3. (Later Composer versions reduce in fp32.) Recorded per row (``fsdp_mp``).
  With bf16 module parameters the embedding's output and the residual stream are bf16 and autocast casts
  nothing: ``Options(autocast_residual_fp32=False)``.
* The Triton FlashAttention kernel is priced as the planner's "flash" attention (two batched matmuls on a
  roofline, no s^2 tensor kept); its own efficiency per shape is not known to the planner.
* Low-precision LayerNorm (bf16 in and out) is what the planner's memory-bound LayerNorm already assumes.
* The H100 cluster's network is not stated: the ``h100`` preset's 8 x 400 Gb/s per node is used.
* Gradient clipping's norm (one read of the sharded gradients and an all-reduce of a scalar) is not priced.

Errors are predicted / published - 1 of tokens/s/GPU: positive = the planner is optimistic (too fast).

Writes ``benchmarks/results/planner_llm_foundry.json``; run from the repository root:
``PYTHONPATH=src python benchmarks/planner/llm_foundry.py`` (seconds; nothing runs on a GPU).
"""

from __future__ import annotations

import statistics
import sys

from on_paper import write_result

from scaletrain import platform as platforms
from scaletrain.plan import Plan, RematPlan
from scaletrain.planner import Options, Shape, plan_cost

SOURCE = {"repo": "mosaicml/llm-foundry", "path": "scripts/train/benchmarking/README.md",
          "commit": "061f2c7ce64e655100286584a7629e2a09f827ba"}
YAMLS = {  # name: (n_layers, d_model, n_heads, the yaml and the commit it was read at)
    "7b": (32, 4096, 32, "scripts/train/yamls/pretrain/mpt-7b.yaml@15fb4ffaa6fbe16a33e158118bd8ba0b77ba78dc"),
    "13b": (40, 5120, 40, "scripts/train/yamls/pretrain/mpt-13b.yaml@309f68378c1e5f83dd5ccefd9350196cb1553e43"),
    "30b": (48, 7168, 56, "scripts/train/yamls/pretrain/mpt-30b.yaml@39393a21d451b7fc0fc342b0a2470d5ec59952f5"),
    "70b": (80, 8192, 64, "scripts/train/yamls/pretrain/mpt-70b.yaml@17e6d6312c13710ecbbeeff7ec93ef8c9ecefe1e"),
}
VOCAB = 50368

# per table: the README's heading, the preset priced, and its rows:
# model, seq, GPUs, published MFU %, micro-batch, grad-accum, global batch (sequences), tokens/s/GPU,
# activation checkpointing, FSDP mixed precision, NumParams
TABLES = {
    "h100_80gb": ("H100 80GB BF16", "h100", [
        ("70b", 2048, 64, 42.57, 8, 4, 2048, 1039, True, "DEFAULT", 64862437376),
        ("70b", 2048, 32, 36.15, 2, 16, 1024, 882, True, "DEFAULT", 64862437376),
        ("30b", 8192, 8, 29.92, 1, 21, 168, 1384, True, "DEFAULT", 30019254272),
        ("30b", 4096, 8, 35.86, 1, 21, 168, 1802, True, "DEFAULT", 29989894144),
        ("30b", 2048, 32, 43.92, 14, 3, 1344, 2308, True, "DEFAULT", 29975214080),
        ("30b", 2048, 16, 43.07, 10, 3, 480, 2263, True, "DEFAULT", 29975214080),
        ("30b", 2048, 8, 38.11, 3, 21, 504, 2002, True, "DEFAULT", 29975214080),
        ("30b", 1024, 8, 38.76, 6, 21, 1008, 2084, True, "DEFAULT", 29967874048),
        ("13b", 32768, 8, 31.68, 1, 3, 24, 1976, True, "DEFAULT", 13011240960),
        ("13b", 16384, 8, 35.55, 3, 3, 72, 2985, True, "DEFAULT", 12927354880),
        ("13b", 4096, 8, 41.6, 10, 3, 240, 4717, True, "DEFAULT", 12864440320),
        ("13b", 2048, 64, 39.86, 2, 1, 128, 4800, False, "DEFAULT", 12853954560),
        ("13b", 2048, 32, 39.95, 2, 1, 64, 4811, False, "DEFAULT", 12853954560),
        ("13b", 2048, 16, 39.58, 2, 1, 32, 4767, False, "DEFAULT", 12853954560),
        ("13b", 2048, 8, 39.79, 2, 1, 16, 4792, False, "DEFAULT", 12853954560),
        ("13b", 1024, 8, 44.27, 40, 3, 960, 5502, True, "DEFAULT", 12848711680),
        ("7b", 65536, 8, 28.59, 1, 2, 16, 1956, True, "DEFAULT", 6918905856),
        ("7b", 32768, 8, 30.94, 2, 2, 32, 3318, True, "DEFAULT", 6784688128),
        ("7b", 8192, 8, 37.14, 8, 2, 128, 6935, True, "DEFAULT", 6684024832),
        ("7b", 4096, 8, 40.42, 16, 2, 256, 8611, True, "DEFAULT", 6667247616),
        ("7b", 2048, 8, 46.44, 6, 1, 48, 10643, False, "DEFAULT", 6658859008),
        ("7b", 1024, 8, 42.83, 64, 2, 1024, 10203, True, "DEFAULT", 6654664704),
    ]),
    "a100_80gb": ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "a100-80g", [
        ("70b", 2048, 64, 53.33, 8, 4, 2048, 410, True, "PURE", 64862437376),
        ("70b", 2048, 32, 48.56, 2, 16, 1024, 373, True, "PURE", 64862437376),
        ("30b", 8192, 8, 39.38, 1, 21, 168, 574, True, "DEFAULT", 30019254272),
        ("30b", 4096, 8, 51.37, 1, 21, 168, 814, True, "DEFAULT", 29989894144),
        ("30b", 2048, 8, 55.3, 3, 21, 504, 916, True, "DEFAULT", 29975214080),
        ("30b", 1024, 8, 55.82, 6, 21, 1008, 946, True, "DEFAULT", 29967874048),
        ("30b", 512, 8, 56.4, 12, 21, 2016, 967, True, "DEFAULT", 29964204032),
        ("13b", 32768, 8, 51.69, 1, 3, 24, 1016, True, "DEFAULT", 13011240960),
        ("13b", 16384, 8, 54.07, 3, 3, 72, 1431, True, "DEFAULT", 12927354880),
        ("13b", 8192, 8, 56.07, 5, 3, 120, 1795, True, "DEFAULT", 12885411840),
        ("13b", 4096, 8, 57.62, 10, 3, 240, 2060, True, "DEFAULT", 12864440320),
        ("13b", 2048, 8, 59.57, 2, 3, 48, 2262, False, "DEFAULT", 12853954560),
        ("13b", 1024, 8, 59.48, 40, 3, 960, 2330, True, "DEFAULT", 12848711680),
        ("7b", 65536, 8, 46.97, 1, 2, 16, 1013, True, "DEFAULT", 6918905856),
        ("7b", 32768, 8, 49.46, 2, 2, 32, 1672, True, "DEFAULT", 6784688128),
        ("7b", 16384, 8, 51.96, 4, 2, 64, 2453, True, "DEFAULT", 6717579264),
        ("7b", 8192, 8, 54.47, 8, 2, 128, 3206, True, "DEFAULT", 6684024832),
        ("7b", 4096, 8, 54.84, 16, 2, 256, 3684, True, "DEFAULT", 6667247616),
        ("7b", 2048, 8, 64.23, 6, 2, 96, 4641, False, "DEFAULT", 6658859008),
        ("7b", 1024, 8, 58.01, 64, 2, 1024, 4357, True, "DEFAULT", 6654664704),
    ]),
    "a100_40gb": ("A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "a100-40g", [
        ("70b", 2048, 128, 48.91, 4, 1, 512, 376, True, "PURE", 64862437376),
        ("70b", 2048, 64, 35.87, 2, 1, 128, 276, True, "PURE", 64862437376),
        ("30b", 2048, 128, 52.25, 6, 1, 768, 865, True, "PURE", 29975214080),
        ("30b", 2048, 32, 51.74, 4, 1, 128, 857, True, "PURE", 29975214080),
        ("13b", 8192, 8, 43.95, 1, 16, 128, 1407, True, "PURE", 12885411840),
        ("13b", 4096, 8, 44.85, 2, 16, 256, 1603, True, "PURE", 12864440320),
        ("13b", 2048, 128, 51.93, 16, 1, 2048, 1972, True, "PURE", 12853954560),
        ("13b", 2048, 64, 52.04, 16, 1, 1024, 1976, True, "PURE", 12853954560),
        ("13b", 2048, 32, 52.62, 14, 1, 448, 1998, True, "PURE", 12853954560),
        ("13b", 2048, 16, 52.5, 10, 1, 160, 1993, True, "PURE", 12853954560),
        ("13b", 2048, 8, 43.94, 4, 16, 512, 1668, True, "PURE", 12853954560),
        ("13b", 1024, 8, 44.07, 8, 16, 1024, 1727, True, "PURE", 12848711680),
        ("13b", 512, 8, 44.28, 16, 16, 2048, 1763, True, "PURE", 12846090240),
        ("7b", 16384, 8, 47.65, 1, 4, 32, 2249, True, "PURE", 6717579264),
        ("7b", 8192, 8, 49.04, 3, 4, 96, 2887, True, "PURE", 6684024832),
        ("7b", 4096, 8, 50.11, 6, 4, 192, 3366, True, "PURE", 6667247616),
        ("7b", 2048, 128, 50.14, 18, 1, 2304, 3623, True, "PURE", 6658859008),
        ("7b", 2048, 64, 50.73, 18, 1, 1152, 3665, True, "PURE", 6658859008),
        ("7b", 2048, 32, 51.55, 18, 1, 576, 3725, True, "PURE", 6658859008),
        ("7b", 2048, 16, 50.44, 16, 1, 256, 3645, True, "PURE", 6658859008),
        ("7b", 2048, 8, 50.92, 12, 4, 384, 3679, True, "PURE", 6658859008),
        ("7b", 1024, 8, 51.31, 24, 4, 768, 3854, True, "PURE", 6654664704),
        ("7b", 512, 8, 50.85, 48, 4, 1536, 3895, True, "PURE", 6652567552),
    ]),
}


H100_2023_GEMM_FLOPS = 720.3e12
"""bf16 FLOP/s of one H100 SXM GEMM with 2023's cuBLAS: pytorch/pytorch issue #100850 (May 2023), a
[2048, 8192] x [8192, 8192] matmul (``--batch-size 1``) at 720.3 TFLOP/s with cuBLAS 11.11.3 (CUDA 11.8, the
cuBLAS of PyTorch 2.0's cu118 wheels; 742.7 with cuBLAS 12.0.2 in NVIDIA's container). The runs' stack
(Composer 0.16, PyTorch < 2.1.1, CUDA 11.8 or 12.1) predates the cuBLAS the ``h100`` preset's MAMF
figure (792.1) was measured with."""
H100_2023_SHAPE = (2048, 8192)
"""That GEMM's output (rows, columns): 512 tiles of 256x128 in 4 waves of 132 SMs (0.97 useful)."""


def h100_2023() -> platforms.Platform:
    """The ``h100`` preset with its matmul table scaled to :data:`H100_2023_GEMM_FLOPS` per useful tile (the
    preset's own rule: a table's top row is a measured GEMM over its shape's wave fraction; the rows below
    keep their ratios to it). Everything else is the preset's."""
    h100 = platforms.get("h100")
    top = H100_2023_GEMM_FLOPS / h100.flops_bf16 / h100.wave_fraction(*H100_2023_SHAPE)
    scale = top / h100.matmul_efficiency[0][1]
    return h100.with_(name="h100-cublas-2023", matmul_efficiency=tuple((g, f * scale) for g, f in h100.matmul_efficiency),
                      source=h100.source + "; matmul table scaled to pytorch/pytorch#100850's 720.3 TFLOP/s "
                      "(cuBLAS 11.11.3, May 2023)")


COMPOSER = Options(autocast_residual_fp32=False)
"""How Composer 0.16 ran MPT under FSDP (module docstring): a bf16 residual stream; otherwise the defaults."""


def shape_of(model: str, seq: int) -> Shape:
    """MPT as the benchmark ran it: GPT-2 structure (learned positions of ``seq`` rows, biases, tied head)."""
    layers, hidden, heads, _ = YAMLS[model]
    return Shape(layers=layers, hidden=hidden, heads=heads, vocab=VOCAB, positions=seq)


def published_plan(gpus: int, micro_batch: int, checkpointing: bool) -> Plan:
    return Plan(dp=gpus, zero=3, micro_batch=micro_batch,
                remat=RematPlan(blocks="all") if checkpointing else RematPlan(),
                precision="bf16", optimizer="adamw")


def price_row(kind: str, plat: platforms.Platform, row: tuple) -> dict:
    model, seq, gpus, mfu, mb, accum, gb, tps, ckpt, fsdp_mp, n_params = row
    if mb * accum * gpus != gb:
        raise SystemExit(f"{kind} {model} s={seq} x{gpus}: micro-batch x accumulation x GPUs != global batch")
    shape = shape_of(model, seq)
    if shape.params() != n_params:
        raise SystemExit(f"{model} s={seq}: shape has {shape.params():,} parameters, the table {n_params:,}")
    c = plan_cost(shape, published_plan(gpus, mb, ckpt), plat, global_batch=gb, seq=seq, options=COMPOSER)
    pred_tps = c.tokens_per_s / gpus
    err = pred_tps / tps - 1
    return {
        "gpu": kind, "model": f"mpt-{model}", "seq": seq, "gpus": gpus, "micro_batch": mb, "grad_accum": accum,
        "global_batch": gb, "sharding": "FULL_SHARD (zero=3)", "activation_checkpointing": ckpt,
        "fsdp_mp": fsdp_mp, "params": n_params,
        "published_tokens_per_s_per_gpu": tps, "published_mfu": mfu / 100,
        "published_step_s": gb * seq / (tps * gpus),
        "predicted_tokens_per_s_per_gpu": pred_tps, "predicted_step_s": c.step_time_s, "predicted_mfu": c.mfu,
        "error": err, "within_15pct": abs(err) <= 0.15,
        "predicted_peak_bytes": c.peak_bytes["total"], "device_bytes": c.device_bytes, "fits": c.fits,
        "phases_s": c.phases_s, "blocks_s": c.blocks_s, "plan": c.to_dict()["plan"],
    }


def summarise(rows: list[dict]) -> dict:
    errs = [r["error"] for r in rows]
    return {"rows": len(rows), "within_15pct": sum(r["within_15pct"] for r in rows),
            "median_abs_error": statistics.median(abs(e) for e in errs),
            "median_error": statistics.median(errs), "max_abs_error": max(abs(e) for e in errs),
            "optimistic": sum(e > 0 for e in errs), "pessimistic": sum(e < 0 for e in errs),
            "predicted_not_to_fit": sum(not r["fits"] for r in rows)}


def main() -> int:
    rows, used = [], {}
    for kind, (heading, preset, table) in TABLES.items():
        plat = h100_2023() if preset == "h100" else platforms.get(preset)
        used[kind] = {"table": heading, "preset": preset, "platform": plat.to_dict(), "source": SOURCE}
        for row in table:
            r = price_row(kind, plat, row)
            rows.append(r)
            ph = r["phases_s"]
            print(f"{kind:9s} {r['model']:8s} s={r['seq']:5d} x{r['gpus']:3d} b={r['micro_batch']:2d} "
                  f"m={r['grad_accum']:2d} ckpt={'T' if r['activation_checkpointing'] else 'F'}  "
                  f"published {r['published_tokens_per_s_per_gpu']:6d}  predicted "
                  f"{r['predicted_tokens_per_s_per_gpu']:8.0f}  {r['error']:+6.1%}  dp_comm "
                  f"{ph['dp_comm'] / r['predicted_step_s']:5.1%}  peak {r['predicted_peak_bytes'] / 2**30:5.1f} GiB"
                  f"{'' if r['fits'] else ' (does not fit)'}")
    summary = {"all": summarise(rows), **{k: summarise([r for r in rows if r["gpu"] == k]) for k in TABLES}}
    for k, s in summary.items():
        print(f"{k}: {s['within_15pct']}/{s['rows']} within 15 %, median |error| {s['median_abs_error']:.1%}, "
              f"{s['optimistic']} optimistic / {s['pessimistic']} pessimistic, {s['predicted_not_to_fit']} predicted "
              f"not to fit")
    write_result("planner_llm_foundry", "llm-foundry (MosaicML) MPT throughput tables, bf16, on paper", {
        "source": SOURCE, "shapes": {k: {"layers": v[0], "hidden": v[1], "heads": v[2], "vocab": VOCAB,
                                         "yaml": v[3]} for k, v in YAMLS.items()},
        "tables": used, "options": COMPOSER.__dict__, "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
