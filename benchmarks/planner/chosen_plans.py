"""The planner's chosen plan for every kind of model, run at 2 processes: predicted vs measured peak and traffic.

Issue #25's first Done-when line: ``scaletrain plan`` and ``scaletrain train plan=auto`` work for
vgg-mini, resnet-mini, gpt2-moe (ep in the search), hf:gpt2, hf:bert, hf:llama, a ``py:`` factory
and a model object from Python, and each chosen plan runs through ``scaletrain train --plan FILE``
with per-rank peaks within 5 % of the prediction and traffic equal to it.

For each model (small configs: the models' defaults, a short sequence), at 2 processes (one per
core, OMP_NUM_THREADS=1), this script:

1. plans it for this machine: ``scaletrain plan --model M --platform HERE.json --nodes 1
   --gpus-per-node 2 --precision fp32 --out plan.toml`` (HERE.json from ``scaletrain calibrate
   --nproc-per-node 2``, measured once at the start); the model object goes through
   ``scaletrain.plan(model, platform=..., devices=2, ...)`` instead;
2. runs that plan: ``scaletrain train --nproc-per-node 2 --plan plan.toml train.measure_memory=true``
   (the model object: ``Trainer(cfg, out, model=model)`` on 2 gloo processes) and compares the
   heaviest rank's tracked peak and rank 0's traffic with the runtime's prediction
   (:func:`scaletrain.techniques.plan_cost.plan_costs`: the heaviest rank's ``peak_bytes``, rank 0's
   ``comm_bytes``, what plan=auto prints);
3. runs ``scaletrain train --nproc-per-node 2 plan=auto train.measure_memory=true`` (not for the
   model object, which has no command line) and takes the prediction and measurement from its metrics
   rows (``predicted_peak_bytes`` / ``tracked_peak_bytes_max``, ``predicted_comm_bytes`` / ``comm_bytes``).

Peaks and traffic are bytes, so machine load does not change them (it can change which plan is
chosen: the plan is recorded). On a miss the tracker's breakdown of the heaviest rank and the
predicted one by category are recorded side by side. Writes
``benchmarks/results/planner_chosen_plans.json``.

    PYTHONPATH=src:examples python benchmarks/planner/chosen_plans.py            # ~15 min here at load 5
    PYTHONPATH=src:examples python benchmarks/planner/chosen_plans.py --models vgg-mini --no-auto
    PYTHONPATH=src:examples python benchmarks/planner/chosen_plans.py --table    # the README's table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "pipeline"))
sys.path.insert(0, str(ROOT / "examples"))
from common import machine  # noqa: E402

WORLD, STEPS = 2, 3
OBJECT = "object:mymodels.make_classifier(width=24)"  # an nn.Module built in Python, handed over as an object
# per model: global batch, sequence length (0: not a sequence model)
MODELS: dict[str, dict[str, int]] = {
    "vgg-mini": {"gb": 16, "seq": 0}, "resnet-mini": {"gb": 16, "seq": 0}, "gpt2-moe": {"gb": 8, "seq": 64},
    "hf:gpt2": {"gb": 8, "seq": 64}, "hf:bert": {"gb": 8, "seq": 64}, "hf:llama": {"gb": 8, "seq": 64},
    "py:mymodels:make_classifier": {"gb": 16, "seq": 0}, OBJECT: {"gb": 16, "seq": 0},
}
OUT = ROOT / "benchmarks" / "results" / "planner_chosen_plans.json"
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))


def base_args(name: str, spec: dict[str, int]) -> list[str]:
    out = [f"model.name={name}", f"train.global_batch={spec['gb']}", f"train.steps={STEPS}", "train.log_every=1",
           "train.eval_every=0", "train.eval_batches=1", "train.progress=off", "train.measure_memory=true"]
    return out + ([f"data.seq_len={spec['seq']}"] if spec["seq"] else [])


def build_object() -> Any:
    """The model object of the Python case (built the same on every rank)."""
    import mymodels

    return mymodels.make_classifier(width=24)


def _cli(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scaletrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


def _last_row(run: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return rows[-1]


def predict(model: Any, plan: Any, spec: dict[str, int]) -> dict[str, Any]:
    """The runtime's prediction for the plan (what plan=auto prints): plan_costs' heaviest rank and rank 0."""
    from scaletrain import models
    from scaletrain.planner.api import target
    from scaletrain.planner.shape import analytic
    from scaletrain.techniques.plan_cost import heaviest, plan_costs

    if isinstance(model, str):
        model = models.get(model, device="meta") if analytic(model) else target(model).model
    costs = plan_costs(plan, model, world=WORLD, global_batch=spec["gb"], seq=spec["seq"],
                       micro_batch=0 if plan.pp > 1 else plan.micro_batch, device="cpu")
    top = heaviest(costs)
    return {"peak_bytes": float(top.peak_bytes), "comm_bytes": float(costs[0].comm_bytes),
            "peak_breakdown": {k: float(v) for k, v in getattr(top, "bytes", {}).items()}}


def compare(pred_peak: float, peak: float, pred_comm: float, comm: float) -> dict[str, Any]:
    return {"predicted_peak_bytes": pred_peak, "measured_peak_bytes": peak, "peak_error": pred_peak / peak - 1,
            "predicted_comm_bytes": pred_comm, "measured_comm_bytes": comm, "comm_equal": pred_comm == comm}


def plan_file_run(name: str, spec: dict[str, int], platform: str, d: Path) -> dict[str, Any]:
    """`scaletrain plan --out` then `scaletrain train --plan FILE`; the chosen plan and its figures."""
    from scaletrain.plan import Plan
    from scaletrain.train.config import load_config

    t0 = time.perf_counter()
    args = ["plan", "--model", name, "--platform", platform, "--nodes", "1", "--gpus-per-node", str(WORLD),
            "--global-batch", str(spec["gb"]), "--precision", "fp32", "--out", str(d / "plan.toml")]
    r = _cli(args + (["--seq", str(spec["seq"])] if spec["seq"] else []))
    if r.returncode:
        return {"error": "plan: " + (r.stderr.strip().splitlines() or ["?"])[-1]}
    plan_s = time.perf_counter() - t0
    plan = Plan.from_config(load_config(d / "plan.toml", [f"model.name={name}"]))
    out = {"plan": plan.describe() + f", micro-batch {plan.micro_batch}", "plan_toml": (d / "plan.toml").read_text(),
           "plan_s": plan_s}
    t0 = time.perf_counter()
    r = _cli(["train", "--nproc-per-node", str(WORLD), "--out", str(d / "run"), "--plan", str(d / "plan.toml"),
              *base_args(name, spec)])
    out["train_wall_s"] = time.perf_counter() - t0
    if r.returncode:
        return {**out, "error": "train: " + (r.stderr.strip().splitlines() or ["?"])[-1]}
    row, pred = _last_row(d / "run"), predict(name, plan, spec)
    return {**out, **compare(pred["peak_bytes"], row["tracked_peak_bytes_max"], pred["comm_bytes"],
                             row.get("comm_bytes", 0.0)),
            "predicted_breakdown": pred["peak_breakdown"], "tracked_breakdown": row.get("tracked_peak_breakdown")}


def auto_run(name: str, spec: dict[str, int], d: Path) -> dict[str, Any]:
    """`scaletrain train plan=auto`: its own prediction against its measurement, from the metrics rows."""
    t0 = time.perf_counter()
    r = _cli(["train", "--nproc-per-node", str(WORLD), "--out", str(d / "auto"), "plan=auto", *base_args(name, spec)])
    wall = time.perf_counter() - t0
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1], "train_wall_s": wall}
    from scaletrain.plan import Plan
    from scaletrain.train.config import load_config

    row = _last_row(d / "auto")
    plan = Plan.from_config(load_config(d / "auto" / "config.toml"))
    return {"plan": plan.describe() + f", micro-batch {plan.micro_batch}", "train_wall_s": wall,
            **compare(row["predicted_peak_bytes"], row["tracked_peak_bytes_max"], row["predicted_comm_bytes"],
                      row.get("comm_bytes", 0.0)),
            "tracked_breakdown": row.get("tracked_peak_breakdown")}


def _train_object(rank: int, world: int, overrides: list[str], out: str) -> None:
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    tr = Trainer(load_config(None, overrides), out, model=build_object())
    tr.fit()
    tr.close()


def object_run(spec: dict[str, int], platform: str, d: Path) -> dict[str, Any]:
    """The model object: scaletrain.plan(model, ...) ranks; the first plan the compat table accepts runs
    through Trainer(cfg, out, model=model) on 2 gloo processes."""
    import scaletrain
    from scaletrain.commands.plan import _platform
    from scaletrain.plan import Plan
    from scaletrain.techniques import compat
    from scaletrain.testing import run_distributed

    model, t0 = build_object(), time.perf_counter()
    ranked = scaletrain.plan(model, platform=_platform(platform), devices=WORLD, global_batch=spec["gb"],
                             seq=spec["seq"], precision="fp32")
    plan_s = time.perf_counter() - t0
    for e in ranked:
        plan = Plan.from_flat(_flat(e["plan"]))
        m = plan.microbatches if plan.pp > 1 else spec["gb"] // (plan.dp * plan.micro_batch)
        facts = compat.Facts.of(model, world=WORLD, device="cpu", seq_len=spec["seq"], eval_every=0, microbatches=m)
        if not compat.violations(plan, facts):
            break
    else:
        return {"error": "no ranked plan passes the compat table", "plan_s": plan_s}
    out = {"plan": plan.describe() + f", micro-batch {plan.micro_batch}", "plan_toml": plan.to_toml(), "plan_s": plan_s}
    t0 = time.perf_counter()
    overrides = [x for x in base_args("object", spec) if not x.startswith("model.name")] + plan.overrides()
    try:
        run_distributed(_train_object, WORLD, overrides, str(d / "run"), timeout_s=600)
    except RuntimeError as e:
        return {**out, "error": "train: " + str(e).strip().splitlines()[-1]}
    out["train_wall_s"] = time.perf_counter() - t0
    row, pred = _last_row(d / "run"), predict(model, plan, spec)
    return {**out, **compare(pred["peak_bytes"], row["tracked_peak_bytes_max"], pred["comm_bytes"],
                             row.get("comm_bytes", 0.0)),
            "predicted_breakdown": pred["peak_breakdown"], "tracked_breakdown": row.get("tracked_peak_breakdown")}


def _flat(d: dict[str, Any]) -> dict[str, Any]:
    """Plan.to_dict()'s nested remat/offload objects as Plan.from_flat's dotted keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update({f"{k}.{a}": b for a, b in v.items()} if isinstance(v, dict) else {k: v})
    return out


