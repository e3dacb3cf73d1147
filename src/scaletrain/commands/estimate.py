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
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks: adds per-rank model-state bytes and "
                                                     "bytes communicated per step (default 1)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage with --dp (default 0)")
    p.add_argument("--hsdp", type=int, default=0, help="with --zero >= 1: shard within groups of this many ranks")
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
    if args.dp > 1 or args.zero:
        est.meta["data_parallel"] = _data_parallel(est, args)
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
    if "data_parallel" in est.meta:
        d = est.meta["data_parallel"]
        m = d["model_state_bytes_per_rank"]
        print(f"data parallel dp={d['dp']} zero={d['zero']}" + (f" hsdp={d['hsdp']}" if d["hsdp"] else "")
              + f": per-rank model states {m['total'] / 2**30:.3f} GiB (params {m['params'] / 2**30:.3f}, grads "
              f"{m['grads'] / 2**30:.3f}, optimizer {m['optimizer'] / 2**30:.3f}); received per rank per step "
              f"{d['comm_bytes_per_step'] / 2**30:.3f} GiB (ring collectives)")
    print_blocks(profile_to_rows(est.profile), measured=False)
    return 0


def _data_parallel(est, args: argparse.Namespace) -> dict:
    """The ZeRO cost face (:func:`scaletrain.techniques.data_parallel.cost.data_parallel_estimate`) for this step."""
    from scaletrain.errors import UserError
    from scaletrain.techniques.data_parallel.cost import data_parallel_estimate

    if args.dp < 1 or (args.hsdp and (args.zero == 0 or args.dp % args.hsdp)):
        raise UserError(f"--dp {args.dp} --hsdp {args.hsdp}: --dp must be >= 1 and --hsdp must divide it "
                        f"(with --zero >= 1)")
    n = est.parameters
    master = 4 * n if est.params_dtype != "fp32" else 0
    k = (est.bytes["optimizer_states"] - master) / n  # optimizer bytes per parameter, masters excluded
    storage = "fp32" if est.params_dtype == "fp32" else est.params_dtype
    return data_parallel_estimate(n, args.zero, args.dp, precision=storage, optim_state_bytes=k, accum=args.accum,
                                  hsdp=args.hsdp)


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
