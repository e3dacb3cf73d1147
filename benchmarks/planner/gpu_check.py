"""The analytic planner checked on a real GPU: predicted vs measured, one device.

On a lent H100/H200 (or any CUDA device) this script measures what the planner's platform preset
assumes and what its plans do:

1. **matmul**: achieved TFLOP/s of the matmul shapes a GPT layer runs (and squares), bf16 and fp32,
   next to the preset's roofline (peak x ``Platform.matmul_fraction``, Calculon's table, x the shape's
   ``Platform.wave_fraction``);
2. **memory bandwidth**: a large device-to-device copy vs ``device_mem_bytes_per_s x mem_fraction``;
3. **plans**: for GPT-2 models at several micro-batches, remat choices and precisions, the plan
   ``scaletrain plan --platform P --nodes 1 --gpus-per-node 1 --fix ...`` prices and writes (``--out``)
   is run with ``scaletrain train --plan`` on the device; median step time (warm-up steps left out)
   and ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``, the allocator's view) against the
   planner's ``step_time_s`` and ``peak_bytes``.

Everything is written to ``OUT/gpu_check.json`` (machine, versions, date). ``--quick`` shrinks every
size so the script can be rehearsed on a CPU (numbers then mean nothing); ``--dry-run`` plans and prices
every plan of the real sizes in this process and runs nothing (seconds on a CPU: what a lent GPU will
run, checked beforehand).

    python benchmarks/planner/gpu_check.py --out DIR [--platform h200] [--quick] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as pyplatform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from scaletrain.platform import get as preset  # noqa: E402

# (model, global batch, seq, micro-batch, remat, precision): one device, so dp = tp = pp = 1
PLANS = [
    ("gpt2-medium", 16, 1024, 16, "none", "bf16"),
    ("gpt2-medium", 16, 1024, 8, "none", "bf16"),
    ("gpt2-medium", 16, 1024, 4, "none", "bf16"),
    ("gpt2-medium", 16, 1024, 16, "full", "bf16"),
    ("gpt2-medium", 16, 1024, 16, "selective", "bf16"),
    ("gpt2-medium", 16, 1024, 8, "none", "fp32"),
    ("gpt2-large", 16, 1024, 8, "none", "bf16"),
    ("gpt2-xl", 16, 1024, 8, "full", "bf16"),
]
# a Llama-3.1-8B layer (SwiGLU 14336, GQA 32/8 heads, 128,256-word untied head) cut to 4 layers: the
# planner's Llama shape checked on the device
LLAMA = {"num_hidden_layers": 4, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192}
LLAMA_PLANS = [("hf:llama", 4, 4096, 1, "none", "bf16"), ("hf:llama", 4, 4096, 2, "none", "bf16"),
               ("hf:llama", 4, 4096, 4, "full", "bf16")]
QUICK_PLANS = [("gpt2-tiny", 4, 64, 4, "none", "bf16"), ("hf:llama", 4, 64, 2, "full", "bf16"),
               ("gpt2-tiny", 4, 64, 4, "selective", "fp32")]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after 3 warm-ups (device synchronised)."""
    for _ in range(3):
        fn()
    _sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def matmuls(plat, device: str, quick: bool) -> list[dict]:
    """Achieved vs preset-predicted TFLOP/s for square and GPT-layer matmul shapes."""
    shapes = [(n, n, n) for n in ((256, 512) if quick else (1024, 2048, 4096, 8192))]
    if not quick:  # gpt2-medium / -xl layers at 16 x 1024 tokens: QKV, fc1, fc2 (m = b·s tokens)
        shapes += [(16384, 3072, 1024), (16384, 4096, 1024), (16384, 1024, 4096),
                   (4096, 4800, 1600), (4096, 6400, 1600), (4096, 1600, 6400)]
    rows = []
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            sec = _time(lambda: a @ b, 5 if quick else 20)
            flops = 2.0 * m * n * k
            # the preset's table times the shape's tile and wave quantization (Platform.wave_fraction)
            pred = flops / (plat.flops(precision) * plat.matmul_fraction(flops) * plat.wave_fraction(m, n))
            rows.append({"precision": precision, "m": m, "n": n, "k": k, "measured_tflops": flops / sec / 1e12,
                         "predicted_tflops": flops / pred / 1e12, "preset_fraction": plat.matmul_fraction(flops),
                         "wave_fraction": plat.wave_fraction(m, n),
                         "measured_fraction": flops / sec / plat.flops(precision)})
            del a, b
    return rows


