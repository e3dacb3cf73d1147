"""Zero-order SGD (MeZO) and Adam against AdamW on the shipped text at equal wall time, and their peak memory.

``gpt2-tiny`` trains on Shakespeare (8 x 64-byte sequences per step, constant lr, no warm-up) with
``optim.name=zo-sgd`` (two forwards per step, no backward: scaletrain.techniques.optim.zero_order),
with ``zo-adam`` (Adam's moments over the same estimate) and with AdamW; the training loss of every
step is set against the cumulated step seconds, and the curves are cut at the same wall time (the
shortest run's). The last step of each run is measured by
the memory tracker (``train.measure_memory``). Writes ``benchmarks/results/optim_zero_order.json``
and ``.png``. Timings are wall time on a shared machine: compare curves, not single seconds.

    .venv/bin/python benchmarks/optim/zero_order.py --seconds 45
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
BASE = ["data.seq_len=64", "train.global_batch=8", "train.eval_every=0", "train.progress=off", "train.log_every=1",
        "optim.warmup_steps=0", "optim.schedule=constant", "optim.weight_decay=0", "train.measure_memory=true"]
RUNS = {"adamw": ["optim.name=adamw", "optim.lr=2e-3"], "zo-sgd": ["optim.name=zo-sgd", "optim.lr=1e-4"],
        "zo-adam": ["optim.name=zo-adam", "optim.lr=1e-3"]}


def run(extra: list[str], seconds: float) -> dict:
    """Train until about ``seconds`` of steps: the step count is sized from a 5-step probe."""
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    def fit(steps: int) -> tuple[list[dict], Trainer]:
        with tempfile.TemporaryDirectory() as d:
            t = Trainer(load_config(None, BASE + extra + [f"train.steps={steps}"]), Path(d), log=lambda s: None)
            t.fit()
            t.close()
            return [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()], t

    t0 = time.perf_counter()
    probe, _ = fit(5)
    per_step = sorted(r["step_time_s"] for r in probe if "loss" in r)[2]
    rows, t = fit(max(5, int(seconds / per_step)))
    elapsed, curve = 0.0, []
    for r in rows:
        if "loss" in r:
            elapsed += r["step_time_s"]
            curve.append({"step": r["step"], "loss": r["loss"], "seconds": elapsed})
    return {"overrides": extra, "curve": curve, "peak_bytes": t.tracked["tracked_peak_bytes"],
            "peak_breakdown": t.tracked["tracked_peak_breakdown"], "wall_s": time.perf_counter() - t0}


def _at(curve: list[dict], seconds: float) -> float:
    """Mean training loss of the last 10 steps done by ``seconds``."""
    done = [c["loss"] for c in curve if c["seconds"] <= seconds][-10:]
    return sum(done) / len(done)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="training seconds per optimizer")
    ap.add_argument("--out", type=Path, default=RESULTS / "optim_zero_order.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    runs = {name: run(extra, args.seconds) for name, extra in RUNS.items()}
    equal = min(r["curve"][-1]["seconds"] for r in runs.values())
    summary = {name: {"steps": len(r["curve"]), "seconds_per_step": r["curve"][-1]["seconds"] / len(r["curve"]),
                      "first_loss": r["curve"][0]["loss"], "loss_at_equal_wall_time": _at(r["curve"], equal),
                      "peak_bytes": r["peak_bytes"]} for name, r in runs.items()}
    for name, s in summary.items():
        print(name, {k: round(v, 4) for k, v in s.items()}, flush=True)
    out = {"benchmark": "optim_zero_order", "date": datetime.now(timezone.utc).isoformat(),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
           "torch": torch.__version__, "setup": {"model": "gpt2-tiny", "data": "shakespeare", "seq": 64, "batch": 8,
                                                  "seconds": args.seconds, "equal_wall_time_s": equal},
           "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    _plot(runs, summary, equal, args.out.with_suffix(".png"))
    return 0


def _plot(runs: dict, summary: dict, equal: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        ax.plot([c["seconds"] for c in r["curve"]], [c["loss"] for c in r["curve"]],
                label=f"{name} (peak {summary[name]['peak_bytes'] / 2**20:.1f} MiB)")
    ax.axvline(equal, color="grey", ls=":", lw=1)
    ax.set_xlabel("training seconds (wall, shared CPU)")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("gpt2-tiny on Shakespeare: zero-order SGD / Adam vs AdamW")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
