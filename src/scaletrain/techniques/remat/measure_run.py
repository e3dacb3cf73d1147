"""Measure what a schedule really costs: activation peak (tracker), step time, gradient parity.

Used by ``scaletrain remat --measure`` and ``benchmarks/remat``. The peak is measured with
:class:`scaletrain.measure.tracker.MemoryTracker` (storage-level, works on CPU): the largest
total over the step of live bytes *other than* parameters, parameter gradients, optimizer
states and module buffers — activations, temporaries, the batch and the loss — which is what the
schedule's predicted peak covers. Module buffers (e.g. BatchNorm statistics) are left out.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn

from scaletrain.techniques.remat.executor import run_schedule
from scaletrain.techniques.remat.schedule import Schedule

EXCLUDED = ("parameters", "gradients", "optimizer_states")


def activation_peak(tracker, exclude=()) -> int:
    """Largest live bytes outside parameters, parameter gradients, optimizer states and the
    storages of ``exclude`` (module buffers: not activations, and not in the prediction)."""
    skip = {r.uid for r in (tracker.record_of(t) for t in exclude) if r is not None}
    best = cur = 0
    for _, rec, delta in tracker.events:
        if rec.category in EXCLUDED or rec.uid in skip:
            continue
        cur += delta
        best = max(best, cur)
    return best


def measure_step(model: nn.Module, step: Callable[[], object], *, repeats: int = 3, seed: int = 0,
                 extra=()) -> dict:
    """Run ``step`` (one forward+backward) ``repeats`` times untracked, then once tracked.

    Returns ``step_time_s`` (median), ``step_time_spread_s`` (max - min), ``measured_peak_bytes``
    and the parameter gradients of the tracked run (``grads``; seeded with ``seed``).
    """
    from scaletrain.measure.tracker import MemoryTracker

    times = []
    for _ in range(max(1, repeats)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    # track_saved=False: the tracker's pack hook keeps the saved tensor itself, which makes a
    # reference cycle for saved outputs and keeps tapes that DTR drops without backward alive.
    # The categories are not needed here (everything but parameters/gradients/states counts).
    with MemoryTracker(model=model, extra=extra, track_saved=False) as tr:
        step()
        peak = activation_peak(tr, exclude=list(model.buffers()))
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return {"step_time_s": statistics.median(times), "step_time_spread_s": max(times) - min(times),
            "measured_peak_bytes": peak, "grads": grads}


def time_interleaved(model: nn.Module, steps: dict[str, Callable[[], object]], *, rounds: int = 5,
                     warmup: int = 1, seed: int = 0) -> dict[str, dict[str, float]]:
    """Seconds of each of ``steps`` (name -> one forward+backward) measured side by side: ``warmup``
    untimed rounds, then ``rounds`` rounds each running every step once, the order rotated by one place
    a round, so a machine's drift (other processes, clocks, a warming cache) spreads over all of them
    instead of favouring whichever ran first. Returns name -> {median, min, max} of its rounds [s] and
    ``rounds``: every round's seconds in order (round k of two names ran in the same round: paired ratios)."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + max(1, rounds)):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return {n: {"median": statistics.median(t), "min": min(t), "max": max(t), "rounds": t} for n, t in times.items()}


def measure_schedule(model: nn.Module, chain, schedule: Schedule, x: torch.Tensor, y, loss_fn: Callable,
                     **kw) -> dict:
    """:func:`measure_step` of ``run_schedule(chain, schedule, x, loss_fn, y)``."""
    return measure_step(model, lambda: run_schedule(chain, schedule, x, loss_fn, y), extra=(x, y), **kw)


def measure_autograd(model: nn.Module, chain, x: torch.Tensor, y, loss_fn: Callable, **kw) -> dict:
    """:func:`measure_step` of the plain ``loss_fn(chain(x), y).backward()`` (the reference)."""
    return measure_step(model, lambda: loss_fn(chain(x), y).backward(), extra=(x, y), **kw)


def measure_torch_checkpoint(model: nn.Module, chain, x: torch.Tensor, y, loss_fn: Callable, **kw) -> dict:
    """:func:`measure_step` with ``torch.utils.checkpoint`` (non-reentrant) on every block."""
    from torch.utils.checkpoint import checkpoint

    def step():
        h = x
        for b in chain.blocks:
            h = checkpoint(b, h, use_reentrant=False)
        loss_fn(h, y).backward()

    return measure_step(model, step, extra=(x, y), **kw)


def same_grads(a: list, b: list) -> bool:
    """Bitwise equality of two gradient lists (None only equals None)."""
    return len(a) == len(b) and all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
                                    for u, v in zip(a, b))
