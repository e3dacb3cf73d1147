"""``scaletrain estimate``: a training step's memory and per-block costs, predicted, nothing allocated."""

from __future__ import annotations

import argparse
from typing import Any

from scaletrain import schema
from scaletrain.argtypes import (MAX_MICROBATCHES, MAX_PIPELINE_RANKS, MAX_RANKS, MAX_VIRTUAL,
                                 count, positive_float, positive_int)
from scaletrain.measure.report import add_step_arguments, check_step_args, parse_overrides

NAME = "estimate"
HELP = "predict a training step's memory and per-block costs without allocating anything"
DESCRIPTION = """Predict the memory of one training step (steady state: optimizer states exist) and
the per-block table, from fake tensors — any reference model at any size, or a model named hf:... /
py:... (`scaletrain models`), in seconds.

Bytes per category (the largest during the step): parameters, gradients, optimizer states,
activations (saved for backward) and the step's peak, with where it happens and its breakdown.
Times in the per-block table are FLOPs / --flops-per-s, or the --platform's data-sheet FLOP/s (lower
bounds), else a nominal figure (see scaletrain.measure.estimate).

With --platform (a preset, a platform JSON file, or `local`) the plan's ranks also get the seconds of
one optimizer step by phase — compute, recompute, communication per collective kind (all and exposed),
pipeline bubble, host/disk copies, optimizer — and the step time (the slowest rank's): every operator
of the block profile on the platform's roofline, collectives alpha-beta on its links, the bubble from
the pipeline simulator (scaletrain.techniques.time_cost). Without --platform a one-process plan is
priced on this machine, measured in-process (scaletrain.planner.local, about 3 s); a multi-process
plan needs --platform: this machine's figures for N processes come from N processes measuring at
once (scaletrain calibrate --nproc-per-node N --out FILE.json, then --platform FILE.json).

examples:
  scaletrain estimate --model gpt2-xl --batch 16 --seq 1024 --precision bf16 --optimizer adamw
  scaletrain estimate --model gpt2-xl --batch 4 --seq 1024 --precision bf16 --tp 2 --pp 2 --microbatches 8 \\
      --platform h100
  scaletrain estimate --model hf:llama --set num_hidden_layers=8 --set hidden_size=512 --batch 4 --seq 256
  scaletrain estimate --model gpt2-small --set n_layer=96 --set n_embd=12288 --set n_head=96 \\
      --set n_positions=2048 --seq 2048 --params-dtype bf16 --precision bf16 --json
"""


PLAN_FLAGS = (("tp", "tp", positive_int(MAX_RANKS)), ("sp", "sp", None), ("cp", "cp", positive_int(MAX_RANKS)),
              ("ep", "ep", positive_int(MAX_RANKS)), ("pp", "pp", positive_int(MAX_PIPELINE_RANKS)),
              ("schedule", "schedule", str), ("microbatches", "microbatches", count(MAX_MICROBATCHES)),
              ("virtual", "virtual", count(MAX_VIRTUAL)), ("remat", "remat.method", str),
              ("remat-budget", "remat.budget", str))
