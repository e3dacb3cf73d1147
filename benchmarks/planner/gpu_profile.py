"""Where a scaletrain step's GPU time goes: kernel time by kind next to the planner's phases.

Runs ``Trainer.fit`` (one process, the real step: autocast, loss, clipping, AdamW) under
``torch.profiler`` with CUDA activity, cuts the trace into steps at the optimizer's
``Optimizer.step#...`` ranges, and for the steady steps (after ``--warmup``) sums the kernels by
kind (matmul, attention, optimizer, cast/copy, loss, other elementwise) and the GPU's busy time
(union of kernel intervals) against each step's wall time: the difference is time the GPU waited
for the host (launch-bound). Written to ``OUT/gpu_profile.json``.

    python benchmarks/planner/gpu_profile.py --out DIR [--model gpt2-medium] [--micro-batch 16 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from scaletrain.measure.phases import _union  # noqa: E402  (length of a union of intervals)
from scaletrain.train.config import load_config  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402

KINDS = (("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
         ("attention", ("flash", "fmha", "attention", "efficient")),
         ("optimizer", ("multi_tensor", "adam", "foreach", "fused_adam")),
         ("loss", ("log_softmax", "nll_loss", "cross_entropy", "softmax")),
         ("cast_copy", ("copy", "cast", "to_copy", "convert")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise_other"


def profile_run(model: str, mb: int, gb: int, seq: int, steps: int, warmup: int, extra: list[str]) -> dict:
    cfg = load_config(None, [f"model.name={model}", f"train.global_batch={gb}", f"train.micro_batch={mb}",
                             f"data.seq_len={seq}", f"train.steps={steps}", "train.precision=bf16",
                             "train.eval_every=0", "train.eval_batches=1", "train.progress=off",
                             "train.checkpoint_format=none", "train.log_every=1", *extra])
    tr = Trainer(cfg, None, log=lambda s: None)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tr.fit()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    events = list(prof.events())
    opt = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.name.startswith("Optimizer.step#") and e.device_type.name == "CPU")
    # GPU-side activity only, without the GPU copies of record_function ranges (``Optimizer.step#AdamW.step``
    # spans the whole optimizer step and its name matches the optimizer kind: counted, it doubled that kind)
    kernels = [e for e in events if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
               and not e.name.startswith("Optimizer.")]
    rows = []
    for i in range(warmup, min(len(opt), steps)):
        t0, t1 = opt[i - 1][1], opt[i][1]  # from the end of the previous optimizer step to the end of this one
        ks = [k for k in kernels if t0 <= k.time_range.start < t1]
        by: dict[str, float] = {}
        for k in ks:
            by[kind_of(k.name)] = by.get(kind_of(k.name), 0.0) + (k.time_range.end - k.time_range.start) / 1e6
        busy = _union([(k.time_range.start, k.time_range.end) for k in ks]) / 1e6
        rows.append({"wall_s": (t1 - t0) / 1e6, "gpu_busy_s": busy, "kernels": len(ks), "by_kind_s": by})
    top: dict[str, float] = {}
    for k in kernels:
        top[k.name[:90]] = top.get(k.name[:90], 0.0) + (k.time_range.end - k.time_range.start) / 1e6
    tr.close()
    return {"model": model, "micro_batch": mb, "global_batch": gb, "seq": seq, "extra": extra, "steps": rows,
            "top_kernels_s": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[16, 4])
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--extra", nargs="*", default=[], help="more train keys (e.g. memory.remat.blocks=all)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "runs": []}
    for mb in args.micro_batch:
        r = profile_run(args.model, mb, args.global_batch, args.seq, args.steps, args.warmup, args.extra)
        res["runs"].append(r)
        (args.out / "gpu_profile.json").write_text(json.dumps(res, indent=1))
        for s in r["steps"]:
            by = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(s["by_kind_s"].items(), key=lambda kv: -kv[1]))
            print(f"mb{mb}: wall {s['wall_s'] * 1e3:.1f} ms, GPU busy {s['gpu_busy_s'] * 1e3:.1f} ms, "
                  f"{s['kernels']} kernels: {by}", flush=True)


if __name__ == "__main__":
    main()
