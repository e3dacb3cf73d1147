"""The peers of a study: the same cell trained by another framework's own loop (one process per device).

``python -m torch.distributed.run --nproc-per-node N -m scaletrain.compare.peers STRATEGY OUT KEY=VALUE...``
(started by :mod:`.runner`, the one place that launches cells) trains ``STRATEGY``, one of :data:`PEERS`:

- ``torch-ddp``: plain ``torch.nn.parallel.DistributedDataParallel`` (bucket size ``parallel.bucket_mb``);
- ``torch-fsdp``: plain FSDP2 ``fully_shard`` on every block that owns its parameters, then the root;
- ``torch-tp``: torch's own tensor parallelism (``parallelize_module``, Colwise/RowwiseParallel) over every
  process, on GPT-2 (:mod:`.tp_peer`; its ranks read the same samples, as scaletrain's ``tp`` cell's);
- ``deepspeed-zero2`` / ``deepspeed-zero3``: a DeepSpeed engine with its ZeRO stage 2 / 3 (``deepspeed`` is
  imported here only, inside that path: never at module load, never by the library).

Everything but the step's engine is scaletrain's, so a peer's cell differs from scaletrain's only in how the
step is computed: the model object of :mod:`scaletrain.models` built under the same seed (identical initial
weights); the rank's batches from :func:`scaletrain.data.build_loader` with the trainer's arguments (each rank
reads exactly the samples scaletrain's DDP rank reads, in the same order); AdamW with scaletrain's decay /
no-decay parameter groups and hyperparameters; the learning rate of :func:`scaletrain.train.lr.lr_factor`
(linear warm-up, then cosine); the global gradient norm clipped to ``optim.grad_clip``; validation at the same
steps on the same validation batches. The metrics.jsonl rows have the fields :func:`.results.read_run` reads of
a scaletrain run: ``step_time_s`` over the trainer's span (rank 0's clock from before the batch fetch to
after the update and, on logging steps, the loss's all-reduce over the ranks: the same
:func:`~scaletrain.techniques.runtime.average_pending` at the same steps; every step's gradient collectives
make rank 0 wait for the slowest rank in both), rank-averaged ``loss`` (rows on logging steps only, as the
trainer's), validation rows, the last step under scaletrain's memory tracker (every rank's peak and its
breakdown, the same tracker and the same step as a scaletrain cell) and the profiled step's phases, and
``comm_bytes`` where the traffic ledger sees every collective: FSDP2's (3 Psi (N-1)/N per step, as scaletrain's
zero3). Not for plain DDP (its C++ reducer calls none of the wrapped functions) nor DeepSpeed (its ZeRO-3 moved
2 Psi (N-1)/N by the ledger's count on gpt2-mini, 2 processes, where ZeRO-3 moves 3: some of its collectives
bypass the wrappers, so the count would be wrong). With one process the peer still runs in
a process group of one (its framework's own one-process run), where scaletrain's one-process run has none.
Units: seconds, bytes.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from scaletrain.compare.matrix import STRATEGIES
from scaletrain.compare.peer_engine import PeerEngine, _optimizer
from scaletrain.compare.tp_peer import loss_context, tp_engine
from scaletrain.errors import ConfigError, UserError, one_line
from scaletrain.techniques.runtime import average_pending

PEERS = tuple(n for n, s in STRATEGIES.items() if s.framework != "scaletrain")
"""The strategies this worker runs (their framework's own loop, not scaletrain's trainer)."""


def torch_engine(strategy: str, model: nn.Module, cfg: Any, device: torch.device) -> PeerEngine:
    """``torch-ddp`` (DDP, gradients all-reduced in ``parallel.bucket_mb`` buckets) or ``torch-fsdp``
    (``fully_shard`` per block, then the root; resharded after forward: ZeRO-3), over the default group."""
    if strategy == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        forward: nn.Module = DDP(model, device_ids=ids, bucket_cap_mb=cfg.parallel.bucket_mb,
                                 gradient_as_bucket_view=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from scaletrain.techniques.data_parallel.fsdp import shardable_blocks

        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for block in shardable_blocks(model):
            fully_shard(block, mesh=mesh)
        forward = fully_shard(model, mesh=mesh)
    opt, factor = _optimizer(cfg, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    clip = cfg.optim.grad_clip

    def step() -> float:
        norm = nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True) if clip > 0 else torch.tensor(math.nan)
        if hasattr(norm, "full_tensor"):  # FSDP2: the norm is a DTensor
            norm = norm.full_tensor()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    return PeerEngine(forward, model, opt, lambda loss: loss.backward(), step, lambda: sched.get_last_lr()[0])


def deepspeed_config(stage: int, cfg: Any, micro_batch: int, world: int, numel: int) -> dict[str, Any]:
    """The DeepSpeed config of one peer run: ZeRO ``stage``, fp32, the cell's batch and clipping, buckets of
    ``parallel.bucket_mb`` MiB as DDP's, capped at the model's ``numel`` parameters: DeepSpeed allocates its
    whole bucket up front (counted in elements, 4 bytes each in fp32), where DDP's buckets never exceed the
    gradients (its own default, 5e8 elements, would be 2 GB here)."""
    bucket = min(int(cfg.parallel.bucket_mb * 2**20 / 4), numel)
    return {"train_batch_size": micro_batch * world, "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1, "gradient_clipping": cfg.optim.grad_clip,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
            "fp16": {"enabled": False}, "bf16": {"enabled": False}, "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False}


def deepspeed_engine(stage: int, model: nn.Module, cfg: Any, micro_batch: int, world: int) -> PeerEngine:
    """A DeepSpeed engine with ZeRO ``stage`` over ``model``: our AdamW as its client optimizer (ZeRO wraps it
    and keeps fp32 partitions), our schedule as its client scheduler (stepped by ``engine.step``)."""
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its per-step INFO lines would bury the run's output
    opt, factor = _optimizer(cfg, model)
    numel = sum(p.numel() for p in model.parameters())
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(
        stage, cfg, micro_batch, world, numel), lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor))

    def step() -> float:
        engine.step()  # clip, update, lr scheduler, zero the gradients
        norm = engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    extra = [p.ds_tensor for p in engine.module.parameters() if getattr(p, "ds_tensor", None) is not None]
    return PeerEngine(engine, engine.module, opt, engine.backward, step, lambda: sched.get_last_lr()[0], extra)


def rank_batches(cfg: Any, train_set: Any, micro_batch: int, rank: int, world: int) -> Iterator[Any]:
    """The training micro-batches of ``rank``: the trainer's loader with the trainer's arguments (a run of
    ``world`` data-parallel ranks from step 0), so each rank reads what scaletrain's DDP rank reads."""
    from scaletrain.data import build_loader

    return iter(build_loader(train_set, micro_batch, shuffle=True, seed=cfg.train.seed, rank=rank,
                             world_size=world, start_sample=0, infinite=True,
                             epoch_multiple=cfg.train.global_batch))


