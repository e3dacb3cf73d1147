"""``scaletrain estimate``: a training step's memory and per-block costs, predicted, nothing allocated."""

from __future__ import annotations

import argparse

from scaletrain.measure.report import add_step_arguments, check_step_args, parse_overrides

NAME = "estimate"
HELP = "predict a training step's memory and per-block costs without allocating anything"
DESCRIPTION = """Predict the memory of one training step (steady state: optimizer states exist) and
the per-block table, from fake tensors — any reference model at any size, in seconds.

Bytes per category (the largest during the step): parameters, gradients, optimizer states,
activations (saved for backward) and the step's peak, with where it happens and its breakdown.
Times are FLOPs / --flops-per-s, or the --platform's data-sheet FLOP/s (lower bounds), else a
nominal figure (see scaletrain.measure.estimate).

examples:
  scaletrain estimate --model gpt2-xl --batch 16 --seq 1024 --precision bf16 --optimizer adamw
  scaletrain estimate --model gpt2-small --set n_layer=96 --set n_embd=12288 --set n_head=96 \\
      --set n_positions=2048 --seq 2048 --params-dtype bf16 --precision bf16 --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_step_arguments(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="device the step would run on: on CUDA storages take whole 512-byte blocks and "
                        "Adam's step counters stay on the host (default cpu)")
    p.add_argument("--platform", default=None,
                   help="a scaletrain.platform preset (h100, a100, v100): its device, data-sheet FLOP/s "
                        "and memory; says whether the step fits")
    p.add_argument("--flops-per-s", type=float, default=None, help="FLOP/s to turn FLOPs into times")
    p.add_argument("--simulate", action="store_true",
                   help="also run a whole step on fake tensors under the tracker, as a cross-check")


def run(args: argparse.Namespace) -> int:
    from scaletrain.measure.estimate import estimate_step, simulate_step
    from scaletrain.measure.report import print_blocks, print_step, to_json
    from scaletrain.measure.profiler import profile_to_rows

    check_step_args(args)
    overrides = parse_overrides(args.set)
    kw = dict(precision=args.precision, optimizer=args.optimizer, accum=args.accum,
              params_dtype=args.params_dtype, device=args.device)
    est = estimate_step(args.model, args.batch, args.seq, flops_per_s=args.flops_per_s, platform=args.platform,
                        **kw, **overrides)
    if args.simulate:
        sim = simulate_step(args.model, args.batch, args.seq, **kw, **overrides)
        est.meta["simulated"] = {"peak": sim.bytes["peak"], "peak_breakdown": sim.peak_breakdown,
                                 "seconds": sim.meta["seconds_to_estimate"]}
    if args.plot:
        from scaletrain.measure.plot import plot_timeline

        plot_timeline(est.points, args.plot, marks=_phase_marks(est.marks),
                      title=f"{args.model} estimated step ({args.precision}, {args.optimizer}, accum {args.accum})",
                      xlabel="replayed allocation/free event")
    if args.json:
        print(to_json(est))
        return 0
    print_step(est, f"estimated in {est.meta['seconds_to_estimate']:.2f} s, nothing allocated")
    if "fits" in est.meta:
        print(f"on {est.meta['platform']} ({est.meta['device_memory_bytes'] / 2**30:.0f} GiB): "
              + ("fits" if est.meta["fits"] else "does NOT fit"))
    if args.simulate:
        s = est.meta["simulated"]
        print(f"cross-check, whole step simulated on fake tensors: peak {s['peak'] / 2**30:.3f} GiB "
              f"({s['seconds']:.2f} s)")
    print_blocks(profile_to_rows(est.profile), measured=False)
    return 0


def _phase_marks(marks: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Only where the kind of phase changes (forward i / backward i / optimizer), to keep plots legible."""
    out, last = [], None
    for x, label in marks:
        kind = label.split(":")[0]
        if kind in ("start", "end"):
            continue
        if kind != last:
            out.append((x, kind))
            last = kind
    return out
