"""Megatron's 3-D with recompute on this machine: gpt2-mini, 8 processes, pp=2 x tp=2 x dp=2, ZeRO-1,
optimal remat inside the stages — against one process, in fp32 (equal losses) and bf16.

    python benchmarks/compose/done_when.py [--steps 20] [--budget 7MiB]

Runs ``scaletrain train`` four times (one process and 8 processes, fp32 and bf16) on the shipped text
with the same global batch (16 x 128 bytes) and micro-batches (2 samples, 4 per replica and step),
then writes ``benchmarks/results/compose_done_when.json``: the loss curves, their largest relative
difference, the per-rank traffic and every pipeline rank's peak (tracker, last step) next to
`scaletrain estimate`'s, and the machine, versions and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["model.name=gpt2-mini", "train.global_batch=16", "train.eval_every=0", "train.eval_batches=2",
          "train.log_every=1", "train.progress=off", "optim.warmup_steps=5"]
PLAN = ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "parallel.microbatches=4",
        "memory.remat.method=optimal"]


def train(out: Path, nproc: int, extra: list[str]) -> tuple[list[dict], float, str]:
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--out", str(out)]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd + COMMON + extra, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - t0, r.stdout


def predicted_vs_measured(prec: str, budget: str, last: dict) -> dict:
    """`scaletrain estimate` with the run's flags against the tracker's peak of every pipeline rank
    (global rank (d pp + p) tp + t: pipeline rank p's first rank is 2 p) and the traffic."""
    cmd = [sys.executable, "-m", "scaletrain.cli", "estimate", "--model", "gpt2-mini", "--dp", "2", "--tp", "2",
           "--zero", "1", "--pp", "2", "--microbatches", "4", "--global-batch", "16", "--seq", "128",
           "--precision", prec, "--remat", "optimal", "--remat-budget", budget, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    ranks = json.loads(r.stdout)["meta"]["plan"]["ranks"]
    measured = last["tracked_peak_bytes_ranks"]
    rows = [{"pipeline_rank": p, "predicted_peak_bytes": c["peak_bytes"], "measured_peak_bytes": measured[2 * p],
             "error": c["peak_bytes"] / measured[2 * p] - 1, "predicted_comm_bytes": c["comm_bytes"]}
            for p, c in enumerate(ranks)]
    return {"command": " ".join(cmd[2:]), "ranks": rows, "measured_comm_bytes_rank0": last.get("comm_bytes")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--budget", default="7MiB", help="memory.remat.budget per stage and micro-batch")
    args = p.parse_args()
    steps = [f"train.steps={args.steps}"]
    res: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor() or
                 platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                 "python": sys.version.split()[0],
                 "load_avg": os.getloadavg(), "steps": args.steps, "budget": args.budget,
                 "command": "scaletrain train --nproc-per-node 8 " + " ".join(COMMON + PLAN + steps)
                 + f" memory.remat.budget={args.budget} [train.precision=bf16]"}
    with tempfile.TemporaryDirectory() as d:
        for prec in ("fp32", "bf16"):
            pr = [f"train.precision={prec}"]
            one, t1, _ = train(Path(d) / f"one-{prec}", 1, steps + pr + ["train.micro_batch=2"])
            par, t8, out = train(Path(d) / f"par-{prec}", 8, steps + pr + PLAN + [f"memory.remat.budget={args.budget}",
                                                                                "train.measure_memory=true"])
            a = [r["loss"] for r in one if "loss" in r]
            b = [r["loss"] for r in par if "loss" in r]
            last = [r for r in par if "loss" in r][-1]
            res[prec] = {"one_process_losses": a, "parallel_losses": b,
                         "max_rel_loss_diff": max(abs(x - y) / abs(x) for x, y in zip(a, b)),
                         "seconds_one": t1, "seconds_parallel": t8,
                         "rank0_metrics_last_step": {k: v for k, v in last.items() if k not in ("lr",)},
                         "header": [line for line in out.splitlines() if line.startswith(("remat", "scaletrain"))],
                         "peak": predicted_vs_measured(prec, args.budget, last)}
            print(prec, "max relative loss difference", res[prec]["max_rel_loss_diff"],
                  "peak errors", [round(x["error"], 5) for x in res[prec]["peak"]["ranks"]], flush=True)
    dest = ROOT / "benchmarks" / "results" / "compose_done_when.json"
    dest.write_text(json.dumps(res, indent=1))
    print("wrote", dest)


if __name__ == "__main__":
    main()
