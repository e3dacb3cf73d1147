"""``scaletrain plan``: the fastest (or cheapest) plan that fits, on paper — ranked, explained, with what was
ruled out; optionally across platforms and node counts, priced for a whole training run, and drawn."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scaletrain.argtypes import check_output, count, positive_float, positive_int
from scaletrain.errors import UserError

NAME = "plan"
HELP = "choose the fastest plan that fits any model on a platform (priced on paper, nothing run)"
DESCRIPTION = """Search data / tensor (+ sequence) / pipeline / expert parallelism, schedule and virtual stages,
micro-batch, ZeRO stage and rematerialization (none / selective / full) for a model on --nodes x
--gpus-per-node devices of a --platform, price every runnable plan (step time by phase, per-rank peak by
category) and rank those that fit. Decoder shapes (gpt2-*, hf:llama, hf:mistral, llama3.1-8b) are priced
analytically (scaletrain.planner.cost), so any size is free; every other model the runtime trains
(vgg-mini, resnet-mini, mlp, gpt2-moe, hf:gpt2, hf:bert, py:module:factory) is built on the meta device
and priced by its fake-tensor trace, the cost model of `scaletrain estimate` (scaletrain.planner.traced).

Budgeted training: --tokens or --samples states the run, so each plan gets its training time and, with a
price per device-hour (platform field price_per_device_hour, or --price NAME=USD), its cost = devices x
hours x price. --objective cost ranks by that cost; with several --platform and a list of --nodes it
answers how many devices of which platform to rent. --deadline and --max-cost reject what breaks them.

examples:
  scaletrain plan --model gpt2-xl --platform a100-80g --nodes 4 --gpus-per-node 8 --global-batch 512 --seq 1024
  scaletrain plan --model gpt2-small --set n_layer=96 --set n_embd=12288 --set n_head=96 --set vocab_size=51200 \\
      --set n_positions=2048 --platform a100-80g --nodes 128 --gpus-per-node 8 --global-batch 1536 --seq 2048 \\
      --fix tp=8 --json
  scaletrain plan --model gpt2-xl --platform a100-80g --platform h100 --price a100-80g=2.00 --price h100=3.25 \\
      --nodes 1,2,4,8 --global-batch 512 --seq 1024 --tokens 30e9 --objective cost --deadline 3d --timeline step.png
  scaletrain plan --model gpt2-xl --platform a100-80g:2,v100:2 --global-batch 64     # heterogeneous devices
  scaletrain plan --model llama3.1-8b --platform gh200 --gpus-per-node 4 --runs 8 --global-batch 32 --seq 2048
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="any model `scaletrain train` takes: a reference model, llama3.1-8b, "
                        "hf:gpt2|llama|mistral|bert with --set, or py:module:factory (see `scaletrain models`)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model config override, e.g. --set n_layer=96 (repeatable)")
    p.add_argument("--platform", action="append", default=None,
                   help="preset (a100-80g, a100-40g, h100, h200, gh200, v100) or a platform JSON file "
                        "(default a100-80g); "
                        "repeatable: the platforms are searched and ranked together; a heterogeneous cluster: "
                        "NAME:COUNT,... (a100-80g:2,v100:2, stage order) or a JSON file {\"devices\": [{\"platform\", "
                        "\"count\"}]}: per-device batches and layers (scaletrain.planner.hetero)")
    p.add_argument("--nodes", default="1", help="nodes: one count, a list or ranges, e.g. 4, 1,2,4 or 1-8 (default 1)")
    p.add_argument("--gpus-per-node", type=positive_int(1024), default=8, help="devices per node (default 8)")
    p.add_argument("--global-batch", type=positive_int(), required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=count(), default=0, help="tokens per sequence (default: the model's n_positions)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help="pin a dimension: dp, tp, pp, cp, ep, zero, hsdp, micro_batch, schedule, virtual, remat, sp, "
                        "params_dtype, attention, pp_split (profile|equal: parallel.balance), offload "
                        "(none|optimizer) (repeatable)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"), help="compute precision")
    p.add_argument("--optimizer", default="adamw", help="optimizer (default adamw)")
    p.add_argument("--tokens", metavar="N", help="the training run: tokens in total, e.g. 300e9")
    p.add_argument("--samples", metavar="N", help="the training run: sequences in total (instead of --tokens)")
    p.add_argument("--objective", default="time", choices=("time", "cost"),
                   help="rank by predicted step time (default) or by the run's cost (needs --tokens/--samples "
                        "and a price)")
    p.add_argument("--price", action="append", default=[], metavar="PLATFORM=USD",
                   help="USD per device-hour for a --platform by name, e.g. h100=3.25 (repeatable; overrides "
                        "the platform's price_per_device_hour)")
    p.add_argument("--deadline", metavar="TIME", help="reject plans whose run takes longer: seconds or 90m, 2h, 3d")
    p.add_argument("--max-cost", type=positive_float(), metavar="USD", help="reject plans whose run costs more (USD)")
    p.add_argument("--runs", type=positive_int(1 << 16), default=0, metavar="N",
                   help="price N runs of the model together: the sweep's shard alternator (spilled shards) against "
                        "N independent plans and task parallelism (scaletrain.sweep.plan_runs)")
    p.add_argument("--top", type=positive_int(1 << 20), default=5, help="plans to list (default 5)")
    p.add_argument("--json", action="store_true", help="print the ranked list as JSON (an array, best first)")
    p.add_argument("--json-rejected", action="store_true",
                   help="with --json: an object with the ranked list, the rejected regions and the search's size")
    p.add_argument("--explain", type=count(1 << 20), default=0, metavar="N",
                   help="full breakdown of the N-th plan (1 = best)")
    p.add_argument("--out", metavar="FILE", help="write the best plan as a plan TOML for `scaletrain train --plan`")
    p.add_argument("--timeline", metavar="FILE.png",
                   help="draw one predicted step of the best plan (or of --explain N's) per pipeline rank, in ms")


