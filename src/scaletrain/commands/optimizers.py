"""``scaletrain optimizers``: the optimizers ``optim.name`` selects, their hyperparameters and state cost."""

from __future__ import annotations

import argparse
import inspect
import json

NAME = "optimizers"
HELP = "list the optimizers, their options (optim.options.*) and state bytes per parameter"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON list")


def run(args: argparse.Namespace) -> int:
    from scaletrain.techniques.optim.registry import OPTIMIZERS, _extras, state_bytes_per_param

    rows = []
    for name, spec in OPTIMIZERS.items():
        sig = inspect.signature(spec.cls.__init__).parameters
        options = {k: sig[k].default for k in _extras(spec)}
        rows.append({"name": name, "takes": list(spec.common), "options": options, "doc": spec.doc,
                     # a 4096 x 4096 fp32 matrix: the cost face's bytes of state per parameter
                     "state_bytes_per_param": state_bytes_per_param(name, (4096, 4096))})
    if args.json:
        print(json.dumps(rows, default=repr))
        return 0
    for r in rows:
        opts = ", ".join(f"{k}={v!r}" for k, v in r["options"].items()) or "none"
        print(f"{r['name']:<10} {r['state_bytes_per_param']:6.3f} B/param (4096x4096)  takes {', '.join(r['takes'])}")
        print(f"{'':<10} {r['doc']}")
        print(f"{'':<10} optim.options: {opts}")
    return 0
