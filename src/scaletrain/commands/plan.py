"""``scaletrain plan``: the fastest plan that fits, on paper — ranked, explained, with what was ruled out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scaletrain.errors import UserError

NAME = "plan"
HELP = "choose the fastest plan that fits a GPT-style model on a platform (analytic, nothing run)"
DESCRIPTION = """Search data / tensor (+ sequence) / pipeline parallelism, schedule and virtual stages,
micro-batch, ZeRO stage and rematerialization (none / selective / full) for a GPT-2-style model on
--nodes x --gpus-per-node devices of a --platform, price every runnable plan analytically
(scaletrain.planner.cost: step time by phase, per-rank peak by category) and rank those that fit.

examples:
  scaletrain plan --model gpt2-xl --platform a100-80g --nodes 4 --gpus-per-node 8 --global-batch 512 --seq 1024
  scaletrain plan --model gpt2-small --set n_layer=96 --set n_embd=12288 --set n_head=96 --set vocab_size=51200 \\
      --set n_positions=2048 --platform a100-80g --nodes 128 --gpus-per-node 8 --global-batch 1536 --seq 2048 \\
      --fix tp=8 --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a gpt2-* reference model (shape; see `scaletrain models`)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model config override, e.g. --set n_layer=96 (repeatable)")
    p.add_argument("--platform", default="a100-80g", help="preset (a100-80g, a100-40g, h100, h200, v100) or a "
                                                          "platform JSON file (default a100-80g)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: the model's n_positions)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help="pin a dimension: dp, tp, pp, zero, micro_batch, schedule, virtual, remat, sp (repeatable)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"), help="compute precision")
    p.add_argument("--optimizer", default="adamw", help="optimizer (default adamw)")
    p.add_argument("--top", type=int, default=5, help="plans to list (default 5)")
    p.add_argument("--json", action="store_true", help="print the ranked list as JSON (an array, best first)")
    p.add_argument("--json-rejected", action="store_true",
                   help="with --json: an object with the ranked list, the rejected regions and the search's size")
    p.add_argument("--explain", type=int, default=0, metavar="N", help="full breakdown of the N-th plan (1 = best)")
    p.add_argument("--out", metavar="FILE", help="write the best plan as a plan TOML for `scaletrain train --plan`")


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
    for flag, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                    ("--global-batch", args.global_batch), ("--top", args.top)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1 (got {v})")
    if args.seq < 0 or args.explain < 0:
        raise UserError("--seq and --explain must be >= 0")


def _check_platform(plat, args: argparse.Namespace) -> None:
    """The figures the cost model divides by, present and positive (a platform file may lack them)."""
    need = ["device_memory_bytes", "flops_bf16", "flops_fp32", "device_mem_bytes_per_s", "intra_node_efficiency",
            "inter_node_efficiency"]
    if args.gpus_per_node > 1:
        need.append("intra_node_bytes_per_s")
    if args.nodes > 1:
        need.append("inter_node_bytes_per_s")
    for k in need:
        v = getattr(plat, k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UserError(f"platform {plat.name!r}: {k} must be a number > 0 for {args.nodes} node(s) of "
                            f"{args.gpus_per_node} device(s) (got {v!r})")
    for k in ("matmul_efficiency", "mem_efficiency"):
        if not all(0 < f <= 1 for _, f in getattr(plat, k)):
            raise UserError(f"platform {plat.name!r}: {k} fractions must be in (0, 1]")


def entry(c, best=None) -> dict:
    """One ranked plan as JSON (the issue's schema, plus phases and bubble)."""
    from scaletrain.planner.search import why_lost

    # "plan" is the Plan's own JSON (flat fields, remat and offload as objects): `scaletrain train --plan`
    # reads this entry back; "summary" says the same in a few words (remat none / selective / full ...)
    d = {"plan": c.plan.to_dict(), "summary": c.to_dict()["plan"], "describe": c.plan.describe(), "fits": c.fits, "step_time_s": c.step_time_s, "tokens_per_s": c.tokens_per_s,
         "tflops_per_device": c.tflops_per_device, "mfu": c.mfu, "peak_bytes": c.peak_bytes["total"],
         "peak_bytes_by_category": c.peak_bytes, "device_bytes": c.device_bytes, "heaviest_rank": c.heaviest_rank,
         "bubble_fraction": c.bubble_fraction, "exposed_comm_s": c.exposed_comm_s, "phases_s": c.phases_s,
         "blocks_s": c.blocks_s}
    if best is not None and best is not c:
        d["why_not_first"] = why_lost(best, c)
    return d


def run(args: argparse.Namespace) -> int:
    from scaletrain.measure.report import parse_overrides
    from scaletrain.planner import Shape, search
    from scaletrain.planner.search import parse_fixed, why_lost

    _check(args)
    shape = Shape.of(args.model, **parse_overrides(args.set))
    plat = _platform(args.platform)
    _check_platform(plat, args)
    fixed = parse_fixed(args.fix)
    seq = args.seq or shape.positions
    if seq > shape.positions:
        raise UserError(f"--seq {seq} exceeds the model's n_positions={shape.positions}; add --set n_positions={seq}")
    from scaletrain.measure import optimizers

    optimizers.check(args.optimizer)
    res = search(shape, plat, nodes=args.nodes, gpus_per_node=args.gpus_per_node, global_batch=args.global_batch,
                 seq=seq, fixed=fixed, precision=args.precision, optimizer=args.optimizer)
    if not res.ranked:
        raise UserError(f"no plan fits {args.model} on {args.nodes} x {args.gpus_per_node} {plat.name} with global batch "
                        f"{args.global_batch}: " + "; ".join(f"{r['region']}: {r['reason']}" for r in res.rejected[:3]))
    best = res.ranked[0]
    if args.out:
        Path(args.out).write_text(best.plan.to_toml(), encoding="utf-8")
    top = res.ranked[:args.top]
    if args.json:  # the ranked list itself, best first (the schema); --json-rejected adds the rest
        if args.json_rejected:
            print(json.dumps({"model": args.model, "platform": plat.name, "world": res.world,
                              "global_batch": args.global_batch, "seq": seq, "evaluated": res.evaluated,
                              "seconds": res.seconds, "ranked": [entry(c, best) for c in top],
                              "rejected": res.rejected}, indent=1))
        else:
            print(json.dumps([entry(c, best) for c in top], indent=1))
        return 0
    print(f"{args.model} ({shape.params() / 1e9:.2f}B parameters) on {args.nodes} x {args.gpus_per_node} "
          f"{plat.name} ({plat.device_memory_bytes / 2**30:.0f} GiB each), global batch {args.global_batch} x {seq} "
          f"tokens: {len(res.ranked)} plans fit of {res.evaluated} priced in {res.seconds:.1f} s")
    for i, c in enumerate(top, 1):
        p = c.plan
        pk = c.peak_bytes
        print(f"{i}. {p.describe()}, micro-batch {p.micro_batch}"
              + (f" x {p.microbatches} per step" if p.pp > 1 else f" x {args.global_batch // (p.dp * p.micro_batch)} "
                 f"accumulated"))
        print(f"   step {c.step_time_s * 1e3:.0f} ms, {c.tokens_per_s:,.0f} tokens/s, {c.tflops_per_device:.0f} TFLOP/s "
              f"per device, MFU {c.mfu:.1%}, bubble {c.bubble_fraction:.1%}, exposed comm {c.exposed_comm_s * 1e3:.0f} ms")
        print(f"   peak {pk['total'] / 2**30:.1f} of {c.device_bytes / 2**30:.0f} GiB ({c.heaviest_rank} stage): "
              + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in pk.items() if k != "total" and v))
        if i > 1:
            print(f"   lost: {why_lost(best, c)}")
    if res.rejected:
        print("rejected:")
        for r in res.rejected[:12]:
            print(f"  {r['region']}" + (f" (+{r['count'] - 1} alike)" if r["count"] > 1 else "") + f": {r['reason']}")
        if len(res.rejected) > 12:
            print(f"  ... {len(res.rejected) - 12} more (--json lists all)")
    if args.explain:
        if args.explain > len(res.ranked):
            raise UserError(f"--explain {args.explain}: only {len(res.ranked)} plans fit")
        c = res.ranked[args.explain - 1]
        p = c.plan
        print(f"plan {args.explain} in full: {p.describe()}, micro-batch {p.micro_batch}")
        print(f"  one micro-batch on one rank ({shape.layers // p.pp} layers per pipeline rank):")
        for k, v in c.blocks_s.items():
            print(f"    {k:22s} {v * 1e3:10.2f} ms")
        print("  the step by phase:")
        for k, v in c.phases_s.items():
            print(f"    {k:22s} {v * 1e3:10.1f} ms")
        print(f"    {'step':22s} {c.step_time_s * 1e3:10.1f} ms")
        print(f"  the heaviest rank ({c.heaviest_rank} stage) at its peak:")
        for k, v in c.peak_bytes.items():
            print(f"    {k:22s} {v / 2**30:10.2f} GiB")
        print(f"    {'device':22s} {c.device_bytes / 2**30:10.2f} GiB (2 GiB of it reserved)")
    if args.out:  # the plan file holds how to train; what to train stays on the command line
        sets = "".join(f" model.overrides.{kv}" for kv in args.set)
        print(f"wrote {args.out}; run it with: scaletrain train --nproc-per-node {args.gpus_per_node} --plan {args.out} "
              f"model.name={args.model}{sets} train.global_batch={args.global_batch} data.seq_len={seq}")
    return 0
