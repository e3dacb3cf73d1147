"""``scaletrain plan --runs N``: N runs of one model on the cluster — the sweep's shard alternator against
N independent plans and task parallelism (:mod:`scaletrain.sweep.plan_runs`)."""

from __future__ import annotations

import argparse
import json
from typing import Callable

from scaletrain.errors import UserError


def run_runs(args: argparse.Namespace, resolve: Callable) -> int:
    """Print (or ``--json``) the layouts of ``--runs`` runs on each ``--platform``, fastest first."""
    from scaletrain.measure.report import parse_overrides
    from scaletrain.planner import budget as bud
    from scaletrain.sweep.plan_runs import price_runs

    for flag, v in (("--out", args.out), ("--timeline", args.timeline), ("--fix", args.fix),
                    ("--explain", args.explain), ("--objective cost", args.objective == "cost")):
        if v:
            raise UserError(f"{flag} is not supported with --runs; allowed there: --model, --set, --platform, "
                            "--nodes (one count), --gpus-per-node, --global-batch, --seq, --precision, --optimizer, "
                            "--json")
    nodes = bud.parse_nodes(args.nodes)
    if len(nodes) != 1:
        raise UserError(f"--runs prices one cluster: give one --nodes count (got {args.nodes})")
    out = []
    for name in args.platform or ["a100-80g"]:
        plat = resolve(name)
        layouts = price_runs(args.model, parse_overrides(args.set), plat, nodes=nodes[0],
                             gpus_per_node=args.gpus_per_node, runs=args.runs, global_batch=args.global_batch,
                             seq=args.seq, precision=args.precision, optimizer=args.optimizer)
        out.append({"platform": plat.name, "host_link": plat.host_link or "not stated",
                    "h2d_bytes_per_s": plat.h2d_bytes_per_s, "layouts": [x.to_dict() for x in layouts]})
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for o in out:
        print(f"{args.runs} runs of {args.model} (global batch {args.global_batch} each) on {nodes[0]} x "
              f"{args.gpus_per_node} {o['platform']} (host link {o['host_link']}, "
              f"{o['h2d_bytes_per_s'] / 1e9:.0f} GB/s): seconds per step of all runs, fastest first")
        for i, x in enumerate(o["layouts"], 1):
            s = x["step_s"]
            print(f"  {i}. {x['layout']:30s} {'does not fit' if s is None else f'{s:.3f} s':>12s}  {x['detail']}")
        best = o["layouts"][0]
        spilled = ("shard alternator", "task parallel (spilled shards)")
        rival = next((x for x in o["layouts"][1:] if (x["layout"] in spilled) != (best["layout"] in spilled)), None)
        if best["step_s"] is None:
            print("  -> nothing fits")
        elif rival is None or rival["step_s"] is None:
            kind = "spilled shards" if best["layout"] in spilled else "resident plans"
            print(f"  -> {kind}: the only kind that fits")
        else:
            print(f"  -> {best['layout']} wins, {rival['step_s'] / best['step_s']:.2f}x faster than {rival['layout']}")
    return 0
