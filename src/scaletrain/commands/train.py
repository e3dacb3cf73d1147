"""``scaletrain train``: run a training job from defaults, a TOML file and dotted overrides."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

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
    p.add_argument("--json", action="store_true", help="print the final result as one JSON object")
    p.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                   help="data-parallel processes on this machine: re-runs this command under "
                   "`python -m torch.distributed.run --standalone --nproc-per-node N` (gloo on CPU, NCCL on GPU); "
                   "for several machines run torchrun yourself")
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


def _relaunch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun with ``--nproc-per-node`` processes (one run directory)."""
    import os
    import subprocess

    from scaletrain.techniques.data_parallel.launch import torchrun_command

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
    model_ranks = cfg.parallel.pp * cfg.parallel.tp * cfg.parallel.cp  # dp = processes / model_ranks
    if cfg.parallel.dp and cfg.parallel.dp * model_ranks != args.nproc_per_node:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} conflicts with --nproc-per-node {args.nproc_per_node}; "
                          f"give one of them (or dp x pp x tp x cp = --nproc-per-node)")
    out = args.out or str(_default_out())  # chosen once, so every rank writes/reads the same directory
    argv = ["train", "--out", out]
    argv += ["--config", str(args.config)] if args.config else []
    argv += ["--plan", str(args.plan)] if args.plan else []
    argv += ["--resume"] if args.resume else []
    argv += ["--json"] if args.json else []
    argv += list(args.overrides)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(torchrun_command(args.nproc_per_node, argv), env=env)
    return proc.returncode


def run(args: argparse.Namespace) -> int:
    if getattr(args, "nproc_per_node", 0):
        return _relaunch(args)
    try:
        return _run(args)
    except ConfigError:
        from scaletrain.techniques.data_parallel.launch import launch_env

        if launch_env().rank != 0:  # the same config error on every rank: rank 0 says it once
            return 2
        raise


def _run(args: argparse.Namespace) -> int:
    from scaletrain.train.trainer import Trainer

    if args.resume and not args.out:
        raise ConfigError("--resume needs --out DIR naming the run to continue")
    out = Path(args.out) if args.out else _default_out()
    config_path = args.config
    if args.resume and config_path is None and (out / "config.toml").is_file():
        config_path = out / "config.toml"
    cfg = load_config(config_path, _overrides(args))
    quiet = args.json
    log = (lambda s: None) if quiet else (lambda s: print(s, flush=True))
    trainer = Trainer(cfg, out, resume=args.resume, log=log)
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
    result = trainer.fit()
    summary = {"steps": result.steps, "final_loss": result.final_loss, **result.val_metrics, "out_dir": str(out)}
    if trainer.data_name == "shakespeare":
        from scaletrain.data.text import byte_unigram_entropy

        h = byte_unigram_entropy("val")
        summary["unigram_entropy"] = h
        log(f"final validation loss {result.val_loss:.4f} nats/byte vs byte-unigram entropy {h:.4f} nats/byte "
            f"of the validation text ({result.val_loss / h:.0%} of it)")
    if args.json and trainer.rank == 0:
        print(json.dumps(summary))
    return 0

