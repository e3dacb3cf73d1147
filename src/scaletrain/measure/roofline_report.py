"""``scaletrain profile --roofline``: every operator of one training step on a platform's roofline
(:mod:`scaletrain.measure.roofline`), as a table, JSON or a log-log PNG."""

from __future__ import annotations

import argparse
import json
import platform as platform_mod
from datetime import datetime, timezone
from typing import Any, Callable

from scaletrain.errors import UserError


def run_roofline(args: argparse.Namespace, device: str, overrides: dict[str, Any],
                 load_platform: Callable[[str], Any]) -> int:
    """Measure one forward + backward of ``args.model`` op by op on ``device`` and price it on ``--platform``
    (``load_platform``: the command's preset / file / ``local`` loader; a bad name is its UserError)."""
    import torch

    from scaletrain import models
    from scaletrain.measure import roofline as rl
    from scaletrain.measure.step import DTYPES, loss_for, make_batch

    if args.optimizer != "adamw" or args.accum != 1 or args.plot:
        raise UserError("--roofline measures one forward + backward: --optimizer, --accum and --plot do not apply")
    plat = load_platform(args.platform)  # a bad name: one line, exit 2, before anything runs
    if args.png and not args.png.lower().endswith(".png"):
        raise UserError(f"--png must name a .png file (got {args.png!r})")
    torch.manual_seed(0)
    module = models.get(args.model, device=device, **overrides)
    if args.params_dtype != "fp32":
        module.to(DTYPES[args.params_dtype])
    x, y = make_batch(module, args.batch, args.seq, device=device)
    ops, seconds = rl.measure_ops(module, x, y, loss_for(module), args.precision, warmup=max(args.warmup, 1))
    table = rl.rows(ops, plat, args.precision, measured=seconds)
    ridge = rl.ridge_point(plat, args.precision)
    meta = {"model": args.model, "batch": args.batch, "seq": args.seq, "measured_on": device,
            "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform_mod.platform()}
    if args.png:
        rl.plot(table, plat, args.precision, args.png,
                title=f"{args.model} b={args.batch} ({args.precision}) on {plat.name}; measured on {device}")
    if args.json:
        print(json.dumps(rl.to_dict(table, plat, args.precision, meta)))
        return 0
    print(f"roofline of {args.model} (batch {args.batch}, {args.precision}) on {plat.name}: peak "
          f"{plat.flops(args.precision) / 1e12:.1f} TFLOP/s, HBM {plat.device_mem_bytes_per_s / 1e9:.0f} GB/s, "
          f"ridge {ridge:.1f} FLOP/byte; achieved figures measured on {device}")
    w = max([len(r.op) for r in table] + [8]) + 2
    print(f"  {'operator':<{w}}{'calls':>6}{'GFLOP':>10}{'MB':>10}{'FLOP/B':>9}{'plat ms':>9}{'bound':>9}"
          f"{'GFLOP/s':>10}{'GB/s':>9}  hint")
    for r in table:
        ach = (f"{r.achieved_flops_per_s / 1e9:>10.2f}{r.achieved_bytes_per_s / 1e9:>9.2f}"
               if r.measured_s else f"{'-':>10}{'-':>9}")
        print(f"  {r.op:<{w}}{r.calls:>6}{r.flops / 1e9:>10.4f}{r.nbytes / 1e6:>10.2f}{r.intensity:>9.2f}"
              f"{r.platform_s * 1e3:>9.4f}{r.bound:>9}{ach}  {r.hint}")
    if args.png:
        print(f"wrote {args.png}")
    return 0
