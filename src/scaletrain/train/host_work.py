"""The trainer's host work per step, measured by running the trainer (:attr:`Platform.host_seconds`).

The cost model prices a step's kernels (the blocks, timed in place), its collectives (α–β), the
optimizer's kernels and the input pipeline. What the trainer's own step does besides runs on the same
cores and was priced by nothing: the loop's bookkeeping (the loss's average, the metrics row, the
scheduler, ``zero_grad``), clipping's Python, DDP's reducer (its per-bucket hooks and the copies into
and out of its flat buckets), ZeRO-1/2's :class:`~scaletrain.techniques.data_parallel.zero.GradSync`
(its per-tensor copies into and out of the flat reduce-scatter buffers and the owned rows, each step and
under ZeRO-2 each micro-batch), and the runtime's Python per micro-batch (``no_sync``, loss scaling).
Seen here (vgg-mini, dp=2, micro-batch 32, 2 gloo processes): a 41 ms step priced at 31 ms.

How it is measured (:func:`host_seconds`): the run's model at one sample per micro-batch (8 tokens for a
language model: its kernels cost little, and its parameters — the tensors and bytes this work walks and
copies — are the run's own), trained by :class:`~scaletrain.train.trainer.Trainer` itself over all the
run's processes at ZeRO 0, 1 and 2 and 1 and 3 micro-batches per step (:data:`RUNS`), against the same
model's bare step in the same process (:func:`bare_step_seconds`: the forward and backward of each
micro-batch, gradient clipping and the run's optimizer — the work the other terms price). Both are timed
in the main thread's CPU seconds (``time.thread_time``), median over steps: host work is CPU work on that
thread, the collectives' waits (priced at α–β) are not, and on a shared machine CPU seconds are not
inflated by the time other processes hold the core (wall-clock medians of 6 steps at load 20 on 2 cores
varied 2x between runs; the CPU seconds do not). The difference at 1 and 3 micro-batches gives the part
per step and the part per micro-batch (a straight line through both; each at least 0). On a machine
otherwise idle these CPU seconds are wall seconds (one thread per process); under load they are what
the work costs on a core to itself, so the term is not inflated by the load the other terms see.

Takes 5 short Trainer runs (9 steps of one sample per micro-batch each) and the bare steps: ~2-4 s on an idle
2-core machine for vgg-mini / hf:bert at 2 processes. Units: seconds. Rows ``(zero stage, seconds per
step, seconds per micro-batch)``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

RUNS = ((0, 1), (0, 3), (1, 1), (2, 1), (2, 3))
"""(ZeRO stage, micro-batches per step) of the measured Trainer runs: every stage at 1, and the stages whose
work per micro-batch differs (0: ``no_sync``'s accumulation, 2: a reduce-scatter per micro-batch) at 3 too
(3, not 2: the slope is a difference of two noisy medians, the longer lever halves its error).
ZeRO-1 accumulates as stage 0 does and takes its part per micro-batch."""
LONG = max(m for _, m in RUNS)
WARMUP, STEPS = 2, 6
"""Steps of each measured run not timed (the first builds optimizer states, DDP's buckets are rebuilt after
it) and timed; the median of the timed ones is kept."""


class _StepClock:
    """``on_step_end`` on every rank: the main thread's CPU seconds at the end of each step."""

    all_ranks = True

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, trainer: Any, step: int, metrics: Any) -> None:
        self.ends.append(time.thread_time())


