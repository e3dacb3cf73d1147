"""results.json / results.csv of a study, and the figures of one run read from its metrics.jsonl.

results.json is a list of cells (dicts), rewritten atomically after every run, so a killed study
loses at most the run in flight. A cell's fields: ``key``, ``model``, ``strategy``, ``framework``,
``devices``, ``status`` (``ok`` / ``failed`` / ``oom`` / ``not applicable`` / ``not installed``),
``error`` (the one-line error or reason), ``runs`` (one entry per repeat), and aggregated over the
runs: ``step_time_s`` (median of the repeats' medians), ``step_time_spread_s`` ([25th, 75th]
percentile of every timed step of every repeat), ``seconds_per_1000_samples``, ``peak_bytes`` (the
heaviest rank's tracked peak), ``peak_breakdown`` (model states, activations, other; bytes),
``time_breakdown_s`` (median per phase), ``val`` ([step, seconds, value] triples), the prediction
(``predicted_step_time_s``, ``predicted_peak_bytes``) and the settings. Units: seconds, bytes.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path
from typing import Any

from scaletrain.compare.matrix import WARMUP_STEPS, Cell

FINISHED = ("failed", "oom", "not applicable", "not installed")
"""Statuses that end a cell whatever its repeats (a rerun does not try them again)."""
CSV_FIELDS = ("model", "strategy", "framework", "devices", "status", "step_time_s", "step_time_p25_s",
              "step_time_p75_s", "predicted_step_time_s", "seconds_per_1000_samples", "peak_bytes",
              "predicted_peak_bytes", "model_state_bytes", "activation_bytes", "other_bytes", "final_val",
              "metric", "repeats", "error")


def load(path: Path) -> list[dict[str, Any]]:
    """The cells of ``path`` (empty when it does not exist yet)."""
    return json.loads(path.read_text()) if path.is_file() else []


def save(cells: list[dict[str, Any]], directory: Path) -> None:
    """Write results.json (atomically) and results.csv into ``directory``."""
    tmp = directory / "results.json.tmp"
    tmp.write_text(json.dumps(cells, indent=1))
    os.replace(tmp, directory / "results.json")
    with open(directory / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for c in cells:
            w.writerow(csv_row(c))


def csv_row(c: dict[str, Any]) -> dict[str, Any]:
    """One results.csv row of cell ``c``."""
    spread = c.get("step_time_spread_s") or [None, None]
    br = c.get("peak_breakdown") or {}
    val = c.get("val") or []
    return {"model": c["model"], "strategy": c["strategy"], "framework": c["framework"], "devices": c["devices"],
            "status": c["status"], "step_time_s": c.get("step_time_s"), "step_time_p25_s": spread[0],
            "step_time_p75_s": spread[1], "predicted_step_time_s": c.get("predicted_step_time_s"),
            "seconds_per_1000_samples": c.get("seconds_per_1000_samples"), "peak_bytes": c.get("peak_bytes"),
            "predicted_peak_bytes": c.get("predicted_peak_bytes"), "model_state_bytes": br.get("model_states"),
            "activation_bytes": br.get("activations"), "other_bytes": br.get("other"),
            "final_val": val[-1][2] if val else None, "metric": c.get("metric"), "repeats": len(c.get("runs", [])),
            "error": c.get("error", "")}


def new_cell(cell: Cell) -> dict[str, Any]:
    """An empty record of ``cell`` with its settings."""
    s = cell.settings
    return {"key": cell.key, "model": cell.model, "strategy": cell.strategy, "framework": cell.framework,
            "devices": cell.devices, "status": "pending", "error": "", "runs": [], "metric": s.metric,
            "global_batch": s.global_batch, "seq_len": s.seq_len, "steps": s.steps,
            "step_time_s": None, "peak_bytes": None, "val": []}


def read_run(metrics_path: Path, steps: int, profile_step: int, metric: str) -> dict[str, Any]:
    """One run's figures from its metrics.jsonl (one row per step, validation rows, the tracked last step).

    Timed steps: after the first :data:`WARMUP_STEPS`, without the profiled step and the memory-
    tracked last step (both slowed by their instruments). The seconds of a validation point are the
    training seconds up to that step (evaluation excluded), the two instrumented steps counted at
    the run's median step time.
    """
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in rows if "step_time_s" in r}
    instrumented = {profile_step, steps}
    timed = [train[s]["step_time_s"] for s in sorted(train) if s > WARMUP_STEPS and s not in instrumented]
    median = statistics.median(timed) if timed else None
    out: dict[str, Any] = {"step_times_s": timed, "step_time_s": median}
    elapsed, clock = 0.0, {}
    for s in sorted(train):
        dt = train[s]["step_time_s"]
        elapsed += median if (s in instrumented and median is not None) else dt
        clock[s] = elapsed
    out["val"] = [[r["step"], clock.get(r["step"]), r[metric]] for r in rows if metric in r]
    tracked = [r for r in rows if "tracked_peak_bytes_max" in r]
    if tracked:
        t = tracked[-1]
        b = t.get("tracked_peak_breakdown", {})
        out["peak_bytes"] = int(t["tracked_peak_bytes_max"])
        out["peak_rank"] = t.get("tracked_peak_rank")
        out["peak_bytes_ranks"] = t.get("tracked_peak_bytes_ranks")
        out["peak_breakdown"] = {"model_states": b.get("parameters", 0) + b.get("gradients", 0)
                                 + b.get("optimizer_states", 0),
                                 "activations": b.get("activations", 0),
                                 "other": b.get("temporaries", 0) + b.get("other", 0)}
    phases = [r["time_breakdown_s"] for r in rows if "time_breakdown_s" in r]
    if phases:
        out["time_breakdown_s"] = phases[-1]
    predicted = [r for r in rows if "predicted_step_time_s" in r]  # plan=auto predicts in its own rows
    if predicted:
        out["predicted_step_time_s"] = predicted[-1]["predicted_step_time_s"]
        out["predicted_peak_bytes"] = predicted[-1].get("predicted_peak_bytes")
    comm = [r["comm_bytes"] for r in rows if "comm_bytes" in r]
    if comm:
        out["comm_bytes"] = comm[-1]
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def aggregate(c: dict[str, Any]) -> dict[str, Any]:
    """Fill ``c``'s aggregated fields from its runs (module docstring); returns ``c``."""
    runs = [r for r in c["runs"] if r.get("step_time_s") is not None]
    if not runs:
        return c
    c["step_time_s"] = statistics.median(r["step_time_s"] for r in runs)
    pooled = [t for r in runs for t in r["step_times_s"]]
    c["step_time_spread_s"] = [_quantile(pooled, 0.25), _quantile(pooled, 0.75)]
    c["repeat_step_times_s"] = [r["step_time_s"] for r in runs]
    c["seconds_per_1000_samples"] = c["step_time_s"] * 1000 / c["global_batch"]
    first = runs[0]  # bytes and validation values are the same in every repeat (deterministic on CPU)
    for k in ("peak_bytes", "peak_breakdown", "peak_rank", "peak_bytes_ranks", "comm_bytes", "plan"):
        if k in first:
            c[k] = first[k]
    for k in ("predicted_step_time_s", "predicted_peak_bytes"):
        if first.get(k) is not None:
            c[k] = first[k]
    c["val"] = min(runs, key=lambda r: abs(r["step_time_s"] - c["step_time_s"]))["val"]
    phases = [r["time_breakdown_s"] for r in runs if r.get("time_breakdown_s")]
    if phases:
        c["time_breakdown_s"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    return c
