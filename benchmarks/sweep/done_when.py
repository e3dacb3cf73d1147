"""Issue 17's "Done when", measured: four gpt2-mini runs that do not fit the device budget, swept
on 2 devices, each identical to its solo run, faster than one after another, makespan predicted.

1. ``scaletrain sweep --nproc-per-node 2 --grid optim.lr=1e-3,3e-3,1e-2,3e-2 memory.device_budget=64MiB
   model.name=gpt2-mini train.steps=N`` (policy auto), timed by the sweep itself;
2. the same four runs one after another, each ``scaletrain train`` with the offload planner under the
   same budget (the way to fit one model without a sweep), one process using both cores;
3. the same four runs solo without a budget, one thread (the devices' thread count): losses, validation
   and final parameters compared bit for bit with the sweep's (and the offloaded runs').

Writes ``benchmarks/results/sweep_done_when.json``.

    PYTHONPATH=src python benchmarks/sweep/done_when.py [--steps 20]    # ~6 minutes here
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "pipeline"))
from common import write_json  # noqa: E402

from scaletrain.train import checkpoint as ckpt  # noqa: E402
from scaletrain.train.config import load_config  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402

LRS = ["1e-3", "3e-3", "1e-2", "3e-2"]
BUDGET = "64MiB"


def common(steps: int) -> list[str]:
    return ["model.name=gpt2-mini", f"train.steps={steps}", "train.eval_batches=2", "train.log_every=1",
            "train.progress=off"]


def solo(steps: int, lr: str, extra: list[str], threads: int, out: Path | None) -> tuple[list[float], float, dict, float]:
    torch.set_num_threads(threads)
    tr = Trainer(load_config(None, common(steps) + [f"optim.lr={lr}", *extra]), out, log=lambda s: None)
    t0 = time.monotonic()
    try:
        res = tr.fit()
        return res.losses, res.val_loss, {k: v.clone() for k, v in tr.model.state_dict().items()}, time.monotonic() - t0
    finally:
        tr.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sweep-done-"))
    cmd = [sys.executable, "-m", "scaletrain.cli", "sweep", "--json", "--nproc-per-node", "2", "--out", str(tmp / "sw"),
           "--grid", "optim.lr=" + ",".join(LRS), f"memory.device_budget={BUDGET}", *common(args.steps)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr)
    s = json.loads(p.stdout)
    print(f"sweep: {s['makespan_s']:.1f} s measured, {s['predicted_makespan_s']:.1f} s predicted "
          f"({s['makespan_error']:+.1%}), policy {s['policy']}", flush=True)
    offload_s, equal = 0.0, {}
    for lr, run in zip(LRS, s["runs"]):
        o_losses, o_val, o_params, dt = solo(args.steps, lr, [f"memory.device_budget={BUDGET}",
                                                               "memory.offload.plan=auto"], 2, None)
        offload_s += dt
        losses, val, params, _ = solo(args.steps, lr, [], 1, None)
        state = ckpt.load(ckpt.latest(Path(run["out_dir"]) / "checkpoints"))
        equal[lr] = {"losses": run["losses"] == losses, "val_loss": run["val_loss"] == val,
                     "params": all(torch.equal(state["model"][k], v) for k, v in params.items()),
                     # another thread count (2) sums in another order: close, not bitwise
                     "offloaded_run_max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(o_losses, losses))}
        print(lr, equal[lr], flush=True)
    rec = {"command": " ".join(["scaletrain", *cmd[3:]]), "steps": args.steps, "budget": BUDGET,
           "model_state_bytes_adamw": 16 * 4_935_680,
           "sweep": {k: s[k] for k in ("makespan_s", "predicted_makespan_s", "makespan_error", "policy",
                                       "predicted_makespan_by_policy", "utilisation", "predicted_utilisation",
                                       "device_peak_bytes", "budget_bytes", "predicted_shard_peak_bytes",
                                       "bytes_moved", "predicted_bytes_moved", "shards", "threads_per_device")},
           "one_after_another_offload_s": offload_s, "speedup": offload_s / s["makespan_s"], "equal_to_solo": equal}
    print(f"one after another with offload: {offload_s:.1f} s; sweep speedup {rec['speedup']:.2f}x")
    print(write_json("sweep_done_when.json", rec))


if __name__ == "__main__":
    main()