def table(data: dict[str, Any]) -> str:
    def cell(r: dict[str, Any] | None) -> list[str]:
        if not r:
            return ["—"] * 4
        if "error" in r:
            return [r.get("plan", "—"), "error: " + r["error"][:80], "", ""]
        peak = (f"{r['predicted_peak_bytes'] / 2**20:.2f} / {r['measured_peak_bytes'] / 2**20:.2f} MiB "
                f"({r['peak_error'] * 100:+.1f}%)")
        comm = (f"{r['predicted_comm_bytes'] / 2**20:.3f} / {r['measured_comm_bytes'] / 2**20:.3f} MiB "
                + ("equal" if r["comm_equal"] else "**differs**"))
        return [r["plan"], peak, comm, f"{r.get('train_wall_s', 0):.0f}"]

    lines = ["| model | path | chosen plan | peak predicted / measured (error) | traffic predicted / measured | wall s |",
             "|---|---|---|---|---|---|"]
    for name in sorted(data["models"], key=lambda n: list(MODELS).index(n) if n in MODELS else len(MODELS)):
        rec = data["models"][name]
        for path in ("plan_file", "auto"):
            if path in rec:
                lines.append("| " + " | ".join([f"`{name}`", "plan --out + train --plan" if path == "plan_file"
                                                 else "train plan=auto", *cell(rec[path])]) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--no-auto", action="store_true", help="skip the plan=auto runs")
    ap.add_argument("--platform", default="", help="a platform JSON (default: `scaletrain calibrate "
                    "--nproc-per-node 2` now)")
    ap.add_argument("--table", action="store_true", help="print the README's table from the JSON and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(OUT.read_text())))
        return 0
    data: dict[str, Any] = json.loads(OUT.read_text()) if OUT.exists() else {"models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        platform = args.platform
        if not platform:
            platform = f"{tmp}/here.json"
            r = _cli(["calibrate", "--nproc-per-node", str(WORLD), "--out", platform])
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
        for name in args.models.split(","):
            spec, d = MODELS[name], Path(tmp) / name.replace(":", "_").replace("(", "_")
            d.mkdir()
            rec: dict[str, Any] = {"global_batch": spec["gb"], "seq": spec["seq"], "load_1min_before": os.getloadavg()[0]}
            rec["plan_file"] = object_run(spec, platform, d) if name == OBJECT else plan_file_run(name, spec, platform, d)
            if name != OBJECT and not args.no_auto:
                rec["auto"] = auto_run(name, spec, d)
            rec["load_1min_after"] = os.getloadavg()[0]
            data["models"][name] = {**data["models"].get(name, {}), **rec}  # --no-auto keeps the earlier auto run
            print(json.dumps({name: {k: {a: b for a, b in v.items() if "breakdown" not in a and a != "plan_toml"}
                                     if isinstance(v, dict) else v for k, v in rec.items()}}), flush=True)
            data.update(machine=machine(), steps=STEPS, world=WORLD)
            OUT.write_text(json.dumps(data, indent=1))
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
