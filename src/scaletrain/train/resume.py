"""``--resume``: load the newest loadable checkpoint, or refuse in one line and change nothing.

Why a module of its own: what may change between a run and its resume is a policy, stated here.
- the model (name or shape): refused (the weights would not match);
- ``train.params_dtype`` may change: checkpoints hold the fp32 masters in the plain layout
  (:mod:`scaletrain.techniques.precision`), so a bf16-parameter run resumes in fp32 and back;
- ``optim.name``: refused unless ``--reset-optimizer``, which keeps the checkpoint's weights, step,
  data position and RNG and starts fresh optimizer states (the learning-rate schedule continues
  at the checkpoint's step);
- anything else (``train.precision``, ``train.steps``, the parallel layout...): allowed.
A newest checkpoint that cannot be loaded (truncated, foreign, a sharded one that fails its manifest's
sizes or CRCs) is skipped with a warning naming it and the next older one is used
(:func:`.checkpoint_io.resume_state`, for both formats).
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, UserError
from scaletrain.train import checkpoint_io
from scaletrain.train.config import Config, from_dict


def saved_config(state: dict[str, Any]) -> Config | None:
    """The config a checkpoint was written under (None when absent or from another schema)."""
    text = state.get("config")
    if not isinstance(text, str):
        return None
    try:
        return from_dict(tomllib.loads(text))
    except (tomllib.TOMLDecodeError, UserError):
        return None


def check_compatible(cfg: Config, saved: Config | None, path: Path, *, reset_optimizer: bool,
                     registry_model: bool) -> None:
    """Refuse in one line a resume whose model, parameter dtype or optimizer differs from ``saved``."""
    if saved is None:
        return
    where = f"checkpoint {path.name} of {str(path.parent.parent)!r}"
    if registry_model and (saved.model.name, saved.model.overrides) != (cfg.model.name, cfg.model.overrides):
        raise ConfigError(f"{where} holds model {saved.model.name!r} with overrides {saved.model.overrides}; this "
                          f"run asks for {cfg.model.name!r} with {cfg.model.overrides}; a resume keeps the model "
                          f"(start a new run with another --out to change it)")
    if saved.optim.name != cfg.optim.name and not reset_optimizer:
        raise ConfigError(f"{where} holds {saved.optim.name!r} optimizer states; this run asks for optim.name="
                          f"{cfg.optim.name!r}: add --reset-optimizer to keep the weights and start fresh "
                          f"{cfg.optim.name!r} states, or resume with optim.name={saved.optim.name!r}")


def restore(trainer: Any, reset_optimizer: bool) -> tuple[Path, list[Path], float, float]:
    """Load the newest good checkpoint of ``trainer.out_dir`` into ``trainer`` (nothing is written).

    Returns (its path, the newer ones that did not load, load start, load end), times in seconds
    since the epoch. The run directory sets the unloadable ones aside once the run has made a good
    step (:meth:`RunDir.open`): left in place, checkpoint rotation would count them and could
    delete the good checkpoints written after them.
    """
    if trainer.out_dir is None:
        raise ConfigError("--resume needs --out DIR naming the run to continue")
    t0 = time.time()
    path, state, skipped = checkpoint_io.resume_state(trainer)  # sharded or consolidated; damaged ones skipped
    check_compatible(trainer.cfg, saved_config(state), path, reset_optimizer=reset_optimizer,
                     registry_model=trainer.model_name == trainer.cfg.model.name)
    trainer.load_state_dict(state, reset_optimizer=reset_optimizer)
    return path, skipped, t0, time.time()
