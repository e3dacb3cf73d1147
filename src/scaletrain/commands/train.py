"""``scaletrain train``: run a training job from defaults, a TOML file and dotted overrides."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

from scaletrain.argtypes import MAX_PROCS, count
from scaletrain.errors import ConfigError
from scaletrain.train.config import describe, load_config

NAME = "train"
HELP = "train a model (default: gpt2-tiny on the shipped Shakespeare text, on CPU, in 1-2 minutes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (sections model, data, optim, train, memory)")
    p.add_argument("--plan", metavar="FILE", help="a plan (how to train: parallelism, ZeRO, remat, offload, precision, "
                   "optimizer) as written by `scaletrain plan --out` or Plan.to_toml(): TOML in config sections, "
                   "or the JSON of `scaletrain plan --json`; applied after --config, before the overrides")
    p.add_argument("--out", metavar="DIR", help="run directory (default: a fresh runs/<timestamp>/); holds "
                   "config.toml, metrics.jsonl and checkpoints/")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out; with no "
                   "--config, the run's own config.toml is reused (overrides still apply)")
    p.add_argument("--reset-optimizer", action="store_true", help="with --resume: keep the checkpoint's weights, "
                   "step and data position but start fresh optimizer states (needed to change optim.name)")
    p.add_argument("--json", action="store_true", help="print the final result as one JSON object")
    p.add_argument("--nproc-per-node", type=count(MAX_PROCS), default=0, metavar="N",
                   help="data-parallel processes on this machine: re-runs this command under "
                   "`python -m torch.distributed.run --standalone --nproc-per-node N` (gloo on CPU, NCCL on GPU); "
                   "for several machines run torchrun yourself (its --max-restarts resume too: give --out on a shared "
                   "filesystem)")
    p.add_argument("--max-restarts", type=count(1000), default=0, metavar="K",
                   help="with --nproc-per-node: restart the job up to K times when a rank dies or hangs past "
                   "parallel.timeout_s, each time with a fresh rendezvous, resuming from the newest complete "
                   "checkpoint (no sample lost or repeated); the time each failure cost is logged as a restart row")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides (listed below)")
    width = max(len(k) for k, _ in describe())
    p.epilog = "config keys (section.key=value):\n" + "\n".join(f"  {k:<{width}}  {h}" for k, h in describe())


def _default_out() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path("runs") / stamp


def _overrides(args: argparse.Namespace) -> list[str]:
    """The plan file's keys (if any), then the command line's: the later wins."""
    if not getattr(args, "plan", None):
        return list(args.overrides)
    from scaletrain.plan import load_plan_overrides

    return load_plan_overrides(args.plan) + list(args.overrides)


def _check_plan_source(args: argparse.Namespace, cfg) -> None:
    """``--plan FILE`` and ``plan=auto`` both choose the plan: one of them (one line, exit 2)."""
    if cfg.plan == "auto" and getattr(args, "plan", None):
        raise ConfigError(f"--plan {args.plan} and plan=auto both choose the plan; give one of them")
    if cfg.plan == "auto":
        from scaletrain.planner.auto import check

        check(cfg)  # keys plan=auto does not plan fail here, before any process starts


def _relaunch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun with ``--nproc-per-node`` processes (one run directory)."""
    from scaletrain.train.agent import torchrun_command
    from scaletrain.train import recovery, rundir

    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node={args.nproc_per_node} is not allowed; must be >= 1")
    if os.environ.get("WORLD_SIZE"):
        raise ConfigError("--nproc-per-node given inside a torchrun job; drop it (torchrun already started the "
                          "processes)")
    if args.resume and not args.out:
        raise ConfigError("--resume needs --out DIR naming the run to continue")
    config_path = args.config
    if args.resume and config_path is None and (Path(args.out) / "config.toml").is_file():
        config_path = Path(args.out) / "config.toml"
    cfg = load_config(config_path, _overrides(args))  # bad keys fail here, once, before any process starts
    _check_plan_source(args, cfg)
    model_ranks = cfg.parallel.pp * cfg.parallel.tp * cfg.parallel.cp  # dp = processes / model_ranks
    if cfg.parallel.dp and cfg.parallel.dp * model_ranks != args.nproc_per_node:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} conflicts with --nproc-per-node {args.nproc_per_node}; "
                          f"give one of them (or dp x pp x tp x cp = --nproc-per-node)")
    if args.reset_optimizer and not args.resume:
        raise ConfigError("--reset-optimizer applies to a --resume only")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts} is not allowed; must be >= 0")
    out = Path(args.out or _default_out())  # chosen once, so every rank writes/reads the same directory
    lock = rundir.check_target(out, args.resume)  # once, here, before any process starts; held across attempts
    argv = ["train", "--out", str(out)]
    argv += ["--config", str(args.config)] if args.config else []
    argv += ["--plan", str(args.plan)] if args.plan else []
    argv += ["--json"] if args.json else []
    argv += list(args.overrides)  # --resume / --reset-optimizer: per attempt (recovery.run_job)
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        return recovery.run_job(lambda a: torchrun_command(args.nproc_per_node, a), argv, out, resume=args.resume,
                                reset_optimizer=args.reset_optimizer, max_restarts=args.max_restarts, log=log)
    finally:
        lock.release()


