"""The planner's ranking against measurement here, at 2 processes (one per core): gpt2-mini, vgg-mini, hf:bert.

For each model: this machine is measured for one of 2 processes as ``plan=auto`` measures it at the
start of a run (:func:`scaletrain.planner.local.measure` on both ranks at once, one thread each, the
model's own kernels for the fixed cost per kernel), in each precision the model's plans use. Each of
≥ 16 distinct runnable 2-process plans (dp, ZeRO 0–3, FSDP grouping, tp/sp where the model allows it,
pp with 1F1B / GPipe / interleaved / ZB-1P, micro-batch, remat; no bf16: see the README) is priced by the function the
planner ranks with (:func:`price`: a decoder shape by :func:`scaletrain.planner.cost.plan_cost`, any
other model by :func:`scaletrain.planner.traced.price` — what ``scaletrain.plan`` and ``plan=auto``
call), and the planner's own first choice (``plan=auto``'s) is added. Then every plan runs through
``scaletrain train --nproc-per-node 2 --plan FILE train.measure_memory=true`` (OMP_NUM_THREADS=1)
in interleaved rounds, one model at a time: each round starts with a fresh calibration that prices
its plans (as plan=auto calibrates at the start of a run), then runs each of the model's plans once
(odd rounds in reverse order, so a drift of load hits all plans alike). Measured step time of a run:
the median of its steps after two
warm-up steps, the tracked last step left out; of a plan: the median over its rounds (the spread
across rounds is recorded). Peak: the heaviest rank's tracked peak; traffic: rank 0's ledger. The
1-minute load average is recorded before and after every run. Writes
``benchmarks/results/planner_measured_models.json``.

    PYTHONPATH=src python benchmarks/planner/measured_models.py                  # 53 min at load 5-14 (~100 launches)
    PYTHONPATH=src python benchmarks/planner/measured_models.py --models vgg-mini --plans 0,3 --repeats 1
    PYTHONPATH=src python benchmarks/planner/measured_models.py --predict-only   # prices only, nothing run
    PYTHONPATH=src python benchmarks/planner/measured_models.py --table          # the README's tables from the JSON
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "pipeline"))
sys.path.insert(0, str(ROOT / "benchmarks" / "planner"))
from common import machine  # noqa: E402
from measured import spearman  # noqa: E402

from scaletrain.plan import Plan, RematPlan  # noqa: E402
from scaletrain.platform import Platform  # noqa: E402
from scaletrain.train.host_work import host_seconds  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402
from scaletrain.planner import auto, local  # noqa: E402
from scaletrain.planner.cost import Options, plan_cost  # noqa: E402
from scaletrain.testing import run_distributed  # noqa: E402
from scaletrain.train.config import load_config  # noqa: E402

WORLD, STEPS = 2, 7
FULL, SEL = RematPlan(blocks="all"), RematPlan(selective="attention")
OPTS = Options(reserve_bytes=0.5 * 2**30)  # plan=auto's on a CPU


def _pp(b: int, m: int, schedule: str = "1f1b", **kw: Any) -> Plan:
    return Plan(pp=2, micro_batch=b, microbatches=m, schedule=schedule,
                virtual=2 if schedule == "interleaved" else 0, **kw)


# per model: global batch, sequence length (0: not a sequence model), the plans
MODELS: dict[str, dict[str, Any]] = {
    "gpt2-mini": {"gb": 8, "seq": 64, "plans": [
        Plan(dp=2, micro_batch=4), Plan(dp=2, micro_batch=2), Plan(dp=2, micro_batch=1),
        Plan(dp=2, zero=1, micro_batch=4), Plan(dp=2, zero=2, micro_batch=2), Plan(dp=2, zero=3, micro_batch=4),
        Plan(dp=2, zero=3, micro_batch=4, fsdp_group="2"), Plan(dp=2, micro_batch=4, remat=FULL),
        Plan(dp=2, micro_batch=4, remat=SEL),
        Plan(tp=2, micro_batch=8), Plan(tp=2, sp=True, micro_batch=8), Plan(tp=2, micro_batch=4),
        _pp(2, 4), _pp(2, 4, "gpipe"), _pp(2, 4, "interleaved"), _pp(2, 4, "zb1p"), _pp(1, 8)]},
    "vgg-mini": {"gb": 64, "seq": 0, "plans": [
        Plan(dp=2, micro_batch=32), Plan(dp=2, micro_batch=16), Plan(dp=2, micro_batch=8),
        Plan(dp=2, zero=1, micro_batch=32), Plan(dp=2, zero=2, micro_batch=16), Plan(dp=2, zero=3, micro_batch=32),
        Plan(dp=2, zero=3, micro_batch=32, fsdp_group="2"), Plan(dp=2, micro_batch=32, remat=FULL),
        Plan(dp=2, micro_batch=4), Plan(dp=2, zero=2, micro_batch=8),
        _pp(16, 4), _pp(8, 8), _pp(16, 4, "gpipe"), _pp(16, 4, "interleaved"), _pp(32, 2), _pp(16, 4, zero=1)]},
    "hf:bert": {"gb": 8, "seq": 64, "plans": [
        Plan(dp=2, micro_batch=4), Plan(dp=2, micro_batch=2), Plan(dp=2, micro_batch=1),
        Plan(dp=2, zero=1, micro_batch=4), Plan(dp=2, zero=2, micro_batch=2), Plan(dp=2, zero=3, micro_batch=4),
        Plan(dp=2, zero=3, micro_batch=4, fsdp_group="2"), Plan(dp=2, micro_batch=4, remat=FULL),
        Plan(dp=2, zero=1, micro_batch=2), Plan(dp=2, zero=2, micro_batch=1),  # (selective remat: GPT-2-style only)
        _pp(2, 4), _pp(1, 8), _pp(2, 4, "gpipe"), _pp(2, 4, "interleaved"), _pp(2, 4, "zb1p"), _pp(4, 2)]},
}
OUT = ROOT / "benchmarks" / "results" / "planner_measured_models.json"


def base_args(name: str, spec: dict[str, Any]) -> list[str]:
    out = [f"model.name={name}", f"train.global_batch={spec['gb']}", f"train.steps={STEPS}", "train.log_every=1",
           "train.eval_every=0", "train.eval_batches=1", "train.progress=off", "train.measure_memory=true"]
    return out + ([f"data.seq_len={spec['seq']}"] if spec["seq"] else [])


def _measure(rank: int, world: int, precision: str, name: str, gb: int, seq: int) -> Any:
    # both ranks at once; rank 0's is used; the blocks timed at every micro-batch the search may choose
    plat = local.measure(world, precision, (name, {}), micro_batches=auto.micro_batches(gb), seq=seq,
                         host=partial(host_seconds, trainer_cls=Trainer))  # as plan=auto measures it
    from scaletrain.train.model_data import data_rate  # the run's input pipeline, as plan=auto measures it

    return plat.with_(data_seconds_per_sample=data_rate(load_config(None, base_args(name, MODELS[name])), None, world))


def platform_for(name: str, precision: str) -> Any:
    """This machine for one of 2 processes (one thread each), measured as plan=auto measures it; rank 0's."""
    spec = MODELS[name]
    return run_distributed(_measure, WORLD, precision, name, spec["gb"], spec["seq"], threads_per_rank=1)[0]


