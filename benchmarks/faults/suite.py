"""Issue 16's fault-injection suite: layouts x faults, each against an uninterrupted run.

Layouts (2 processes each): ``dp`` (ZeRO-0, DDP), ``zero3``, ``pp`` (pp=2), ``tp`` (tp=2).
Faults (one rank and one step drawn from ``--seed``, printed):

- ``kill-step``: SIGKILL at the start of a step; ``kill-collective``: SIGKILL inside a step,
  between the forward/backward's collectives and the clip/optimizer step's;
- ``kill-save``: SIGKILL once part of the rank's checkpoint file is written (before the manifest
  and rename); ``kill-async-save``: the same in ``train.checkpoint_async``'s writer thread;
- ``stop``: SIGSTOP (a hang), caught by the peers' ``parallel.timeout_s`` (here 5 s);
- ``corrupt``: the job dies (SIGKILL, no restarts), its newest checkpoint is truncated, and
  ``--resume`` must skip it for the one before; ``delete``: the same with the newest deleted;
- ``disk-full``: the save fails with ENOSPC (emulated: ``SCALETRAIN_FAULT_KIND=enospc`` raises it
  in the checkpoint writer after part of the file is written — no size-limited file system can be
  mounted without root here); the job must stop in one line (a restart would hit the same full
  disk), with the earlier checkpoints intact; after space is freed ``--resume`` finishes.

Restartable faults run under ``--max-restarts 3``. Each row: the final parameters' largest
absolute difference from the uninterrupted run of that layout (equal: <= 1e-6), whether every step
is logged once, how many failures were detected, the time lost measured by the restart rows
(detection + restart + reload + recompute, s) and the extra wall time over the uninterrupted run
(s). Output: ``benchmarks/results/faults_suite.json`` and a Markdown table on stdout.

    .venv/bin/python benchmarks/faults/suite.py [--seed 0] [--layouts dp,zero3] [--faults stop,corrupt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))

import torch  # noqa: E402

from scaletrain.train import checkpoint as ckpt  # noqa: E402

STEPS, EVERY = 8, 2
COMMON = ["model.name=gpt2-tiny", "model.overrides.n_layer=2", "data.seq_len=32", "data.name=synthetic-text",
          "train.global_batch=4", f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}", "train.eval_every=0",
          "train.eval_batches=1", "train.log_every=1", "optim.warmup_steps=2", "train.keep_checkpoints=3"]
LAYOUTS = {"dp": ["parallel.zero=0"], "zero3": ["parallel.zero=3"], "pp": ["parallel.pp=2"], "tp": ["parallel.tp=2"]}
FAULTS = ("kill-step", "kill-collective", "kill-save", "kill-async-save", "stop", "corrupt", "delete", "disk-full")
ENV_KEYS = ("SCALETRAIN_FAULT_AT_STEP", "SCALETRAIN_FAULT_RANK", "SCALETRAIN_FAULT_KIND", "SCALETRAIN_FAULT_WHERE")


def run(out: Path, overrides: list[str], fault: dict[str, str], restarts: int, resume: bool = False
        ) -> tuple[int, float, str]:
    """One ``scaletrain train`` job on 2 processes: (exit code, wall seconds, stderr + stdout)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env.update(PYTHONPATH=str(SRC), **fault)
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           "--out", str(out), *(["--resume"] if resume else []), *overrides]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, time.perf_counter() - t, proc.stderr + proc.stdout


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final checkpoint's model parameters (either format)."""
    return ckpt.load(ckpt.latest(run_dir / "checkpoints"))["model"]


def damage(run_dir: Path, how: str) -> str:
    """Truncate (``corrupt``) or remove (``delete``) the newest checkpoint; its name."""
    newest = ckpt.latest(run_dir / "checkpoints")
    if how == "delete":
        ckpt.remove(newest)
    else:
        f = sorted(newest.glob("rank*"))[0] if newest.is_dir() else newest
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return newest.name


