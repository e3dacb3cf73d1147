"""``scaletrain calibrate``: measure this machine as a :class:`~scaletrain.platform.Platform` file.

What ``plan=auto`` measures before it plans (:mod:`scaletrain.planner.local`): FLOP/s and the
matmul-efficiency table by size, memory-bound kernels by size, the fixed cost per kernel of the given
model's operators, and gloo's α/β — each measured by ``--nproc-per-node`` processes at once, so the
figures are what one of N processes sharing this machine gets. The JSON it writes is accepted by
``scaletrain plan --platform FILE.json`` and ``scaletrain estimate --platform FILE.json``, and can be
edited (or given a ``price_per_device_hour``) like any platform file. Units: FLOP/s, bytes/s, seconds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from scaletrain.argtypes import MAX_PROCS, positive_float, positive_int
from scaletrain.errors import ConfigError

NAME = "calibrate"
HELP = "measure this machine (N processes at once) as a platform file for plan / estimate --platform"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=positive_int(MAX_PROCS), default=1,
                   help="processes measuring at once (default 1)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="matmul and elementwise precision to measure (default fp32)")
    p.add_argument("--model", default="gpt2-mini", help="a gpt2-* model whose operators set the fixed cost "
                   "per kernel (default gpt2-mini)")
    p.add_argument("--out", default="", help="write the platform JSON here (default: print it)")
    p.add_argument("--timeout", type=positive_float(1e7), default=300.0,
                   help="give up after this many seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print the platform as JSON (also without --out)")
    p.add_argument("--compile", action="store_true", help="also time a torch.compile'd gpt2 block against eager "
                   "(compile_factor, what the cost model multiplies compute by under train.compile; tens of seconds "
                   "on a CPU)")


def run(args: argparse.Namespace) -> int:
    from scaletrain import models
    from scaletrain.planner.local import calibrate_to_file

    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} is not allowed; give a positive process count")
    models.check_name(args.model)
    out = Path(args.out) if args.out else None
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise ConfigError(f"--out {args.out!r} must be a file path in an existing directory")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "platform.json"
        plat = calibrate_to_file(args.nproc_per_node, path, args.model, args.precision, args.timeout)
        if plat is None:
            raise ConfigError(f"calibration with {args.nproc_per_node} process(es) failed or took over "
                              f"{args.timeout:g} s; allowed: fewer processes or a larger --timeout")
        text = path.read_text()
    if args.compile:
        from scaletrain.techniques.compile import measure_factor

        device = "cuda" if plat.device_type == "cuda" else "cpu"
        factor, compile_s = measure_factor(device)
        plat = plat.with_(compile_factor=factor)
        text = json.dumps(plat.to_dict())
        print(f"compile: compiled/eager block = {factor:.3f} on {device} (compiling took {compile_s:.1f} s)")
    if out is not None:
        out.write_text(text)
    if args.json or out is None:
        print(json.dumps(json.loads(text), indent=1))
    else:
        half = f", {plat.flops_bf16 / 1e9:.1f} {args.precision}" if args.precision != "fp32" else ""
        print(f"{plat.name}: matmul peak {plat.flops_fp32 / 1e9:.1f} GFLOP/s fp32{half}, "
              f"{plat.device_mem_bytes_per_s / 1e9:.1f} GB/s memory-bound, "
              f"{plat.kernel_overhead_s * 1e6:.1f} us per kernel, all-reduce "
              f"{plat.intra_node_bytes_per_s / 1e9:.2f} GB/s + {plat.intra_node_latency_s * 1e6:.0f} us per step "
              f"-> {out} (use with --platform {out})")
    return 0