def _platform(name: str):
    from scaletrain import platform as platforms

    path = Path(name)
    if name.endswith(".json"):
        if not path.is_file():
            raise UserError(f"--platform {name}: no such file")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"--platform {name}: not a JSON object of platform fields ({e})") from None
        if not isinstance(data, dict):
            raise UserError(f"--platform {name}: not a JSON object of platform fields")
        try:
            return platforms.Platform.from_dict(data)
        except TypeError as e:
            raise UserError(f"--platform {name}: {e}") from None
    if name.lower() == "local":
        raise UserError("--platform local: calibrate() describes this CPU, not a GPU cluster; give a preset or a file")
    return platforms.get(name)


def _check(args: argparse.Namespace) -> None:
    for flag, v in (("--gpus-per-node", args.gpus_per_node), ("--global-batch", args.global_batch),
                    ("--top", args.top)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1 (got {v})")
    if args.seq < 0 or args.explain < 0:
        raise UserError("--seq and --explain must be >= 0")
    if args.tokens and args.samples:
        raise UserError("--tokens and --samples both state the training run; give one")
    if args.timeline and not args.timeline.lower().endswith(".png"):
        raise UserError(f"--timeline {args.timeline}: the timeline is a PNG; give a FILE.png")
    for flag, path in (("--out", args.out), ("--timeline", args.timeline)):
        if path:
            check_output(flag, path)


def _check_platform(plat, nodes: int, gpus_per_node: int) -> None:
    """The figures the cost model divides by, present and positive (a platform file may lack them)."""
    need = ["device_memory_bytes", "flops_bf16", "flops_fp32", "device_mem_bytes_per_s", "intra_node_efficiency",
            "inter_node_efficiency"]
    if gpus_per_node > 1:
        need.append("intra_node_bytes_per_s")
    if nodes > 1:
        need.append("inter_node_bytes_per_s")
    for k in need:
        v = getattr(plat, k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UserError(f"platform {plat.name!r}: {k} must be a number > 0 for {nodes} node(s) of "
                            f"{gpus_per_node} device(s) (got {v!r})")
    for k in ("matmul_efficiency", "mem_efficiency"):
        if not all(0 < f <= 1 for _, f in getattr(plat, k)):
            raise UserError(f"platform {plat.name!r}: {k} fractions must be in (0, 1]")
    price = plat.price_per_device_hour
    if isinstance(price, bool) or not isinstance(price, (int, float)) or not price >= 0:
        raise UserError(f"platform {plat.name!r}: price_per_device_hour must be a number >= 0 (USD per device-hour; "
                        f"0 = unknown), got {price!r}")


def _platforms(args: argparse.Namespace, nodes: list[int]) -> list:
    """The --platform list (presets or files), checked, with --price applied by platform name."""
    plats = [_platform(n) for n in (args.platform or ["a100-80g"])]
    names = [p.name for p in plats]
    for n in names:
        if names.count(n) > 1:
            raise UserError(f"--platform: two platforms are named {n!r}; give each file its own \"name\"")
    for item in args.price:
        name, sep, usd = item.partition("=")
        try:
            price = float(usd) if sep else -1.0
        except ValueError:
            price = -1.0
        if not price > 0:
            raise UserError(f"--price {item!r}: expected PLATFORM=USD per device-hour > 0, e.g. h100=3.25")
        if name not in names:
            raise UserError(f"--price {item!r}: no --platform named {name!r}; given: {', '.join(names)}")
        plats[names.index(name)] = plats[names.index(name)].with_(price_per_device_hour=price)
    for p in plats:
        _check_platform(p, max(nodes), args.gpus_per_node)
    return plats


def run(args: argparse.Namespace) -> int:
    from scaletrain.measure.report import parse_overrides
    from scaletrain.planner import budget as bud
    from scaletrain.planner.api import entry, rank
    from scaletrain.planner.hetero import is_cluster
    from scaletrain.planner.shape import analytic

    _check(args)
    if args.platform and any(is_cluster(p) for p in args.platform):  # a100-80g:2,v100:2 or a cluster file
        from scaletrain.commands._plan_cluster import run_cluster

        return run_cluster(args, _platform)
    if args.runs:  # N runs of the model: the sweep's shard alternator vs independent plans vs task parallelism
        from scaletrain.commands._plan_runs import run_runs

        return run_runs(args, _platform)
    nodes = bud.parse_nodes(args.nodes)
    plats = _platforms(args, nodes)
    workload = bud.Workload(tokens=bud.parse_count("--tokens", args.tokens) if args.tokens else 0.0,
                            samples=bud.parse_count("--samples", args.samples) if args.samples else 0.0)
    deadline = bud.parse_duration(args.deadline) if args.deadline else None
    if args.timeline and not analytic(args.model):
        raise UserError(f"--timeline draws the analytic planner's step of a decoder shape; {args.model} is priced by "
                        f"its trace: see `scaletrain estimate --model {args.model} --platform ...` for its phases")
    shape, seq, res = rank(args.model, parse_overrides(args.set), plats, nodes, gpus_per_node=args.gpus_per_node,
                           global_batch=args.global_batch, seq=args.seq, fix=args.fix, precision=args.precision,
                           optimizer=args.optimizer, workload=workload, objective=args.objective,
                           deadline_s=deadline, max_cost=args.max_cost)
    best = res.ranked[0]
    if args.explain > len(res.ranked):
        raise UserError(f"--explain {args.explain}: only {len(res.ranked)} plans fit")
    chosen = res.ranked[args.explain - 1] if args.explain else best
    if args.out:
        Path(args.out).write_text(best.cost.plan.to_toml(), encoding="utf-8")
    if args.timeline:
        from scaletrain.planner.timeline import draw_step, step_timeline

        tl = step_timeline(chosen.cost, shape, chosen.platform, global_batch=args.global_batch, seq=seq)
        draw_step(tl, args.timeline, title=f"{args.model} ({shape.params() / 1e9:.2f}B) on {chosen.where}: {tl.title}")
    top = res.ranked[:args.top]
    if args.json:  # the ranked list itself, best first (the schema); --json-rejected adds the rest
        ranked = [entry(r, best, args.objective) for r in top]
        if args.json_rejected:
            print(json.dumps({"model": args.model, "platform": best.platform.name, "world": best.devices,
                              "platforms": [p.name for p in plats], "nodes": nodes, "objective": args.objective,
                              "global_batch": args.global_batch, "seq": seq, "evaluated": res.evaluated,
                              "seconds": res.seconds, "ranked": ranked, "rejected": res.rejected}, indent=1))
        else:
            print(json.dumps(ranked, indent=1))
        return 0
    _print(args, shape, seq, plats, nodes, workload, res, top)
    if args.explain:
        _explain(args.explain, chosen, shape)
    if args.timeline:
        print(f"wrote {args.timeline}: one predicted step of plan {args.explain or 1} ({chosen.where})")
    if args.out:  # the plan file holds how to train; what to train stays on the command line
        sets = "".join(f" model.overrides.{kv}" for kv in args.set)
        print(f"wrote {args.out}; run it with: scaletrain train --nproc-per-node {best.gpus_per_node} "
              f"--plan {args.out} "
              f"model.name={args.model}{sets} train.global_batch={args.global_batch}"
              + (f" data.seq_len={seq}" if seq else ""))
    return 0


def _n(n: float) -> str:
    """A parameter count: billions (as before), or millions / thousands for small models."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else (f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K")


def _ms(s: float) -> str:
    """Seconds as milliseconds: whole ones from 10 ms, three significant figures below."""
    return f"{s * 1e3:.0f}" if s >= 0.01 else f"{s * 1e3:.3g}"


def _gib(b: float) -> str:
    """Bytes as GiB with one decimal, or as MiB below 0.1 GiB (small models)."""
    return f"{b / 2**30:.1f}" if b >= 0.1 * 2**30 or b == 0 else f"{b / 2**20:.1f} MiB"


def _print(args, shape, seq, plats, nodes, workload, res, top) -> None:
    """The ranked list as text: header, each plan, by rental (when several), rejected regions."""
    from scaletrain.planner import budget as bud

    several = len(res.searches) > 1
    best = res.ranked[0]
    if several:
        print(f"{args.model} ({_n(shape.params())} parameters) on {', '.join(p.name for p in plats)} x "
              f"{', '.join(map(str, nodes))} node(s) of {args.gpus_per_node}, global batch {args.global_batch}"
              f"{f' x {seq} tokens' if seq else ' samples'}: {len(res.ranked)} plans kept of {res.evaluated} priced "
              f"in {res.seconds:.1f} s")
    else:
        plat = plats[0]
        print(f"{args.model} ({_n(shape.params())} parameters) on {nodes[0]} x {args.gpus_per_node} "
              f"{plat.name} ({plat.device_memory_bytes / 2**30:.0f} GiB each), global batch {args.global_batch}"
              f"{f' x {seq} tokens' if seq else ' samples'}: {len(res.ranked)} plans fit of {res.evaluated} priced "
              f"in {res.seconds:.1f} s")
    if workload.stated:
        print(f"training run: {workload.describe()} = {best.steps:,} steps; ranked by "
              + ("the run's cost" if args.objective == "cost" else "predicted step time"))
    for i, r in enumerate(top, 1):
        c, p, pk = r.cost, r.cost.plan, r.cost.peak_bytes
        print(f"{i}. {(r.where + ': ') if several else ''}{p.describe()}, micro-batch {p.micro_batch}"
              + (f" x {p.microbatches} per step" if p.pp > 1 else f" x {args.global_batch // (p.dp * p.micro_batch)} "
                 f"accumulated"))
        print(f"   step {_ms(c.step_time_s)} ms, {c.tokens_per_s:,.0f} {'tokens' if seq else 'samples'}/s, "
              f"{c.tflops_per_device:.0f} TFLOP/s per device, MFU {c.mfu:.1%}, bubble {c.bubble_fraction:.1%}, "
              f"exposed comm {_ms(c.exposed_comm_s)} ms")
        print(f"   peak {_gib(pk['total'])} of {c.device_bytes / 2**30:.0f} GiB ({c.heaviest_rank}"
              f"{' stage' if c.heaviest_rank in ('first', 'last') else ''}): "
              + ", ".join(f"{k} {_gib(v)}" for k, v in pk.items() if k != "total" and v))
        if len(set(c.stage_layers)) > 1:
            print(f"   layers per pipeline rank: {'+'.join(map(str, c.stage_layers))} (the runtime's split, "
                  f"parallel.balance={p.balance})")
        if r.steps:
            print(f"   run: {bud.fmt_duration(r.train_time_s)} on {r.where}, "
                  + (f"{bud.fmt_usd(r.train_cost)} at {bud.fmt_usd(r.platform.price_per_device_hour)} per device-hour"
                     if r.train_cost is not None else f"cost unknown ({r.platform.name} has no price_per_device_hour)"))
        if i > 1:
            print(f"   lost: {bud.why_lost(best, r, args.objective)}")
    if several:
        print("by rental (the best plan kept on each):")
        for row in bud.by_rental(res):
            b = row["best"]
            name = f"{row['devices']} x {row['platform']}"
            if b is None:
                print(f"  {name:>18s}: {row['why']}")
                continue
            run = (f", run {bud.fmt_duration(b.train_time_s)}" if b.steps else "") + (
                f", {bud.fmt_usd(b.train_cost)}" if b.train_cost is not None else "")
            print(f"  {name:>18s}: step {b.cost.step_time_s * 1e3:.0f} ms{run} ({b.cost.plan.describe()})")
    if res.rejected:
        print("rejected:")
        for r in res.rejected[:12]:
            print(f"  {r['region']}" + (f" (+{r['count'] - 1} alike)" if r["count"] > 1 else "") + f": {r['reason']}")
        if len(res.rejected) > 12:
            print(f"  ... {len(res.rejected) - 12} more (--json lists all)")


def _explain(n: int, r, shape) -> None:
    """Plan ``n`` in full: one micro-batch per block, the step by phase, the heaviest rank's peak."""
    c, p = r.cost, r.cost.plan
    print(f"plan {n} in full: {p.describe()}, micro-batch {p.micro_batch}")
    if c.blocks_s:  # the analytic planner's per-layer figures (a traced model's are in `scaletrain estimate`)
        print(f"  one micro-batch on one rank ({shape.layers // p.pp} layers per pipeline rank):")
    for k, v in c.blocks_s.items():
        print(f"    {k:22s} {_ms(v):>10s} ms")
    print("  the step by phase:")
    for k, v in c.phases_s.items():
        print(f"    {k:22s} {_ms(v):>10s} ms")
    print(f"    {'step':22s} {_ms(c.step_time_s):>10s} ms")
    stage = " stage" if c.heaviest_rank in ("first", "last") else ""
    print(f"  the heaviest rank ({c.heaviest_rank}{stage}) at its peak:")
    for k, v in c.peak_bytes.items():
        print(f"    {k:22s} {_gib(v):>10s}" + ("" if _gib(v).endswith("MiB") else " GiB"))
    print(f"    {'device':22s} {c.device_bytes / 2**30:10.2f} GiB (2 GiB of it reserved)")
