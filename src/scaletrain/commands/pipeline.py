"""``scaletrain pipeline``: simulate a pipeline schedule — step time, bubble, in-flight micro-batches."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from scaletrain.argtypes import (MAX_MICROBATCHES, MAX_PIPELINE_PASSES, MAX_PIPELINE_RANKS, MAX_VIRTUAL, bounded,
                                 check_output, positive_float, positive_int)
from scaletrain.errors import UserError

NAME = "pipeline"
HELP = "simulate a pipeline schedule: step time, bubble fraction, peak in-flight micro-batches per rank"
DESCRIPTION = """\
Simulate one pipeline-parallel schedule with a discrete-event model and report the step time,
the bubble fraction (idle time / (ranks x step time)) and the peak number of micro-batch
activations each rank holds.

Costs are unit costs (each rank's share of the forward = 1, backward = 2, split backward
I = W = 1) unless --model names a reference model (estimated on fake tensors: FLOPs at a nominal
FLOP/s, so times are indicative) or --profile gives a Profile JSON; its blocks are then split
into stages by the memory-aware partitioner (or equally with --equal-split).

Schedules: gpipe, 1f1b, interleaved (--virtual v, M divisible by P), zb1p, chimera (even P and M),
pipedream, pipedream-2bw (asynchronous: steady-state step over --steps windows).