class _Ranks:
    """The data-parallel ranks of a peer run, as :func:`~scaletrain.techniques.runtime.average_pending`
    averages the logged losses over a runtime's: the same collective at the same steps, inside the timed span."""

    def __init__(self, world: int) -> None:
        self.world = world

    def mean(self, values: list[float]) -> list[float]:
        return [v / self.world for v in _all_reduce(values)]


def _all_reduce(values: list[float]) -> list[float]:
    """Sum over ranks, outside the traffic ledger (bookkeeping)."""
    import torch.distributed as dist

    from scaletrain.measure.comm import LEDGER

    t = torch.tensor(values, dtype=torch.float64)
    with LEDGER.paused():
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(engine: PeerEngine, cfg: Any, adapter: Any, val_set: Any, micro_batch: int, rank: int,
             world: int, device: torch.device) -> dict[str, float]:
    """The trainer's validation: ``train.eval_batches`` micro-batches per rank of the unshuffled validation
    split (the same samples as every scaletrain cell), loss summed over ranks; nats per target."""
    from scaletrain.data import build_loader
    from scaletrain.models.adapters import logits_of

    engine.forward.eval()
    loader = build_loader(val_set, micro_batch, shuffle=False, seed=0, rank=rank, world_size=world, drop_last=True)
    total, correct, count = 0.0, 0, 0
    for i, (x, y) in enumerate(loader):
        if i >= cfg.train.eval_batches:
            break
        x, y = x.to(device), y.to(device)
        out = engine.forward(x)
        total += float(adapter.loss(out, y)) * len(y)
        correct += int((logits_of(out).argmax(-1) == y).sum()) if adapter.task != "lm" else 0
        count += len(y)
    engine.forward.train()
    total, correct, count = _all_reduce([total, correct, count])
    metrics = {"val_loss": total / max(count, 1)}
    if adapter.task == "lm":
        metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 50.0))
    else:
        metrics["val_acc"] = correct / max(count, 1)
    return metrics


