"""Elastic re-planning: a resumed round whose world size differs from its checkpoint's re-plans.

Why: under torchrun's elastic rendezvous (``--nnodes MIN:MAX``) a lost node ends the round and the
agents that are left start the next one with fewer processes; a node that joins makes them start
one with more (torch/distributed/elastic/agent/server/api.py, "Detected N new nodes"). The command
line is the same in every round, so its layout — written for the first world — may not divide the
new one. This module makes such a round run instead of failing in ``Plan.resolved``:

- ``plan=auto``: the planner runs again for the processes there are (it does so every round);
  pinned keys that no longer fit are dropped first, as below;
- pinned keys: ``parallel.tp`` / ``cp`` / ``pp`` are kept while their product divides the new world
  (in that order), ``parallel.dp`` when it equals what is left, ``hsdp`` / ``ep`` when they divide
  the data-parallel size, ``parallel.microbatches`` / ``train.micro_batch`` when they still split the
  global batch; a key that does not is dropped (back to its default, derived) and named; a pinned
  micro-batch that no longer splits becomes the largest that does and is not larger (per-device
  memory stays bounded);
- ``train.global_batch`` is never changed, so every optimizer step sums the same samples and the
  mathematics equals the uninterrupted run's (accumulation makes up for fewer replicas); a global
  batch the new data-parallel size cannot split is one line, exit 2.

The checkpoint itself loads under any layout (:mod:`.shard_layouts`, :mod:`.checkpoint_io`) and the
data position is ``step x global_batch`` whatever the layout (:mod:`scaletrain.data.loader`).
Rank 0 logs one ``{"event": "replan", ...}`` metrics row: old and new world, plan, micro-batch and
accumulation, the keys dropped, and the time lost (the ``restart`` row's parts, when the round is a
torchrun restart: from the old round's last step to the new round being back there). A plain
``--resume`` at another world size re-plans the same way (its row has no time lost).

Only a *resumed* round re-plans: a fresh run whose pinned layout does not divide the world it was
started with is a bad input (one line, exit 2) as before.

What torchrun needs for it (torch 2.13, read in its code and seen in tests/test_elastic_replan.py):

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for a node to *join* a running job. With the default
  shared agent store, a node that joins a later round as a non-zero rank waits for the round's
  ``MASTER_ADDR`` key, which the rank-0 agent publishes only in the first round it is rank 0
  (elastic/rendezvous/dynamic_rendezvous.py ``next_rendezvous``, ``if self._bootstrap_store_info is
  None or (rank == 0 ...)``): ``DistStoreError: wait timeout ... /torch.rendezvous.<id>.2/MASTER_ADDR``.
  Without the shared store each round's rank 0 hosts the process group's store on a fresh port, and
  the run directory is recognised by the job's ``--rdzv-id`` (:func:`.elastic.record`).
- The ``--rdzv-endpoint`` node must stay: its store holds the rendezvous itself.
- A lost node is dropped from the rendezvous once its keep-alive has expired (``--rdzv-conf
  keep_alive_interval=S,keep_alive_max_attempt=N``, default 5 s x 3), and a round smaller than
  ``--nnodes``' maximum waits ``last_call_timeout`` (default 30 s) for more nodes: both are time lost.
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, UserError
from scaletrain.plan import OffloadPlan, Plan, RematPlan


@dataclass
class Previous:
    """The layout the newest checkpoint was written under."""

    world: int
    """Processes of the round that wrote it."""
    plan: str
    """Its plan, as :meth:`Plan.describe` says it."""
    micro_batch: int
    """Samples per forward/backward on one device (0: unknown)."""
    accum: int
    """Micro-batches per optimizer step (0: unknown)."""
    step: int


def _plan_of(d: dict[str, Any]) -> Plan:
    top = {k: v for k, v in d.items() if k not in ("remat", "offload")}
    return Plan(**top, remat=RematPlan(**d.get("remat", {})), offload=OffloadPlan(**d.get("offload", {})))


def _batches(config_text: Any, plan: Plan) -> tuple[int, int]:
    """(micro_batch, accum) of a saved config under ``plan`` (resolved); (0, 0) when unreadable."""
    try:
        from scaletrain.train.config import from_dict

        t = from_dict(tomllib.loads(config_text)).train
        micro = t.micro_batch or t.global_batch // max(plan.dp, 1)
        if plan.pp > 1 and plan.microbatches:
            return t.global_batch // (plan.microbatches * max(plan.dp, 1)), plan.microbatches
        return micro, t.global_batch // max(micro * max(plan.dp, 1), 1)
    except (TypeError, ValueError, tomllib.TOMLDecodeError, UserError, AttributeError):
        return 0, 0


def previous(out_dir: Path) -> Previous | None:
    """The newest readable checkpoint's layout in ``out_dir`` (None when there is none).

    A sharded checkpoint says it in its manifest (``world``, ``plan``); a consolidated one (one
    file) is loaded, as the resume will load it anyway."""
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train import sharded_checkpoint as sharded

    for path in reversed(ckpt.list_checkpoints(out_dir / "checkpoints")):
        try:
            if path.is_dir():
                m = sharded.read_manifest(path)
                world, step, config, plan = int(m["world"]), int(m["step"]), m.get("config"), _plan_of(m["plan"])
            else:
                from scaletrain.train.resume import saved_config

                state = ckpt.load(path)
                world, step, config = int((state.get("parallel") or {}).get("dp", 1)), int(state["step"]), state.get(
                    "config")
                saved = saved_config(state)
                plan = Plan.from_config(saved).resolved(world) if saved is not None else Plan(dp=world)
            return Previous(world, plan.describe(), *_batches(config, plan), step)
        except (UserError, KeyError, TypeError, ValueError):
            continue  # a damaged one: the resume skips it too
    return None


@dataclass
class Replan:
    """One re-planned round: what changed, for the log line and the metrics row."""

    old: Previous
    world: int
    cfg: Any
    """The config this round runs (pinned keys that did not fit dropped)."""
    dropped: list[str] = field(default_factory=list)
    """``key=old value`` (dropped: back to its default) or ``key=old->new`` (changed), in config keys."""
    plan: str = ""
    micro_batch: int = 0
    accum: int = 0

    def settle(self, plan: Plan, micro_batch: int, accum: int) -> None:
        """The new round's resolved plan and batch split (once the trainer has them)."""
        self.plan, self.micro_batch, self.accum = plan.describe(), micro_batch, accum

    def describe(self) -> str:
        kept = f"; dropped {', '.join(self.dropped)}" if self.dropped else ""
        return (f"re-planned for {self.world} processes (was {self.old.world}): {self.old.plan} -> {self.plan}, "
                f"micro-batch {self.old.micro_batch} x {self.old.accum} -> {self.micro_batch} x {self.accum}{kept}")

    def row(self, step: int, global_batch: int, restart: dict[str, Any] | None) -> dict[str, Any]:
        """The ``replan`` metrics row; ``restart``: the round's restart row (its time lost), if any."""
        lost = {k: restart[k] for k in ("lost_s", "detect_s", "restart_s", "reload_s", "recompute_s",
                                        "resumed_from_step", "failed_at_step", "recomputed_steps")} if restart else {}
        return {"event": "replan", "step": step, "old_world": self.old.world, "new_world": self.world,
                "old_plan": self.old.plan, "new_plan": self.plan, "global_batch": global_batch,
                "old_micro_batch": self.old.micro_batch, "old_accum": self.old.accum,
                "new_micro_batch": self.micro_batch, "new_accum": self.accum, "dropped": list(self.dropped),
                "lost_s": lost.pop("lost_s", None), **lost}


