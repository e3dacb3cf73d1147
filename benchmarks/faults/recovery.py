"""Issue 16's Done-when for automatic recovery, at full size:

    scaletrain train --nproc-per-node 4 --max-restarts 3 parallel.pp=2 parallel.zero=1 \\
        train.checkpoint_every=10 ...

with one rank killed (SIGKILL) at two random steps, against the same command uninterrupted.
Reported: the final parameters' largest absolute difference (must be <= 1e-6: no sample lost or
repeated, bitwise-equal resume), every restart row (time lost per failure: detection + restart +
reload + recomputed steps, seconds), and both runs' wall time. Output:
``benchmarks/results/faults_recovery.json``.

    .venv/bin/python benchmarks/faults/recovery.py [--nproc 4] [--steps 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))

from scaletrain.train import checkpoint as ckpt  # noqa: E402


def train(out: Path, args: argparse.Namespace, faults: list[int] | None, rank: int) -> tuple[float, str]:
    """Run the job; (wall seconds, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    for k in ("SCALETRAIN_FAULT_AT_STEP", "SCALETRAIN_FAULT_RANK", "SCALETRAIN_FAULT_KIND"):
        env.pop(k, None)
    if faults:
        env.update(SCALETRAIN_FAULT_AT_STEP=",".join(map(str, faults)), SCALETRAIN_FAULT_RANK=str(rank),
                   SCALETRAIN_FAULT_KIND="kill")
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", str(args.nproc), "--max-restarts",
           "3", "--out", str(out), *args.overrides]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"run {out} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault steps and the faulty rank")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults_recovery.json"))
    args = ap.parse_args()
    args.overrides = ["parallel.pp=2", "parallel.zero=1", "train.checkpoint_every=10", f"train.steps={args.steps}",
                      "model.name=gpt2-tiny", "data.seq_len=64", "train.global_batch=8", "train.eval_every=0",
                      "train.eval_batches=1", "train.log_every=1", "optim.warmup_steps=5", "train.keep_checkpoints=2"]
    rng = random.Random(args.seed)
    faults = sorted(rng.sample(range(2, args.steps + 1), 2))
    rank = rng.randrange(args.nproc)
    with tempfile.TemporaryDirectory() as tmp:
        base_wall, _ = train(Path(tmp) / "base", args, None, rank)
        hit_wall, stderr = train(Path(tmp) / "hit", args, faults, rank)
        a = ckpt.load(ckpt.latest(Path(tmp) / "base" / "checkpoints"))
        b = ckpt.load(ckpt.latest(Path(tmp) / "hit" / "checkpoints"))
        diff = max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"])
        rows = [json.loads(line) for line in (Path(tmp) / "hit" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    result = {
        "command": "scaletrain train --nproc-per-node {} --max-restarts 3 {}".format(args.nproc,
                                                                                    " ".join(args.overrides)),
        "fault": {"kind": "SIGKILL", "rank": rank, "steps": faults},
        "max_abs_param_diff": diff, "equal_within_1e-6": diff <= 1e-6, "final_step": b["step"],
        "steps_logged_once": steps == list(range(1, args.steps + 1)),
        "restarts": [r for r in rows if r.get("event") == "restart"],
        "wall_s": {"uninterrupted": round(base_wall, 2), "with_faults": round(hit_wall, 2)},
        "launcher_lines": [line for line in stderr.splitlines() if "restart" in line or "died" in line],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m": os.getloadavg()[0]},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
