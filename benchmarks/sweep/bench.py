"""One sweep, four ways: makespan measured next to the simulator's prediction.

Four gpt2-mini runs (optim.lr = 1e-3, 3e-3, 1e-2, 3e-2) whose model states (~79 MB with AdamW)
do not fit the 64 MiB device budget, on this machine's 2 cores:

  (a) one run after another with offloading — ``scaletrain train memory.offload.plan=auto`` under
      the same budget (the offload planner's choice: weights and optimizer on the host, blocks
      recomputed), one process using every core;
  (b) task parallelism — one run per device (policy ``task``) — does not fit the budget, so it
      runs without one: the ideal a bigger device would give;
  (c) model parallelism — each run's shards spread over both devices, one run at a time
      (policy ``sequential``);
  (d) shard alternator parallelism — policies ``lrtf`` (Sharded-LRTF) and ``round_robin``.

Each variant runs in its own process; (b)–(d) print their prediction before training. Writes
``benchmarks/results/sweep.json`` and ``benchmarks/results/sweep_timeline.png`` (the Sharded-LRTF
timeline, predicted above measured).

    PYTHONPATH=src python benchmarks/sweep/bench.py [--steps 20]     # ~6 minutes here
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "pipeline"))
from common import RESULTS, write_json  # noqa: E402

LRS = ["1e-3", "3e-3", "1e-2", "3e-2"]
VARIANTS = {
    "a_one_after_another_offload": None,
    "b_task_parallel_no_budget": dict(policy="task", budget=""),
    "c_model_parallel": dict(policy="sequential"),
    "d_shard_alternator_lrtf": dict(policy="lrtf"),
    "d_shard_alternator_round_robin": dict(policy="round_robin"),
}


def base(steps: int, budget: str) -> list[str]:
    return ["model.name=gpt2-mini", f"train.steps={steps}", "train.eval_batches=2", "train.log_every=5",
            "train.progress=off", f"memory.device_budget={budget}"]


def one_after_another(steps: int, budget: str, out: Path) -> dict:
    """(a) in this process: four solo runs with the offload planner, back to back, all cores."""
    import torch

    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(2)
    t0 = time.monotonic()
    for lr in LRS:
        tr = Trainer(load_config(None, base(steps, budget) + [f"optim.lr={lr}", "memory.offload.plan=auto"]),
                     out / f"lr={lr}", log=lambda s: None)
        try:
            tr.fit()
        finally:
            tr.close()
    return {"makespan_s": time.monotonic() - t0, "predicted_makespan_s": None}


def sweep(steps: int, budget: str, policy: str, out: Path) -> dict:
    from scaletrain.sweep.options import SweepOptions
    from scaletrain.sweep.run import Run, run_sweep, write_summary
    from scaletrain.train.config import load_config

    runs = [Run(f"lr={lr}", load_config(None, base(steps, budget) + [f"optim.lr={lr}"])) for lr in LRS]
    res = run_sweep(runs, SweepOptions(devices=2, policy=policy), out, log=lambda s: None)
    write_summary(out / "sweep.json", res)
    s = res.summary
    return {k: s[k] for k in ("makespan_s", "predicted_makespan_s", "makespan_error", "utilisation",
                              "predicted_utilisation", "device_peak_bytes", "budget_bytes", "bytes_moved",
                              "predicted_bytes_moved", "shards")} | {
        "final_losses": [r["final_loss"] for r in res.runs]}


def child(args: argparse.Namespace) -> None:
    out = Path(args.out)
    spec = VARIANTS[args.variant]
    if spec is None:
        rec = one_after_another(args.steps, args.budget, out)
    else:
        rec = sweep(args.steps, spec.get("budget", args.budget), spec["policy"], out)
    print("RESULT " + json.dumps(rec))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--only", nargs="*", default=list(VARIANTS))
    args = ap.parse_args()
    if args.variant:
        return child(args)
    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    try:
        for name in args.only:
            out = tmp / name
            cmd = [sys.executable, __file__, "--variant", name, "--out", str(out), "--steps", str(args.steps),
                   "--budget", args.budget]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                results[name] = {"status": "failed", "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                results[name] = {"status": "ok", **json.loads(line[len("RESULT "):])}
            print(name, json.dumps({k: results[name].get(k) for k in ("status", "makespan_s", "predicted_makespan_s",
                                                                       "makespan_error", "error")}), flush=True)
            if name == "d_shard_alternator_lrtf" and (out / "timeline.png").is_file():
                RESULTS.mkdir(parents=True, exist_ok=True)
                shutil.copy(out / "timeline.png", RESULTS / "sweep_timeline.png")
        seq = results.get("a_one_after_another_offload", {}).get("makespan_s")
        for r in results.values():
            if seq and r.get("makespan_s"):
                r["speedup_vs_one_after_another"] = seq / r["makespan_s"]
        path = write_json("sweep.json", {"steps": args.steps, "budget": args.budget, "runs": LRS,
                                         "command": "PYTHONPATH=src python benchmarks/sweep/bench.py",
                                         "variants": results})
        print(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
