"""``scaletrain train plan=auto``: plan for this machine and the processes launched, run it, and log
the prediction next to the measurement.

What happens, in order (every rank calls :func:`choose` at the same point of the trainer's setup):

1. **Which keys are free.** Plan keys left at their defaults are planned; ``parallel.dp/tp/pp/zero/
   sequence_parallel/schedule/virtual``, ``train.micro_batch`` and ``memory.remat.blocks=all`` /
   ``memory.remat.selective=attention`` set to another value are *pinned* (as ``scaletrain plan --fix``).
   ``train.precision`` and ``optim.name`` are the user's (they change the mathematics) and are kept.
   ``parallel.cp`` / ``parallel.hsdp`` pin the same way (``parallel.balance`` is kept and priced as the
   runtime splits). Any other plan key (offload, compression, remat solvers, params_dtype,
   ``parallel.microbatches``) is not planned: one line, exit 2 (:func:`check`).
2. **This machine** (:func:`scaletrain.planner.local.measure`): every rank measures matmul, copy and
   all-reduce rates at once, so the figures are what one of N processes sharing the cores gets.
3. **Search** on rank 0 (one node of N devices; a decoder shape by :func:`scaletrain.planner.search.search`,
   any other model by its trace, :func:`scaletrain.planner.traced.search`): only plans
   whose mathematics equals one process's (synchronous schedules, no compression, the precision and
   optimizer given) are candidates; the first in predicted step time that the compatibility table
   accepts for the real model on this device is chosen. Its per-rank peak and traffic come from
   :func:`scaletrain.techniques.plan_cost.plan_costs` (the estimator of the real modules, exact on
   this machine's runs); a plan whose peak does not fit the device is skipped.
4. **Broadcast**: rank 0's choice goes to every rank (calibration timings differ per rank, so the
   ranks could not all plan alike on their own).

The trainer then runs the chosen plan; :class:`AutoPlan` adds ``predicted_*`` beside the measured
``step_time_s`` / ``comm_bytes`` / ``tracked_peak_bytes_max`` in each metrics row and in the final
summary. Units: seconds, bytes.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from scaletrain import schema
from scaletrain.errors import ConfigError, UserError
from scaletrain.plan import PLAN_KEYS, Plan

PINNABLE = {k: k for k in schema.searched()}
"""Plan field -> ``search`` fix key, for the plan keys ``plan=auto`` chooses and a user may pin (the schema's
searched keys; their fix keys are their field names)."""
KEPT = schema.kept()
"""Plan fields that are the user's and kept as given (or meaningless without a refused key)."""
WARMUP_STEPS = 2
"""Steps left out of the measured step time (allocator and autograd warm-up)."""


def check(cfg: Any) -> dict[str, Any]:
    """The ``search`` pins the config asks for; ConfigError (one line) for a plan key ``plan=auto``
    does not plan. Pure: no measurement, no process group."""
    flat, default = Plan.from_config(cfg).to_flat(), Plan().to_flat()
    fixed: dict[str, Any] = {}
    if flat["balance"] != default["balance"]:  # kept as given, and priced as the runtime will split
        fixed["pp_split"] = flat["balance"]
    for name, value in flat.items():
        if value == default[name] or name in KEPT:
            continue
        if name == "microbatches" and flat["micro_batch"]:
            continue  # derived from the pinned micro-batch (a resumed plan=auto run's config holds both)
        if name in PINNABLE:
            fixed[PINNABLE[name]] = value
        elif (kind := _remat_kind(name, value)) is not None:
            fixed["remat"] = kind if fixed.get("remat") != "full" else "full"
        else:
            raise ConfigError(f"plan=auto does not plan {PLAN_KEYS[name]}={value!r}: it chooses parallel.dp/tp/pp/"
                              f"zero/sequence_parallel/schedule/virtual, train.micro_batch and the remat (pin any "
                              f"of those by setting it); drop {PLAN_KEYS[name]} or set plan=manual")
    if fixed.get("schedule") not in (None, "1f1b", "gpipe", "interleaved"):
        raise ConfigError(f"plan=auto plans the synchronous schedules 1f1b, gpipe and interleaved; "
                          f"parallel.schedule={fixed['schedule']!r} needs plan=manual")
    return fixed


def _remat_kind(name: str, value: Any) -> str | None:
    """The planner's remat kind (``schema.REMAT_KINDS``) that plan key ``name=value`` asks for, if any."""
    return next((kind for kind, keys in schema.REMAT_KINDS.items() if keys.get(name) == value), None)


