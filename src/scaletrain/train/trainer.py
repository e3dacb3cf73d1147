"""The training loop, indifferent to which plan it runs.

Order of one optimizer step (``global_batch`` samples):
  for each of ``accum`` micro-batches: forward (under autocast for bf16/fp16), loss / accum,
  backward (scaled for fp16) — through the plain model, or through a rematerialization
  schedule when one is configured;
  then unscale (fp16), clip the global gradient norm, optimizer step (skipped by the loss
  scaler on inf/NaN), scheduler step, zero grads.

Everything that decides the *next* losses — model, optimizer, scheduler, scaler, RNG states and
the data position — is checkpointed, so a resumed run continues bitwise identically on CPU.

Data parallelism (``parallel.*``): started by torchrun (or ``scaletrain train --nproc-per-node``),
every process runs this same loop on its share of each global batch. A strategy object from
:mod:`scaletrain.techniques.data_parallel` / :mod:`~scaletrain.techniques.data_parallel.zero` wraps the steps
above (no-sync for early micro-batches, gradient reduction, sharded clipping, the parameter
all-gather after the step); logged losses are averaged over ranks, so they equal a single
process's on the same global batch. Only rank 0 writes files and prints; checkpoints are sharded
(every rank its own pieces) or consolidated (:mod:`.checkpoint_io`), and load at any layout.
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
import sys
import time
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.data import build_loader
from scaletrain.errors import ConfigError
from scaletrain.measure.comm import LEDGER
from scaletrain.plan import Plan
from scaletrain.planner import auto as plan_auto
from scaletrain.techniques.compat import Facts
from scaletrain.techniques.data_parallel import launch
from scaletrain.techniques.runtime import RunContext, average_pending
from scaletrain.techniques.stack import build_runtime
from scaletrain.models.adapters import adapt
from scaletrain.train import checkpoint_io, elastic, faults, handback, interrupt, model_record, preflight
from scaletrain.train import replan, resume as resuming, rundir
from scaletrain.train.callbacks import Hooks
from scaletrain.train.config import Config, to_toml
from scaletrain.train.divergence import DivergenceGuard
from scaletrain.train.host_work import host_seconds  # plan=auto measures the trainer's own host work
from scaletrain.train.logging import ProgressBar
from scaletrain.train.lr import lr_factor
from scaletrain.train.model_data import as_pairs, build_datasets, data_rate  # dict samples: as (x, y) pairs


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    val_loss: float | None
    val_metrics: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    """Training loss of every optimizer step run in this call (mean over micro-batches)."""
    out_dir: Path | None = None
    comm_bytes_per_step: float = 0.0
    """Bytes received per rank in the last step's collectives (0 with one process)."""
    model_state_bytes: dict[str, float] = field(default_factory=dict)
    """Per-rank bytes of parameters / gradients / optimizer states, measured after the backward
    of the second step (when the optimizer states exist); empty for runs of one step."""


