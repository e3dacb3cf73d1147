"""``scaletrain sweep``: train many runs at once on shared devices (Hydra's shard alternator parallelism)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from scaletrain.argtypes import MAX_PROCS, positive_int
from scaletrain.errors import ConfigError

NAME = "sweep"
HELP = "train several runs (a grid or a runs file) together: each model cut into shards that fit a device, " \
       "shards of different runs alternating on the devices"
DESCRIPTION = """Train several runs at once, each exactly as `scaletrain train` would (its own run directory,
metrics and checkpoints, bitwise the same losses on CPU), on devices that cannot hold one model:
every model is cut into shards that fit memory.device_budget, its fp32 parameters, gradients and
optimizer states stay on the host, and a scheduler (Sharded-LRTF by default) keeps every device busy
with the ready shards of the different runs. Before training, each shard task is profiled on the
devices and the whole sweep is simulated: the predicted makespan and utilisation are printed and
written next to the measured ones (sweep.json, timeline.png).

  scaletrain sweep --nproc-per-node 2 model.name=gpt2-mini memory.device_budget=64MiB \\
      --grid optim.lr=1e-3,3e-3,1e-2,3e-2"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaletrain.sweep.options import describe_options

    p.add_argument("--grid", nargs="+", action="extend", default=[], metavar="KEY=V1,V2",
                   help="a grid axis (Cartesian product over all axes; one value = set for every run)")
    p.add_argument("--runs", metavar="FILE", help="TOML runs file ([sweep], [base], [[run]] tables) instead of --grid")
    p.add_argument("--config", metavar="FILE", help="TOML config shared by every run of the grid")
    p.add_argument("--nproc-per-node", "--devices", dest="devices", type=positive_int(MAX_PROCS), default=None,
                   metavar="N",
                   help="logical devices (worker processes) the runs share (default 2)")
    p.add_argument("--policy", default=None, help="lrtf, round_robin, sequential or task (see below)")
    p.add_argument("--shards", type=positive_int(1 << 16), default=None, metavar="K",
                   help="shards per model (default: fewest that fit)")
    p.add_argument("--device-budget", default=None, metavar="BYTES", help="per-device budget (default: the runs' "
                   "memory.device_budget)")
    p.add_argument("--cores", type=positive_int(1 << 16), default=None, help="host cores (default: this machine's)")
    p.add_argument("--threads", type=positive_int(1 << 16), default=None,
                   help="compute threads per device (default cores / devices)")
    p.add_argument("--predict-only", action="store_true", help="profile and simulate, print the prediction, train "
                   "nothing (no run directory is written)")
    p.add_argument("--out", metavar="DIR", help="sweep directory (default runs/sweep-<timestamp>); one run directory "
                   "per run inside, plus sweep.json and timeline.png")
    p.add_argument("--resume", action="store_true", help="continue every run of --out from its newest checkpoint")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config keys set for every run")
    width = max(len(k) for k, _ in describe_options())
    p.epilog = "sweep options ([sweep] in a runs file; flags above):\n" + "\n".join(
        f"  {k:<{width}}  {h}" for k, h in describe_options())


def _options(args: argparse.Namespace, table: dict):
    from scaletrain.sweep.options import SweepOptions
    from scaletrain.train.config import _fill

    opts = SweepOptions()
    _fill(opts, table, "sweep.")
    flags = {"devices": args.devices, "policy": args.policy, "shards": args.shards,
             "device_budget": args.device_budget, "cores": args.cores, "threads": args.threads}
    _fill(opts, {k: v for k, v in flags.items() if v is not None}, "sweep.")
    return opts


def run(args: argparse.Namespace) -> int:
    from scaletrain.sweep import grid
    from scaletrain.sweep.run import Run, run_sweep, write_summary

    if args.runs and args.grid:
        raise ConfigError("give --grid or --runs, not both")
    if not args.runs and not args.grid:
        raise ConfigError("nothing to sweep: give --grid section.key=v1,v2,... or --runs FILE")
    if args.resume and not args.out:
        raise ConfigError("--resume needs --out DIR naming the sweep to continue")
    if args.runs:
        table, found = grid.file_runs(args.runs, list(args.overrides))
    else:
        table, found = {}, grid.grid_runs(args.config, list(args.overrides), args.grid)
    opts = _options(args, table)
    out = Path(args.out) if args.out else Path("runs") / f"sweep-{_dt.datetime.now():%Y%m%d-%H%M%S-%f}"
    runs = [Run(name, cfg, over) for name, cfg, over in found]
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    result = run_sweep(runs, opts, out, log=log, resume=args.resume, predict_only=args.predict_only)
    s = result.summary
    if not args.predict_only:
        write_summary(out / "sweep.json", result)
    failed = [r for r in result.runs if r.get("status") == "failed"]
    if args.json:
        print(json.dumps({k: v for k, v in {**s, "runs": result.runs}.items() if k != "timeline"}))
    if failed:  # the others trained to their end; the summary says which failed and why
        raise ConfigError(f"{len(failed)} of {len(result.runs)} runs failed: "
                          + "; ".join(f"{r['name']}: {r['error']}" for r in failed))
    if args.json:
        return 0
    for r in result.runs:
        if r.get("status") == "ok":
            log(f"{r['name']}: {r['steps']} steps, final loss {r['final_loss']:.4f}, val_loss {r['val_loss']:.4f} "
                f"({r['out_dir']})")
    pred = f"predicted {s['predicted_makespan_s']:.1f} s"
    if args.predict_only:
        log(f"sweep: {pred}, device utilisation {', '.join(f'{u:.0%}' for u in s['predicted_utilisation'])}")
        return 0
    log(f"sweep: makespan {s['makespan_s']:.1f} s ({pred}, {s['makespan_error']:+.1%}); device utilisation "
        f"{', '.join(f'{u:.0%}' for u in s['utilisation'])} (predicted "
        f"{', '.join(f'{u:.0%}' for u in s['predicted_utilisation'])}); device peaks "
        f"{', '.join(f'{b / 2**20:.1f}' for b in s['device_peak_bytes'])} MiB of "
        f"{(s['budget_bytes'] or 0) / 2**20:.1f} MiB; {out / 'sweep.json'}, {out / 'timeline.png'}")
    return 0
