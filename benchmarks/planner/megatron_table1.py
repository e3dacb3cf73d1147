"""On paper against Megatron-LM (Narayanan et al., SC21) Table 1: predicted TFLOP/s per GPU for the
ten published GPT runs, and the planner's own top plan for each.

Inputs per row (REFERENCES.md, Table 1): heads, hidden, layers, (t, p), GPUs, batch; the micro-batch
and virtual stages are the published run script's (NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh``:
MBS and ``--num-layers-per-virtual-pipeline-stage``). V = 51,200, s = 2048, A100 80 GB (a100-80g
preset), full recomputation, dropout 0.1. Megatron 2021 specifics are passed as options, not fitted:
materialised softmax + dropout (no flash attention), scatter/gather p2p, fp16 parameters (params_dtype
bf16, no autocast copies), Megatron's fp32 vocabulary-parallel loss and fp16 optimizer
(``MEGATRON_2021_LOSS_BYTES``, ``MEGATRON_2021_OPTIMIZER_BYTES``). The
published TFLOP/s never enters a prediction: it is only compared.

Writes ``benchmarks/results/planner_megatron_table1.json``; run from the repository root:
``PYTHONPATH=src python benchmarks/planner/megatron_table1.py``.
"""

from __future__ import annotations

import sys
import time

from on_paper import write_result

from scaletrain import platform as platforms
from scaletrain.plan import Plan, RematPlan
from scaletrain.planner import Options, Shape, plan_cost, search

# params (B), heads, hidden, layers, t, p, GPUs, batch, micro-batch, virtual, published TFLOP/s per GPU
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
]
SEQ, VOCAB = 2048, 51200
MEGATRON_2021_LOSS_BYTES = 52.0
"""Bytes per logit of Megatron-LM 2021's loss, counted from its code (NVIDIA/Megatron-LM at de7dc40:
``megatron/model/gpt_model.py`` ``post_language_model_processing`` calls ``vocab_parallel_cross_entropy(
output.float(), labels)`` unless ``--fp16-lm-cross-entropy``; ``megatron/mpu/cross_entropy.py``
``_VocabParallelCrossEntropy``). Forward: the cast to fp32 (read 2, write 4), the row max (read 4), the
max subtracted (4 + 4), ``torch.exp(..., out=)`` (4 + 4), the row sum (4) and the softmax kept for the
backward by ``exp_logits.div_`` (4 + 4): 38. Backward: ``grad_input.mul_(grad_output)`` (4 + 4) and the
cast back to fp16 (4 + 2): 14."""
MEGATRON_2021_OPTIMIZER_BYTES = 60.0
"""Bytes per parameter of Megatron-LM 2021's fp16 optimizer step, counted from its code (de7dc40:
``megatron/optimizer/optimizer.py`` ``Float16OptimizerWithFloat16Params.step``, ``clip_grads.py``, apex
``FusedAdam``): the fp16 gradient copied to the fp32 main gradient (read 2, write 4), unscaled and checked
for inf by ``torch._amp_foreach_non_finite_check_and_unscale_`` (4 + 4), its L2 norm (``multi_tensor_l2norm``,
read 4) and scale (``multi_tensor_scale``, 4 + 4, run when the norm exceeds ``--clip-grad 1.0``, as early
in training, where these 500-iteration runs are), FusedAdam (read p, g, m, v; write p, m, v: 28), and the
fp32 main parameter copied to the fp16 one (4 + 2). The registry's 92 is torch's eight foreach kernels."""
MEGATRON_2021_NORM = "apex"
"""Megatron-LM 2021's LayerNorm is apex's fused kernel: ``megatron/model/__init__.py`` imports
``MixedFusedLayerNorm as LayerNorm`` from ``megatron/model/fused_layer_norm.py``, which calls the
``fused_mix_prec_layer_norm_cuda`` extension built from ``megatron/fused_kernels/layer_norm_cuda_kernel.cu``,
apex's ``fused_layer_norm_cuda`` kernel (:data:`scaletrain.cost.norm.NORM_KERNELS` ``apex``)."""
MEGATRON = Options(attention="materialized", p2p_scatter=True, stage_split="uniform", norm_kernel=MEGATRON_2021_NORM,
                   loss_bytes_per_logit=MEGATRON_2021_LOSS_BYTES, optimizer_bytes_per_param=MEGATRON_2021_OPTIMIZER_BYTES)
# The run script's ``--DDP-impl`` per row (``examples/sc21/run_table_1.sh`` at de7dc40, Aug 2021): PyTorch's
# DDP (gradient buckets overlapped with the backward) for 1.7B-18B, Megatron's ``local`` DDP for the rest.
# ``local`` all-reduces after the whole forward-backward (``megatron/training.py`` ``train_step``:
# ``allreduce_gradients()`` after ``forward_backward_func``), in one call per gradient dtype: its contiguous
# buffer, or the flattened gradients (``megatron/model/distributed.py``). Gradients are fp16 either way
# (``--fp16`` without ``--accumulate-allreduce-grads-in-fp32``), as the planner prices 16-bit parameters.
LOCAL_DDP = {39.1, 76.1, 145.6, 310.1, 529.6, 1008.0}
MEGATRON_LOCAL_DDP = Options(attention="materialized", p2p_scatter=True, dp_overlap=False,
                             stage_split="uniform", norm_kernel=MEGATRON_2021_NORM, loss_bytes_per_logit=MEGATRON_2021_LOSS_BYTES,
                             optimizer_bytes_per_param=MEGATRON_2021_OPTIMIZER_BYTES)
