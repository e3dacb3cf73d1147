"""Before a sweep trains: measure its tasks, then predict it (:mod:`.simulate`) and its bytes.

- Shard tasks: every device runs one micro-batch's whole program of each distinct model shape
  at once (:meth:`.worker.Worker.profile`), ``repeats`` times after a warm-up; a task's duration
  is the median over devices and repeats — measured under the load the sweep itself puts on the
  machine (every device busy), which is what the simulator needs.
- Host step: clipping + the optimizer's step on a copy of the model with random gradients,
  one thread (a host core), median of ``repeats`` after a warm-up step.
- Latency: a model's hand-over between two of its tasks (thread -> hub -> queue -> worker ->
  queue -> thread), the median of no-op round trips.
Seconds throughout.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from scaletrain.data import build_loader
from scaletrain.sweep.hub import Hub
from scaletrain.sweep.simulate import Durations, RunProgram


def program_of(tr: Any, shards: int) -> RunProgram:
    """What ``tr`` (a built trainer, possibly resumed) will still run."""
    cfg = tr.cfg.train
    start = tr.step
    evals = [s - start for s in range(start + 1, cfg.steps + 1)
             if s == cfg.steps or (cfg.eval_every and s % cfg.eval_every == 0)]
    val_batches = len(build_loader(tr.val_set, tr.micro_batch, shuffle=False, seed=0, drop_last=True))
    saves = [s - start for s in range(start + 1, cfg.steps + 1)
             if s == cfg.steps or (cfg.checkpoint_every and s % cfg.checkpoint_every == 0)] if tr.out_dir else []
    return RunProgram(shards=shards, steps=cfg.steps - start, accum=tr.accum, eval_steps=evals,
                      eval_micro=min(cfg.eval_batches * tr.accum, val_batches), checkpoint_steps=saves)


def shape_key(tr: Any, bounds: list[tuple[int, int]]) -> tuple:
    c = tr.cfg
    return (c.model.name, repr(sorted(c.model.overrides.items())), tr.micro_batch, c.data.seq_len, c.train.precision,
            c.optim.name, tuple(bounds))


def task_seconds(hub: Hub, model: int, tr: Any, repeats: int) -> tuple[dict[tuple[str, int], float], float]:
    """(median seconds per task, spread): the spread is the median over tasks of (slowest - fastest) /
    median sample — how much the machine's speed moved while it was measured (a shared machine's load)."""
    x, y = tr.ctx.example_batch()
    outs = hub.broadcast({"op": "profile", "model": model, "x": x, "y": y, "repeats": repeats, "task": tr.task})
    merged: dict[tuple[str, int], list[float]] = {}
    for o in outs:
        for key, ts in o["times"].items():
            merged.setdefault(tuple(key), []).extend(ts)
    spread = statistics.median((max(v) - min(v)) / statistics.median(v) for v in merged.values())
    return {k: statistics.median(v) for k, v in merged.items()}, spread


def host_step_seconds(tr: Any, repeats: int) -> tuple[float, float]:
    """(clip + optimizer step, writing a checkpoint of model + optimizer states), seconds."""
    model = copy.deepcopy(tr.model)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-3
    opt = tr.ctx.build_optimizer(model)
    clip = tr.cfg.optim.grad_clip
    times = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip, foreach=True)
        opt.step()
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, Path(d) / "c.pt")
        save = time.perf_counter() - t0
    return statistics.median(times[1:]), save


def latency_seconds(hub: Hub, n: int = 20) -> float:
    rounds = []
    for _ in range(n):
        t0 = time.monotonic()
        r = hub.call(0, "N", 0, {})
        rounds.append(time.monotonic() - t0 - (r["t1"] - r["t0"]))
    return statistics.median(rounds)


def durations(hub: Hub, trainers: list[Any], bounds: list[list[tuple[int, int]]],
              repeats: int) -> tuple[list[Durations], float]:
    """(per run, its tasks' predicted seconds; the largest profile spread). Runs of one shape share one profile."""
    lat = latency_seconds(hub)
    spreads = [0.0]
    cache: dict[tuple, Durations] = {}
    out = []
    for i, tr in enumerate(trainers):
        key = shape_key(tr, bounds[i])
        if key not in cache:
            host, save = host_step_seconds(tr, repeats)
            tasks, spread = task_seconds(hub, i, tr, repeats)
            spreads.append(spread)
            cache[key] = Durations(tasks, host, lat, save)
        out.append(cache[key])
    hub.broadcast({"op": "reset"})  # the sweep's peaks, bytes and timeline count from here
    hub.timeline.clear()
    return out, max(spreads)