@dataclass
class AutoPlan:
    """The chosen plan, its prediction and what was measured (rank 0's values on every rank)."""

    plan: Plan
    cfg: Any
    """The config with the plan's keys set (what the trainer runs and writes to config.toml)."""
    predicted_step_time_s: float
    predicted_peak_bytes: float
    """The heaviest rank's peak (plan_costs), bytes; compare with ``tracked_peak_bytes_max``."""
    predicted_comm_bytes: float
    """Bytes rank 0 receives per step in collectives (plan_costs; ring convention of the ledger)."""
    platform: dict[str, Any]
    candidates: int
    runner_up: str = ""
    seconds: float = 0.0
    step_times: list[float] = field(default_factory=list)

    def predicted(self) -> dict[str, float]:
        """The ``predicted_*`` fields of a metrics row."""
        return {"predicted_step_time_s": self.predicted_step_time_s, "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_comm_bytes": self.predicted_comm_bytes}

    def header(self, world: int) -> str:
        """The run header's block: the plan, why, and its prediction."""
        p = self.platform
        return "\n".join([
            f"plan=auto: {self.plan.describe()}, micro-batch {self.plan.micro_batch}"
            + (f" x {self.plan.microbatches} micro-batches" if self.plan.pp > 1 else ""),
            f"  predicted: step {self.predicted_step_time_s * 1e3:.1f} ms, peak {self.predicted_peak_bytes / 2**20:.1f} "
            f"MiB on the heaviest rank, {self.predicted_comm_bytes / 2**20:.2f} MiB received per step by rank 0",
            f"  chosen first of {self.candidates} runnable plans for {world} process(es) in {self.seconds:.1f} s"
            + (f"; runner-up {self.runner_up}" if self.runner_up else ""),
            f"  this machine per process: {p['flops'] / 1e9:.1f} GFLOP/s matmul, {p['mem'] / 1e9:.1f} GB/s memory-bound "
            f"kernels, {p.get('kernel_s', 0) * 1e6:.0f} us per kernel"
            + (f", all-reduce {p['beta'] / 1e9:.2f} GB/s + {p['alpha'] * 1e6:.0f} us per ring step" if world > 1 else "")
            + "".join(f", trainer host work {a * 1e3:.1f} ms per step + {c * 1e3:.2f} ms per micro-batch"
                      for z, a, c in p.get("host", ()) if z == self.plan.zero)])

    def summary(self, tracked: dict[str, Any] | None, comm_bytes: float) -> tuple[dict[str, Any], str]:
        """(summary fields, one line): predicted next to measured (median step time after warm-up)."""
        later = self.step_times[WARMUP_STEPS:] or self.step_times
        step = statistics.median(later) if later else float("nan")
        out: dict[str, Any] = {"plan": self.plan.describe(), **self.predicted(), "step_time_s": step}
        parts = [f"step {self.predicted_step_time_s * 1e3:.1f} ms predicted vs {step * 1e3:.1f} ms measured "
                 f"({_err(self.predicted_step_time_s, step)})"]
        if tracked:
            peak = tracked["tracked_peak_bytes_max"]
            out["tracked_peak_bytes_max"] = peak
            parts.append(f"peak {self.predicted_peak_bytes / 2**20:.2f} vs {peak / 2**20:.2f} MiB "
                         f"({_err(self.predicted_peak_bytes, peak)})")
        if self.plan.world() > 1:
            out["comm_bytes"] = comm_bytes
            parts.append(f"traffic {self.predicted_comm_bytes / 2**20:.3f} vs {comm_bytes / 2**20:.3f} MiB "
                         f"({_err(self.predicted_comm_bytes, comm_bytes)})")
        return out, "plan=auto, predicted vs measured: " + "; ".join(parts)


def _err(pred: float, meas: float) -> str:
    return f"{(pred / meas - 1) * 100:+.1f}%" if meas else "n/a"


def apply(cfg: Any, plan: Plan) -> Any:
    """A copy of ``cfg`` with every plan key set to ``plan``'s value (the one schema: PLAN_KEYS) and
    ``plan="manual"``: the run's config.toml records the chosen plan, so ``--resume`` continues it as is."""
    out = copy.deepcopy(cfg)
    out.plan = "manual"
    for name, value in plan.to_flat().items():
        *path, last = PLAN_KEYS[name].split(".")
        obj = out
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return out


def micro_batches(global_batch: int) -> tuple[int, ...]:
    """Every micro-batch the traced search can choose for ``global_batch`` (a divisor of a rank's share,
    at most :data:`scaletrain.planner.traced.MAX_MICRO_BATCH`): the sizes :func:`local.measure` times the
    model's blocks at."""
    from scaletrain.planner.traced import MAX_MICRO_BATCH

    return tuple(b for b in range(1, min(global_batch, MAX_MICRO_BATCH) + 1) if global_batch % b == 0)