def batch_arithmetic(global_batch: int, micro_batch: int, world: int) -> tuple[int, int]:
    """(micro_batch, accumulation steps) so that micro_batch x accum x world == global_batch.

    micro_batch 0 means "as large as possible without accumulation". Conflicts are reported
    with the numbers that would work, sparing users DeepSpeed's batch-size puzzles.
    """
    if micro_batch == 0:
        if global_batch % world:
            raise ConfigError(f"train.global_batch={global_batch} is not divisible by the {world} data-parallel "
                              f"ranks; use a multiple of {world}")
        return global_batch // world, 1
    per_step = micro_batch * world
    if global_batch % per_step:
        ok = [m for m in range(1, global_batch // world + 1) if global_batch % (m * world) == 0]
        raise ConfigError(f"train.global_batch={global_batch} is not a multiple of train.micro_batch={micro_batch} x "
                          f"{world} data-parallel ranks; allowed micro_batch: {', '.join(map(str, ok))}")
    return micro_batch, global_batch // per_step


def _rss_peak_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Trainer:
    """Builds everything a run needs from a :class:`Config` and runs the loop (:meth:`fit`)."""

    def __init__(self, cfg: Config, out_dir: Path | str | None = None, *, model: nn.Module | None = None,
                 resume: bool = False, log: Callable[[str], None] | None = None, reset_optimizer: bool = False,
                 runtime: Callable[..., Any] | None = None, train_data: Any = None, eval_data: Any = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, callbacks: list[Any] | None = None,
                 eval_fn: Callable[..., dict[str, float]] | None = None):
        """``runtime``: builds the runtime instead of the plan's stack, called like
        :func:`~scaletrain.techniques.stack.build_runtime` (``scaletrain sweep`` passes its spilled
        shards); everything else — data, loop, metrics, checkpoints — is this trainer's.
        ``train_data`` / ``eval_data`` / ``collate_fn``: your own data instead of ``data.name``
        (:func:`~scaletrain.train.model_data.build_datasets`). ``callbacks`` / ``eval_fn``: your code at
        each step, evaluation and checkpoint (:mod:`.callbacks`)."""
        self.cfg = cfg
        self._user_data, self._user_hooks = (train_data, eval_data, collate_fn), (callbacks, eval_fn)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.resume, self.reset_optimizer = resume or elastic.resume_round(self.out_dir), reset_optimizer
        self._build_runtime = runtime or build_runtime
        # before anything is built: an unusable or busy --out is one line; its lock is held until close()
        self._run_lock = rundir.check_target(self.out_dir, resume)
        try:
            env = launch.launch_env()
            self.device = preflight.resolve_device(cfg.train.device, env.local_rank)
            self._created_group = launch.init_process_group(self.device, cfg.parallel.timeout_s, elastic.group_store)
        except BaseException:
            self._run_lock.release()
            raise
        try:
            self._setup(cfg, model, log)
        except BaseException:
            # a bad config must not leave the process group behind
            launch.shutdown(self._created_group, finished=getattr(self, "_finished", False))
            self._run_lock.release()
            raise

    def _setup(self, cfg: Config, model: nn.Module | None, log: Callable[[str], None] | None) -> None:
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.hooks = Hooks(*self._user_hooks, self.rank)
        say = log or (lambda s: print(s, flush=True))
        self.log = say if self.rank == 0 else (lambda s: None)
        preflight.check_unused(cfg)  # a value set for a feature that is off is one line, not ignored
        self.replan = replan.start(cfg, self.world, self.out_dir if self.resume else None)  # another world size
        cfg = self.cfg = self.replan.cfg if self.replan is not None else cfg  # pinned keys that fit it
        host_work = partial(host_seconds, trainer_cls=type(self))  # the Trainer measures its own host work
        self.auto = plan_auto.choose(cfg, self.world, self.rank, self.device, data_rate=lambda: data_rate(
            cfg, model, self.world, *self._user_data), host_work=host_work) if cfg.plan == "auto" else None
        cfg = self.cfg = self.auto.cfg if self.auto is not None else cfg  # plan=auto: the chosen plan's keys set
        self.plan = Plan.from_config(cfg).resolved(self.world)
        self.dp_world = self.plan.dp
        """Data-parallel replicas: processes / (pp x tp x cp)."""
        if self.world == 1 and (cfg.parallel.zero or cfg.parallel.compression != "none"):
            self.log(f"note: one process, so parallel.zero={cfg.parallel.zero} / parallel.compression="
                     f"{cfg.parallel.compression} have no effect")
        self.micro_batch, self.accum = self._batch_arithmetic()
        if self.replan is not None:
            self.replan.settle(self.plan, self.micro_batch, self.accum)
            self.log(self.replan.describe())
        torch.manual_seed(cfg.train.seed)  # the same on every rank: identical initial weights
        random.seed(cfg.train.seed)
        self.model_name = cfg.model.name if model is None else type(model).__name__
        self.model = model if model is not None else preflight.build_model(cfg)
        self.model.to(self.device)
        self.adapter = adapt(self.model)  # what the loop needs of a model it did not write (task, loss, sizes)
        self.task = self.adapter.task
        self._snapshot = handback.take(self.model) if model is not None else None
        """The user's model as given: restored with the trained values after fit() / close()."""
        self._build_data()
        if model is not None:  # config.toml names what was trained: rebuildable, or the class (model_record)
            cfg = self.cfg = model_record.recorded(cfg, self.model, self.data_name)
        preflight.check_model_data(cfg, self.model, self.task, self.model_name, self.data_name, self.train_set)
        self.ctx = self._context()
        facts = Facts.of(self.model, world=self.world, device=self.device.type, seq_len=cfg.data.seq_len,
                         eval_every=cfg.train.eval_every, microbatches=self.accum)
        self.parallel = self._build_runtime(self.plan, self.model, self.ctx, facts)
        self.forward_module: nn.Module = self.parallel.forward_module
        preflight.check_loaders(self)
        if self.world > 1:  # per-replica streams for dropout etc. (the data order has its own generator): equal
            # within a TP group (replicated regions draw the same masks; sharded ones fork per TP rank)
            from scaletrain.techniques.tensor_parallel.rng import replica_seed

            seed = replica_seed(cfg.train.seed, self.rank, self.plan.tp)
            torch.manual_seed(seed)
            random.seed(seed)
            LEDGER.install()
        self.optimizer = self.parallel.build_optimizer(self._build_optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.scaler = self.parallel.make_scaler(self.device, cfg.train.precision == "fp16")
        self.ctx.optimizer, self.ctx.scaler = self.optimizer, self.scaler
        self.step = 0
        self.comm_bytes = 0.0
        self.model_state_bytes: dict[str, float] = {}
        self.tracked: dict[str, Any] | None = None
        """``train.measure_memory``: the last step's tracked per-rank peaks (for the metrics row)."""
        self.phases: dict[str, float] = {}
        """``train.profile_step``: rank 0's seconds per phase of that step (for its metrics row)."""

    # ------------------------------------------------------------------ construction
    def _context(self) -> RunContext:
        """What the runtime may know of this run (never the trainer itself)."""
        cfg = self.cfg

        def example_batch() -> tuple[torch.Tensor, torch.Tensor]:
            loader = build_loader(as_pairs(self.train_set, self.adapter), self.micro_batch, shuffle=False,
                                  seed=cfg.train.seed)
            x, y = next(iter(loader))
            return x.to(self.device), y.to(self.device)

        return RunContext(device=self.device, rank=self.rank, world=self.world, dp_world=self.dp_world,
                          micro_batch=self.micro_batch, accum=self.accum,
                          seq_len=cfg.data.seq_len if self.task == "lm" else None, task=self.task,
                          precision=cfg.train.precision, model_name=self.model_name, seed=cfg.train.seed,
                          grad_clip=cfg.optim.grad_clip, log_every=cfg.train.log_every, steps=cfg.train.steps,
                          optim_hyper={"momentum": cfg.optim.momentum} if cfg.optim.name in ("sgd", "lars") else {},
                          timeout_s=cfg.parallel.timeout_s, loss_fn=self.loss_fn, log=self.log,
                          build_optimizer=self._build_optimizer, example_batch=example_batch)

    @property
    def forward_backward(self) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
        """One micro-batch's forward and backward (the stack's: plain, or a remat executor)."""
        return self.ctx.forward_backward  # type: ignore[return-value]

    @forward_backward.setter
    def forward_backward(self, fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
        self.ctx.forward_backward = fn

    def _build_data(self) -> None:
        self.data_name, self.train_set, self.val_set = build_datasets(self.cfg, self.adapter,
                                                                      self._snapshot is not None, *self._user_data)
        self.tokens_per_sample = getattr(self.train_set, "tokens_per_sample", 1)

    def _make_train_loader(self, start_sample: int):
        par = self.parallel
        return build_loader(as_pairs(self.train_set, self.adapter), self.micro_batch, shuffle=True,
                            seed=self.cfg.train.seed, rank=par.data_rank, world_size=par.data_world,
                            start_sample=start_sample, infinite=True,
                            epoch_multiple=self.cfg.train.global_batch)  # epochs alike under every layout

    def _batch_arithmetic(self) -> tuple[int, int]:
        """(micro_batch, micro-batches per optimizer step) over the ``self.dp_world`` data-parallel replicas.

        With a pipeline, ``parallel.microbatches`` (when given) fixes the count and the
        micro-batch size is derived from it.
        """
        t, p = self.cfg.train, self.cfg.parallel
        if p.pp > 1 and p.microbatches:
            per = p.microbatches * self.dp_world
            if t.global_batch % per:
                raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by parallel.microbatches="
                                  f"{p.microbatches} x {self.dp_world} data-parallel replicas")
            if t.micro_batch and t.micro_batch * per != t.global_batch:
                raise ConfigError(f"train.micro_batch={t.micro_batch} x parallel.microbatches={p.microbatches} x "
                                  f"{self.dp_world} data-parallel replicas != train.global_batch={t.global_batch}; "
                                  f"set train.micro_batch=0 (derived: {t.global_batch // per})")
            return t.global_batch // per, p.microbatches
        return batch_arithmetic(t.global_batch, t.micro_batch, self.dp_world)

    def _build_optimizer(self, module: nn.Module | None = None) -> torch.optim.Optimizer:
        import inspect

        from scaletrain.techniques.optim import OPTIMIZERS, build_optimizer

        o = self.cfg.optim
        spec = OPTIMIZERS[o.name]
        defaults = {k: v.default for k, v in inspect.signature(spec.cls.__init__).parameters.items()}
        given = dict(lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps, momentum=o.momentum)
        if isinstance(defaults.get("eps"), tuple):  # Adafactor/CAME: (eps1, eps2) of their own, not Adam's eps
            given.pop("eps")
        if isinstance(defaults.get("betas"), tuple) and len(defaults["betas"]) > 2:  # CAME's third beta stays
            given["betas"] = (o.beta1, o.beta2, *defaults["betas"][2:])
        # Each optimizer takes only its own hyperparameters; the config carries all of them.
        kwargs = {k: v for k, v in given.items() if k in spec.common}
        return build_optimizer(o.name, module if module is not None else self.model, **kwargs, **o.options)

    def _lr_lambda(self, step: int) -> float:
        o = self.cfg.optim
        return lr_factor(step, warmup=o.warmup_steps, total=self.cfg.train.steps, schedule=o.schedule,
                         min_ratio=o.min_lr_ratio)

    def autocast(self):
        p = self.cfg.train.precision
        if p == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if p == "bf16" else torch.float16)

    def loss_fn(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        """The model's own loss if it returned one, else its family's (cross-entropy on the logits:
        [batch, seq, vocab] vs [batch, seq], or [batch, classes] vs [batch]); nats per target."""
        return self.adapter.loss(out, y)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": self.parallel.rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        extra: dict[str, Any] = {}
        if self.world > 1:  # every rank's RNG (dropout streams differ per rank); rank 0's is "rng"
            ranks: list[Any] = [None] * self.world
            dist.all_gather_object(ranks, rng)
            rng = ranks[0]
            extra = {"rng_ranks": ranks, "parallel": {"dp": self.world, "zero": self.cfg.parallel.zero}}
        return {
            **extra,
            "step": self.step,
            "model": self.parallel.model_state_dict(),
            "optimizer": self.parallel.optimizer_state_dict(self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "rng": rng,
            "data": {"samples_seen": self.step * self.cfg.train.global_batch, "name": self.data_name},
            "config": to_toml(self.cfg),
        }

    def load_state_dict(self, state: dict[str, Any], reset_optimizer: bool = False) -> None:
        """Continue from ``state``; with ``reset_optimizer`` the optimizer states start fresh (the
        weights, step, data position and RNG come from ``state``; the lr schedule goes on from its step)."""
        try:
            self.parallel.load_model_state_dict(state["model"])
            if not reset_optimizer:
                self.parallel.load_optimizer_state_dict(self.optimizer, state["optimizer"])
        except ConfigError:
            raise
        except (RuntimeError, ValueError, KeyError) as e:
            first = " ".join(x.strip() for x in str(e).strip().splitlines()[:2])[:300]  # torch: header + 1st cause
            raise ConfigError(f"checkpoint does not match this model/optimizer configuration ({first})") from None
        if reset_optimizer:  # lr of the checkpoint's step, from this run's optim.lr
            self.scheduler.last_epoch = int(state["step"])
            for g, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
                g["lr"] = base * self._lr_lambda(self.scheduler.last_epoch)
        else:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        rng = state["rng"]
        ranks = state.get("rng_ranks")
        if ranks and len(ranks) == self.world:
            rng = ranks[self.rank]
        elif self.rank != 0:  # another world size: fresh per-rank streams, deterministic in the step
            from scaletrain.techniques.tensor_parallel.rng import replica_seed

            torch.manual_seed(replica_seed(self.cfg.train.seed, self.rank, self.plan.tp) + 7919 * self.step)
            return
        self.parallel.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def save_checkpoint(self) -> Path | None:
        """Collective: sharded (each rank its shards) or consolidated (rank 0), :mod:`.checkpoint_io`;
        nothing with ``train.checkpoint_format=none``."""
        if self.out_dir is None or self.cfg.train.checkpoint_format == "none":
            return None
        return checkpoint_io.save(self)

    def close(self) -> None:
        """Release DDP/FSDP objects, then leave the process group if this trainer joined it.

        Deleting the wrappers and collecting garbage *before* ``destroy_process_group`` is what
        avoids the abort DDP prints when its reducer outlives the group at interpreter exit.
        """
        if getattr(self, "parallel", None) is None:
            self._run_lock.release()
            return
        with contextlib.suppress(Exception):  # a background checkpoint still being written (fit failed)
            checkpoint_io.wait(self)
        if self.world == 1 or getattr(self, "_finished", False):  # collective: not after an error on a rank
            self.hand_back(structure=True)
        self.parallel.close()
        self.forward_module = self.model
        self.forward_backward = None  # type: ignore[assignment]
        del self.optimizer, self.scheduler
        self.parallel = None  # type: ignore[assignment]
        if self.world > 1:
            LEDGER.uninstall()
        launch.shutdown(self._created_group, finished=getattr(self, "_finished", False))
        self._run_lock.release()  # the run directory is complete: another job may take it

    def hand_back(self, structure: bool) -> None:
        """Write the trained weights into the user's model object (see :mod:`.handback`); collective."""
        if self._snapshot is not None:
            handback.hand_back(self._snapshot, self.parallel.model_state_dict(), structure=structure)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        par = self.parallel
        loader = build_loader(as_pairs(self.val_set, self.adapter), self.micro_batch, shuffle=False, seed=0,
                              rank=par.data_rank, world_size=par.data_world, drop_last=True)
        total, correct, count, batches = 0.0, 0, 0, []
        for i, (x, y) in enumerate(loader):  # eval_batches global batches: the same samples under every layout
            if i >= self.cfg.train.eval_batches * self.accum:
                break
            x, y = x.to(self.device), y.to(self.device)
            batches += [(x, y)] if self.hooks.eval_fn is not None else []
            loss_sum, right, n = par.eval_batch(self.ctx, x, y)
            total, correct, count = total + loss_sum, correct + right, count + n
        self.model.train(was_training)
        total, correct, count = self.parallel.sum([total, correct, count])  # over ranks' shards
        val_loss = total / max(count, 1)
        metrics = {"val_loss": val_loss}
        if self.task == "lm":
            metrics["val_ppl"] = math.exp(min(val_loss, 50.0))
        else:
            metrics["val_acc"] = correct / max(count, 1)
        self.model.eval()
        metrics.update(self.hooks.user_metrics(self.forward_module, batches, self.step, par.mean))
        self.model.train(was_training)
        return metrics

    # ------------------------------------------------------------------ the loop
    def _clip(self) -> float:
        if self.cfg.optim.grad_clip <= 0:
            return float("nan")
        self.scaler.unscale_(self.optimizer)
        return self.parallel.clip_grad_norm(self.optimizer, self.cfg.optim.grad_clip)

    def _train_step(self, it: Any) -> float:
        """One optimizer step over ``accum`` micro-batches; returns this rank's loss (averaged over
        the ranks by :func:`~scaletrain.techniques.runtime.average_pending` on logging steps only)."""
        par = self.parallel
        self.ctx.step = self.step
        if self.cfg.train.measure_memory and self.step == self.cfg.train.steps - 1 and self.tracked is None:
            return self._tracked_step(it)
        LEDGER.reset()
        step_loss = par.run_micro_batches(self.ctx, it)
        faults.maybe_fire(self.step + 1, self.rank, self.out_dir, "collective")  # tests only: between collectives
        if self.step == 1 and self.world > 1:  # optimizer states exist from the first step on
            from scaletrain.measure.model_states import measure_model_state_bytes

            m = measure_model_state_bytes(self.model, self.optimizer,
                                          extra_grads=getattr(par, "state_tensors", lambda: [])())
            self.model_state_bytes = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}
        par.prepare_step(self.optimizer)
        self._grad_norm = self._clip()
        par.optimizer_step(self.optimizer, self.scaler)
        par.after_step()
        self.scheduler.step()
        par.zero_grad(self.optimizer)
        self.comm_bytes = LEDGER.total() if self.world > 1 else 0.0
        return step_loss

    def _tracked_step(self, it: Any) -> float:
        """The step under the memory tracker (local shards of DTensors): every rank's peak and its
        breakdown by category, gathered for rank 0's metrics row."""
        from scaletrain.measure.comm import DTensorMemoryTracker

        extra = getattr(self.parallel, "state_tensors", lambda: [])()
        with DTensorMemoryTracker(model=self.model, optimizer=self.optimizer, extra=extra, track_saved=True) as tr:
            self.tracked = {}  # re-entry guard
            loss = self._train_step(it)
        mine = {"peak": int(tr.peak_bytes), **{k: int(v) for k, v in tr.peak_breakdown.items()}}
        ranks: list[Any] = [mine]
        if self.world > 1:
            ranks = [None] * self.world
            with LEDGER.paused():
                dist.all_gather_object(ranks, mine)
        heaviest = max(range(len(ranks)), key=lambda r: ranks[r]["peak"])
        self.tracked = {"tracked_peak_bytes": mine["peak"], "tracked_peak_bytes_max": ranks[heaviest]["peak"],
                        "tracked_peak_rank": heaviest, "tracked_peak_bytes_ranks": [r["peak"] for r in ranks],
                        "tracked_peak_breakdown": ranks[heaviest]}
        return loss

    def fit(self) -> TrainResult:
        cfg = self.cfg
        t_load, skipped = (time.time(),) * 2, []
        if self.resume:  # nothing is written before the first good step, so a bad resume changes nothing on disk
            path, skipped, *t_load = resuming.restore(self, self.reset_optimizer)
            self.log(f"resumed from {path} at step {self.step}")
        # the run directory is created after the first good step (config.toml, metrics trimmed to self.step)
        metrics = rundir.RunDir(self.out_dir if self.rank == 0 else None, self.step, to_toml(cfg), self.log, skipped,
                                loggers=cfg.train.loggers)
        if metrics.restart is not None:
            metrics.restart.note_reload(t_load[0], t_load[1], self.step)
        metrics.replan = (self.replan, cfg.train.global_batch) if self.replan is not None else None
        show = cfg.train.progress == "on" or (cfg.train.progress == "auto" and sys.stderr.isatty())
        unit = "tok" if self.task == "lm" else "samples"
        bar = ProgressBar(cfg.train.steps, self.step, unit, enabled=show and self.rank == 0)
        loader = self._make_train_loader(self.step * cfg.train.global_batch)
        it = iter(loader)
        losses: list[float] = []
        diverge = DivergenceGuard(cfg.train.precision, cfg.optim.lr, cfg.optim.grad_clip, self.scaler)
        val: dict[str, float] = {}
        self.model.train()
        window_t, window_items = time.perf_counter(), 0
        can_save = self.out_dir is not None and cfg.train.checkpoint_format != "none"
        guard = interrupt.Guard(cfg.train.checkpoint_every_s, self.world, can_save)  # periodic and Ctrl-C saves
        try:
            guard.install()
            while self.step < cfg.train.steps:
                t0 = time.perf_counter()
                faults.maybe_fire(self.step + 1, self.rank, self.out_dir)  # tests only: SCALETRAIN_FAULT_*
                try:
                    if self.step + 1 == cfg.train.profile_step and self.rank == 0:
                        from scaletrain.measure.phases import profile_step

                        step_loss, self.phases = profile_step(lambda: self._train_step(it))
                    else:
                        step_loss = self._train_step(it)
                except Exception as exc:
                    failure = launch.explain_comm_failure(exc, self.rank, self.step, cfg.parallel.timeout_s)
                    if failure is None or self.world == 1:
                        raise
                    raise failure from None
                grad_norm = self._grad_norm
                self.step += 1
                metrics.after_step(self.step)
                losses.append(step_loss)
                last = self.step == cfg.train.steps
                # alike on every rank
                periodic, stop = guard.periodic(self.step, time.perf_counter() - t0), guard.stop()
                every = cfg.train.checkpoint_every
                saves = last or stop or periodic or bool(every and self.step % every == 0)
                # the ranks' losses are averaged on logging steps and before a save (no diverged checkpoint)
                step_loss, agreed = average_pending(self.parallel, losses,
                                                    self.ctx.counts_traffic(self.step - 1) or saves)
                dt = time.perf_counter() - t0
                self.auto.step_times.append(dt) if self.auto is not None else None
                items = cfg.train.global_batch * (self.tokens_per_sample if self.task == "lm" else 1)
                window_items += items
                rate = items / dt if dt > 0 else float("nan")
                bar.update(self.step, step_loss, rate)
                # the loss only where every rank holds the same value: every rank stops alike (none is left
                # waiting in a collective); fp16's skipped steps are the same on every rank, counted every step
                diverge.check(self.step, step_loss, saves=saves, loss_agreed=agreed)  # before it saves
                if self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps:
                    now = time.perf_counter()
                    row = {"step": self.step, "loss": step_loss, "lr": self.scheduler.get_last_lr()[0],
                           "grad_norm": grad_norm, "step_time_s": dt,
                           f"{unit}_per_s": window_items / max(now - window_t, 1e-9),
                           "rss_peak_bytes": _rss_peak_bytes()}
                    if self.device.type == "cuda":
                        row["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
                        row["device_reserved_peak_bytes"] = torch.cuda.max_memory_reserved(self.device)
                    if self.scaler.is_enabled():
                        row["loss_scale"] = float(self.scaler.get_scale())
                    row.update(self.parallel.metrics())
                    row.update(self.tracked or {})
                    if self.phases:  # written once, in the first row after the profiled step
                        row["time_breakdown_s"], self.phases = self.phases, {}
                    row.update(self.auto.predicted() if self.auto is not None else {})
                    if self.world > 1:
                        row["comm_bytes"] = self.comm_bytes
                        if self.model_state_bytes:
                            row["model_state_bytes"] = sum(self.model_state_bytes.values())
                    metrics.write(row)
                    window_t, window_items = now, 0
                self.hooks.call("on_step_end", self, self.step, {"loss": step_loss, "grad_norm": grad_norm,
                                                                 "lr": self.scheduler.get_last_lr()[0]})
                if last or (cfg.train.eval_every and self.step % cfg.train.eval_every == 0):
                    val = self.evaluate()
                    metrics.write({"step": self.step, **val})
                    bar.close() if show else None
                    self.log(self._val_line(val))
                    self.hooks.call("on_eval", self, self.step, val)
                    bar = ProgressBar(cfg.train.steps, self.step, unit, enabled=show and self.rank == 0)
                if saves:
                    saved = self.save_checkpoint()
                    if saved is not None:
                        self.hooks.call("on_checkpoint", self, self.step, saved)
                if stop and not last:
                    raise guard.interrupted(self.step, self.out_dir)
        finally:
            guard.restore()
            metrics.close()
        self._finished = True  # close() may wait for the peers before leaving the group
        if self.world == 1:  # (several processes: at close(), which every rank calls)
            self.hand_back(structure=False)
        return TrainResult(self.step, losses[-1] if losses else float("nan"), val.get("val_loss"), val, losses,
                           self.out_dir, self.comm_bytes, dict(self.model_state_bytes))

    def _val_line(self, val: dict[str, float]) -> str:
        if "val_ppl" in val:
            unit = "nats/byte" if self.data_name == "shakespeare" else "nats/token"  # shipped text: byte tokens
            return f"step {self.step}: val_loss {val['val_loss']:.4f} {unit}, perplexity {val['val_ppl']:.2f}"
        return f"step {self.step}: val_loss {val['val_loss']:.4f}, accuracy {val.get('val_acc', 0):.3f}"
