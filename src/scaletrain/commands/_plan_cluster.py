"""``scaletrain plan --platform a100-80g:2,v100:2``: a heterogeneous cluster's plans (:mod:`scaletrain.planner.hetero`)
— per-replica batches and per-stage layers sized to each device, beside the even split they beat."""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable

from scaletrain.errors import UserError


def run_cluster(args: argparse.Namespace, resolve: Callable) -> int:
    """Print (or ``--json``) the data-parallel and pipeline layouts of ``args.platform``'s cluster."""
    from scaletrain.measure.report import parse_overrides
    from scaletrain.planner import hetero
    from scaletrain.planner.shape import Shape, analytic

    if len(args.platform) != 1:
        raise UserError("--platform NAME:COUNT,...: give the whole cluster in one --platform (e.g. a100-80g:2,v100:2)")
    for flag, v in (("--out", args.out), ("--timeline", args.timeline), ("--tokens", args.tokens),
                    ("--samples", args.samples), ("--fix", args.fix), ("--price", args.price)):
        if v:
            raise UserError(f"{flag} is not supported with a heterogeneous --platform list; allowed there: --model, "
                            "--set, --global-batch, --seq, --precision, --optimizer, --json")
    if not analytic(args.model):
        raise UserError(f"a heterogeneous --platform list is priced for decoder shapes (gpt2-*, hf:llama, ...); "
                        f"{args.model} is not one")
    plats = hetero.parse_cluster(args.platform[0], resolve)
    shape = Shape.of(args.model, **parse_overrides(args.set))
    seq = args.seq or shape.positions
    plans = hetero.plan_cluster(shape, plats, global_batch=args.global_batch, seq=seq, precision=args.precision,
                                optimizer=args.optimizer)
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=1))
        return 0
    print(f"{args.model} on {len(plats)} devices ({', '.join(p.name for p in plats)}), global batch "
          f"{args.global_batch} x {seq} tokens: {len(plans)} layout(s), fastest first")
    for i, h in enumerate(plans, 1):
        what = "samples per replica" if h.kind == "data" else "layers per stage"
        even = "does not fit" if math.isinf(h.even_step_s) else f"{h.even_step_s * 1e3:.0f} ms"
        print(f"{i}. {'data parallel' if h.kind == 'data' else 'pipeline (1F1B)'}: {what} "
              f"{'+'.join(map(str, h.split))} (even {'+'.join(map(str, h.even))})")
        print(f"   step {h.step_s * 1e3:.0f} ms; even split {even}"
              + ("" if math.isinf(h.even_step_s) else f" -> {h.margin:.2f}x faster"))
        print("   peak " + ", ".join(f"{d} {b / 2**30:.1f}/{c / 2**30:.0f} GiB" + (f" (micro-batch {m})" if h.kind ==
                                      "data" else "") for d, b, c, m in zip(h.devices, h.peak_bytes, h.device_bytes,
                                                                             h.micro_batch)))
        print(f"   {h.notes}")
    return 0
