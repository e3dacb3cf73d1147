"""Measure a Chain block by block, and a whole training step, on the real device.

:func:`profile_chain` fills every :class:`~scaletrain.measure.types.BlockProfile` field:
memory from one tracked forward+backward of each block in isolation (the same traces the
estimator takes on fake tensors, :mod:`scaletrain.measure.blocks`), FLOPs from
``torch.utils.flop_counter``, and times — CUDA events on GPU, ``time.perf_counter`` on CPU —
as the median over ``repeats`` runs after ``warmup`` runs, with the spread (max - min).

:func:`measure_step` runs real training steps and tracks the second (optimizer states exist
then), giving the numbers :func:`scaletrain.measure.estimate.estimate_step` predicts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any, Callable

import torch
from torch import nn

from scaletrain import models
from scaletrain.chain import Chain, to_chain
from scaletrain.measure import optimizers
from scaletrain.measure.blocks import profile_from_traces, trace_chain
from scaletrain.measure.compose import StepEstimate, step_from_tracker
from scaletrain.measure.step import (DTYPES, autocast, check_precision, loss_for, make_batch, make_optimizer,
                                     make_scaler, train_step)
from scaletrain.measure.tracker import MemoryTracker
from scaletrain.measure.types import Profile


class _Timer:
    """Seconds of a region: CUDA events on GPU (asynchronous kernels), perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0
        return False


def _time_block(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, x_grad: bool, precision: str,
                repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    dev = x.device
    fwd, bwd = [], []
    for r in range(warmup + repeats):
        xi = x.detach().requires_grad_(x_grad)
        with _Timer(dev) as tf:
            with autocast(precision, dev.type):
                y = fn(xi)
        g = torch.ones_like(y)
        with _Timer(dev) as tb:
            torch.autograd.backward(y, g)
        if r >= warmup:
            fwd.append(tf.s)
            bwd.append(tb.s)
        del y, g, xi
    return fwd, bwd


def profile_chain(chain: Chain | nn.Module, example_input: torch.Tensor, loss_fn: Callable | None = None, *,
                  target: torch.Tensor | None = None, repeats: int = 5, warmup: int = 2, precision: str = "fp32",
                  name: str = "") -> Profile:
    """Measure every block of ``chain`` on ``example_input`` (on the chain's device).

    The loss (``loss_fn(output, target)``; by default the model task's loss on a random target)
    is measured as well and kept in ``meta["loss"]``. Parameter gradients and buffers (e.g.
    BatchNorm statistics) are restored afterwards.
    """
    check_precision(precision)
    chain = to_chain(chain)
    params = list(dict.fromkeys(chain.parameters()))
    dev = params[0].device if params else example_input.device
    loss_fn = loss_fn or loss_for(chain)
    if target is None:
        _, target = make_batch(chain, example_input.shape[0], _seq(example_input), device=dev)
    grads = {p: p.grad for p in params}
    bufs = [(b, b.detach().clone()) for b in chain.buffers()]
    for p in params:
        p.grad = None
    try:
        traces = trace_chain(chain, example_input, target, loss_fn, precision=precision, device_type=dev.type)
        fns = list(chain.blocks) + [lambda z: loss_fn(z, target)]
        times = []
        h = example_input
        for i, fn in enumerate(fns):
            x_grad = i > 0 and h.is_floating_point()
            times.append(_time_block(fn, h, x_grad, precision, repeats, warmup))
            with torch.no_grad(), autocast(precision, dev.type):
                h = fn(h) if i < len(fns) - 1 else h
            for p in params:
                p.grad = None
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for b, v in bufs:
                b.copy_(v)
    prof = profile_from_traces(chain, traces, model=name or type(getattr(chain, "source", None) or chain).__name__,
                               batch=int(example_input.shape[0]), seq=_seq(example_input), precision=precision,
                               device=str(dev), measured=True)
    for b, (fw, bw) in zip(prof.blocks + [None], times):
        target_b = b if b is not None else prof.meta["loss"]
        vals = dict(fwd_time_s=statistics.median(fw), bwd_time_s=statistics.median(bw),
                    fwd_time_spread_s=max(fw) - min(fw), bwd_time_spread_s=max(bw) - min(bw))
        if b is None:
            target_b.update(vals)
        else:
            for k, v in vals.items():
                setattr(b, k, v)
    prof.meta.update(repeats=repeats, warmup=warmup, timer="cuda events" if dev.type == "cuda" else "perf_counter")
    return prof


def _seq(x: torch.Tensor) -> int:
    return int(x.shape[1]) if x.dim() == 2 and not x.is_floating_point() else 0


def measure_step(model: str | nn.Module, batch: int = 1, seq: int | None = None, *, precision: str = "fp32",
                 optimizer: str = "adamw", accum: int = 1, params_dtype: str = "fp32", device: str = "cpu",
                 loss_fn: Callable | None = None, optimizer_kwargs: dict | None = None, seed: int = 0,
                 keep_tracker: bool = False, **overrides: Any) -> StepEstimate:
    """Run two real training steps and track the second; bytes as :func:`estimate_step` reports them.

    With ``keep_tracker`` the MemoryTracker is returned in ``meta["tracker"]`` (for plots).
    """
    check_precision(precision)
    optimizer = optimizers.check(optimizer)
    torch.manual_seed(seed)
    if isinstance(model, str):
        name, module = model, models.get(model, device=device, **overrides)
    else:
        name, module = type(model).__name__, model
    if params_dtype != "fp32":
        module.to(DTYPES[params_dtype])
    opt = make_optimizer(module, optimizer, params_dtype=params_dtype, **(optimizer_kwargs or {}))
    scaler = make_scaler(precision, torch.device(device).type)
    batches = [make_batch(module, batch, seq, device=device) for _ in range(accum)]
    loss_fn = loss_fn or loss_for(module)
    train_step(module, opt, batches, precision=precision, loss_fn=loss_fn, scaler=scaler)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with MemoryTracker(model=module, optimizer=opt, extra=[t for b in batches for t in b], device=device) as tr:
        untracked = base - tr.current_bytes if cuda else 0  # e.g. library workspaces, never tensors
        train_step(module, opt, batches, precision=precision, loss_fn=loss_fn, scaler=scaler, mark=tr.mark)
        if cuda:
            torch.cuda.synchronize()
    est = step_from_tracker(tr, module, name=name, batch=batch, seq=seq or 0, precision=precision,
                            optimizer=optimizer, accum=accum, params_dtype=params_dtype, device=device,
                            measured=True)
    if cuda:  # the caching allocator's own count, for comparison (issue 3: within 5%)
        est.meta.update(cuda_max_memory_allocated=int(torch.cuda.max_memory_allocated()),
                        cuda_untracked_bytes=int(untracked))
    if keep_tracker:
        est.meta["tracker"] = tr
    return est


def profile_to_rows(prof: Profile) -> list[dict]:
    """Per-block rows (dicts) of a Profile, the loss last."""
    rows = [asdict(b) for b in prof.blocks]
    if prof.meta.get("loss"):
        rows.append(dict(prof.meta["loss"]))
    return rows