ONE_BUCKET_MB = 1e7
"""A bucket larger than any rank's gradients: local DDP's one all-reduce per step."""


def shape_of(row: tuple) -> Shape:
    _, a, h, l, *_ = row
    return Shape(layers=l, hidden=h, heads=a, vocab=VOCAB, positions=SEQ, dropout=0.1)


def published_plan(row: tuple) -> Plan:
    _, _, _, _, t, p, gpus, batch, mb, v, _ = row
    dp = gpus // (t * p)
    return Plan(dp=dp, tp=t, pp=p, micro_batch=mb, microbatches=batch // (dp * mb) if p > 1 else 0,
                schedule="interleaved" if v > 1 else "1f1b", virtual=v if v > 1 else 0,
                remat=RematPlan(blocks="all"), precision="bf16", params_dtype="bf16",
                bucket_mb=ONE_BUCKET_MB if row[0] in LOCAL_DDP else 25.0)


def main() -> int:
    plat = platforms.get("a100-80g")
    rows = []
    for row in ROWS:
        size, *_, gpus, batch, _, _, published = row
        shape = shape_of(row)
        c = plan_cost(shape, published_plan(row), plat, global_batch=batch, seq=SEQ,
                      options=MEGATRON_LOCAL_DDP if size in LOCAL_DDP else MEGATRON)
        err = c.tflops_per_device / published - 1
        t0 = time.perf_counter()
        res = search(shape, plat, nodes=gpus // 8, gpus_per_node=8, global_batch=batch, seq=SEQ)
        planning_s = time.perf_counter() - t0
        top = res.ranked[0] if res.ranked else None
        # the same search priced with Megatron 2021's kernels (materialised attention), for a like-for-like view
        same = search(shape, plat, nodes=gpus // 8, gpus_per_node=8, global_batch=batch, seq=SEQ, options=MEGATRON)
        top_m = same.ranked[0] if same.ranked else None
        rows.append({
            "params_b": size, "gpus": gpus, "batch": batch, "published_tflops_per_gpu": published,
            "published_plan": c.to_dict()["plan"], "predicted_tflops_per_gpu": c.tflops_per_device,
            "error": err, "within_15pct": abs(err) <= 0.15, "predicted_step_s": c.step_time_s,
            "bubble_fraction": c.bubble_fraction, "phases_s": c.phases_s, "predicted_peak_bytes": c.peak_bytes["total"],
            "fits_80gb": c.fits,
            "planner": None if top is None else {
                "plan": top.to_dict()["plan"], "describe": top.plan.describe(),
                "tflops_per_gpu": top.tflops_per_device, "mfu": top.mfu, "step_s": top.step_time_s,
                "peak_bytes": top.peak_bytes["total"], "fits_80gb": top.fits,
                "at_least_published": top.tflops_per_device >= published,
                "at_least_predicted_published_plan": top.step_time_s <= c.step_time_s * (1 + 1e-9)
                or top.tflops_per_device >= c.tflops_per_device,
                "plans_priced": res.evaluated, "planning_s": planning_s},
            "planner_megatron_kernels": None if top_m is None else {
                "describe": top_m.plan.describe(), "micro_batch": top_m.plan.micro_batch,
                "tflops_per_gpu": top_m.tflops_per_device, "peak_bytes": top_m.peak_bytes["total"],
                "fits_80gb": top_m.fits, "at_least_published": top_m.tflops_per_device >= published},
        })
        print(f"{size:7.1f}B  t={row[4]} p={row[5]:2d} b={row[8]:2d} v={row[9]}  predicted {c.tflops_per_device:6.1f} "
              f"published {published}  error {err:+.1%}  | planner: "
              + (f"{top.plan.describe()}, b={top.plan.micro_batch}: {top.tflops_per_device:.0f} TFLOP/s, "
                 f"{top.peak_bytes['total'] / 2**30:.0f} GiB, {planning_s:.1f} s" if top else "nothing fits"))
    # planner speed: GPT-3 175B on 1024 A100s (the figure: under 60 s)
    gpt3 = Shape(layers=96, hidden=12288, heads=96, vocab=VOCAB, positions=SEQ)
    t0 = time.perf_counter()
    res = search(gpt3, plat, nodes=128, gpus_per_node=8, global_batch=1536, seq=SEQ)
    speed = {"model": "GPT-3 175B (96 x 12288, 96 heads)", "gpus": 1024, "global_batch": 1536,
             "seconds": time.perf_counter() - t0, "plans_priced": res.evaluated, "plans_fit": len(res.ranked),
             "best": res.ranked[0].plan.describe() if res.ranked else None}
    print(f"planning GPT-3 175B on 1024 A100: {speed['seconds']:.1f} s, {speed['plans_priced']} plans priced")
    errs = [abs(r["error"]) for r in rows]
    write_result("planner_megatron_table1", "Megatron-LM SC21 Table 1, on paper", {
        "platform": plat.to_dict(), "options": MEGATRON.__dict__,
        "local_ddp_rows": {"rows_b": sorted(LOCAL_DDP), "options": MEGATRON_LOCAL_DDP.__dict__,
                           "bucket_mb": ONE_BUCKET_MB}, "rows": rows,
        "summary": {"rows_within_15pct": sum(r["within_15pct"] for r in rows), "rows": len(rows),
                    "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs)},
        "planner_speed": speed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
