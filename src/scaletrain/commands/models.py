"""``scaletrain models``: the reference models with their parameter counts."""

from __future__ import annotations

import argparse
import json

NAME = "models"
HELP = "list the reference models with their parameter counts, and the hf: / py: families"


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
    rows += _families()
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


def _families() -> list[dict]:
    """The hf: families (parameters at their defaults, when transformers is installed) and the py: form."""
    from scaletrain import models
    from scaletrain.errors import UserError
    from scaletrain.models.external import HF_FAMILIES

    rows = []
    for fam, spec in HF_FAMILIES.items():
        try:
            n: int | None = models.count_params(models.get(f"hf:{fam}", device="meta"))
        except UserError:  # transformers not installed
            n = None
        task = "lm" if fam != "bert" else "mlm"
        rows.append({"name": f"hf:{fam}", "parameters": n, "published": None, "task": task,
                     "default_data": spec.default_data, "description": spec.description})
    rows.append({"name": "hf:/path/dir", "parameters": None, "published": None, "task": "", "default_data": "",
                 "description": "local config.json + safetensors weights, loaded by its architectures entry"})
    rows.append({"name": "py:mod:fn", "parameters": None, "published": None, "task": "", "default_data": "",
                 "description": "your factory: fn(**model.overrides) returning an nn.Module"})
    return rows
