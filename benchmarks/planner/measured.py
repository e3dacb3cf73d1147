"""The planner against measurement on this machine: predict, then run, distinct plans of gpt2-tiny.

For each process count N in 1, 2, 4: this machine is measured for one of N processes
(:func:`scaletrain.planner.local.measure`, all N at once, one thread each — what
``plan=auto`` does at the start of a run), every plan is priced (step time:
:func:`scaletrain.planner.cost.plan_cost`; per-rank peak and traffic:
:func:`scaletrain.techniques.plan_cost.plan_costs`) and then run through
``scaletrain train --nproc-per-node N --plan FILE train.measure_memory=true``. Measured step time =
median of the steps after two warm-up steps, the last (tracked) step left out; peak = the tracked
heaviest rank's; traffic = rank 0's ledger. The planner's own first choice for each N (``plan=auto``'s)
is among the plans. Writes ``benchmarks/results/planner_measured.json``.

    PYTHONPATH=src python benchmarks/planner/measured.py          # ~10 minutes on the shared 2-core machine
    PYTHONPATH=src python benchmarks/planner/measured.py --plot   # planner_measured.png from the JSON
    PYTHONPATH=src python benchmarks/planner/measured.py --table  # the README's table from the JSON
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "pipeline"))
from common import machine  # noqa: E402

from scaletrain import models  # noqa: E402
from scaletrain.plan import Plan, RematPlan  # noqa: E402
from scaletrain.planner import auto, local  # noqa: E402
from scaletrain.planner.cost import Options, plan_cost  # noqa: E402
from scaletrain.planner.shape import Shape  # noqa: E402
from scaletrain.techniques.plan_cost import heaviest, plan_costs  # noqa: E402
from scaletrain.testing import run_distributed  # noqa: E402
from scaletrain.train.config import load_config  # noqa: E402

MODEL, GB, SEQ, STEPS = "gpt2-tiny", 16, 128, 6
BASE = [f"model.name={MODEL}", f"train.global_batch={GB}", f"data.seq_len={SEQ}", f"train.steps={STEPS}",
        "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.progress=off",
        "train.measure_memory=true"]
FULL, SEL = RematPlan(blocks="all"), RematPlan(selective="attention")
PLANS: dict[int, list[Plan]] = {
    1: [Plan(micro_batch=16), Plan(micro_batch=4), Plan(micro_batch=16, remat=FULL),
        Plan(micro_batch=16, precision="bf16")],
    2: [Plan(dp=2, micro_batch=8), Plan(dp=2, zero=1, micro_batch=8), Plan(dp=2, zero=3, micro_batch=8),
        Plan(tp=2, micro_batch=16), Plan(tp=2, sp=True, micro_batch=16, remat=SEL),
        Plan(pp=2, micro_batch=4, microbatches=4), Plan(pp=2, schedule="gpipe", micro_batch=4, microbatches=4),
        Plan(pp=2, schedule="interleaved", virtual=2, micro_batch=4, microbatches=4)],
    4: [Plan(dp=4, micro_batch=4), Plan(dp=4, zero=2, micro_batch=2), Plan(dp=2, tp=2, micro_batch=8),
        Plan(dp=2, pp=2, micro_batch=2, microbatches=4), Plan(pp=4, micro_batch=2, microbatches=8)],
}
"""17 plans (+ the planner's first choice per N where it is not among them)."""


PARTIAL = ROOT / "benchmarks" / "results" / "planner_measured.partial.json"


def _measure(rank: int, world: int, precision: str) -> Any:
    return local.measure(world, precision, (MODEL, {}))  # every rank at once; rank 0's is used


def platform_for(world: int, precision: str) -> Any:
    """This machine for one of ``world`` processes (one thread each), rank 0's figures."""
    return run_distributed(_measure, world, precision, threads_per_rank=1)[0]


def predict(plan: Plan, world: int, plat: Any) -> dict[str, Any]:
    shape, model = Shape.of(MODEL), models.get(MODEL, device="meta")
    c = plan_cost(shape, plan, plat, global_batch=GB, seq=SEQ, options=Options(reserve_bytes=0.5 * 2**30))
    costs = plan_costs(plan, model, world=world, global_batch=GB, seq=SEQ,
                       micro_batch=0 if plan.pp > 1 else plan.micro_batch)
    return {"step_time_s": c.step_time_s, "peak_bytes": float(heaviest(costs).peak_bytes),
            "comm_bytes": float(costs[0].comm_bytes), "phases_s": c.phases_s}


def run(plan: Plan, world: int) -> dict[str, Any]:
    """Train the plan; measured step time (median after warm-up, tracked step excluded), peak, traffic."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "plan.toml").write_text(plan.to_toml())
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", str(world),
                            "--out", f"{d}/run", "--plan", f"{d}/plan.toml", *BASE],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode:
            return {"error": (r.stderr.strip().splitlines() or ["?"])[-1], "wall_s": time.perf_counter() - t0}
        rows = [json.loads(x) for x in Path(f"{d}/run/metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    times = [x["step_time_s"] for x in rows]
    return {"step_time_s": statistics.median(times[2:-1]), "step_times_s": times,
            "peak_bytes": rows[-1]["tracked_peak_bytes_max"], "comm_bytes": rows[-1].get("comm_bytes", 0.0),
            "wall_s": time.perf_counter() - t0}


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    rx, ry = ranks(x), ranks(y)
    n = len(x)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> int:
    t_start, load_before = time.perf_counter(), machine()["load_average_1_5_15"]
    rows, platforms, firsts = [], {}, {}
    for world, plans in PLANS.items():
        plats = {p: platform_for(world, p) for p in sorted({pl.precision for pl in plans})}
        platforms[world] = {p: {"flops": pl.flops(p), "elementwise_bytes_per_s": pl.device_mem_bytes_per_s,
                                "allreduce_bytes_per_s": pl.intra_node_bytes_per_s,
                                "allreduce_alpha_s": pl.intra_node_latency_s,
                                "kernel_overhead_s": pl.kernel_overhead_s} for p, pl in plats.items()}
        cfg = load_config(None, ["plan=auto", *BASE])
        first = Plan.from_flat(auto._plan_on_rank0(cfg, world, {}, plats["fp32"], torch.device("cpu"))["plan"])
        firsts[world] = first.describe() + f", micro-batch {first.micro_batch}"
        todo = [pl.resolved(world) for pl in plans]
        if first not in todo:
            todo.append(first)
        for plan in todo:
            pred = predict(plan, world, plats[plan.precision])
            meas = run(plan, world)
            row = {"world": world, "plan": plan.describe() + f", micro-batch {plan.micro_batch}",
                   "planner_first": plan == first, "predicted": pred, "measured": meas}
            rows.append(row)
            PARTIAL.write_text(json.dumps(rows))  # a run cut short keeps what it measured
            print(json.dumps({k: row[k] for k in ("world", "plan")}), f"pred {pred['step_time_s'] * 1e3:.0f} ms",
                  f"meas {meas.get('step_time_s', float('nan')) * 1e3:.0f} ms", meas.get("error", ""), flush=True)
    ok = [r for r in rows if "error" not in r["measured"]]
    pt, mt = [r["predicted"]["step_time_s"] for r in ok], [r["measured"]["step_time_s"] for r in ok]
    step_err = [p / m - 1 for p, m in zip(pt, mt)]
    peak_err = [r["predicted"]["peak_bytes"] / r["measured"]["peak_bytes"] - 1 for r in ok]
    per_world = {}
    for w in PLANS:
        rs = [r for r in ok if r["world"] == w]
        fastest = min(r["measured"]["step_time_s"] for r in rs)
        top = next((r for r in rs if r["planner_first"]), None)
        per_world[w] = {"spearman": spearman([r["predicted"]["step_time_s"] for r in rs],
                                             [r["measured"]["step_time_s"] for r in rs]) if len(rs) > 2 else None,
                        "planner_first": firsts[w], "fastest_measured_s": fastest,
                        "planner_first_measured_s": top["measured"]["step_time_s"] if top else None,
                        "first_within_10pct": bool(top and top["measured"]["step_time_s"] <= 1.1 * fastest)}
    summary = {"plans": len(rows), "ran": len(ok), "spearman": spearman(pt, mt),
               "median_abs_step_error": statistics.median(abs(e) for e in step_err),
               "median_step_error": statistics.median(step_err),
               "max_abs_peak_error": max(abs(e) for e in peak_err),
               "median_abs_peak_error": statistics.median(abs(e) for e in peak_err),
               "peaks_within_5pct": sum(abs(e) <= 0.05 for e in peak_err),
               "comm_exact": sum(r["predicted"]["comm_bytes"] == r["measured"]["comm_bytes"] for r in ok),
               "per_world": per_world}
    out = {"benchmark": "planner measured", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "machine": {**machine(), "load_before": load_before}, "torch": torch.__version__,
           "model": MODEL, "global_batch": GB, "seq": SEQ, "steps": STEPS, "platforms": platforms,
           "summary": summary, "rows": rows, "seconds": time.perf_counter() - t_start}
    path = ROOT / "benchmarks" / "results" / "planner_measured.json"
    path.write_text(json.dumps(out, indent=1))
    PARTIAL.unlink(missing_ok=True)
    print(json.dumps(summary, indent=1))
    return 0


def plot(path: Path = ROOT / "benchmarks" / "results" / "planner_measured.json") -> Path:
    """Predicted vs measured step time, one point per plan, coloured by process count (PNG beside the JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ok = [r for r in data["rows"] if "error" not in r["measured"]]
    for w, colour in ((1, "tab:blue"), (2, "tab:orange"), (4, "tab:green")):
        rs = [r for r in ok if r["world"] == w]
        ax.scatter([r["measured"]["step_time_s"] * 1e3 for r in rs], [r["predicted"]["step_time_s"] * 1e3 for r in rs],
                   c=colour, label=f"{w} process(es)")
    hi = max(max(r["measured"]["step_time_s"], r["predicted"]["step_time_s"]) for r in ok) * 1e3 * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="predicted = measured")
    ax.set(xlabel="measured step time (ms, median after warm-up)", ylabel="predicted step time (ms)",
           title=f"{data['model']}, {len(ok)} plans, Spearman {data['summary']['spearman']:.2f}", xlim=(0, hi),
           ylim=(0, hi))
    ax.legend()
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def table(path: Path = ROOT / "benchmarks" / "results" / "planner_measured.json") -> str:
    """The README's markdown table from the JSON."""
    data = json.loads(path.read_text())
    lines = ["| N | plan | predicted ms | measured ms | error | predicted peak MiB | measured MiB | error | traffic |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        p, m = r["predicted"], r["measured"]
        name = r["plan"] + (" **(planner's first)**" if r["planner_first"] else "")
        if "error" in m:
            lines.append(f"| {r['world']} | {name} | {p['step_time_s'] * 1e3:.0f} | failed: {m['error']} | | | | | |")
            continue
        traffic = "exact" if p["comm_bytes"] == m["comm_bytes"] else f"{p['comm_bytes']:.0f} vs {m['comm_bytes']:.0f} B"
        lines.append(f"| {r['world']} | {name} | {p['step_time_s'] * 1e3:.0f} | {m['step_time_s'] * 1e3:.0f} | "
                     f"{(p['step_time_s'] / m['step_time_s'] - 1) * 100:+.0f}% | {p['peak_bytes'] / 2**20:.2f} | "
                     f"{m['peak_bytes'] / 2**20:.2f} | {(p['peak_bytes'] / m['peak_bytes'] - 1) * 100:+.1f}% | {traffic} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--plot" in sys.argv:  # the figure again from the JSON, nothing run
        print(plot())
        raise SystemExit(0)
    if "--table" in sys.argv:
        print(table())
        raise SystemExit(0)
    code = main()
    plot()
    raise SystemExit(code)
