"""``scaletrain compare``: the comparative study of strategies x device counts x models, as one command."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

from scaletrain.argtypes import positive_int

NAME = "compare"
HELP = "run the comparative study (strategies x devices x models) and write report.html, results.json/csv"
DESCRIPTION = """Runs every cell of the matrix strategies x device counts x models as `scaletrain train`
subprocesses with the same global batch, samples, optimizer and learning rate per model, repeats
interleaved, warm-up excluded; writes results.json (after every run: a rerun with the same --out
continues where it stopped), results.csv and report.html (figures embedded, opens offline): time per
fixed samples and speedup vs devices, validation vs step and vs seconds, per-device peak memory by
category, time per phase of a step, the survey's findings marked reproduced or not, every figure
beside the cost model's prediction.

examples:
  scaletrain compare --quick --out runs/compare
  scaletrain compare --models gpt2-mini --devices 1,2 --strategies ddp,zero3,1f1b --repeats 3
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaletrain.compare.matrix import MODELS, STRATEGIES

    p.add_argument("--quick", action="store_true", help="the quick study (under 10 minutes here): gpt2-mini and "
                   "vgg-mini, 1/2/4 devices, ddp, zero3, tp, 1f1b, pipedream2bw, deepspeed-zero3; 1 repeat, 12 steps")
    p.add_argument("--out", metavar="DIR", help="study directory (default runs/compare-<timestamp>); reuse it to "
                   "continue a stopped study")
    p.add_argument("--models", metavar="A,B", help=f"models (of {', '.join(MODELS)})")
    p.add_argument("--devices", metavar="1,2,4", help="process counts (default 1,2,4)")
    p.add_argument("--strategies", metavar="A,B", help=f"strategies (of {', '.join(STRATEGIES)})")
    p.add_argument("--repeats", type=positive_int(1000), metavar="R",
                   help="runs per cell, interleaved (default 3; --quick 1)")
    p.add_argument("--steps", type=positive_int(1 << 24), metavar="S",
                   help="optimizer steps per run (default: the model's; --quick 12)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of progress lines")


def run(args: argparse.Namespace) -> int:
    from scaletrain.compare import environment, matrix, report, results, runner
    from scaletrain.errors import ConfigError

    base = matrix.QUICK if args.quick else matrix.FULL
    models = matrix.parse_list(args.models, tuple(matrix.MODELS), "model") if args.models else base["models"]
    strategies = (matrix.parse_list(args.strategies, tuple(matrix.STRATEGIES), "strategy") if args.strategies
                  else base["strategies"])
    devices = matrix.parse_devices(args.devices) if args.devices else base["devices"]
    repeats = args.repeats if args.repeats is not None else base["repeats"]
    if repeats < 1:
        raise ConfigError(f"--repeats={repeats} is not allowed; must be >= 1")
    steps = args.steps if args.steps is not None else (matrix.QUICK_STEPS if args.quick else None)
    if steps is not None and steps < 6:
        raise ConfigError(f"--steps={steps} is not allowed; must be >= 6 (2 warm-up, 1 profiled, 1 memory-tracked "
                          f"and at least 2 timed steps)")
    out = Path(args.out or Path("runs") / f"compare-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    cells = matrix.build(models, strategies, devices, steps)
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    log(f"scaletrain compare: {len(cells)} cells ({len(models)} models x {len(strategies)} strategies x "
        f"{len(devices)} device counts), {repeats} repeat(s), in {out}")
    t0 = time.perf_counter()
    env_before = environment.snapshot()
    runs_before = sum(len(r["runs"]) for r in results.load(out / "results.json"))
    records = runner.run_study(cells, out, repeats, log)
    ran = sum(len(r["runs"]) for r in records) > runs_before
    study = environment.study(env_before, time.perf_counter() - t0, cells, repeats, sys.argv)
    study = environment.save(study, out, ran)
    page = report.write(records, study, out / "report.html")
    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    if args.json:
        print(json.dumps({"out": str(out), "report": str(page), "cells": len(records), "status": counts,
                          "seconds": study["seconds"]}))
    else:
        print(f"{len(records)} cells ({', '.join(f'{v} {k}' for k, v in counts.items())}) in "
              f"{study['seconds']:.0f} s; report {page}")
    return 0
