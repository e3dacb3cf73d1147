"""On paper against ZeRO-Offload (Ren et al., USENIX ATC'21, "ZeRO-Offload: Democratizing Billion-Scale
Model Training"): the largest GPT that trains on one V100-32GB with the host's memory is 13B (PyTorch
alone: 1.4B), and 40 TFLOP/s for the 10B model on one V100.

Inputs (facts, none fitted): the GPT-2 sizes of the paper's model-configuration table (layers x hidden and
batch per GPU; 10B = 50 x 4096, 32 heads, batch 10 is also DeepSpeed's ZeRO-Offload tutorial's; the other
rows were not re-read from the paper when this was written, and each gives its size by 12·l·h²), Megatron-LM
GPT-2 as DeepSpeed ran it: sequence 1024, vocabulary 50,257 padded to 50,304, dropout 0.1, materialised
softmax (no flash attention on V100 in 2020), full activation checkpointing; fp16 parameters on the GPU
with fp32 masters (params_dtype bf16 here: the v100 preset's 16-bit figure is its fp16 one). The platform
is the ``v100`` preset (V100 SXM 32 GB, PCIe Gen3, a DGX-2's 1.5 TB of host memory, CPU Adam rate 1e9
parameters/s — an assumption of the preset, not the paper's measurement). For each size the planner
prices ZeRO-Offload's system on one GPU for every micro-batch, with and without full recompute, twice —
optimizer on the device, then on the host — and says whether any plan fits; and what ``scaletrain plan``
itself proposes there (its runtime keeps fp32 parameters on the device, so it offloads sooner and fits less).

Writes ``benchmarks/results/planner_zero_offload.json``; run from the repository root:
``PYTHONPATH=src python benchmarks/planner/zero_offload.py`` (seconds, nothing runs on a GPU).
"""

from __future__ import annotations

import sys

from on_paper import write_result

from scaletrain import platform as platforms
from scaletrain.plan import OffloadPlan, Plan, RematPlan
from scaletrain.planner import Options, Shape, plan_cost, search

# params (B), layers, hidden, batch per GPU — the paper's single-GPU-sized rows (model parallelism 1)
# and the first rows beyond 13B, run with model parallelism there (priced here on one GPU all the same)
SIZES = [(1, 20, 2048, 32), (2, 40, 2048, 32), (4, 64, 2304, 32), (6, 53, 3072, 16), (8, 72, 3072, 16),
         (10, 50, 4096, 10), (11, 55, 4096, 8), (12, 60, 4096, 4), (13, 65, 4096, 4), (15, 78, 4096, 8),
         (20, 25, 8192, 8)]
SEQ, VOCAB, HEAD_DIM = 1024, 50304, 128
PUBLISHED_LARGEST_B, PUBLISHED_PYTORCH_B, PUBLISHED_10B_TFLOPS = 13, 1.4, 40
MEGATRON_2020 = Options(attention="materialized")