def run(args: argparse.Namespace) -> int:
    if getattr(args, "nproc_per_node", 0):
        return _relaunch(args)
    if getattr(args, "max_restarts", 0):
        raise ConfigError("--max-restarts needs --nproc-per-node N (the launcher restarts the processes it started)")
    if getattr(args, "reset_optimizer", False) and not args.resume:
        raise ConfigError("--reset-optimizer applies to a --resume only")
    if os.environ.get("RANK") is not None:
        from scaletrain.train.process_tree import enter_rank

        enter_rank(int(os.environ["RANK"]))  # dies with its torchrun agent; the launcher can stop a hung rank
    return _run(args)  # a UserError on several ranks is said once (scaletrain.errors.report)


def _run(args: argparse.Namespace) -> int:
    from scaletrain.train.trainer import Trainer

    if args.resume and not args.out:
        raise ConfigError("--resume needs --out DIR naming the run to continue")
    out = Path(args.out) if args.out else _default_out()
    config_path = args.config
    if args.resume and config_path is None and (out / "config.toml").is_file():
        config_path = out / "config.toml"
    cfg = load_config(config_path, _overrides(args))
    _check_plan_source(args, cfg)
    quiet = args.json
    log = (lambda s: None) if quiet else (lambda s: print(s, flush=True))
    trainer = Trainer(cfg, out, resume=args.resume, log=log, reset_optimizer=getattr(args, "reset_optimizer", False))
    try:
        if trainer.world > 1 and not args.out:  # under plain torchrun: use rank 0's directory everywhere
            import torch.distributed as dist

            box = [str(out)]
            dist.broadcast_object_list(box, src=0)
            out = trainer.out_dir = Path(box[0])
        return _train(args, cfg, trainer, out, trainer.log)
    finally:
        trainer.close()


def _train(args: argparse.Namespace, cfg, trainer, out: Path, log) -> int:
    n_params = sum(p.numel() for p in trainer.model.parameters())  # DTensors report their full size
    # data-parallel replicas only: pipeline / tensor ranks do not multiply the batch (they show in `how`)
    ranks = f" x {trainer.dp_world} data-parallel ranks" if trainer.dp_world > 1 else ""
    how = f", {trainer.parallel.describe()}" if trainer.world > 1 else ""
    how += "".join(f", {p}" for p in trainer.plan.memory_parts())  # remat / offload on (one process too)
    log(f"scaletrain: training {trainer.model_name} ({n_params:,} parameters) on {trainer.data_name}, "
        f"{cfg.train.steps} steps x {cfg.train.global_batch} samples (micro-batch {trainer.micro_batch} x "
        f"{trainer.accum} accumulation{ranks}), {cfg.train.precision}, {cfg.optim.name}, "
        f"device {trainer.device.type}{how}; run directory {out}")
    if trainer.auto is not None:
        log(trainer.auto.header(trainer.world))
    result = trainer.fit()
    summary = {"steps": result.steps, "final_loss": result.final_loss, **result.val_metrics, "out_dir": str(out)}
    if trainer.auto is not None:  # predicted next to measured (scaletrain.planner.auto)
        extra, line = trainer.auto.summary(trainer.tracked, result.comm_bytes_per_step)
        summary.update(extra)
        log(line)
    if result.val_loss is None and args.resume:  # resumed at train.steps: no step ran, nothing validated
        log(f"nothing to train: the run is already at step {result.steps} = train.steps; raise train.steps to "
            f"continue it")
    elif trainer.data_name == "shakespeare":
        from scaletrain.data.text import byte_unigram_entropy

        h = byte_unigram_entropy("val")
        summary["unigram_entropy"] = h
        log(f"final validation loss {result.val_loss:.4f} nats/byte vs byte-unigram entropy {h:.4f} nats/byte "
            f"of the validation text ({result.val_loss / h:.0%} of it)")
    if args.json and trainer.rank == 0:
        print(json.dumps(summary))
    return 0

