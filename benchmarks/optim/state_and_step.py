"""Every optimizer of ``build_optimizer``: state bytes per parameter (measured and predicted) and
CPU step time on a 16 M-parameter GPT-2-shaped model.

For each name: build it over the model (decay/no-decay groups), give every parameter the same
random gradient, take ``--warmup`` steps (state allocation; torch.compile for adam8bit), then
``--repeats`` timed rounds in which the optimizers take turns (machine load hits all alike).
Reported: measured state bytes (``measured_state_bytes``: numel * element_size of the tensors in
``optimizer.state``), the cost face's prediction (``state_bytes``), bytes per parameter, and the
median / quartiles of the step time. Output: ``benchmarks/results/optim_state_step.json``.

    .venv/bin/python benchmarks/optim/state_and_step.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"

# Hyperparameters used (documented defaults; sgd with momentum 0.9 as is usual).
SETTINGS = {"sgd": {"lr": 0.1, "momentum": 0.9}, "adam": {}, "adamw": {}, "adam8bit": {},
            "adamw8bit": {}, "adafactor": {}, "came": {}, "lamb": {}, "lars": {}}


def main() -> int:
    from scaletrain import models
    from scaletrain.techniques.optim import build_optimizer, measured_state_bytes, state_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "optim_state_step.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    torch.manual_seed(0)
    runs = {}
    for name, kw in SETTINGS.items():
        model = models.get("gpt2-mini", n_embd=args.hidden, n_layer=args.layers, n_head=8,
                           n_positions=128)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        opt = build_optimizer(name, model, **kw)
        t0 = time.perf_counter()
        opt.step()
        first = time.perf_counter() - t0
        for _ in range(args.warmup):
            opt.step()
        shapes = [p.shape for p in model.parameters()]
        runs[name] = {"opt": opt, "times": [], "first_step_s": first, "params": sum(s.numel() for s in shapes),
                      "measured": measured_state_bytes(opt),
                      "predicted": state_bytes(name, shapes, **kw)}
    for _ in range(args.repeats):
        for r in runs.values():
            t0 = time.perf_counter()
            r["opt"].step()
            r["times"].append(time.perf_counter() - t0)
    out = {}
    for name, r in runs.items():
        q = statistics.quantiles(r["times"], n=4)
        out[name] = {"settings": SETTINGS[name], "state_bytes_measured": r["measured"],
                     "state_bytes_predicted": r["predicted"],
                     "bytes_per_param": r["measured"] / r["params"],
                     "step_median_s": statistics.median(r["times"]), "step_q1_s": q[0], "step_q3_s": q[2],
                     "first_step_s": r["first_step_s"]}
        print(f"{name:10s} {out[name]['bytes_per_param']:7.4f} B/param (predicted "
              f"{r['predicted'] / r['params']:.4f})  step {out[name]['step_median_s'] * 1e3:8.1f} ms")
    result = {"benchmark": "optim_state_step", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "loadavg": os.getloadavg()},
              "parameters": next(iter(runs.values()))["params"], "optimizers": out}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