def fit_world(cfg: Any, world: int) -> tuple[Any, list[str]]:
    """(a copy of ``cfg`` whose pinned layout keys fit ``world`` processes, the keys dropped or
    changed); see the module docstring for the rules. ConfigError when the global batch cannot be
    split over the data-parallel ranks left."""
    cfg = copy.deepcopy(cfg)
    p, t = cfg.parallel, cfg.train
    notes: list[str] = []

    def drop(name: str, default: Any) -> None:
        notes.append(f"parallel.{name}={getattr(p, name)}")
        setattr(p, name, default)

    model = 1
    for name in ("tp", "cp", "pp"):
        v = getattr(p, name)
        if world % (model * v):
            drop(name, 1)
        else:
            model *= v
    dp = world // model
    if p.dp and p.dp != dp:
        drop("dp", 0)
    if p.tp == 1 and p.sequence_parallel:
        drop("sequence_parallel", False)
    if p.pp == 1:
        for name, default in (("schedule", "1f1b"), ("virtual", 0), ("microbatches", 0)):
            if getattr(p, name) != default and any(n.startswith("parallel.pp=") for n in notes):
                drop(name, default)
    if p.hsdp and dp % p.hsdp:
        drop("hsdp", 0)
    if p.ep > 1 and dp % p.ep:
        drop("ep", 1)
    g = t.global_batch
    if g % dp:
        raise ConfigError(f"train.global_batch={g} cannot be split over the {dp} data-parallel replicas of the "
                          f"{world} processes this round has (kept as given so the mathematics is unchanged); "
                          f"restart with a world whose data-parallel size divides {g}")
    if p.pp > 1 and p.microbatches and g % (p.microbatches * dp):
        drop("microbatches", 0)
    if t.micro_batch and g % (t.micro_batch * dp):
        new = max(m for m in range(1, t.micro_batch + 1) if g % (m * dp) == 0)
        notes.append(f"train.micro_batch={t.micro_batch}->{new}")
        t.micro_batch = new
    return cfg, notes


def start(cfg: Any, world: int, out_dir: Path | None) -> Replan | None:
    """The re-plan of a resumed round in ``out_dir`` (None when this is not a resume, or its
    checkpoint was written under the same world size: then nothing changes)."""
    if out_dir is None:
        return None
    old = previous(out_dir)
    if old is None or old.world == world:
        return None
    new_cfg, dropped = fit_world(cfg, world)
    return Replan(old, world, new_cfg, dropped)