"""The plan flags: (flag, plan field of :mod:`scaletrain.schema`, argparse type with the CLI's bounds); their
help and default are the key's, and ``_plan`` turns each into its config key, validated by the config."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_step_arguments(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="device the step would run on: on CUDA storages take whole 512-byte blocks and "
                        "Adam's step counters stay on the host (default cpu)")
    p.add_argument("--platform", default=None,
                   help="a scaletrain.platform preset (h100, h200, gh200, a100-80g, a100-40g, v100), "
                        "a platform JSON file, "
                        "or local (this machine, one process): its device, FLOP/s and memory; says whether the "
                        "step fits and prices the plan's step time by phase")
    p.add_argument("--flops-per-s", type=positive_float(), default=None, help="FLOP/s to turn FLOPs into times")
    p.add_argument("--dp", type=positive_int(MAX_RANKS), default=1,
                   help="data-parallel ranks: adds per-rank model-state bytes and bytes communicated per step "
                        "(default 1)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage with --dp (default 0)")
    p.add_argument("--hsdp", type=count(MAX_RANKS), default=0,
                   help="with --zero >= 1: shard within groups of this many ranks")
    p.add_argument("--simulate", action="store_true",
                   help="also run a whole step on fake tensors under the tracker, as a cross-check")
    g = p.add_argument_group("plan", "any of these (or --plan) predicts every rank of that plan: its peak by "
                                     "category (the heaviest rank's is `bytes.peak`) and the bytes it receives per "
                                     "step in collectives — the composed cost faces, scaletrain.techniques.plan_cost")
    g.add_argument("--plan", metavar="FILE", help="a plan file (TOML or JSON, as `scaletrain train --plan`)")
    for flag, name, typ in PLAN_FLAGS:  # help and default from the plan key's one declaration
        key = schema.BY_FIELD[name]
        words = f": {', '.join(map(str, key.choices))}" if key.choices else ""
        text = f"{key.help}{words} ({key.path}; default {key.default!r})"
        if key.type is bool:
            g.add_argument(f"--{flag}", action="store_true", help=text)
        else:
            g.add_argument(f"--{flag}", type=typ, default=key.default, help=text)
    g.add_argument("--global-batch", type=count(), default=0,
                   help="samples per optimizer step over all replicas (default: --batch x --accum x dp)")


def run(args: argparse.Namespace) -> int:
    from scaletrain.measure.estimate import estimate_step, simulate_step
    from scaletrain.measure.report import print_blocks, print_step, to_json, unit_for
    from scaletrain.measure.profiler import profile_to_rows

    check_step_args(args)
    overrides = parse_overrides(args.set)
    kw = dict(precision=args.precision, optimizer=args.optimizer, accum=args.accum,
              params_dtype=args.params_dtype, device=args.device)
    plat = _platform(args.platform, args.precision, (args.model, overrides)) if args.platform else None
    est = estimate_step(args.model, args.batch, args.seq, flops_per_s=args.flops_per_s, platform=plat,
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
        est.meta["data_parallel"] = _data_parallel(est, args, overrides)
    if (args.plan or args.dp > 1 or args.tp > 1 or args.cp > 1 or args.ep > 1 or args.pp > 1 or args.remat != "none"
            or (plat is not None and not est.meta.get("backward_free"))):  # the plan's cost faces price a backward
        est.meta["plan"] = _plan(args, overrides, plat)
        if est.meta["plan"].get("step_time_s") is not None:
            est.meta["step_time_s"] = est.meta["plan"]["step_time_s"]
    one_peak = est.bytes["peak"]
    if "plan" in est.meta:  # JSON's bytes.peak is the heaviest rank's, not one process's
        est.meta["one_process_peak_bytes"] = one_peak
        est.bytes["peak"] = est.meta["plan"]["heaviest"]["peak_bytes"]
    if args.json:
        print(to_json(est))
        return 0
    how = f"estimated in {est.meta['seconds_to_estimate']:.2f} s, nothing allocated"
    plan_peak, est.bytes["peak"] = est.bytes["peak"], one_peak  # the table below is the one-process step
    unit, size = u = unit_for(max(one_peak, plan_peak))  # one unit for every byte figure of the report
    print_step(est, how + (", one process without the plan (the plan's ranks follow)" if "plan" in est.meta else ""),
               u)
    est.bytes["peak"] = plan_peak
    if "fits" in est.meta:
        print(f"on {est.meta['platform']} ({est.meta['device_memory_bytes'] / 2**30:.0f} GiB): "
              + ("fits" if est.meta["fits"] else "does NOT fit"))
    if args.simulate:
        s = est.meta["simulated"]
        print(f"cross-check, whole step simulated on fake tensors: peak {s['peak'] / size:.3f} {unit} "
              f"({s['seconds']:.2f} s)")
    plan_dims = est.meta.get("plan", {}).get("plan", {})
    model_parallel = any(int(plan_dims.get(k, 1) or 1) > 1 for k in ("tp", "pp", "cp", "ep"))
    if "data_parallel" in est.meta and not model_parallel:  # ZeRO's formula alone; the plan's ranks say more
        d = est.meta["data_parallel"]
        m = d["model_state_bytes_per_rank"]
        print(f"data parallel dp={d['dp']} zero={d['zero']}" + (f" hsdp={d['hsdp']}" if d["hsdp"] else "")
              + f": per-rank model states {m['total'] / size:.3f} {unit} (params {m['params'] / size:.3f}, grads "
              f"{m['grads'] / size:.3f}, optimizer {m['optimizer'] / size:.3f}); received per rank per step "
              f"{d['comm_bytes_per_step'] / size:.3f} {unit} (ring collectives)")
    if "plan" in est.meta:
        pl = est.meta["plan"]
        print(f"plan {pl['describe']} on {pl['world']} processes:")
        for r in pl["ranks"]:
            b = r["bytes"]
            print(f"  {r['rank']}: peak {r['peak_bytes'] / size:.3f} {unit} (params {b['params'] / size:.3f}, grads "
                  f"{b['grads'] / size:.3f}, optimizer {b['optimizer'] / size:.3f}, activations and transients "
                  f"{b['activations_and_transients'] / size:.3f}); receives {r['comm_bytes'] / size:.3f} {unit} "
                  f"per step in collectives")
        print(f"heaviest: {pl['heaviest']['rank']}, peak {pl['heaviest']['peak_bytes'] / size:.3f} {unit}")
        print_times(pl)
    elif est.meta.get("backward_free"):
        print(f"step seconds by phase: not priced for {est.optimizer} (the cost faces price a backward pass)")
    else:
        print("step seconds by phase: add --platform (a preset, a platform JSON file, or local)")
    print_blocks(profile_to_rows(est.profile), measured=False, unit=u)
    return 0


def _plan(args: argparse.Namespace, overrides: dict, plat: Any = None) -> dict:
    """The whole plan, rank by rank (scaletrain.techniques.plan_cost), refused as `train` would refuse it;
    with a platform (or, for one process, this machine measured in-process) each rank's seconds by phase."""
    from scaletrain import models
    from scaletrain.plan import Plan, toml_value, load_plan_overrides
    from scaletrain.techniques import compat
    from scaletrain.techniques.plan_cost import heaviest, plan_costs
    from scaletrain.train.config import load_config

    flags = [("dp", "dp"), ("zero", "zero"), ("hsdp", "hsdp"), *((f.replace("-", "_"), n) for f, n, _ in PLAN_FLAGS),
             ("precision", "precision"), ("params_dtype", "params_dtype"), ("optimizer", "optimizer")]
    keys = [f"{schema.BY_FIELD[name].path}={toml_value(getattr(args, dest))}" for dest, name in flags]
    cfg = load_config(None, keys + (load_plan_overrides(args.plan) if args.plan else []))
    plan = Plan.from_config(cfg)
    world = plan.world(max(plan.dp, 1))
    model = models.get(args.model, device="meta", **overrides)
    seq = args.seq or getattr(getattr(model, "config", None), "n_positions", 0) or 1
    micro = 0 if plan.pp > 1 and plan.microbatches else args.batch
    gb = args.global_batch or (args.batch * args.accum * max(plan.dp, 1) if not (plan.pp > 1 and plan.microbatches)
                               else args.batch * plan.microbatches * max(plan.dp, 1))
    M = plan.microbatches if plan.pp > 1 and plan.microbatches else gb // max(micro * max(plan.dp, 1), 1)
    compat.check(plan.resolved(world), compat.Facts.of(model, world=world, device=args.device, seq_len=seq,
                                                        microbatches=M))
    priced, why = plat, ""
    if plat is None and world == 1:
        priced = _platform("local", args.precision, (args.model, overrides))
    elif plat is None:
        why = (f"the step time of {world} processes needs --platform (a preset, a platform JSON file; this machine's "
               f"for {world} processes: scaletrain calibrate --nproc-per-node {world} --out platform.json)")
    costs = plan_costs(plan, model, world=world, global_batch=gb, seq=seq, micro_batch=micro, device=args.device,
                       platform=priced)
    top = heaviest(costs)
    out = {"describe": plan.resolved(world).describe(), "world": world, "global_batch": gb,
           "plan": plan.resolved(world).to_dict(), "ranks": [c.to_dict() for c in costs], "heaviest": top.to_dict(),
           "comm_bytes_per_step": top.comm_bytes, "step_time_s": None}
    if priced is not None:
        slow = max(costs, key=lambda c: c.step_time_s or 0.0)
        out.update(step_time_s=slow.step_time_s, slowest=slow.rank, platform=priced.name,
                   platform_source=priced.source)
    else:
        out["time_note"] = why
    from scaletrain.techniques.compile import priced_note

    out["compile_note"] = priced_note(plan, priced.compile_factor if priced is not None else 0.0, args.device)
    return out


