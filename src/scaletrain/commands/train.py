"""``scaletrain train``: run a training job from defaults, a TOML file and dotted overrides."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

from scaletrain.errors import ConfigError
from scaletrain.train.config import describe, load_config

NAME = "train"
HELP = "train a model (default: gpt2-tiny on the shipped Shakespeare text, on CPU, in ~2 minutes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (sections model, data, optim, train, memory)")
    p.add_argument("--out", metavar="DIR", help="run directory (default: a fresh runs/<timestamp>/); holds "
                   "config.toml, metrics.jsonl and checkpoints/")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out; with no "
                   "--config, the run's own config.toml is reused (overrides still apply)")
    p.add_argument("--json", action="store_true", help="print the final result as one JSON object")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides (listed below)")
    width = max(len(k) for k, _ in describe())
    p.epilog = "config keys (section.key=value):\n" + "\n".join(f"  {k:<{width}}  {h}" for k, h in describe())


def _default_out() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path("runs") / stamp


def run(args: argparse.Namespace) -> int:
    from scaletrain.train.trainer import Trainer

    if args.resume and not args.out:
        raise ConfigError("--resume needs --out DIR naming the run to continue")
    out = Path(args.out) if args.out else _default_out()
    config_path = args.config
    if args.resume and config_path is None and (out / "config.toml").is_file():
        config_path = out / "config.toml"
    cfg = load_config(config_path, args.overrides)
    quiet = args.json
    log = (lambda s: None) if quiet else (lambda s: print(s, flush=True))
    trainer = Trainer(cfg, out, resume=args.resume, log=log)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log(f"scaletrain: training {trainer.model_name} ({n_params:,} parameters) on {trainer.data_name}, "
        f"{cfg.train.steps} steps x {cfg.train.global_batch} samples (micro-batch {trainer.micro_batch} x "
        f"{trainer.accum} accumulation), {cfg.train.precision}, {cfg.optim.name}, device {trainer.device.type}; "
        f"run directory {out}")
    result = trainer.fit()
    summary = {"steps": result.steps, "final_loss": result.final_loss, **result.val_metrics, "out_dir": str(out)}
    if trainer.data_name == "shakespeare":
        from scaletrain.data.text import byte_unigram_entropy

        h = byte_unigram_entropy("val")
        summary["unigram_entropy"] = h
        log(f"final validation loss {result.val_loss:.4f} nats/byte vs byte-unigram entropy {h:.4f} nats/byte "
            f"of the validation text ({result.val_loss / h:.0%} of it)")
    if args.json:
        print(json.dumps(summary))
    return 0
