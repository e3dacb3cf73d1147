"""`remat --measure`'s interleaving over 6 budgets at once: "optimal" against "periodic", one table.

gpt2-mini (batch 4, seq 128, fp32, 1 thread): both methods are planned at each of 6 budgets, from just
above periodic's least feasible one (13.0 MiB) to where few forwards are recomputed, as
``scaletrain remat --budget B --methods optimal periodic --measure`` plans them; then all 12 schedules (and
plain autograd) run in the same rounds (:func:`~scaletrain.techniques.remat.measure_run.time_interleaved`:
one warm-up round, the order rotated a place per round, a budget's two schedules side by side), so a
shared machine's load falls on every budget and method alike. Per budget: the ratio of medians
(optimal / periodic) and the median of the per-round paired ratios (both ran in the same round, seconds
apart: robust to load that changes between rounds); ``forwards`` counts every block forward a schedule
runs (8 without recompute), so equal counts mean the same recompute work.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/remat_sweep.py   # -> results/speed_remat_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
BUDGETS = ("14MiB", "16MiB", "20MiB", "26MiB", "34MiB", "44MiB")
"""Budgets where both methods are feasible (periodic needs >= 13.03 MiB on this workload)."""
METHODS = ("optimal", "periodic")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (after one warm-up round)")
    p.add_argument("--budgets", default=",".join(BUDGETS))
    p.add_argument("--out", default=str(RESULTS / "speed_remat_sweep.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.step import loss_for, make_batch
    from scaletrain.techniques import remat
    from scaletrain.techniques.remat.executor import run_schedule
    from scaletrain.techniques.remat.fromtrace import estimate_graph
    from scaletrain.techniques.remat.measure_run import measure_autograd, measure_schedule, same_grads, time_interleaved

    name, batch, seq = "gpt2-mini", 4, 128
    meta = to_chain(models.get(name, device="meta"))
    with FakeTensorMode():
        xf, yf = make_batch(meta, batch, seq)
    graph, _ = estimate_graph(meta, xf, target=yf, precision="fp32", name=name)
    torch.manual_seed(0)
    model = models.get(name)
    chain = to_chain(model)
    x, y = make_batch(chain, batch, seq)
    loss_fn = loss_for(model)
    ref = measure_autograd(model, chain, x, y, loss_fn, repeats=1)
    steps = {"autograd": lambda: loss_fn(chain(x), y).backward()}
    plans = {}
    for budget in args.budgets.split(","):
        for method in METHODS:
            s = remat.solve(graph, remat.parse_bytes(budget), method)
            m = measure_schedule(model, chain, s, x, y, loss_fn, repeats=1)  # peak and gradients; a warm-up
            plans[(budget, method)] = {"forwards": s.n_forwards, "ops": str(s), "predicted_time_s": s.predicted_time_s,
                                       "measured_peak_bytes": m["measured_peak_bytes"],
                                       "grads_match": same_grads(m["grads"], ref["grads"])}
            steps[f"{budget} {method}"] = (lambda s: lambda: run_schedule(chain, s, x, loss_fn, y))(s)
    load_before = os.getloadavg()
    spread = time_interleaved(model, steps, rounds=args.rounds)
    rows = []
    for budget in args.budgets.split(","):
        o, q = spread[f"{budget} optimal"], spread[f"{budget} periodic"]
        paired = [a / b for a, b in zip(o["rounds"], q["rounds"])]
        rows.append({"budget": budget, "optimal_median_s": o["median"], "periodic_median_s": q["median"],
                     "ratio_of_medians": o["median"] / q["median"], "paired_ratio_median": statistics.median(paired),
                     "paired_ratio_min_max": (min(paired), max(paired)), "optimal_min_s": o["min"],
                     "periodic_min_s": q["min"], "ratio_of_mins": o["min"] / q["min"],
                     "forwards": (plans[(budget, "optimal")]["forwards"], plans[(budget, "periodic")]["forwards"]),
                     "measured_peak_bytes": (plans[(budget, "optimal")]["measured_peak_bytes"],
                                             plans[(budget, "periodic")]["measured_peak_bytes"]),
                     "grads_match": all(plans[(budget, m)]["grads_match"] for m in METHODS)})
        r = rows[-1]
        print(f"{budget:>6s} optimal {o['median'] * 1e3:6.1f} ms  periodic {q['median'] * 1e3:6.1f} ms  "
              f"ratio {r['ratio_of_medians']:.3f} (paired {r['paired_ratio_median']:.3f}, mins "
              f"{r['ratio_of_mins']:.3f})  forwards {r['forwards'][0]}/{r['forwards'][1]}", flush=True)
    print(f"autograd {spread['autograd']['median'] * 1e3:.1f} ms; load average {load_before} -> {os.getloadavg()}")
    doc = {"benchmark": "remat_measure_sweep", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": f"OMP_NUM_THREADS=1 python benchmarks/speed/remat_sweep.py --rounds {args.rounds}",
           "torch": torch.__version__, "workload": {"model": name, "batch": batch, "seq": seq, "threads": 1},
           "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                       "note": "shared machine: compare the interleaved ratios"},
           "table": rows, "autograd": {k: v for k, v in spread["autograd"].items() if k != "rounds"},
           "schedules": {f"{b} {m}": v for (b, m), v in plans.items()},
           "rounds_s": {k: v["rounds"] for k, v in spread.items()}}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