def shape_of(layers: int, hidden: int) -> Shape:
    return Shape(layers=layers, hidden=hidden, heads=hidden // HEAD_DIM, vocab=VOCAB, positions=SEQ, dropout=0.1)


def best_paper_plan(shape: Shape, plat, batch: int, offload: bool):
    """ZeRO-Offload's system on one GPU as the paper ran it — fp16 parameters on the device, Adam's fp32
    masters and states on the host when ``offload`` — priced for every micro-batch dividing ``batch`` with
    and without full recompute: the fastest plan that fits, else the one nearest to fitting. (scaletrain's
    runtime keeps fp32 parameters with offload — compat rule params-dtype — so its search cannot propose it.)"""
    priced = []
    for b in (d for d in range(1, batch + 1) if batch % d == 0):
        for full in (False, True):
            off = OffloadPlan(optimizer="host", recompute="all" if full else "none") if offload else OffloadPlan()
            plan = Plan(dp=1, micro_batch=b, remat=RematPlan(blocks="all") if full and not offload else RematPlan(),
                        offload=off, precision="bf16", params_dtype="bf16")
            priced.append(plan_cost(shape, plan, plat, global_batch=batch, seq=SEQ, options=MEGATRON_2020))
    ok = [c for c in priced if c.fits]
    if ok:
        return min(ok, key=lambda c: c.step_time_s), True
    return min(priced, key=lambda c: c.peak_bytes["total"]), False


def scaletrain_search(shape: Shape, plat, batch: int):
    """What ``scaletrain plan`` proposes on one GPU (its runtime: fp32 parameters; offload only if needed)."""
    res = search(shape, plat, nodes=1, gpus_per_node=1, global_batch=batch, seq=SEQ, options=MEGATRON_2020)
    return res.ranked[0] if res.ranked else None


def summary(c) -> dict | None:
    if c is None:
        return None
    return {"fits": c.fits, "describe": c.plan.describe(), "micro_batch": c.plan.micro_batch, "tflops": c.tflops_per_device,
            "step_s": c.step_time_s, "peak_gib": c.peak_bytes["total"] / 2**30,
            "peak_by_category_gib": {k: v / 2**30 for k, v in c.peak_bytes.items()},
            "host_gib": c.host_bytes / 2**30, "phases_s": c.phases_s}


def main() -> int:
    plat = platforms.get("v100")
    rows = []
    for size, l, h, batch in SIZES:
        shape = shape_of(l, h)
        without, ok0 = best_paper_plan(shape, plat, batch, offload=False)
        with_, ok1 = best_paper_plan(shape, plat, batch, offload=True)
        ours = scaletrain_search(shape, plat, batch)
        rows.append({"params_b": size, "params": shape.params(), "layers": l, "hidden": h, "batch": batch,
                     "fits_without_offload": ok0, "fits_with_offload": ok1,
                     "without": summary(without), "with": summary(with_),
                     "scaletrain_plan": summary(ours)})

        def say(c, ok: bool) -> str:
            peak = c.peak_bytes["total"] / 2**30
            return (f"fits (b={c.plan.micro_batch}, {peak:.1f} GiB)" if ok
                    else f"does not fit (least {peak:.1f} GiB + 2 reserve)")

        print(f"{size:3d}B ({shape.params() / 1e9:5.2f}B, {l} x {h}, batch {batch:2d}): without offload "
              f"{say(without, ok0)}; with offload {say(with_, ok1)}; scaletrain plan: "
              + (f"{ours.plan.describe()}, b={ours.plan.micro_batch}" if ours else "nothing fits"))
    largest_with = max((r["params_b"] for r in rows if r["fits_with_offload"]), default=0)
    largest_without = max((r["params_b"] for r in rows if r["fits_without_offload"]), default=0)
    largest_ours = max((r["params_b"] for r in rows if r["scaletrain_plan"]), default=0)
    sizes = [r["params_b"] for r in rows]
    steps_off = abs(sizes.index(largest_with) - sizes.index(PUBLISHED_LARGEST_B)) if largest_with in sizes else None
    # the second check: 10B, batch 10, full recompute, optimizer on the host, without and with DPU; then the
    # same at half and twice the preset's CPU Adam rate (an assumption of the preset), to show what it weighs
    s10 = shape_of(50, 4096)
    tput = {}
    for label, dpu, adam in (("no_dpu", False, 1.0), ("dpu", True, 1.0), ("no_dpu_adam_x0.5", False, 0.5),
                             ("no_dpu_adam_x2", False, 2.0)):
        plan = Plan(dp=1, micro_batch=10, offload=OffloadPlan(optimizer="host", recompute="all", dpu=dpu),
                    precision="bf16", params_dtype="bf16")
        p = plat.with_(cpu_adam_params_per_s=plat.cpu_adam_params_per_s * adam)
        c = plan_cost(s10, plan, p, global_batch=10, seq=SEQ, options=MEGATRON_2020)
        tput[label] = {"tflops": c.tflops_per_device, "error": c.tflops_per_device / PUBLISHED_10B_TFLOPS - 1,
                       "cpu_adam_params_per_s": p.cpu_adam_params_per_s, "step_s": c.step_time_s,
                       "phases_s": c.phases_s, "peak_gib": c.peak_bytes["total"] / 2**30, "fits": c.fits}
        print(f"10B on one V100, batch 10, {label}: {c.tflops_per_device:.1f} TFLOP/s (published "
              f"{PUBLISHED_10B_TFLOPS}); step {c.step_time_s:.2f} s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in c.phases_s.items() if v))
    print(f"largest that fits: {largest_without}B without offload (paper: PyTorch {PUBLISHED_PYTORCH_B}B), "
          f"{largest_with}B with (paper: {PUBLISHED_LARGEST_B}B): {steps_off} table size(s) apart; scaletrain's "
          f"runtime: {largest_ours}B")
    write_result("planner_zero_offload", "ZeRO-Offload (Ren et al. ATC'21) on one V100-32GB, on paper", {
        "platform": plat.to_dict(), "options": MEGATRON_2020.__dict__, "seq": SEQ, "vocab": VOCAB, "rows": rows,
        "summary": {"largest_with_offload_b": largest_with, "published_largest_b": PUBLISHED_LARGEST_B,
                    "table_sizes_apart": steps_off, "within_one_size": steps_off is not None and steps_off <= 1,
                    "largest_without_offload_b": largest_without, "published_pytorch_b": PUBLISHED_PYTORCH_B,
                    "largest_scaletrain_runtime_b": largest_ours},
        "throughput_10b": {"published_tflops": PUBLISHED_10B_TFLOPS, **tput}})
    return 0

if __name__ == "__main__":
    sys.exit(main())