def _tracked_step(engine: PeerEngine, run_step: Callable[[], float], rank: int, world: int) -> tuple[float, dict]:
    """``run_step`` under scaletrain's memory tracker (local shards of DTensors), as the trainer's tracked step:
    every rank's peak and the heaviest rank's breakdown, for rank 0's row."""
    import torch.distributed as dist

    from scaletrain.measure.comm import LEDGER, DTensorMemoryTracker

    with DTensorMemoryTracker(model=engine.model, optimizer=engine.optimizer, track_saved=True) as tr:
        tr.register(engine.extra, "parameters")
        loss = run_step()
    mine = {"peak": int(tr.peak_bytes), **{k: int(v) for k, v in tr.peak_breakdown.items()}}
    ranks: list[Any] = [None] * world
    with LEDGER.paused():
        dist.all_gather_object(ranks, mine)
    heaviest = max(range(world), key=lambda r: ranks[r]["peak"])
    return loss, {"tracked_peak_bytes": mine["peak"], "tracked_peak_bytes_max": ranks[heaviest]["peak"],
                  "tracked_peak_rank": heaviest, "tracked_peak_bytes_ranks": [r["peak"] for r in ranks],
                  "tracked_peak_breakdown": ranks[heaviest]}


def train(strategy: str, out: Path, overrides: list[str], device: torch.device) -> list[dict[str, Any]]:
    """Train ``strategy`` with the cell's ``overrides`` (``scaletrain train`` keys) in this process of the
    torchrun job; rank 0 writes ``out/metrics.jsonl``. Returns the rows written (rank 0; [] elsewhere)."""
    import torch.distributed as dist

    from scaletrain import models
    from scaletrain.measure.comm import LEDGER
    from scaletrain.models.adapters import adapt
    from scaletrain.train.config import load_config
    from scaletrain.train.model_data import build_datasets
    from scaletrain.train.trainer import batch_arithmetic

    if strategy not in PEERS:
        raise ConfigError(f"unknown peer {strategy!r}; allowed: {', '.join(PEERS)}")
    cfg = load_config(None, overrides)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // cfg.parallel.tp  # data-parallel ranks (the TP peer's ranks read the same samples)
    micro, accum = batch_arithmetic(cfg.train.global_batch, cfg.train.micro_batch, dp)
    if accum != 1:
        raise ConfigError(f"train.micro_batch={cfg.train.micro_batch}: the peers take one micro-batch per rank and "
                          f"step; allowed: train.micro_batch=0 or {cfg.train.global_batch // dp}")
    torch.manual_seed(cfg.train.seed)  # the trainer's order: seed, model, data, then per-replica streams
    model = models.get(cfg.model.name, **cfg.model.overrides).to(device)
    adapter = adapt(model)
    _, train_set, val_set = build_datasets(cfg, adapter, user_model=False)
    LEDGER.install()  # before the engine: DeepSpeed keeps its own references to the collectives it will call
    try:
        with loss_context(strategy):
            return _loop(strategy, out, cfg, model, adapter, train_set, val_set, (micro, rank, world), device)
    finally:
        LEDGER.uninstall()


