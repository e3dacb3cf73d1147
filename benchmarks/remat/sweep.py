"""Rematerialization budget sweep on CPU: measured peak and step time versus the budget.

For a heterogeneous GPT-2 (8192-token vocabulary: a head and embedding much larger than a
layer), ``resnet-mini`` and the homogeneous ``mlp``, budgets go from the least feasible one
(``optimal``'s) to the no-remat peak. For each budget and each of ``optimal``, ``periodic``
and ``revolve`` it plans on the estimated Profile, then runs one step for real and records
the measured activation peak (storage tracker), the median step time, and whether gradients
equal plain autograd's bitwise. ``torch.utils.checkpoint`` on every block (budget-free) and
plain autograd are measured once per model as references.

Output: benchmarks/results/remat_sweep.json and remat_sweep.png (step-time overhead over
autograd, measured in the same round-robin as the methods, versus measured peak; one panel per
model), plus DP solve times for 25..200 blocks. Times come from a shared 2-core machine: read
the overheads, not the absolute times.

    .venv/bin/python benchmarks/remat/sweep.py               # ~5-10 min on 2 busy cores
    .venv/bin/python benchmarks/remat/sweep.py --quick       # 4 budgets, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
METHODS = ("optimal", "periodic", "revolve")


def _models(quick: bool):
    from scaletrain import models

    return [
        ("gpt2-hetero", lambda: models.get("gpt2-mini", vocab_size=8192, n_layer=8), dict(batch=2, seq=128)),
        ("resnet-mini", lambda: models.get("resnet-mini"), dict(batch=16, seq=None)),
        ("mlp", lambda: models.get("mlp", widths=(192,) + (512,) * 12 + (10,)), dict(batch=64, seq=None)),
    ]


def sweep_model(name: str, build, shape: dict, budgets_n: int, repeats: int) -> dict:
    from scaletrain.chain import to_chain
    from scaletrain.measure.step import loss_for, make_batch
    from scaletrain.techniques import remat
    from scaletrain.techniques.remat.fromtrace import estimate_graph
    from scaletrain.techniques.remat.measure_run import (measure_autograd, measure_schedule,
                                                         measure_torch_checkpoint, same_grads)

    torch.manual_seed(0)
    model = build()
    chain = to_chain(model)
    x, y = make_batch(chain, shape["batch"], shape["seq"])
    loss_fn = loss_for(model)
    graph, _ = estimate_graph(chain, x, target=y, loss_fn=loss_fn)
    lo, hi = remat.min_budget(graph, "optimal"), remat.min_budget(graph, "none")
    ref = measure_autograd(model, chain, x, y, loss_fn, repeats=repeats)
    ckpt = measure_torch_checkpoint(model, chain, x, y, loss_fn, repeats=repeats)
    out = {"model": name, "blocks": len(graph), "batch": shape["batch"], "seq": shape["seq"],
           "min_feasible_bytes": {m: remat.min_budget(graph, m) for m in ("optimal", "periodic", "revolve", "none")},
           "autograd": {k: ref[k] for k in ("measured_peak_bytes", "step_time_s", "step_time_spread_s")},
           "torch_checkpoint_every_block": {k: ckpt[k] for k in ("measured_peak_bytes", "step_time_s",
                                                                   "step_time_spread_s")}
           | {"grads_match": same_grads(ckpt["grads"], ref["grads"])},
           "block_out_bytes": [n.out_bytes for n in graph.nodes],
           "block_saved_bytes": [n.saved_bytes for n in graph.nodes], "points": []}
    budgets = sorted({lo + (hi - lo) * k // (budgets_n - 1) for k in range(budgets_n)})
    for b in budgets:
        rows, steps = [], {"autograd": lambda: loss_fn(chain(x), y).backward()}
        for method in METHODS:
            row = {"method": method, "budget_bytes": b}
            rows.append(row)
            try:
                s = remat.solve(graph, b, method)
            except Exception as e:  # noqa: BLE001 - infeasible for this method: recorded
                row["error"] = str(e)
                continue
            m = measure_schedule(model, chain, s, x, y, loss_fn, repeats=1)
            row.update(predicted_peak_bytes=s.predicted_peak_bytes, predicted_time_s=s.predicted_time_s,
                       predicted_overhead=s.predicted_time_s / remat.baseline_time(graph), forwards=s.n_forwards,
                       measured_peak_bytes=m["measured_peak_bytes"],
                       grads_match=same_grads(m["grads"], ref["grads"]), ops=str(s))
            steps[method] = lambda s=s: remat.run_schedule(chain, s, x, loss_fn, y)
        times = interleaved_times(model, steps, repeats)
        for row in rows:
            if "error" in row:
                continue
            t = times[row["method"]]
            row.update(step_time_s=statistics.median(t), step_time_min_s=min(t),
                       autograd_time_s=statistics.median(times["autograd"]),
                       measured_overhead=statistics.median(t) / statistics.median(times["autograd"]))
            print(f"{name:12s} {row['method']:9s} budget {b / 2**20:8.2f} MiB  "
                  f"pred {row['predicted_peak_bytes'] / 2**20:8.2f}"
                  f"  meas {row['measured_peak_bytes'] / 2**20:8.2f} MiB  time x{row['measured_overhead']:.3f}"
                  f" (pred x{row['predicted_overhead']:.3f})  fwds {row['forwards']:3d}"
                  f"  grads {'=' if row['grads_match'] else 'DIFF'}", flush=True)
        out["points"] += rows
    return out


def interleaved_times(model, steps: dict, repeats: int) -> dict[str, list[float]]:
    """Time each step ``repeats`` times, round-robin, so load drift on a shared machine hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, f in steps.items():
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def dp_times(sizes=(25, 50, 100, 200), slots: int = 500) -> list[dict]:
    """Wall time of the optimal DP on random heterogeneous chains (500 memory slots)."""
    from scaletrain.techniques.remat import optimal
    from scaletrain.techniques.remat.periodic import none_ops
    from scaletrain.techniques.remat.schedule import Graph, Node
    from scaletrain.techniques.remat.simulate import simulate

    rows = []
    for n in sizes:
        rnd = random.Random(n)
        g = Graph.chain([Node(f"b{i}", rnd.uniform(1e-3, 5e-3), rnd.uniform(2e-3, 1e-2), rnd.randint(1, 8) << 20,
                              rnd.randint(0, 16) << 20, rnd.randint(0, 4) << 20, rnd.randint(0, 4) << 20)
                         for i in range(n)], 1 << 20)
        lo, hi = optimal.min_budget_optimal(g), simulate(g, none_ops(n)).peak_bytes
        t0 = time.perf_counter()
        s = optimal.solve_optimal(g, (2 * lo + hi) // 3, slots=slots)
        rows.append({"blocks": n, "slots": slots, "solve_s": time.perf_counter() - t0,
                     "predicted_time_s": s.predicted_time_s})
        print(f"DP {n:4d} blocks, {slots} slots: {rows[-1]['solve_s']:.2f} s", flush=True)
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4))
    for ax, r in zip(axes, results):
        base = r["autograd"]["step_time_s"]
        for method, mark in zip(METHODS, "os^"):
            pts = [p for p in r["points"] if p["method"] == method and "measured_peak_bytes" in p]
            pts.sort(key=lambda p: p["measured_peak_bytes"])
            ax.plot([p["measured_peak_bytes"] / 2**20 for p in pts], [p["measured_overhead"] for p in pts],
                    marker=mark, label=method)
        c = r["torch_checkpoint_every_block"]
        ax.plot([c["measured_peak_bytes"] / 2**20], [c["step_time_s"] / base], "kx", ms=10,
                label="torch.utils.checkpoint / block")
        ax.plot([r["autograd"]["measured_peak_bytes"] / 2**20], [1.0], "k*", ms=10, label="autograd")
        ax.set_title(f"{r['model']} ({r['blocks']} blocks)")
        ax.set_xlabel("measured activation peak (MiB)")
        ax.set_ylabel("step time / autograd")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 budgets, 2 repeats")
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    a = ap.parse_args()
    budgets, repeats = (4, 2) if a.quick else (a.budgets, a.repeats)
    torch.set_num_threads(a.threads)
    results = [sweep_model(n, b, s, budgets, repeats) for n, b, s in _models(a.quick)]
    dp = dp_times()
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "remat_sweep", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "cpus": torch.get_num_threads(), "python": sys.version.split()[0]},
           "torch": torch.__version__, "budgets": budgets, "repeats": repeats, "models": results,
           "dp_solve_times": dp}
    (RESULTS / "remat_sweep.json").write_text(json.dumps(doc, indent=1))
    plot(results, RESULTS / "remat_sweep.png")
    print(f"wrote {RESULTS / 'remat_sweep.json'} and remat_sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
