"""One process of a pipeline test run (spawned by :func:`scaletrain.testing.run_distributed`): train
with the given flags under the memory tracker, writing a sharded checkpoint at step 2, report what the
tests compare with one process, then resume that checkpoint and report the resumed losses."""

from __future__ import annotations

from pathlib import Path

from scaletrain.train.config import load_config


def train_and_resume(rank: int, world: int, out_dir: str, flags: list[str]) -> dict:
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train.trainer import Trainer

    cfg = load_config(None, flags + ["train.measure_memory=true", "train.checkpoint_every=2",
                                     "train.checkpoint_format=sharded"])
    t = Trainer(cfg, out_dir, log=lambda s: None)
    res = t.fit()
    metrics = t.parallel.metrics()
    out = {"losses": res.losses, "norm": t._grad_norm, "comm": t.comm_bytes, "tracked": t.tracked,
           "predicted": metrics["predicted_comm_bytes"], "how": t.parallel.describe(),
           "model": {k: v.clone() for k, v in t.parallel.model_state_dict().items()},
           "opt": t.parallel.optimizer_state_dict(t.optimizer)}
    t.close()
    t = Trainer(load_config(None, flags), None, log=lambda s: None)  # resume the sharded step-2 checkpoint
    t.load_state_dict(ckpt.load(ckpt.at_step(Path(out_dir) / "checkpoints", 2)))
    out["resumed"] = t.fit().losses
    t.close()
    return out
