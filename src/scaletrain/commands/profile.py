"""``scaletrain profile``: measure a training step's memory and each block's costs on this machine."""

from __future__ import annotations

import argparse
import os

from scaletrain.argtypes import count, positive_int
from scaletrain.errors import UserError
from scaletrain.measure.report import add_step_arguments, check_step_args, parse_overrides

NAME = "profile"
HELP = "measure a training step's memory and per-block times/bytes/FLOPs on the local device"
DESCRIPTION = """Run real training steps of a reference model on this machine and measure them:
the step's memory by category (tracked storage by storage; the second step, when optimizer
states exist), and per block the forward/backward times (median of --repeats after --warmup,
CUDA events on GPU), bytes and FLOPs. The estimate for the same configuration is shown beside.

example:
  scaletrain profile --model gpt2-tiny --batch 8 --seq 256 --precision bf16 --optimizer adamw --plot step.png
  scaletrain profile --model gpt2-tiny --batch 8 --seq 256 --roofline --platform a100-80g --png roofline.png
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_step_arguments(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--repeats", type=positive_int(1000), default=5, help="timed runs per block (default 5)")
    p.add_argument("--warmup", type=count(1000), default=2, help="untimed runs per block first (default 2)")
    p.add_argument("--force", action="store_true", help="run even if the estimate says it will not fit")
    p.add_argument("--roofline", action="store_true",
                   help="instead: each operator's FLOP/byte, achieved FLOP/s and bytes/s here, and whether it is "
                        "compute- or memory-bound on --platform (scaletrain.measure.roofline)")
    p.add_argument("--platform", default="a100-80g",
                   help="with --roofline: a preset (h100, h200, gh200, a100-80g, a100-40g, v100), a platform JSON file "
                        "or local (default a100-80g)")
    p.add_argument("--png", default=None, metavar="PNG", help="with --roofline: write the log-log roofline to PNG")


def _available_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info()[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def run(args: argparse.Namespace) -> int:
    import torch

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.estimate import estimate_step
    from scaletrain.measure.profiler import measure_step, profile_chain, profile_to_rows
    from scaletrain.measure.report import print_blocks, print_step, to_json, unit_for
    from scaletrain.measure.step import DTYPES, make_batch

    check_step_args(args)
    if args.repeats < 1 or args.warmup < 0:
        raise UserError(f"--repeats must be >= 1 and --warmup >= 0 (got {args.repeats}, {args.warmup})")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda requested but no CUDA device is available; use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"unknown --device {device!r}; allowed: cpu, cuda")
    overrides = parse_overrides(args.set)
    if args.roofline:
        from scaletrain.commands.estimate import _platform
        from scaletrain.measure.roofline_report import run_roofline

        return run_roofline(args, device, overrides, lambda n: _platform(n, args.precision, (args.model, overrides)))
    if args.png or args.platform != "a100-80g":
        raise UserError("--png and --platform go with --roofline")
    kw = dict(precision=args.precision, optimizer=args.optimizer, accum=args.accum, params_dtype=args.params_dtype)
    try:
        est = estimate_step(args.model, args.batch, args.seq, device=device, **kw, **overrides)
    except UserError as e:
        if "data-dependent" not in str(e):
            raise
        est = None  # cannot be estimated (e.g. MoE routing): measure without the guard
    avail = _available_bytes(device)
    if est is not None and est.bytes["peak"] > 0.9 * avail and not args.force:
        raise UserError(f"estimated peak {est.bytes['peak'] / 2**30:.2f} GiB exceeds the {avail / 2**30:.2f} GiB "
                        f"available on {device}; lower --batch/--seq, use `scaletrain estimate`, or pass --force")
    torch.manual_seed(0)
    module = models.get(args.model, device=device, **overrides)
    if args.params_dtype != "fp32":
        module.to(DTYPES[args.params_dtype])
    x, y = make_batch(module, args.batch, args.seq, device=device)
    prof = profile_chain(to_chain(module), x, target=y, repeats=args.repeats, warmup=args.warmup,
                         precision=args.precision, name=args.model)
    meas = measure_step(module, args.batch, args.seq, device=device, keep_tracker=bool(args.plot), **kw)
    meas.model, meas.profile = args.model, prof
    if est is not None:
        meas.meta["estimated"] = {"peak": est.bytes["peak"], "peak_breakdown": est.peak_breakdown,
                                  "bytes": est.bytes}
    if args.plot:
        from scaletrain.measure.plot import plot_timeline

        plot_timeline(meas.meta.pop("tracker"), args.plot,
                      title=f"{args.model} measured step ({args.precision}, {args.optimizer}, accum {args.accum})")
    if args.json:
        print(to_json(meas))
        return 0
    unit, size = u = unit_for(meas.bytes["peak"])  # one unit for every byte figure of the report
    print_step(meas, f"measured on {device}", u)
    if "cuda_max_memory_allocated" in meas.meta:
        print(f"torch.cuda.max_memory_allocated: {meas.meta['cuda_max_memory_allocated'] / size:.3f} {unit} "
              f"(of which {meas.meta['cuda_untracked_bytes'] / size:.3f} {unit} allocated outside tensors)")
    if est is not None:
        err = (est.bytes["peak"] - meas.bytes["peak"]) / max(meas.bytes["peak"], 1) * 100
        print(f"estimated peak {est.bytes['peak'] / size:.3f} {unit} ({err:+.2f}% vs measured)")
    print_blocks(profile_to_rows(prof), measured=True, unit=u)
    return 0
