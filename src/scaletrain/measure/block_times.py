"""Each block's forward and backward seconds, measured on real tensors: the measured source of the per-block table.

The traced cost model prices a block as the sum of its operators on a roofline
(:mod:`scaletrain.measure.census`, :func:`scaletrain.techniques.time_cost.block_seconds`). On a GPU
that is what the kernels do; on this CPU it is not, and not by one constant: measured here at one
thread (2026-11-28, vgg-mini, micro-batch 32), a convolution's backward ran 2.7x its roofline, a
2x2 max-pool 7x, while a ReLU ran 10x *faster* than the tanh-GELU rate that sets the memory-bound
roofline. Per operator kind the error has either sign, so no efficiency figure fixes it. Where the
model can run on this machine — the CPU processes ``plan=auto`` plans for — the honest source is the
blocks themselves: each distinct block (equal :func:`~scaletrain.measure.blocks._signature`: measured
once) is run forward and backward on real tensors at each micro-batch the search may choose, and its
median seconds become the table's entries (:attr:`scaletrain.platform.Platform.measured_blocks`),
which :mod:`scaletrain.techniques.time_cost` uses in place of the roofline for that block.

Timing rule (the one :mod:`scaletrain.planner.local` uses for every figure it measures): all ranks
measure at once (the caller's barrier), one warm-up, then the median of ``repeats`` samples. A block's
backward is timed with its parameters' gradients freshly allocated (a step's first micro-batch, or a
step of one micro-batch). Units: seconds.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable

import torch

from scaletrain.measure.blocks import _signature


def model_key(model: Any, chain: Any = None) -> str:
    """A model's identity in the measured table, equal for the same configuration on any device
    (meta in the planner, real in the measurement): its class, its parameter count and its Chain's block
    count (``chain``: the model's Chain when the caller has it)."""
    from scaletrain.chain import to_chain

    n = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__}/{n}/{len(to_chain(chain if chain is not None else model).blocks)}"


def lookup(table: tuple, key: str, precision: str, seq: int,
           micro_batch: int) -> tuple[list[float], list[float]] | None:
    """(forward, backward) seconds per block of ``key`` at ``micro_batch`` from a measured table
    (:attr:`scaletrain.platform.Platform.measured_blocks`): the entry itself, else linear between the two
    measured sizes around it, else proportional to the micro-batch from the nearest measured size
    (outside the measured range); None when the table has no entry for the model, precision and seq."""
    rows = sorted((b, f, g) for k, p, s, b, f, g in table if k == key and p == precision and s in (seq, 0))
    if not rows:
        return None
    below = [r for r in rows if r[0] <= micro_batch]
    above = [r for r in rows if r[0] >= micro_batch]
    if below and above:
        (b0, f0, g0), (b1, f1, g1) = below[-1], above[0]
        if b0 == b1:
            return list(f0), list(g0)
        w = (micro_batch - b0) / (b1 - b0)
        return ([x + w * (y - x) for x, y in zip(f0, f1)], [x + w * (y - x) for x, y in zip(g0, g1)])
    b0, f0, g0 = below[-1] if below else above[0]
    r = micro_batch / b0
    return [x * r for x in f0], [x * r for x in g0]


def _cast(precision: str) -> Any:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _time_block(fn: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter], h: torch.Tensor,
                x_grad: bool, precision: str, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(median forward s, median backward s, output) of one block on input ``h``."""
    fwd, bwd = [], []
    y = h
    for i in range(repeats + 1):  # the first round is the warm-up
        x = h.detach()
        if x_grad:
            x.requires_grad_(True)
        t0 = time.perf_counter()
        with _cast(precision):
            y = fn(x)
        t1 = time.perf_counter()
        if y.requires_grad:
            torch.autograd.backward(y, torch.ones_like(y))
        t2 = time.perf_counter()
        for p in params:
            p.grad = None
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd), y.detach()


def time_blocks(chain: Any, example_input: torch.Tensor, target: torch.Tensor, loss_fn: Callable,
                precision: str = "fp32", repeats: int = 3) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of every block of ``chain`` on one real micro-batch, then of the
    loss (last entry) — the entries of :func:`scaletrain.measure.census.census`, measured."""
    from scaletrain.chain import to_chain

    chain = to_chain(chain)
    fwd: list[float] = []
    bwd: list[float] = []
    seen: dict[tuple, tuple[float, float, torch.Tensor]] = {}
    h = example_input
    for i, block in enumerate(chain.blocks):
        x_grad = i > 0 and h.is_floating_point()
        sig = _signature(block, h, x_grad)
        if sig not in seen:
            seen[sig] = _time_block(block, list(block.parameters()), h, x_grad, precision, repeats)
        f, b, h = seen[sig]
        fwd.append(f)
        bwd.append(b)
    f, b, _ = _time_block(lambda z: loss_fn(z, target), [], h, True, precision, repeats)
    return fwd + [f], bwd + [b]
