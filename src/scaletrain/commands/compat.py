"""``scaletrain compat``: what combines with what — the compatibility table, as a matrix or a check."""

from __future__ import annotations

import argparse
import json

from scaletrain.argtypes import MAX_RANKS, positive_int

NAME = "compat"
HELP = "show which techniques combine (the one compatibility table), or check a config / plan file"
DESCRIPTION = """Every refusal scaletrain makes of a combination of techniques lives in one table
(scaletrain.techniques.compat), with its reason and what is allowed. Without arguments this prints
the pairwise matrix over the techniques (the README's copy is this output); with --config / --plan /
overrides it checks one plan against the table for --nproc processes and a meta model.

examples:
  scaletrain compat
  scaletrain compat --nproc 8 parallel.pp=2 parallel.tp=2 parallel.zero=1 memory.remat.method=periodic
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--markdown", action="store_true", help="print the matrix as Markdown (what the README holds)")
    p.add_argument("--config", metavar="FILE", help="a config TOML to check")
    p.add_argument("--plan", metavar="FILE", help="a plan file to check (TOML or JSON, see `scaletrain train --plan`)")
    p.add_argument("--nproc", type=positive_int(MAX_RANKS), default=1,
                   help="processes the plan would run on (default 1)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides to check")


def run(args: argparse.Namespace) -> int:
    from scaletrain.techniques import compat

    if args.config or args.plan or args.overrides:
        return _check(args)
    if args.markdown:
        print(compat.matrix_markdown())
        return 0
    names, rows, notes = compat.matrix()
    if args.json:
        print(json.dumps({"features": names, "matrix": rows, "reasons": notes}))
        return 0
    width = max(len(n) for n in names)
    print(" " * (width + 1) + " ".join(f"{i + 1:>2}" for i in range(len(names))))
    for i, (n, row) in enumerate(zip(names, rows)):
        print(f"{n:>{width}} " + " ".join(f"{c:>2}" for c in row) + f"  {i + 1}")
    print()
    for i, note in enumerate(notes):
        print(f"{i + 1:>3}. {note}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from scaletrain import models
    from scaletrain.plan import Plan, load_plan_overrides
    from scaletrain.techniques import compat
    from scaletrain.train.config import load_config

    overrides = (load_plan_overrides(args.plan) if args.plan else []) + list(args.overrides)
    cfg = load_config(args.config, overrides)
    model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
    plan = Plan.from_config(cfg).resolved(args.nproc)
    compat.check_config(cfg, model, world=args.nproc)
    if args.json:
        print(json.dumps({"ok": True, "plan": plan.to_dict()}))
    else:
        print(f"ok: {plan.describe()} on {args.nproc} process(es)")
    return 0
