"""Issue 17's "Done when", measured: four gpt2-mini runs that do not fit the device budget, swept
on 2 devices, each identical to its solo run, faster than one after another, makespan predicted.

1. ``scaletrain sweep --nproc-per-node 2 --grid optim.lr=1e-3,3e-3,1e-2,3e-2 memory.device_budget=64MiB
   model.name=gpt2-mini train.steps=N`` (policy auto), timed by the sweep itself;
2. the same four runs one after another, each ``scaletrain train`` with the offload planner under the
   same budget (the way to fit one model without a sweep), one process using both cores;
3. the same four runs solo without a budget, one thread (the devices' thread count): losses, validation
   and final parameters compared bit for bit with the sweep's (and the offloaded runs').

Writes ``benchmarks/results/sweep_done_when.json``.

    PYTHONPATH=src python benchmarks/sweep/done_when.py [--steps 20 --repeats 2]    # ~8 minutes here
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


def solo(steps: int, lr: str, extra: list[str], threads: int,
         out: Path | None) -> tuple[list[float], float, dict, float]:
    torch.set_num_threads(threads)
    tr = Trainer(load_config(None, common(steps) + [f"optim.lr={lr}", *extra]), out, log=lambda s: None)
    t0 = time.monotonic()
    try:
        res = tr.fit()
        return res.losses, res.val_loss, {k: v.clone() for k, v in tr.model.state_dict().items()}, time.monotonic() - t0
    finally:
        tr.close()


def sweep_once(steps: int, out: Path) -> tuple[dict, list[str]]:
    cmd = [sys.executable, "-m", "scaletrain.cli", "sweep", "--json", "--nproc-per-node", "2", "--out", str(out),
           "--grid", "optim.lr=" + ",".join(LRS), f"memory.device_budget={BUDGET}", *common(steps)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr)
    return json.loads(p.stdout), cmd


def one_after_another(steps: int) -> tuple[float, dict[str, list[float]]]:
    """The four runs back to back, each with the offload planner under the budget, both cores."""
    total, losses = 0.0, {}
    for lr in LRS:
        losses[lr], _, _, dt = solo(steps, lr, [f"memory.device_budget={BUDGET}", "memory.offload.plan=auto"], 2, None)
        total += dt
    return total, losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2, help="sweep / one-after-another pairs, interleaved")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sweep-done-"))
    sweeps, seqs = [], []
    for r in range(args.repeats):  # interleaved, so both see the same machine
        s, cmd = sweep_once(args.steps, tmp / f"sw{r}")
        sweeps.append(s)
        t, offloaded = one_after_another(args.steps)
        seqs.append(t)
        print(f"repeat {r}: sweep {s['makespan_s']:.1f} s measured, {s['predicted_makespan_s']:.1f} s predicted "
              f"({s['makespan_error']:+.1%}, policy {s['policy']}); one after another with offload {t:.1f} s",
              flush=True)
    s = sweeps[0]
    equal = {}
    for lr, run in zip(LRS, s["runs"]):
        losses, val, params, _ = solo(args.steps, lr, [], 1, None)
        state = ckpt.load(ckpt.latest(Path(run["out_dir"]) / "checkpoints"))
        equal[lr] = {"losses": run["losses"] == losses, "val_loss": run["val_loss"] == val,
                     "params": all(torch.equal(state["model"][k], v) for k, v in params.items()),
                     # another thread count (2) sums in another order: close, not bitwise
                     "offloaded_run_max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(offloaded[lr], losses))}
        print(lr, equal[lr], flush=True)
    keys = ("makespan_s", "predicted_makespan_s", "makespan_error", "policy", "predicted_makespan_by_policy",
            "utilisation", "predicted_utilisation", "device_peak_bytes", "budget_bytes", "predicted_shard_peak_bytes",
            "bytes_moved", "predicted_bytes_moved", "shards", "threads_per_device")
    rec = {"command": " ".join(["scaletrain", *cmd[3:]]), "steps": args.steps, "budget": BUDGET,
           "model_state_bytes_adamw": 16 * 4_935_680,
           "sweeps": [{k: x[k] for k in keys} for x in sweeps], "one_after_another_offload_s": seqs,
           "speedup_per_repeat": [b / a["makespan_s"] for a, b in zip(sweeps, seqs)],
           "max_abs_makespan_error": max(abs(x["makespan_error"]) for x in sweeps), "equal_to_solo": equal}
    print(f"speedup over one after another: {', '.join(f'{x:.2f}x' for x in rec['speedup_per_repeat'])}; "
          "makespan errors " + ", ".join(f"{x['makespan_error']:+.1%}" for x in sweeps))
    print(write_json("sweep_done_when.json", rec))


if __name__ == "__main__":
    main()