def bandwidth(plat, device: str, quick: bool) -> dict:
    """A device-to-device copy: bytes read + written per second vs the preset's HBM figure."""
    n = (1 << 20) if quick else (1 << 30)  # elements of fp32: 4 MiB / 4 GiB
    x = torch.empty(n, device=device)
    y = torch.empty_like(x)
    sec = _time(lambda: y.copy_(x), 5 if quick else 20)
    moved = 2 * 4 * n
    return {"bytes_moved": moved, "measured_bytes_per_s": moved / sec,
            "predicted_bytes_per_s": plat.device_mem_bytes_per_s * plat.mem_fraction(moved)}


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "scaletrain.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _cli_here(*args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (``--dry-run``: no interpreter start and torch import per plan)."""
    import contextlib
    import io

    from scaletrain.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def run_plan(spec: tuple, platform: str, out: Path, steps: int, device: str, dry_run: bool = False) -> dict:
    """Plan one configuration on paper, then train it here; predicted next to measured. ``dry_run``: plan
    and price only (the CPU rehearsal of what a lent GPU runs), nothing estimated or trained."""
    model, gb, seq, mb, remat, precision = spec
    overrides = LLAMA if model == "hf:llama" and seq > 256 else {}
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    name = f"{model.replace(':', '-')}_mb{mb}_{remat}_{precision}"
    row: dict = {"name": name, "model": model, "global_batch": gb, "seq": seq, "micro_batch": mb,
                 "remat": remat, "precision": precision}
    plan_file = out / f"{name}.toml"
    plan_cli = _cli_here if dry_run else partial(_cli, timeout=300)
    p = plan_cli("plan", "--model", model, *sets, "--platform", platform, "--nodes", "1", "--gpus-per-node", "1",
                 "--global-batch", str(gb), "--seq", str(seq), "--fix", "dp=1", "--fix", f"micro_batch={mb}",
                 "--fix", f"remat={remat}", "--fix", "zero=0", "--precision", precision, "--json", "--out",
                 str(plan_file))
    if p.returncode != 0:
        return {**row, "status": "plan failed", "error": p.stderr.strip()[-800:]}
    best = json.loads(p.stdout)[0]
    row.update(predicted_step_time_s=best["step_time_s"], predicted_peak_bytes=best["peak_bytes"],
               predicted_peak_by_category=best["peak_bytes_by_category"], predicted_phases_s=best["phases_s"],
               fits=best["fits"], describe=best["describe"])
    if dry_run:
        return {**row, "status": "planned (dry run)"}
    # the second predictor: scaletrain estimate (fake tensors of the real model, the plan's remat)
    e = _cli("estimate", "--model", model, *sets, "--plan", str(plan_file), "--seq", str(seq), "--global-batch", str(gb),
             "--batch", str(mb), "--precision", precision, "--device", device, "--json", timeout=300)
    if e.returncode == 0:
        row["estimate_peak_bytes"] = json.loads(e.stdout)["bytes"]["peak"]
    else:
        row["estimate_error"] = e.stderr.strip()[-500:]
    run_dir = out / "runs" / name
    t0 = time.perf_counter()
    try:
        r = _cli("train", "--plan", str(plan_file), f"model.name={model}",
                 *[f"model.overrides.{k}={v}" for k, v in overrides.items()], f"train.global_batch={gb}",
                 f"data.seq_len={seq}", f"train.steps={steps}", "train.log_every=1", "train.eval_every=0",
                 "train.eval_batches=1", "train.progress=off", "train.checkpoint_format=none",
                 f"train.device={device}", "--out", str(run_dir), timeout=180)
    except subprocess.TimeoutExpired:
        return {**row, "status": "train timed out (180 s)"}
    row["wall_s"] = time.perf_counter() - t0
    if r.returncode != 0:
        return {**row, "status": "train failed", "error": (r.stderr or r.stdout).strip()[-1500:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [x for x in rows if "step_time_s" in x]
    timed = [x["step_time_s"] for x in steps_rows if x["step"] > 3] or [x["step_time_s"] for x in steps_rows]
    peak = max((x.get("device_peak_bytes", 0) for x in steps_rows), default=0)
    reserved = max((x.get("device_reserved_peak_bytes", 0) for x in steps_rows), default=0)  # the allocator's view
    step = statistics.median(timed)
    row.update(status="ok", step_time_s=step, step_time_min_s=min(timed), peak_bytes=peak,
               step_time_error=(row["predicted_step_time_s"] - step) / step,
               peak_error=(row["predicted_peak_bytes"] - peak) / peak if peak else None,
               reserved_peak_bytes=reserved,
               reserved_error=(row["predicted_peak_bytes"] - reserved) / reserved if reserved else None,
               estimate_peak_error=((row["estimate_peak_bytes"] - peak) / peak
                                    if peak and "estimate_peak_bytes" in row else None),
               losses=[x["loss"] for x in steps_rows])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--platform", default="h200")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to rehearse on a CPU")
    ap.add_argument("--dry-run", action="store_true",
                    help="plan and price every plan here (CPU is fine), run nothing: checks the script before a GPU")
    ap.add_argument("--plans", choices=("gpt2", "llama"), default="gpt2", help="which plans to run")
    ap.add_argument("--only", default="", help="comma-separated sections: matmul,bandwidth,plans")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plat = preset(args.platform)
    sections = set(args.only.split(",")) if args.only else {"matmul", "bandwidth", "plans"}
    if args.dry_run:  # the measurements mean nothing off the device they describe
        sections &= {"plans"}
    result: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": pyplatform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "host": pyplatform.node(), "cpus": os.cpu_count()},
        "platform": args.platform, "steps": args.steps}
    out_file = args.out / "gpu_check.json"

    def save() -> None:
        out_file.write_text(json.dumps(result, indent=1))

    if "plans" in sections:
        result["plans"] = []
        for spec in (QUICK_PLANS if args.quick else LLAMA_PLANS if args.plans == "llama" else PLANS):
            row = run_plan(spec, args.platform, args.out, args.steps, device, dry_run=args.dry_run)
            result["plans"].append(row)
            save()
            if row["status"] == "planned (dry run)":
                print(f"{row['name']}: predicted step {row['predicted_step_time_s'] * 1e3:.1f} ms, peak "
                      f"{row['predicted_peak_bytes'] / 2**30:.2f} GiB, fits {row['fits']}", flush=True)
            elif row["status"] == "ok":
                print(f"{row['name']}: step {row['step_time_s'] * 1e3:.1f} ms measured vs "
                      f"{row['predicted_step_time_s'] * 1e3:.1f} predicted ({row['step_time_error']:+.1%}); peak "
                      f"{row['peak_bytes'] / 2**30:.2f} GiB vs {row['predicted_peak_bytes'] / 2**30:.2f} "
                      f"({(row['peak_error'] or 0):+.1%}) [{row['wall_s']:.0f} s]", flush=True)
            else:
                print(f"{row['name']}: {row['status']}: {row.get('error', '')[-400:]}", flush=True)
    if "matmul" in sections:
        result["matmul"] = matmuls(plat, device, args.quick)
        save()
        for r in result["matmul"]:
            print(f"matmul {r['precision']} {r['m']}x{r['n']}x{r['k']}: {r['measured_tflops']:.0f} TFLOP/s "
                  f"measured, {r['predicted_tflops']:.0f} predicted", flush=True)
    if "bandwidth" in sections:
        result["bandwidth"] = bandwidth(plat, device, args.quick)
        save()
        print(f"copy: {result['bandwidth']['measured_bytes_per_s'] / 1e12:.2f} TB/s measured, "
              f"{result['bandwidth']['predicted_bytes_per_s'] / 1e12:.2f} predicted", flush=True)
    save()


if __name__ == "__main__":
    main()