def trainer_step_seconds(name: str, overrides: dict, precision: str, zero: int, accum: int, world: int,
                         seq: int, micro_batch: int = 1, optimizer: str = "adamw", *, trainer_cls: type) -> float:
    """Median main-thread CPU seconds between two steps' ends of :class:`~scaletrain.train.trainer.Trainer`
    training ``name`` with ``micro_batch`` samples per micro-batch, ``accum`` micro-batches, over ``world``
    processes (the process group as it stands), ZeRO ``zero``. Nothing is written; every rank calls it.
    ``trainer_cls``: the Trainer (handed in: this module is the trainer's, not imported by it back)."""
    from scaletrain.train.config import load_config

    args = [f"model.name={name}", f"train.global_batch={world * accum * micro_batch}",
            f"train.micro_batch={micro_batch}", f"train.steps={WARMUP + STEPS + 1}", "train.log_every=1",
            "train.eval_every=0", "train.eval_batches=1", "train.progress=off", f"train.precision={precision}",
            "train.device=cpu", f"parallel.zero={zero}", f"optim.name={optimizer}"]
    cfg = load_config(None, args + ([f"data.seq_len={seq}"] if seq else []))
    cfg.model.overrides = dict(overrides)
    clock = _StepClock()
    trainer = trainer_cls(cfg, None, callbacks=[clock], log=lambda s: None)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return statistics.median(b - a for a, b in zip(clock.ends[WARMUP:], clock.ends[WARMUP + 1:]))


def bare_step_seconds(name: str, overrides: dict, precision: str, accum: int, seq: int, micro_batch: int = 1,
                      optimizer: str = "adamw") -> tuple[float, float]:
    """Median main-thread CPU seconds of the work the other terms price for one step of
    :func:`trainer_step_seconds`' run, in this process alone: (``accum`` forwards and backwards of the
    model's Chain on ``micro_batch`` samples, the loss included; gradient clipping and the optimizer's step
    over all the parameters)."""
    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.models.adapters import adapt
    from scaletrain.techniques.optim.registry import build_optimizer
    from scaletrain.techniques.plan_cost import _loss

    torch.manual_seed(0)
    model = models.get(name, **overrides)
    a = adapt(model)
    lm = a.task == "lm"
    spec = a.input_spec(micro_batch, seq if lm else None)
    x = (torch.randn(tuple(spec.shape), dtype=spec.dtype) if spec.is_floating_point()
         else torch.zeros(tuple(spec.shape), dtype=spec.dtype))
    y = torch.zeros(tuple(x.shape) if lm else (micro_batch,), dtype=torch.long)
    chain = to_chain(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(optimizer, params)
    cast = (torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
            if precision != "fp32" else contextlib.nullcontext())
    passes, steps = [], []
    for i in range(WARMUP + STEPS):
        t0 = time.thread_time()
        for _ in range(accum):
            with cast:
                out = chain(x)
            _loss(out, y).backward()
        t1 = time.thread_time()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= WARMUP:
            passes.append(t1 - t0)
            steps.append(time.thread_time() - t1)
    return statistics.median(passes), statistics.median(steps)


def host_seconds(name: str, overrides: dict, precision: str = "fp32", world: int = 1, seq: int = 8,
                 optimizer: str = "adamw", *, trainer_cls: type) -> tuple:
    """:attr:`Platform.host_seconds` of ``name`` (module docstring); every rank calls it at once.
    ``seq``: the tokens of a language model's sample (ignored by others); ``trainer_cls``: the
    :class:`~scaletrain.train.trainer.Trainer` that runs the measured steps (the trainer hands itself in)."""
    from scaletrain import models
    from scaletrain.models.adapters import adapt

    s = seq if adapt(models.get(name, device="meta", **overrides)).task == "lm" else 0
    bare = {m: bare_step_seconds(name, overrides, precision, m, s, optimizer=optimizer) for m in (1, LONG)}
    excess: dict[tuple[int, int], float] = {}
    for zero, accum in RUNS if world > 1 else RUNS[:2]:
        if dist.is_initialized() and world > 1:
            dist.barrier()
        passes, step = bare[accum]
        shards = world if zero in (1, 2) else 1  # ZeRO-1/2 update (and clip) this rank's shard only
        run = trainer_step_seconds(name, overrides, precision, zero, accum, world, s, optimizer=optimizer,
                                   trainer_cls=trainer_cls)
        excess[zero, accum] = run - passes - step / shards
    rows = []
    for zero in sorted({z for z, _ in excess}):
        more = excess.get((zero, LONG), excess[zero, 1] + excess[0, LONG] - excess[0, 1])
        per_mb = max((more - excess[zero, 1]) / (LONG - 1), 0.0)
        rows.append((zero, max(excess[zero, 1] - per_mb, 0.0), per_mb))
    return tuple(rows)
