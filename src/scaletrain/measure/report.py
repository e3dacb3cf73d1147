"""Shared arguments and printing for ``scaletrain estimate`` and ``scaletrain profile``.

Bytes inside, GiB / MiB / ms only here, when printing.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from scaletrain.argtypes import positive_int
from scaletrain.errors import UserError
from scaletrain.measure.types import PRECISIONS

if TYPE_CHECKING:  # the CLI builds its parser without importing torch
    from scaletrain.measure.compose import StepEstimate

GIB = 2.0**30
MIB = 2.0**20
ROWS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer states", "optimizer_states"),
        ("activations", "activations"), ("peak", "peak"))


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """--model --batch --seq --precision --optimizer --accum --params-dtype --set --json."""
    p.add_argument("--model", required=True, help="model: a reference name, hf:gpt2 / hf:llama / hf:mistral / "
                                                   "hf:bert, hf:/path/to/dir or py:module:factory (see `scaletrain "
                                                   "models`); --set KEY=VALUE sets its config fields")
    p.add_argument("--batch", type=positive_int(), default=1, help="micro-batch size (default 1)")
    p.add_argument("--seq", type=positive_int(), default=None,
                   help="sequence length for language models (default: context)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32, or bf16/fp16 autocast with fp32 parameters (default fp32)")
    p.add_argument("--optimizer", default="adamw",
                   help="an optimizer of the registry (`scaletrain optimizers`): sgd, adam, adamw, adam8bit, "
                        "adamw8bit, adafactor, came, lamb, lars (default adamw)")
    p.add_argument("--accum", type=positive_int(1 << 20), default=1,
                   help="micro-batches per optimizer step (default 1)")
    p.add_argument("--params-dtype", choices=PRECISIONS, default="fp32",
                   help="storage dtype of parameters and gradients; bf16/fp16 adds fp32 master weights "
                        "to the optimizer state (ZeRO's 2+2+12 bytes/parameter with Adam)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model option, e.g. --set n_layer=96 (repeatable)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the memory timeline by category to PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        if "=" not in it:
            raise UserError(f"--set expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        val: Any = v
        for conv in (int, float):
            try:
                val = conv(v)
                break
            except ValueError:
                continue
        out[k.strip()] = val
    return out


def check_step_args(args: argparse.Namespace) -> None:
    from scaletrain import models
    from scaletrain.measure import optimizers

    models.check_name(args.model)  # UserError listing the names
    optimizers.check(args.optimizer)
    if args.batch < 1 or args.accum < 1:
        raise UserError(f"--batch and --accum must be >= 1 (got {args.batch}, {args.accum})")
    if args.seq is not None and args.seq < 1:
        raise UserError(f"--seq must be >= 1 (got {args.seq})")


def to_json(est: StepEstimate) -> str:
    d = est.to_dict()
    d["meta"] = {k: v for k, v in d.get("meta", {}).items() if _jsonable(v)}
    return json.dumps(d)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def unit_for(n_bytes: float) -> tuple[str, float]:
    """The one binary unit a whole report prints its bytes in, from its largest figure: GiB from
    1 GiB up, else MiB (KiB below 1 MiB), so that no report mixes GiB, MiB and raw bytes."""
    for name, size in (("GiB", GIB), ("MiB", MIB)):
        if n_bytes >= size:
            return name, size
    return "KiB", 1024.0


def fold_rows(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(name, printed figures) rows with runs of identical figures folded into one row named
    ``first–last ×n`` (a model's repeated blocks read as one line)."""
    out: list[tuple[str, str, str, int]] = []
    for name, text in rows:
        if out and out[-1][2] == text:
            first, _, _, n = out[-1]
            out[-1] = (first, name, text, n + 1)
        else:
            out.append((name, name, text, 1))
    return [(first if n == 1 else f"{first}–{last} ×{n}", text) for first, last, text, n in out]


def print_step(est: StepEstimate, how: str, unit: tuple[str, float] | None = None) -> None:
    """The step's totals in ``unit`` (default: :func:`unit_for` its peak)."""
    name, size = unit or unit_for(est.bytes.get("peak", 0))
    prec = est.precision if est.precision == "fp32" else f"{est.precision} autocast"
    seq = f" x seq {est.seq}" if est.seq else ""
    print(f"{est.model}: batch {est.batch}{seq}, {prec}, {est.params_dtype} parameters, {est.optimizer}, "
          f"accum {est.accum} on {est.device} — {how}")
    print(f"parameters: {est.parameters:,}")
    print(f"{'':<18}{name:>10}")
    for label, key in ROWS:
        print(f"{label:<18}{est.bytes.get(key, 0) / size:>10.3f}")
    print(f"peak at: {est.peak_phase}; by category ({name}): "
          + ", ".join(f"{k} {v / size:.3f}" for k, v in est.peak_breakdown.items() if v))
    if est.meta.get("optimizer_step_transient_modelled") is False:
        print(f"note: the temporary memory of {est.optimizer}'s step is not modelled (counted as 0)")


def print_blocks(rows: list[dict], measured: bool, unit: tuple[str, float] = ("MiB", MIB)) -> None:
    """Per-block figures in ``unit``; identical consecutive blocks folded (:func:`fold_rows`)."""
    name, size = unit
    head = (f"{'params':>10}{'input':>10}{'output':>10}{'saved':>10}{'fwd tmp':>10}{'bwd tmp':>10}"
            f"{'GFLOP f':>10}{'GFLOP b':>10}{'fwd ms':>10}{'bwd ms':>10}")
    lines = []
    for r in rows:
        spread = ""
        if measured and r.get("fwd_time_spread_s"):
            spread = f"  ±{r['fwd_time_spread_s'] * 1e3 / 2:.2f}/{r['bwd_time_spread_s'] * 1e3 / 2:.2f}"
        lines.append((r["name"], f"{r['param_bytes'] / size:>10.3f}{r['input_bytes'] / size:>10.3f}"
                      f"{r['output_bytes'] / size:>10.3f}{r['saved_bytes'] / size:>10.3f}"
                      f"{r['fwd_temp_bytes'] / size:>10.3f}{r['bwd_temp_bytes'] / size:>10.3f}"
                      f"{r['flops_fwd'] / 1e9:>10.2f}{r['flops_bwd'] / 1e9:>10.2f}"
                      f"{r['fwd_time_s'] * 1e3:>10.2f}{r['bwd_time_s'] * 1e3:>10.2f}{spread}"))
    lines = fold_rows(lines)
    width = max([16, *(len(n) + 2 for n, _ in lines)])
    print()
    print(f"per block ({name}; times " + ("measured median" if measured else "from FLOPs / flops_per_s")
          + "; identical consecutive blocks on one row)")
    print(f"{'block':<{width}}" + head)
    for n, text in lines:
        print(f"{n:<{width}}{text}")