examples:
  scaletrain pipeline --schedule 1f1b --ranks 4 --microbatches 8
  scaletrain pipeline --schedule interleaved --ranks 4 --microbatches 8 --virtual 2 --png tl.png
  scaletrain pipeline --schedule chimera --ranks 4 --microbatches 4 --json
  scaletrain pipeline --schedule 1f1b --ranks 2 --microbatches 4 --model gpt2-tiny --batch 2
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb1p, chimera, pipedream, "
                   "pipedream-2bw (default 1f1b)")
    p.add_argument("--ranks", "-P", type=positive_int(MAX_PIPELINE_RANKS), default=4,
                   help="pipeline ranks P (default 4)")
    p.add_argument("--microbatches", "-M", type=positive_int(MAX_MICROBATCHES), default=8,
                   help="micro-batches per step M (default 8)")
    p.add_argument("--virtual", "-v", type=positive_int(MAX_VIRTUAL), default=None,
                   help="stages per rank for interleaved (default 2 there, 1 elsewhere)")
    p.add_argument("--steps", type=positive_int(64), default=None,
                   help="steps to lay out (default 1; 4 for the asynchronous schedules, steady state measured)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="reference model to estimate per-block costs for (e.g. gpt2-tiny)")
    src.add_argument("--profile", type=Path, default=None, help="Profile JSON giving per-block costs (seconds, bytes)")
    p.add_argument("--batch", type=positive_int(), default=1, help="with --model: micro-batch size (default 1)")
    p.add_argument("--seq", type=positive_int(), default=None,
                   help="with --model: sequence length (default: the model's)")
    p.add_argument("--equal-split", action="store_true", help="with --profile: equal-blocks stages instead of the DP")
    p.add_argument("--bandwidth-gbps", type=positive_float(infinite=True), default=math.inf,
                   help="point-to-point bandwidth in GB/s (1e9 bytes/s) for boundary tensors (default: infinite)")
    p.add_argument("--latency-us", type=bounded(float, 0.0, 1e9), default=0.0,
                   help="per-message latency in microseconds (default 0)")
    p.add_argument("--memory-limit-gib", type=positive_float(infinite=True), default=math.inf,
                   help="per-rank memory limit for the partitioner")
    p.add_argument("--bytes-per-param", type=positive_float(1e6), default=16.0,
                   help="weights+grads+optimizer bytes per parameter (default 16, fp32 Adam)")
    p.add_argument("--png", type=Path, default=None, help="write a timeline PNG (ranks x time) here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _load_profile(path: Path):
    from scaletrain.measure.types import Profile

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--profile {path}: no such file") from None
    except UnicodeDecodeError:
        raise UserError(f"--profile {path}: not UTF-8 text (a Profile JSON from `scaletrain profile --json`)") from None
    except OSError as e:
        raise UserError(f"--profile {path}: cannot be read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--profile {path}: not JSON ({e.msg} at line {e.lineno})") from None
    try:
        return Profile.from_dict(data)
    except (TypeError, KeyError) as e:
        raise UserError(f"--profile {path}: not a scaletrain Profile ({e})") from None


def run(args: argparse.Namespace) -> int:
    from scaletrain.techniques.pipeline import Link, build, simulate

    if args.png is not None:
        if args.png.suffix.lower() != ".png":
            raise UserError(f"--png {args.png}: the timeline is a PNG; give a FILE.png")
        check_output("--png", args.png)
    v = args.virtual if args.virtual is not None else (2 if args.schedule == "interleaved" else 1)
    steps = args.steps or (4 if args.schedule.startswith("pipedream") else 1)
    passes = args.ranks * args.microbatches * v * steps
    if passes > MAX_PIPELINE_PASSES:
        raise UserError(f"--ranks {args.ranks} x --microbatches {args.microbatches} x --virtual {v} x --steps "
                        f"{steps} = {passes:,} passes to simulate; allowed: at most {MAX_PIPELINE_PASSES:,}")
    sched = build(args.schedule, args.ranks, args.microbatches, v, args.steps)
    link = Link(args.bandwidth_gbps * 1e9, args.latency_us * 1e-6)
    costs, units, split = None, "unit", None
    if args.profile is not None or args.model is not None:
        from scaletrain.techniques.pipeline import partition as pt

        if args.model is not None:
            from scaletrain.measure.estimate import estimate_step

            prof = estimate_step(args.model, batch=args.batch, seq=args.seq).profile
        else:
            prof = _load_profile(args.profile)
        kw = dict(n_ranks=args.ranks, schedule=args.schedule, n_microbatches=args.microbatches, virtual=v,
                  bytes_per_param=args.bytes_per_param, bandwidth_Bps=link.bandwidth_Bps, latency_s=link.latency_s)
        if args.equal_split:
            bounds = pt.equal_bounds(len(prof.blocks), args.ranks * v)
        else:
            bounds = pt.partition(prof, memory_limit_bytes=args.memory_limit_gib * pt.GiB, **kw).bounds
        split, costs = pt.evaluate(prof, bounds, **kw)
        units = "s"
    res = simulate(sched, costs, link)
    out = res.to_dict()
    # without --model/--profile every pass costs 1: times are counted in forward passes of one micro-batch
    out.update(virtual=v, steps=sched.n_steps, time_unit="s" if units == "s" else "forward_pass",
               asynchronous=sched.asynchronous)
    if split is not None:
        out.update(stage_bounds=split.bounds, stage_time_s=split.stage_time_s,
                   partition_rank_memory_bytes=split.rank_memory_bytes)
    if args.png:
        from scaletrain.techniques.pipeline.timeline import draw

        title = (f"{args.schedule} P={args.ranks} M={args.microbatches}" + (f" v={v}" if v > 1 else "")
                 + f"  bubble {res.bubble_fraction:.3f}")
        out["png"] = str(draw(res.events, args.png, title=title, n_ranks=args.ranks,
                              time_unit="unit" if units == "unit" else None))
    if args.json:
        print(json.dumps(out))
        return 0
    t = (lambda x: f"{x:.3f} units") if units == "unit" else (lambda x: f"{x * 1e3:.3f} ms")
    print(f"schedule {args.schedule}  P={args.ranks}  M={args.microbatches}" + (f"  v={v}" if v > 1 else "")
          + ("  (asynchronous: steady state)" if sched.asynchronous else ""))
    source = f"{args.model} (estimated)" if args.model else str(args.profile)
    print(f"costs    {'unit (F=1, B=2, I=W=1 per rank share)' if units == 'unit' else source}")
    print(f"step     {t(res.step_time_s)}")
    print(f"bubble   {res.bubble_fraction:.4f}")
    print(f"{'rank':>4}  {'bubble':>7}  {'peak in-flight':>14}  {'weight versions':>15}" +
          ("  peak memory GiB" if units == "s" else ""))
    for r in range(args.ranks):
        mem = f"  {res.peak_memory_bytes[r] / 2**30:16.3f}" if units == "s" else ""
        print(f"{r:>4}  {res.bubble_per_rank[r]:7.4f}  {res.peak_inflight[r]:>14}  "
              f"{res.peak_weight_versions[r]:>15}{mem}")
    if split is not None:
        print(f"stages   blocks {split.bounds}  (stage times ms: "
              + ", ".join(f"{x * 1e3:.2f}" for x in split.stage_time_s) + ")")
    if args.png:
        print(f"timeline {out['png']}")
    return 0