def _platform(name: str, precision: str, model: tuple[str, dict]) -> Any:
    """A preset, a platform JSON file (as ``scaletrain plan --platform``) or ``local``: this machine for one
    process, measured in-process (:func:`scaletrain.planner.local.measure`, what ``plan=auto`` uses; the
    fixed cost per kernel from ``model`` when it is a GPT-2 shape)."""
    if name.lower() == "local":
        from scaletrain.planner import local

        return local.measure(1, precision, model)
    from scaletrain.commands.plan import _platform as load

    return load(name)


def print_times(pl: dict) -> None:
    """The ranks' seconds by phase (milliseconds), one row per pipeline rank, or why there are none."""
    if pl.get("compile_note"):  # train.compile: priced by the measured factor, or said not to be
        print(pl["compile_note"])
    if pl.get("step_time_s") is None:
        print(f"time: {pl.get('time_note', 'no platform')}")
        return
    print(f"time per optimizer step on {pl['platform']} (ms; communication exposed / all, by kind):")
    print(f"  {'rank':<28} {'compute':>9} {'recompute':>9} {'comm':>15} {'bubble':>8} {'copies':>15} "
          f"{'optimizer':>9} {'step':>9}")
    for r in pl["ranks"]:
        t = r["time_s"]
        comm = f"{sum(t['comm_exposed'].values()) * 1e3:.3f}/{sum(t['comm'].values()) * 1e3:.3f}"
        copies = f"{sum(t['copies_exposed'].values()) * 1e3:.3f}/{sum(t['copies'].values()) * 1e3:.3f}"
        print(f"  {r['rank']:<28} {t['compute'] * 1e3:>9.3f} {t['recompute'] * 1e3:>9.3f} {comm:>15} "
              f"{t['bubble'] * 1e3:>8.3f} {copies:>15} {t['optimizer'] * 1e3:>9.3f} {t['step'] * 1e3:>9.3f}")
        kinds = ", ".join(f"{k} {t['comm_exposed'][k] * 1e3:.3f}/{v * 1e3:.3f}" for k, v in t["comm"].items() if v)
        if kinds:
            print(f"  {'':<28} by kind: {kinds}")
    print(f"step time: {pl['step_time_s'] * 1e3:.3f} ms (the slowest rank: {pl['slowest']})")


def _data_parallel(est, args: argparse.Namespace, overrides: dict) -> dict:
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
    kept = 0
    if args.zero == 3:  # the root and the last FSDP group stay gathered from forward into backward
        from scaletrain import models
        from scaletrain.techniques.data_parallel.fsdp import kept_elements

        kept = kept_elements(models.get(args.model, device="meta", **overrides), "auto", args.dp, args.accum,
                             args.device)
    return data_parallel_estimate(n, args.zero, args.dp, precision=storage, optim_state_bytes=k, accum=args.accum,
                                  hsdp=args.hsdp, kept=kept)


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