def choose(cfg: Any, world: int, rank: int, device: torch.device,
           data_rate: Callable[[], float] | None = None, host_work: Callable[..., tuple] | None = None) -> AutoPlan:
    """Plan this run (module docstring); collective when ``world`` > 1: every rank must call it.
    ``data_rate``: measures the run's input pipeline in host seconds per sample (the trainer's own data;
    :attr:`~scaletrain.platform.Platform.data_seconds_per_sample`), None to leave it unpriced. ``host_work``:
    measures the trainer's host work per step on the run's model (:attr:`~scaletrain.platform.Platform.
    host_seconds`; the trainer hands in :func:`scaletrain.train.host_work.host_seconds`), None to leave it
    unpriced."""
    from scaletrain.planner import local

    fixed = check(cfg)
    if device.type != "cpu":  # local.measure times this host's CPU kernels: its figures would mislead a GPU's search
        raise ConfigError(f"plan=auto calibrates CPU processes only, not {device.type} devices; plan on paper "
                          f"instead: scaletrain plan --model {cfg.model.name} --platform h100|h200|a100-80g|FILE.json "
                          f"--nodes 1 --gpus-per-node {world} --global-batch {cfg.train.global_batch} --out plan.toml, "
                          f"then scaletrain train --plan plan.toml")
    plat = local.measure(world, cfg.train.precision, (cfg.model.name, dict(cfg.model.overrides)),
                         optimizer=cfg.optim.name, micro_batches=micro_batches(cfg.train.global_batch),
                         seq=cfg.data.seq_len, host=host_work)  # all ranks at once
    if data_rate is not None:
        plat = plat.with_(data_seconds_per_sample=data_rate())
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = _plan_on_rank0(cfg, world, fixed, plat, device)
        except UserError as e:  # every rank must learn of it, then fail alike
            payload[0] = e
    if world > 1 and dist.is_initialized():
        dist.broadcast_object_list(payload, src=0)
    got = payload[0]
    if isinstance(got, UserError):
        raise ConfigError(str(got))
    plan = Plan.from_flat(got["plan"])
    return AutoPlan(plan=plan, cfg=apply(cfg, plan), **{k: v for k, v in got.items() if k != "plan"})


def _plan_on_rank0(cfg: Any, world: int, fixed: dict[str, Any], plat: Any, device: torch.device) -> dict[str, Any]:
    """Search, keep the first plan the compatibility table accepts and that fits by plan_costs."""
    from scaletrain import models
    from scaletrain.planner.cost import Options
    from scaletrain.planner.search import search
    from scaletrain.planner.api import target
    from scaletrain.planner.traced import Traced, search as traced_search
    from scaletrain.techniques import compat
    from scaletrain.techniques.plan_cost import heaviest, plan_costs

    t0 = time.perf_counter()
    name, over = cfg.model.name, dict(cfg.model.overrides)
    try:
        shape = target(name, plat, **over)
    except UserError as e:
        raise ConfigError(f"plan=auto: {e}") from None
    seq, gb = cfg.data.seq_len, cfg.train.global_batch
    user = Plan.from_config(cfg)
    opts = Options(reserve_bytes=0.5 * 2**30)  # CPU: the interpreter and torch, no CUDA context
    traced = isinstance(shape, Traced)  # decoder shapes on paper unless their blocks were measured here
    find = traced_search if traced else search
    res = find(shape, plat, nodes=1, gpus_per_node=world, global_batch=gb, seq=seq, fixed=fixed,
               precision=cfg.train.precision, optimizer=cfg.optim.name, options=opts, device=device.type)
    model = shape.model if traced else models.get(name, device="meta", **over)
    for i, c in enumerate(res.ranked):
        plan = c.plan.with_(bucket_mb=user.bucket_mb, fsdp_group=c.plan.fsdp_group, balance=user.balance)
        m = plan.microbatches if plan.pp > 1 else gb // (plan.dp * plan.micro_batch)
        facts = compat.Facts.of(model, world=world, device=device.type, seq_len=seq,
                                eval_every=cfg.train.eval_every, microbatches=m)
        if compat.violations(plan, facts):
            continue
        costs = plan_costs(plan, model, world=world, global_batch=gb, seq=seq,
                           micro_batch=0 if plan.pp > 1 else plan.micro_batch, device=device.type)
        top = heaviest(costs)
        if top.peak_bytes + opts.reserve_bytes > plat.device_memory_bytes:
            continue
        nxt = next((r for r in res.ranked[i + 1:] if r.plan != c.plan), None)
        runner = (f"{nxt.plan.describe()}, micro-batch {nxt.plan.micro_batch} "
                  f"({(nxt.step_time_s / c.step_time_s - 1) * 100:+.1f}%)") if nxt else ""
        return {"plan": plan.to_flat(), "predicted_step_time_s": c.step_time_s,
                "predicted_peak_bytes": float(top.peak_bytes), "predicted_comm_bytes": float(costs[0].comm_bytes),
                "platform": {"flops": plat.flops(cfg.train.precision), "mem": plat.device_mem_bytes_per_s,
                             "beta": plat.intra_node_bytes_per_s, "alpha": plat.intra_node_latency_s,
                             "kernel_s": plat.kernel_overhead_s, "host": [list(r) for r in plat.host_seconds],
                             "source": plat.source},
                "candidates": len(res.ranked), "runner_up": runner, "seconds": time.perf_counter() - t0}
    why = "; ".join(f"{r['region']}: {r['reason']}" for r in res.rejected[:2]) or "no candidate left"
    pins = ", ".join(f"{k}={v}" for k, v in fixed.items())
    raise ConfigError(f"plan=auto: no runnable plan for {name} on {world} process(es)"
                      + (f" with {pins}" if pins else "") + f" and global batch {gb}: {why}")
