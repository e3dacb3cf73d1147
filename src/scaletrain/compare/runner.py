"""Run a study: every cell as ``scaletrain train`` subprocesses, repeats interleaved, resumable.

The one place that launches cells: a scaletrain strategy runs ``scaletrain train --nproc-per-node N``; a peer
(framework ``pytorch`` / ``deepspeed``) runs :mod:`.peers` under ``torch.distributed.run`` with N processes
and the same keys, and writes the same metrics.jsonl rows, so both fill a cell the same way.

Order: repeat r runs every unfinished cell, the cell order rotated by r places, so that no cell
always runs first (on a cold machine) or last (after the others heated it) — drifts of a shared
machine spread over all cells instead of biasing some. results.json is rewritten after every run;
a rerun with the same directory skips the cells (and repeats) already done, and a run killed in
flight starts again from scratch (its directory is removed first).

A cell that cannot run is kept with the reason, never dropped: ``not installed`` (a peer's
package does not import), ``not applicable`` (one device is the one-process run; or the
compatibility table refuses the combination for this model: its one line), ``failed`` (the run's
one-line error), ``oom`` (out of memory, or killed by the kernel's OOM killer).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from scaletrain.compare import predict as predicting
from scaletrain.compare import results
from scaletrain.compare.environment import child_env
from scaletrain.compare.matrix import STRATEGIES, Cell
from scaletrain.errors import UserError, one_line

RUN_TIMEOUT_S = 600.0
"""Longest one run may take before it is stopped and marked failed [seconds]."""


def blocked(cell: Cell) -> tuple[str, str] | None:
    """(status, reason) when ``cell`` cannot run here, else None. Nothing is started."""
    strategy = STRATEGIES[cell.strategy]
    if strategy.requires and importlib.util.find_spec(strategy.requires) is None:
        return "not installed", (f"`import {strategy.requires}` fails here (a peer of the `bench` extra: "
                                 f"pip install -c constraints.txt -e .[bench])")
    if strategy.framework != "scaletrain" and strategy.keys:  # a model-parallel peer (torch-tp): where its twin runs
        return blocked(Cell(cell.model, strategy.like, cell.devices, cell.settings))
    if strategy.framework != "scaletrain":  # a peer: its own one-process run too (the framework's overhead)
        if cell.devices > cell.settings.global_batch or cell.settings.global_batch % cell.devices:
            return "not applicable", (f"the peers take one micro-batch per device: global batch "
                                      f"{cell.settings.global_batch} does not split over {cell.devices} devices")
        return None
    if cell.strategy == "auto":
        from scaletrain.planner.shape import Shape

        try:
            Shape.of(cell.settings.name)
        except UserError as e:
            return "not applicable", f"plan=auto: {one_line(e)}"
    elif cell.devices < strategy.min_devices:
        return "not applicable", (f"{cell.strategy} needs >= {strategy.min_devices} devices (below, it is one of "
                                  f"the plain strategies' cells)")
    elif cell.devices == 1 and cell.strategy != "ddp":
        return "not applicable", f"on 1 device {cell.strategy} is the one-process run (the ddp cell at 1 device)"
    from scaletrain import models
    from scaletrain.techniques import compat
    from scaletrain.train.config import load_config

    try:
        cfg = load_config(None, cell.train_overrides())
        model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
        compat.check_config(cfg, model, world=cell.devices, microbatches=cfg.parallel.microbatches)
    except UserError as e:
        return "not applicable", one_line(e)
    return None


def _error_line(stderr: str, stdout: str) -> str:
    """The run's one-line error: the launcher's ``scaletrain: error:`` line, else the last line it wrote."""
    lines = [ln.strip() for ln in (stderr + "\n" + stdout).splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("scaletrain: error:")]
    if said:
        return said[-1][len("scaletrain: error:"):].strip()
    return lines[-1][:300] if lines else "no output"


def run_once(cell: Cell, repeat: int, directory: Path, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One repeat of ``cell``: its run directory, wall seconds and figures, or ``status``/``error``."""
    out = directory / "runs" / cell.key.replace("/", "_") / f"r{repeat}"
    if out.exists():  # a run killed in flight: start it again
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = child_env()
    if cell.framework == "scaletrain":
        cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", str(cell.devices), "--out",
               str(out), "--json", *cell.train_overrides()]
    else:  # a peer: its framework's own loop (scaletrain.compare.peers), one process per device under torchrun
        env.setdefault("OMP_NUM_THREADS", "1")  # as scaletrain's launcher sets it (torchrun does only for N > 1)
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (it would look for CUDA)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cell.devices}",
               "-m", "scaletrain.compare.peers", cell.strategy, str(out), *cell.train_overrides()]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"repeat": repeat, "status": "failed", "error": f"timed out after {timeout_s:.0f} s"}
    run: dict[str, Any] = {"repeat": repeat, "dir": str(out.relative_to(directory)), "wall_s": time.perf_counter() - t0}
    out.mkdir(exist_ok=True)
    (out / "output.txt").write_text(p.stdout + p.stderr)  # the run's own words, for a failure's diagnosis
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the final checkpoint: not part of the study
    if p.returncode != 0:
        msg = _error_line(p.stderr, p.stdout)
        oom = "out of memory" in msg.lower() or p.returncode in (-9, 137) or "SIGKILL" in msg
        return {**run, "status": "oom" if oom else "failed", "error": msg}
    s = cell.settings
    run.update(results.read_run(out / "metrics.jsonl", s.steps, cell.profile_step, s.metric))
    summary = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if summary and "plan" in (said := json.loads(summary[-1])):
        run["plan"] = said["plan"]  # plan=auto: the plan it chose
    run["status"] = "ok"
    return run


