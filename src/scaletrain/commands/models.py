"""``scaletrain models``: the reference models with their parameter counts, and the hf: / py: forms.

Read from :mod:`scaletrain.models.catalog` — no torch, no transformers — so it answers at once.
"""

from __future__ import annotations

import argparse
import json

NAME = "models"
HELP = "list the reference models with their parameter counts, and the hf: / py: families"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON list")


def run(args: argparse.Namespace) -> int:
    from scaletrain.models.catalog import LISTED

    rows = [{"name": name, "parameters": r.parameters, "published": r.published, "task": r.task,
             "default_data": r.default_data, "description": r.description} for name, r in LISTED.items()]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'model':<13} {'parameters':>15}  {'task':<9} description")
    for r in rows:
        n = f"{r['parameters']:,}" if r["parameters"] is not None else "-"
        print(f"{r['name']:<13} {n:>15}  {r['task']:<9} {r['description']}")
    print("\nany hf: family takes model.overrides.<config field>=...; py:package.module:factory gets "
          "model.overrides.* as keyword arguments")
    return 0
