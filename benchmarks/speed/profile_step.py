"""Where an engine's step goes: torch.profiler over a few steps of one or more ``run.py`` engines.

The same 2 gloo processes, 1 thread each, the same model, batch and step as ``run.py``; after 2 warm-up
steps each engine is profiled for ``--steps`` steps on every rank and rank 0's operators are summed by
kind: ``collective`` (c10d / gloo calls and their waits), ``matmul`` (addmm, mm, bmm, linear's and the
attention's kernels), ``other aten`` (the rest of torch's operators, self time) and ``outside operators``
(Python: module hooks, DTensor's dispatch, the optimizer's loop) = wall time less the operators' self time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/profile_step.py --engines st-ddp,st-tp,torch-tp
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import TP_ENGINES, WORKLOADS, _engine  # noqa: E402 - the bench's own engines

MATMUL = ("aten::addmm", "aten::mm", "aten::bmm", "aten::_scaled_dot_product", "aten::scaled_dot_product",
          "aten::_flash_attention", "aten::matmul")


def _kind(name: str) -> str:
    low = name.lower()
    if "c10d" in low or "gloo" in low or "allreduce" in low or "all_reduce" in low or "wait" in low:
        return "collective"
    if name.startswith(MATMUL):
        return "matmul"
    return "other aten"


def _worker(rank: int, world: int, workload: str, engines: list[str], steps: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from torch.profiler import ProfilerActivity, profile

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.step import loss_for, make_batch

    w = WORKLOADS[workload]
    micro = w["batch"] // world
    out = {}
    for name in engines:
        torch.manual_seed(0)
        model = models.get(workload)
        step = _engine(name, model, loss_for(model), micro, world, w["seq"], rank)[0]
        torch.manual_seed(1 if name in TP_ENGINES else 1 + rank)
        batch = make_batch(to_chain(models.get(workload)), micro * (world if name in TP_ENGINES else 1), w["seq"])
        for _ in range(2):
            step(*batch)
        dist.barrier()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step(*batch)
        wall = (time.perf_counter() - t0) / steps
        kinds = {"collective": 0.0, "matmul": 0.0, "other aten": 0.0}
        top = []
        for e in prof.key_averages():
            if e.key.startswith("ProfilerStep"):
                continue
            kinds[_kind(e.key)] += e.self_cpu_time_total / 1e6 / steps
            top.append((e.self_cpu_time_total / 1e6 / steps, e.key, e.count // steps))
        kinds["outside operators"] = wall - sum(kinds.values())
        top.sort(reverse=True)
        out[name] = {"step_s": wall, "kinds_s": kinds,
                     "top": [{"self_s": s, "op": k, "calls": c} for s, k, c in top[:12]]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="gpt2-mini")
    p.add_argument("--engines", default="st-ddp,st-tp,torch-tp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    from scaletrain.testing import run_distributed

    res = run_distributed(_worker, 2, args.workload, args.engines.split(","), args.steps, timeout_s=1200)[0]
    for name, r in res.items():
        k = r["kinds_s"]
        print(f"{name:10s} step {r['step_s'] * 1e3:6.0f} ms: " + ", ".join(f"{n} {v * 1e3:.0f}" for n, v in k.items()))
        for t in r["top"][:8]:
            print(f"    {t['self_s'] * 1e3:7.1f} ms  {t['calls']:4d}x  {t['op']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "engines": res}, indent=1))


if __name__ == "__main__":
    main()