def scenario(tmp: Path, layout: str, fault: str, rng: random.Random) -> dict[str, Any]:
    """Run one fault on one layout; the row of the table (without the comparison)."""
    over = COMMON + LAYOUTS[layout]
    rank = rng.randrange(2)
    saves = list(range(EVERY, STEPS + 1, EVERY))
    out = tmp / f"{layout}-{fault}"
    env = {"SCALETRAIN_FAULT_RANK": str(rank), "SCALETRAIN_FAULT_KIND": "kill"}
    row: dict[str, Any] = {"layout": layout, "fault": fault, "rank": rank}
    if fault in ("kill-step", "kill-collective", "stop"):
        step = rng.randrange(2, STEPS + 1)
        env.update(SCALETRAIN_FAULT_AT_STEP=str(step), SCALETRAIN_FAULT_WHERE=fault.split("-")[-1].replace(
            "stop", "step"))
        if fault == "stop":
            env["SCALETRAIN_FAULT_KIND"] = "stop"
            over = over + ["parallel.timeout_s=5"]
        code, wall, err = run(out, over, env, 3)
    elif fault in ("kill-save", "kill-async-save"):
        step = rng.choice(saves if fault == "kill-save" else saves[:-1])  # the last save is never async
        env.update(SCALETRAIN_FAULT_AT_STEP=str(step), SCALETRAIN_FAULT_WHERE=fault[5:])
        if fault == "kill-async-save":
            over = over + ["train.checkpoint_async=true"]
        code, wall, err = run(out, over, env, 3)
    elif fault in ("corrupt", "delete"):
        step = rng.randrange(2 * EVERY + 1, STEPS + 1)  # two checkpoints exist before it
        env.update(SCALETRAIN_FAULT_AT_STEP=str(step), SCALETRAIN_FAULT_WHERE="step")
        code1, wall1, err1 = run(out, over, env, 0)
        row["damaged"] = damage(out, fault)
        code, wall, err = run(out, over, {}, 0, resume=True)
        row["first_exit"], wall, err = code1, wall1 + wall, err1 + err
        row["skipped_warning"] = "skipping damaged checkpoint" in err if fault == "corrupt" else None
    else:  # disk-full
        step = rng.choice(saves[1:])
        env.update(SCALETRAIN_FAULT_AT_STEP=str(step), SCALETRAIN_FAULT_WHERE="save", SCALETRAIN_FAULT_KIND="enospc")
        code1, wall1, err1 = run(out, over, env, 3)
        row["first_exit"] = code1
        row["error_line"] = next((ln for ln in err1.splitlines() if "not written" in ln), None)
        code, wall2, err = run(out, over, {}, 0, resume=True)  # space freed
        wall, err = wall1 + wall2, err1 + err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    restarts = [r for r in rows if r.get("event") == "restart"]
    failures = len(restarts) + (row.get("first_exit", 0) != 0)  # restarted ones + the one that ended a job
    row.update(step=step, exit=code, wall_s=round(wall, 2), failures=failures,
               traceback="Traceback" in err, steps_logged_once=[r["step"] for r in rows if "loss" in r] ==
               list(range(1, STEPS + 1)), restart_lost_s=round(sum(r["lost_s"] for r in restarts), 2),
               restarts=[{k: r[k] for k in ("detect_s", "restart_s", "reload_s", "recomputed_steps", "recompute_s")}
                         for r in restarts],
               stderr_tail=None if code == 0 else err[-1500:])
    return row


def matrix(layouts: list[str], faults: list[str], full: bool) -> list[tuple[str, str]]:
    """(layout, fault) pairs: all of them with ``full``, else a cover in which every fault runs on
    two layouts and every layout sees half the faults (rotating), so the suite fits ~10 min here."""
    if full:
        return [(lay, f) for lay in layouts for f in faults]
    n = len(layouts)
    return [(lay, f) for i, lay in enumerate(layouts) for j, f in enumerate(faults) if (j - i) % n in (0, n // 2)
            or n == 1]


def table(rows: list[dict[str, Any]]) -> str:
    """The README's Markdown table."""
    lines = ["| layout | fault | rank | step | failures seen | max abs param diff | equal | steps once | "
             "lost (restart rows) s | extra wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "-" if r.get("max_abs_param_diff") is None else f"{r['max_abs_param_diff']:.1e}"
        lines.append(f"| {r['layout']} | {r['fault']} | {r['rank']} | {r['step']} | {r['failures']} | {diff} | "
                     f"{'yes' if r.get('equal') else 'NO'} | {'yes' if r['steps_logged_once'] else 'NO'} | "
                     f"{r['restart_lost_s']} | {r.get('extra_wall_s', '-')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seed of the faulty ranks and steps")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--full", action="store_true", help="every fault on every layout (~30 min here)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults_suite.json"))
    args = ap.parse_args()
    print(f"seed {args.seed}", flush=True)
    rng, rows, base = random.Random(args.seed), [], {}
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for layout, fault in matrix(args.layouts.split(","), args.faults.split(","), args.full):
            if layout not in base:
                code, wall, err = run(Path(tmp) / f"{layout}-base", COMMON + LAYOUTS[layout], {}, 0)
                if code != 0:
                    raise SystemExit(f"uninterrupted {layout} run failed ({code}): {err[-1500:]}")
                base[layout] = {"wall_s": round(wall, 2), "params": params(Path(tmp) / f"{layout}-base")}
            row = scenario(Path(tmp), layout, fault, rng)
            if row["exit"] == 0:
                a, b = base[layout]["params"], params(Path(tmp) / f"{layout}-{fault}")
                row["max_abs_param_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
                row["equal"] = row["max_abs_param_diff"] <= 1e-6
                row["extra_wall_s"] = round(row["wall_s"] - base[layout]["wall_s"], 2)
            print(json.dumps({k: v for k, v in row.items() if k != "stderr_tail"}), flush=True)
            rows.append(row)
            shutil.rmtree(Path(tmp) / f"{layout}-{fault}", ignore_errors=True)
    result = {"seed": args.seed, "full_matrix": args.full, "steps": STEPS, "checkpoint_every": EVERY,
              "common_overrides": COMMON,
              "layouts": LAYOUTS, "uninterrupted_wall_s": {k: v["wall_s"] for k, v in base.items()}, "rows": rows,
              "all_equal": all(r.get("equal") for r in rows), "suite_wall_s": round(time.perf_counter() - t0, 1),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "load_avg_1m": [load0, os.getloadavg()[0]]},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
