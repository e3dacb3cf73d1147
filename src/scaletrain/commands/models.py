"""``scaletrain models``: the reference models with their parameter counts."""

from __future__ import annotations

import argparse
import json

NAME = "models"
HELP = "list the reference models and their parameter counts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON list")


def run(args: argparse.Namespace) -> int:
    from scaletrain import models

    rows = []
    for name in models.names():
        m = models.get(name, device="meta")  # no memory allocated, even for gpt2-xl
        e = models.entry(name)
        rows.append({"name": name, "parameters": models.count_params(m), "published": e.published_params,
                     "task": getattr(m, "task", ""), "default_data": e.default_data, "description": e.description})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'model':<13} {'parameters':>15}  {'task':<9} description")
    for r in rows:
        print(f"{r['name']:<13} {r['parameters']:>15,}  {r['task']:<9} {r['description']}")
    return 0
