"""Weight streaming (L2L, Pudipeddi et al. 2020; ZeRO-Infinity's parameter offload): parameters
live on the host; only the blocks being computed plus a prefetch window are on the device.

Residency is reference-counted per parameter by :class:`ParamClaims`, one state machine shared
by the apply face and the cost face (so the predicted bytes are the counted bytes):

- forward of block i: claim blocks i .. i+w (w = window; only i+w is new after block 0), run
  block i, drop block i's claim — except for the last w+1 blocks, kept for the backward that
  starts right after the forward (no refetch at the turnaround);
- backward of block i (a hook on the gradient of block i's output, i.e. just before its
  backward runs): claim blocks i-w .. i, then drop what the previous block held;
- a parameter is fetched when its count goes 0 -> 1 and freed when it goes back to 0. Tied
  parameters (GPT-2's embedding and head) are claimed by every block that uses them.

The device copy of a parameter is the parameter's own tensor whose *storage* is resized to 0
when freed and back when fetched (FSDP's trick): the ``nn.Parameter`` object, its shape and
the views autograd saved of it stay valid, so nothing in the model or the autograd graph has to
know. The host copy is the fp32 master held by :class:`HostOptimizer`, so streaming costs no
extra host memory.

Gradients go to the host as soon as each parameter's gradient is accumulated (post-accumulate-
grad hook -> :meth:`HostOptimizer.receive_grad`), so at most the gradients of the block in
backward are on the device.

Cost face — :func:`predict_streaming`: replays the same claims to count bytes fetched (h2d
params) per micro-batch and the largest parameter bytes resident at once.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from scaletrain.techniques.offload.pools import Pools


class ParamClaims:
    """Reference counts of parameter residency driven by forward/backward block events."""

    def __init__(self, block_params: Sequence[Sequence[int]], window: int,
                 fetch: Callable[[int], None], release: Callable[[int], None]):
        if window < 0:
            raise ValueError(f"weight prefetch window must be >= 0, got {window}")
        self.block_params = [list(b) for b in block_params]
        self.n = len(block_params)
        self.window = window
        self._fetch, self._release = fetch, release
        self.count: dict[int, int] = {}
        self.fwd: set[int] = set()
        self.bwd: set[int] = set()
        self._last_bwd: int | None = None

    def _claim(self, b: int) -> None:
        for p in self.block_params[b]:
            c = self.count.get(p, 0)
            self.count[p] = c + 1
            if c == 0:
                self._fetch(p)

    def _drop(self, b: int) -> None:
        for p in self.block_params[b]:
            c = self.count[p] - 1
            self.count[p] = c
            if c == 0:
                self._release(p)

    def forward_start(self, i: int) -> None:
        for b in range(i, min(i + self.window, self.n - 1) + 1):
            if b not in self.fwd:
                self.fwd.add(b)
                self._claim(b)

    def forward_end(self, i: int) -> None:
        if i < self.n - 1 - self.window:
            self.fwd.discard(i)
            self._drop(i)

    def backward_start(self, i: int) -> None:
        for b in range(i, max(i - self.window, 0) - 1, -1):
            if b not in self.bwd:
                self.bwd.add(b)
                self._claim(b)
        for b in sorted(self.fwd):  # the turnaround: forward claims handed over to the backward
            self.fwd.discard(b)
            self._drop(b)
        if self._last_bwd is not None and self._last_bwd != i and self._last_bwd in self.bwd:
            self.bwd.discard(self._last_bwd)
            self._drop(self._last_bwd)
        self._last_bwd = i

    def finish(self) -> None:
        """End of the micro-batch: drop every claim left."""
        for b in sorted(self.fwd | self.bwd):
            self._drop(b)
        self.fwd.clear()
        self.bwd.clear()
        self._last_bwd = None


def replay_claims(block_params: Sequence[Sequence[int]], param_bytes: Sequence[int], window: int,
                  backward_blocks: Sequence[int]) -> tuple[int, int]:
    """(bytes fetched, peak resident parameter bytes) for one micro-batch (the cost face).

    ``backward_blocks``: blocks whose backward starts (their output requires grad), any order.
    """
    live = {"now": 0, "peak": 0, "fetched": 0}

    def fetch(p: int) -> None:
        live["now"] += param_bytes[p]
        live["fetched"] += param_bytes[p]
        live["peak"] = max(live["peak"], live["now"])

    def release(p: int) -> None:
        live["now"] -= param_bytes[p]

    c = ParamClaims(block_params, window, fetch, release)
    for i in range(len(block_params)):
        c.forward_start(i)
        c.forward_end(i)
    for i in sorted(backward_blocks, reverse=True):
        c.backward_start(i)
    c.finish()
    return live["fetched"], live["peak"]


def predict_streaming(block_params: Sequence[Sequence[int]], param_bytes: Sequence[int], window: int,
                      backward_blocks: Sequence[int]) -> dict[str, int]:
    """Bytes fetched per micro-batch, gradient bytes sent back, and peak resident parameter bytes."""
    fetched, peak = replay_claims(block_params, param_bytes, window, backward_blocks)
    return {"h2d_params": fetched, "d2h_grads": sum(param_bytes), "param_peak_bytes": peak}


class WeightStreamer:
    """Apply face: moves the parameters of a Chain in and out of the device pool."""

    def __init__(self, params: list[nn.Parameter], block_params: Sequence[Sequence[int]],
                 masters: dict[int, torch.Tensor], pools: Pools, window: int = 1):
        self.params = params
        self.pools = pools
        self.masters = masters
        for p in params:
            if p.data.device != pools.device:
                p.data = pools.device_empty(p.shape, p.dtype)
            pools.free_device_storage(p.data)
        self.block_params = [list(b) for b in block_params]
        self.claims = ParamClaims(block_params, window, self._fetch, self._release)
        self.resident: set[int] = set()
        self._tickets: dict[int, object] = {}

    def _fetch(self, j: int) -> None:
        p = self.params[j]
        self.pools.alloc_device_storage(p.data, "parameters")
        self._tickets[j] = self.pools.h2d_into(p.data, self.masters[id(p)], "params")
        self.resident.add(j)

    def _release(self, j: int) -> None:
        p = self.params[j]
        t = self._tickets.pop(j, None)
        if t is not None:  # (GPU) the copy into it must be ordered before the memory is reused
            t.wait_device()
        self.pools.free_device_storage(p.data)
        self.resident.discard(j)

    def wait(self, block: int) -> None:
        """Make the compute stream wait until block ``block``'s parameters have arrived (GPU)."""
        for j in self.block_params[block]:
            t = self._tickets.pop(j, None)
            if t is not None:
                t.wait_device()

    def resident_bytes(self) -> int:
        return sum(self.params[j].numel() * self.params[j].element_size() for j in self.resident)
