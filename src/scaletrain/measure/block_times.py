"""Each block's forward and backward seconds, measured on real tensors: the measured source of the per-block table.

The traced cost model prices a block as the sum of its operators on a roofline
(:mod:`scaletrain.measure.census`, :func:`scaletrain.techniques.time_cost.block_seconds`). On a GPU
that is what the kernels do; on this CPU it is not, and not by one constant: measured here at one
thread (2026-11-28, vgg-mini, micro-batch 32), a convolution's backward ran 2.7x its roofline, a
2x2 max-pool 7x, while a ReLU ran 10x *faster* than the tanh-GELU rate that sets the memory-bound
roofline. Per operator kind the error has either sign, so no efficiency figure fixes it. Where the
model can run on this machine — the CPU processes ``plan=auto`` plans for — the honest source is the
blocks themselves: the model is run forward and backward on real tensors at each micro-batch the
search may choose, every block timed in place (:func:`time_blocks`), and the median seconds become the
table's entries (:attr:`scaletrain.platform.Platform.measured_blocks`), which
:mod:`scaletrain.techniques.time_cost` uses in place of the roofline for that block.

Timing rule (the one :mod:`scaletrain.planner.local` uses for every figure it measures): all ranks
measure at once (the caller's barrier), one warm-up, then the median of ``repeats`` samples. The
parameters' gradients are freshly allocated in every pass (a step's first micro-batch, or a step of one
micro-batch). Units: seconds.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable

import torch



def model_key(model: Any, chain: Any = None) -> str:
    """A model's identity in the measured table, equal for the same configuration on any device
    (meta in the planner, real in the measurement): its class, its parameter count and its Chain's block
    count (``chain``: the model's Chain when the caller has it)."""
    from scaletrain.chain import to_chain

    n = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__}/{n}/{len(to_chain(chain if chain is not None else model).blocks)}"


def tp_key(key: str, tp: int, sp: bool) -> str:
    """The measured table's key of a model's blocks timed sharded ``tp`` ways (``sp``: with sequence
    parallelism), their in-layer collectives included (:func:`scaletrain.planner.local.block_table`)."""
    return f"{key}/tp{tp}" + ("/sp" if sp else "")


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


def _one_step(blocks: list, loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list,
              precision: str) -> tuple[list[float], list[float]]:
    """One forward and backward of the whole chain, timed at every block boundary: (forward seconds per
    block and the loss, backward seconds per block and the loss).

    Forward: the clock is read between blocks. Backward: a hook on each boundary activation reads the
    clock when its gradient is ready, so block i's backward is the span from its output's gradient to its
    input's (the first block's ends when ``backward`` returns; its parameters' gradients included)."""
    marks: list[float] = []
    ready: dict[int, float] = {}
    h = x
    t = [time.perf_counter()]
    with _cast(precision):
        for i, fn in enumerate(blocks + [loss]):
            h = fn(h)
            t.append(time.perf_counter())
            if i < len(blocks) and h.requires_grad:
                h.register_hook(lambda g, i=i: ready.__setitem__(i, time.perf_counter()) or None)
    fwd = [b - a for a, b in zip(t, t[1:])]
    t0 = time.perf_counter()
    if h.requires_grad:
        h.backward()
    end = time.perf_counter()
    for p in params:
        p.grad = None
    # boundary i (the output of block i) has its gradient at ready[i]; block i's backward runs from
    # ready[i] to ready[i - 1]; the loss's from the start to ready[last]
    n = len(blocks)
    marks = [ready.get(i, end) for i in range(n)]  # a boundary without gradient: nothing ran before it
    bwd = [(marks[i - 1] if i else end) - marks[i] for i in range(n)] + [marks[n - 1] - t0 if n else end - t0]
    return fwd, [max(b, 0.0) for b in bwd]


def time_blocks(chain: Any, example_input: torch.Tensor, target: torch.Tensor, loss_fn: Callable,
                precision: str = "fp32", repeats: int = 3) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of every block of ``chain`` on one real micro-batch, then of the
    loss (last entry) — the entries of :func:`scaletrain.measure.census.census`, measured.

    Each block is timed *in place*, inside whole forward and backward passes of the chain (one warm-up,
    then the median of ``repeats`` passes per block), not run alone over and over: alone, a block finds
    its input, weights and saved tensors in the cache it just filled, which a step never does. Measured
    here (2026-11-28, vgg-mini, micro-batch 32, 1 thread, 5 interleaved rounds): the blocks timed alone
    summed to 0.5-0.8x the whole pass's forward and backward, every round; in place they sum to it."""
    from scaletrain.chain import to_chain

    chain = to_chain(chain)
    blocks = list(chain.blocks)
    params = list(dict.fromkeys(chain.parameters()))
    saved = {p: p.grad for p in params}
    for p in params:
        p.grad = None
    runs = []
    try:
        for i in range(repeats + 1):  # the first pass is the warm-up
            step = _one_step(blocks, lambda z: loss_fn(z, target), example_input, params, precision)
            if i:
                runs.append(step)
    finally:
        for p, g in saved.items():
            p.grad = g
    fwd = [statistics.median(r[0][j] for r in runs) for j in range(len(blocks) + 1)]
    bwd = [statistics.median(r[1][j] for r in runs) for j in range(len(blocks) + 1)]
    return fwd, bwd