def price(name: str, plan: Plan, plat: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The plan priced by the function the planner ranks with (decoder shapes on paper, any other
    model by its trace), plus the heaviest rank's peak and rank 0's traffic from plan_costs."""
    from scaletrain.planner.api import target
    from scaletrain.planner.shape import Shape
    from scaletrain.planner.traced import price as traced_price
    from scaletrain.techniques.plan_cost import heaviest, plan_costs

    tgt, seq = target(name, plat), spec["seq"]
    if isinstance(tgt, Shape):
        from scaletrain import models

        c = plan_cost(tgt, plan, plat, global_batch=spec["gb"], seq=seq, options=OPTS)
        model = models.get(name, device="meta")
    else:
        c = traced_price(tgt, plan, plat, global_batch=spec["gb"], seq=seq, device="cpu", options=OPTS)
        model = tgt.model
    costs = plan_costs(plan, model, world=WORLD, global_batch=spec["gb"], seq=seq,
                       micro_batch=0 if plan.pp > 1 else plan.micro_batch, device="cpu")
    return {"step_time_s": c.step_time_s, "phases_s": c.phases_s, "peak_bytes": float(heaviest(costs).peak_bytes),
            "comm_bytes": float(costs[0].comm_bytes)}


def label(plan: Plan) -> str:
    """The plan in a few words (describe() + the FSDP grouping when not auto + the micro-batch)."""
    group = f", fsdp_group={plan.fsdp_group}" if plan.zero == 3 and plan.fsdp_group != "auto" else ""
    return plan.describe() + group + f", micro-batch {plan.micro_batch}"


def run(name: str, plan: Plan, spec: dict[str, Any]) -> dict[str, Any]:
    """Train the plan once; its step time (median after warm-up, tracked step excluded), peak, traffic, load."""
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "plan.toml").write_text(plan.to_toml())
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--nproc-per-node", str(WORLD),
                            "--out", f"{d}/run", "--plan", f"{d}/plan.toml", *base_args(name, spec)],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode:
            return {"error": (r.stderr.strip().splitlines() or ["?"])[-1], "wall_s": time.perf_counter() - t0}
        rows = [json.loads(x) for x in Path(f"{d}/run/metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    times = [x["step_time_s"] for x in rows]
    return {"step_time_s": statistics.median(times[auto.WARMUP_STEPS:-1]), "step_times_s": times,
            "peak_bytes": rows[-1]["tracked_peak_bytes_max"], "comm_bytes": rows[-1].get("comm_bytes", 0.0),
            "wall_s": time.perf_counter() - t0, "load_1min": [load0, os.getloadavg()[0]]}


def first_choice(name: str, spec: dict[str, Any], plat: Any) -> Plan:
    """What plan=auto would run for this model on 2 processes with this platform."""
    cfg = load_config(None, ["plan=auto", *base_args(name, spec)])
    return Plan.from_flat(auto._plan_on_rank0(cfg, WORLD, {}, plat, torch.device("cpu"))["plan"])


def _platform_json(plat: Any, precision: str) -> dict[str, Any]:
    return {"flops": plat.flops(precision), "matmul_efficiency": plat.matmul_efficiency,
            "elementwise_bytes_per_s": plat.device_mem_bytes_per_s, "mem_efficiency": plat.mem_efficiency,
            "allreduce_bytes_per_s": plat.intra_node_bytes_per_s, "allreduce_alpha_s": plat.intra_node_latency_s,
            "kernel_overhead_s": plat.kernel_overhead_s, "measured_blocks": plat.measured_blocks,
            "data_seconds_per_sample": plat.data_seconds_per_sample,
            **{k: v for k, v in plat.meta.items() if k != "threads"}}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman ρ, median |error|, first choice vs fastest, peaks within 5 %, traffic exact (measured rows)."""
    ok = [r for r in rows if r.get("measured", {}).get("step_time_s")]
    if len(ok) < 3:
        return {"ran": len(ok)}
    pt, mt = [r["predicted"]["step_time_s"] for r in ok], [r["measured"]["step_time_s"] for r in ok]
    err = [p / m - 1 for p, m in zip(pt, mt)]
    peak = [r["predicted"]["peak_bytes"] / r["measured"]["peak_bytes"] - 1 for r in ok]
    fastest = min(mt)
    top = next((r for r in ok if r["planner_first"]), None)
    spread = [r["measured"]["spread"] for r in ok if r["measured"].get("spread") is not None]
    return {"plans": len(rows), "ran": len(ok), "spearman": spearman(pt, mt),
            "median_abs_step_error": statistics.median(abs(e) for e in err),
            "median_step_error": statistics.median(err),
            "peaks_within_5pct": sum(abs(e) <= 0.05 for e in peak), "max_abs_peak_error": max(abs(e) for e in peak),
            "comm_exact": sum(r["predicted"]["comm_bytes"] == r["measured"]["comm_bytes"] for r in ok),
            "fastest_measured_s": fastest, "fastest_plan": ok[mt.index(fastest)]["plan"],
            "planner_first": top["plan"] if top else None,
            "planner_first_measured_s": top["measured"]["step_time_s"] if top else None,
            "first_within_10pct": bool(top and top["measured"]["step_time_s"] <= 1.1 * fastest),
            "median_round_spread": statistics.median(spread) if spread else None}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--plans", default="", help="comma-separated plan indices (default: all; the first choice is kept)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds over the plans, each calibrated at its start (median)")
    ap.add_argument("--predict-only", action="store_true", help="price the plans, run nothing")
    ap.add_argument("--rescore", default="", help="a JSON this script wrote: price its plans again (this code, a fresh "
                    "calibration unless --platforms) against its measurements; nothing run")
    ap.add_argument("--platforms", default="", help="with --rescore: a JSON whose platform_dicts to price with")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    names = [m for m in a.models.split(",") if m]
    bad = [m for m in names if m not in MODELS]
    if bad:
        print(f"--models: unknown {bad}; allowed: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    pick = [int(i) for i in a.plans.split(",") if i] if a.plans else None
    t_start, info = time.perf_counter(), machine()
    rows: list[dict[str, Any]] = []
    platforms: dict[str, Any] = {}
    old = json.loads(Path(a.rescore).read_text()) if a.rescore else None
    saved = json.loads(Path(a.platforms).read_text())["platform_dicts"] if a.platforms else {}
    dicts: dict[str, Any] = {}
    running = not a.predict_only and old is None
    partial = Path(a.out).with_suffix(".partial.json")
    for name in names:  # one model at a time: its rounds close together, each calibrated at its start
        spec = MODELS[name]
        if old is not None:
            plans = [Plan.from_flat(r["plan_flat"]) for r in old["rows"] if r["model"] == name]
        else:
            plans = [p.resolved(WORLD) for i, p in enumerate(spec["plans"]) if pick is None or i in pick]
        precisions = sorted({p.precision for p in plans} | {"fp32"})
        mine: list[dict[str, Any]] = []
        platforms[name], dicts[name] = [], []
        rounds = a.repeats if running else len(saved.get(name, [])) or 1
        for rnd in range(rounds):
            # this machine now, for 2 processes, as plan=auto measures it at the start of a run
            plats = {pr: Platform.from_dict(saved[name][rnd][pr]) if name in saved else platform_for(name, pr)
                     for pr in precisions}
            platforms[name].append({pr: _platform_json(pl, pr) for pr, pl in plats.items()})
            dicts[name].append({pr: pl.to_dict() for pr, pl in plats.items()})
            if rnd == 0:
                first = first_choice(name, spec, plats["fp32"]).resolved(WORLD)
                if first not in plans:
                    plans.append(first)
                for plan in plans:
                    runs = next((r["runs"] for r in (old or {}).get("rows", [])
                                 if r["model"] == name and r["plan_flat"] == plan.to_flat()), [])
                    mine.append({"model": name, "plan": label(plan), "plan_flat": plan.to_flat(),
                                 "planner_first": plan == first, "predictions": [], "runs": runs})
            for row in mine:
                row["predictions"].append(price(name, Plan.from_flat(row["plan_flat"]), plats[
                    Plan.from_flat(row["plan_flat"]).precision], spec))
                print(f"round {rnd}: {name}: {row['plan']}: predicted "
                      f"{row['predictions'][-1]['step_time_s'] * 1e3:.1f} ms", flush=True)
            if not running:
                continue
            for row in (mine if rnd % 2 == 0 else mine[::-1]):  # odd rounds in reverse: drift hits all alike
                m = run(name, Plan.from_flat(row["plan_flat"]), spec)
                row["runs"].append(m)
                partial.write_text(json.dumps({"rows": rows + mine, "platform_dicts": dicts}))  # a cut run keeps these
                print(f"round {rnd}: {name}: {row['plan']}: measured {m.get('step_time_s', float('nan')) * 1e3:.0f} ms "
                      f"{m.get('error', '')}", flush=True)
        for row in mine:
            p = row["predictions"]
            row["predicted"] = {**p[0], "step_time_s": statistics.median(x["step_time_s"] for x in p),
                                "round_step_times_s": [x["step_time_s"] for x in p]}
        rows += mine
    for row in rows:
        good = [m for m in row["runs"] if "step_time_s" in m]
        if good:
            s = [m["step_time_s"] for m in good]
            row["measured"] = {"step_time_s": statistics.median(s), "round_step_times_s": s,
                               "spread": max(s) / min(s) - 1 if len(s) > 1 else None,
                               "peak_bytes": good[-1]["peak_bytes"], "comm_bytes": good[-1]["comm_bytes"]}
        elif row["runs"]:
            row["measured"] = {"error": row["runs"][-1]["error"]}
    summary = {"overall": summarise(rows), **{n: summarise([r for r in rows if r["model"] == n]) for n in names}}
    out = {"benchmark": "planner measured, 3 models, 2 processes",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "machine": {**info, "load_after": machine()["load_average_1_5_15"]}, "torch": torch.__version__,
           "world": WORLD, "threads_per_process": 1, "steps": STEPS, "repeats": a.repeats,
           "models": {n: {"global_batch": MODELS[n]["gb"], "seq": MODELS[n]["seq"]} for n in names},
           "platforms": platforms, "platform_dicts": dicts, "summary": summary, "rows": rows,
           "seconds": time.perf_counter() - t_start}
    if not a.predict_only or old is not None:
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


def table(path: Path = OUT) -> str:
    """The README's tables from the JSON: per plan, then the summary per model and overall."""
    data = json.loads(path.read_text())
    lines = ["| model | plan | predicted ms | measured ms (rounds) | error | peak error | traffic |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        p, m = r["predicted"], r.get("measured", {})
        name = r["plan"] + (" **(planner's first)**" if r["planner_first"] else "")
        if "step_time_s" not in m:
            lines.append(f"| {r['model']} | {name} | {p['step_time_s'] * 1e3:.0f} | failed: {m.get('error', '')} "
                         f"| | | |")
            continue
        rounds = "/".join(f"{x * 1e3:.0f}" for x in m["round_step_times_s"])
        traffic = "exact" if p["comm_bytes"] == m["comm_bytes"] else f"{p['comm_bytes']:.0f} vs {m['comm_bytes']:.0f} B"
        lines.append(f"| {r['model']} | {name} | {p['step_time_s'] * 1e3:.0f} | "
                     f"{m['step_time_s'] * 1e3:.0f} ({rounds}) | "
                     f"{(p['step_time_s'] / m['step_time_s'] - 1) * 100:+.0f}% | "
                     f"{(p['peak_bytes'] / m['peak_bytes'] - 1) * 100:+.1f}% | {traffic} |")
    lines += ["", "| | Spearman ρ | median \\|error\\| | median error | first choice vs fastest | peaks within 5 % | "
              "traffic exact | median spread between rounds |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    for k, s in data["summary"].items():
        if "spearman" not in s:
            continue
        first = (f"{s['planner_first_measured_s'] / s['fastest_measured_s'] * 100 - 100:+.0f}%"
                 if s.get("planner_first_measured_s") and k != "overall" else "—")
        spread = f"{s['median_round_spread'] * 100:.0f}%" if s.get("median_round_spread") is not None else "—"
        lines.append(f"| {k} | {s['spearman']:.2f} | {s['median_abs_step_error'] * 100:.0f}% | "
                     f"{s['median_step_error'] * 100:+.0f}% | {first} | {s['peaks_within_5pct']}/{s['ran']} | "
                     f"{s['comm_exact']}/{s['ran']} | {spread} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--table" in sys.argv:
        print(table())
        raise SystemExit(0)
    raise SystemExit(main(sys.argv[1:]))