def _rotated(cells: list[Cell], r: int) -> list[Cell]:
    k = r % len(cells) if cells else 0
    return cells[k:] + cells[:k]


def run_study(cells: list[Cell], directory: Path, repeats: int, log: Callable[[str], None] = print,
              timeout_s: float = RUN_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run (or continue) the study of ``cells`` in ``directory``; returns the cells' records."""
    directory.mkdir(parents=True, exist_ok=True)
    done = {c["key"]: c for c in results.load(directory / "results.json")}
    records = [done.get(c.key) or results.new_cell(c) for c in cells]
    by_key = {r["key"]: r for r in records}
    platforms: dict[int, Any] = {}
    gpt2 = next((c.model for c in cells if c.model.startswith("gpt2")), None)
    for c in cells:
        rec = by_key[c.key]
        if rec["status"] != "pending":
            continue
        why = blocked(c)
        if why:
            rec["status"], rec["error"] = why
        elif "predicted_peak_bytes" not in rec and c.strategy != "auto":  # auto: the run's own prediction
            if c.devices not in platforms and gpt2:
                log(f"calibrating this machine for {c.devices} process(es) (planner.local.measure)")
                platforms[c.devices] = predicting.calibrate(c.devices, gpt2, directory)
            rec.update(predicting.predict(c, platforms.get(c.devices)))
    results.save(records, directory)
    todo = sum(max(repeats - len(r["runs"]), 0) for r in records if r["status"] == "pending")
    n = 0
    for r in range(repeats):
        for c in _rotated(cells, r):
            rec = by_key[c.key]
            if rec["status"] != "pending" or len(rec["runs"]) != r:
                continue
            n += 1
            run = run_once(c, r, directory, timeout_s)
            if run["status"] != "ok":
                rec["status"], rec["error"] = run["status"], run["error"]
            rec["runs"].append(run)
            results.aggregate(rec)
            results.save(records, directory)
            log(_progress(n, todo, c, run, rec))
    for rec in records:
        if rec["status"] == "pending" and len(rec["runs"]) >= repeats:
            rec["status"] = "ok"
    results.save(records, directory)
    return records


def _progress(n: int, todo: int, cell: Cell, run: dict[str, Any], rec: dict[str, Any]) -> str:
    """One line per run: what ran, its median step and peak next to their predictions."""
    head = f"[{n}/{todo}] {cell.key} repeat {run['repeat'] + 1}"
    if run["status"] != "ok":
        return f"{head}: {run['status']}: {run['error']}"
    pt, pp = rec.get("predicted_step_time_s"), rec.get("predicted_peak_bytes")
    step = f"{run['step_time_s'] * 1e3:.0f} ms/step" if run.get("step_time_s") else "no timed step"
    step += f" (predicted {pt * 1e3:.0f})" if pt else ""
    peak = f", peak {run['peak_bytes'] / 2**20:.1f} MiB" if run.get("peak_bytes") else ""
    peak += f" (predicted {pp / 2**20:.1f})" if pp and peak else ""
    return f"{head}: {step}{peak}, {run['wall_s']:.0f} s"