def _loop(strategy: str, out: Path, cfg: Any, model: nn.Module, adapter: Any, train_set: Any, val_set: Any,
          layout: tuple[int, int, int], device: torch.device) -> list[dict[str, Any]]:
    """:func:`train` from the engine on: build it, run the steps, evaluate, write rank 0's rows.
    ``layout``: (micro-batch [samples], rank, world)."""
    import json

    from scaletrain.measure.comm import LEDGER
    from scaletrain.techniques.tensor_parallel.rng import replica_seed

    micro, rank, world = layout
    tp = cfg.parallel.tp  # the TP peer: its ranks read the samples of data-parallel rank rank // tp of world // tp
    if strategy.startswith("deepspeed"):
        engine = deepspeed_engine(int(strategy[-1]), model, cfg, micro, world)
    elif strategy == "torch-tp":
        engine = tp_engine(model, cfg, device)
    else:
        engine = torch_engine(strategy, model, cfg, device)
    torch.manual_seed(replica_seed(cfg.train.seed, rank, tp))
    it = rank_batches(cfg, train_set, micro, rank // tp, world // tp)
    unit = "tok" if adapter.task == "lm" else "samples"
    items = cfg.train.global_batch * (getattr(train_set, "tokens_per_sample", 1) if unit == "tok" else 1)
    rows: list[dict[str, Any]] = []
    norm = [math.nan]  # the last step's global gradient norm

    def one_step() -> float:
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = adapter.loss(engine.forward(x), y)
        engine.backward(loss)
        norm[0] = engine.step()
        return float(loss.detach())

    engine.forward.train()
    losses: list[float] = []
    ranks = _Ranks(world)
    for step in range(1, cfg.train.steps + 1):
        LEDGER.reset()
        t0 = time.perf_counter()  # the trainer's span: batch fetch .. update, + the loss average on logging steps
        tracked: dict[str, Any] = {}
        phases: dict[str, float] = {}
        if cfg.train.measure_memory and step == cfg.train.steps:
            loss, tracked = _tracked_step(engine, one_step, rank, world)
        elif step == cfg.train.profile_step and rank == 0:
            from scaletrain.measure.phases import profile_step

            loss, phases = profile_step(one_step)
        else:
            loss = one_step()
        comm = LEDGER.total()
        losses.append(loss)
        logged = step % cfg.train.log_every == 0 or step == cfg.train.steps
        loss, _ = average_pending(ranks, losses, logged)
        dt = time.perf_counter() - t0
        row = {"step": step, "loss": loss, "lr": engine.lr(), "grad_norm": norm[0], "step_time_s": dt,
               f"{unit}_per_s": items / max(dt, 1e-9), **tracked}
        if comm > 0 and not strategy.startswith("deepspeed"):  # module docstring: where the ledger sees it all
            row["comm_bytes"] = comm
        if phases:
            row["time_breakdown_s"] = phases
        rows.append(row) if logged else None
        if step == cfg.train.steps or (cfg.train.eval_every and step % cfg.train.eval_every == 0):
            rows.append({"step": step, **evaluate(engine, cfg, adapter, val_set, micro, rank // tp, world // tp,
                                                  device)})
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows
    return []


def main(argv: list[str]) -> int:
    """``STRATEGY OUT KEY=VALUE...`` under torchrun; a bad input is one ``scaletrain: error:`` line, exit 2."""
    import torch.distributed as dist

    if len(argv) < 2:
        print(f"scaletrain: error: usage: python -m scaletrain.compare.peers STRATEGY OUT [KEY=VALUE...]; "
              f"STRATEGY one of {', '.join(PEERS)}", file=sys.stderr)
        return 2
    from datetime import timedelta

    from scaletrain.techniques.data_parallel.launch import backend_for, launch_env
    from scaletrain.train.config import load_config
    from scaletrain.train.preflight import resolve_device

    try:
        cfg = load_config(None, argv[2:])
        device = resolve_device(cfg.train.device, launch_env().local_rank)  # the trainer's device, so the same
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=cfg.parallel.timeout_s))  # even for 1
        try:
            train(argv[0], Path(argv[1]), argv[2:], device)
            gc.collect()  # the engine, its hooks and buckets go before the group does
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except UserError as e:
        print(f"scaletrain: error: rank {os.environ.get('RANK', '0')}: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover - the peer's subprocess (module docstring)
    code = main(sys.argv[1:])
    if code:
        sys.exit(code)
    # Everything is written and the group is gone. Twice in the full study a finished 2-process vgg-mini peer
    # run (DeepSpeed ZeRO-3; plain fully_shard with the profiled step) then had a rank abort in a C++
    # destructor at interpreter exit (SIGABRT, "terminate called without an active exception": a joinable
    # thread left behind), which marks a complete cell failed. Leave without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
