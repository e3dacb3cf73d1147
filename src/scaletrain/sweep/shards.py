"""Where a model is cut into shards that fit a device: the cost face of spilled shards (bytes).

A shard is a contiguous run of the model's Chain blocks. On a device it holds, at its worst
(the backward task, or the last shard's forward + loss + backward):

    params(shard) + grads(shard) + saved activations(shard) + input + output (+ their gradients)
    + the largest transient of one of its blocks (+ the loss's, for the last shard)

with the per-block facts from :func:`scaletrain.techniques.offload.probe.probe_chain` (fake
tensors, no memory). :func:`partition` picks the fewest shards whose predicted peaks fit the
budget — fewer shards, fewer copies — and among those the cut that balances the shards'
FLOPs (the largest shard bounds how well shards of different models interleave).
All sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from scaletrain.errors import ConfigError
from scaletrain.techniques.offload.probe import ChainCosts


@dataclass(frozen=True)
class ShardCost:
    """Predicted device bytes and FLOPs of one shard task set."""

    start: int
    end: int
    param_bytes: int
    peak_bytes: int
    flops_fwd: float
    flops_bwd: float
    out_bytes: int


def shard_cost(c: ChainCosts, a: int, b: int, last: bool) -> ShardCost:
    """Cost of blocks ``a .. b-1`` as one shard (``last``: it also computes the loss)."""
    params = sorted({p for i in range(a, b) for p in c.blocks[i].params})
    pbytes = sum(c.param_bytes[p] for p in params)
    saved = set()
    for i in range(a, b):
        saved.update(c.blocks[i].saved)
    saved_bytes = sum(c.storage_bytes[s] for s in saved)
    inp = c.input_bytes if a == 0 else c.blocks[a - 1].out_bytes
    out = c.blocks[b - 1].out_bytes
    temp = max(max(c.blocks[i].fwd_temp_bytes, c.blocks[i].bwd_temp_bytes) for i in range(a, b))
    if last:
        temp = max(temp, c.loss_fwd_temp_bytes + c.loss_saved_bytes, c.loss_bwd_temp_bytes)
    peak = 2 * pbytes + saved_bytes + 2 * inp + 2 * out + temp
    return ShardCost(a, b, pbytes, peak, sum(c.blocks[i].flops_fwd for i in range(a, b)),
                     sum(c.blocks[i].flops_bwd for i in range(a, b)), out)


def partition(c: ChainCosts, budget: int | None, shards: int = 0) -> list[tuple[int, int]]:
    """Contiguous shard bounds: ``shards`` of them (0 = the fewest that fit ``budget``), FLOP-balanced."""
    n = len(c)
    if shards > n:
        raise ConfigError(f"sweep shards={shards} but the model has only {n} chain blocks; allowed: 0 (auto) .. {n}")

    @lru_cache(maxsize=None)
    def fits(a: int, b: int) -> bool:
        return budget is None or shard_cost(c, a, b, b == n).peak_bytes <= budget

    def flops(a: int, b: int) -> float:
        return sum(c.blocks[i].flops_fwd + c.blocks[i].flops_bwd for i in range(a, b))

    def best(k: int) -> tuple[float, list[tuple[int, int]]] | None:
        @lru_cache(maxsize=None)
        def go(a: int, k: int) -> tuple[float, tuple[tuple[int, int], ...]] | None:
            if k == 1:
                return (flops(a, n), ((a, n),)) if fits(a, n) else None
            out = None
            for b in range(a + 1, n - k + 2):
                if not fits(a, b):
                    continue
                rest = go(b, k - 1)
                if rest is None:
                    continue
                cand = (max(flops(a, b), rest[0]), ((a, b),) + rest[1])
                if out is None or cand[0] < out[0]:
                    out = cand
            return out

        r = go(0, k)
        return None if r is None else (r[0], list(r[1]))

    for k in ([shards] if shards else range(1, n + 1)):
        r = best(k)
        if r is not None:
            return r[1]
    if shards:
        fewest = next((k for k in range(shards + 1, n + 1) if best(k) is not None), None)
        raise ConfigError(f"sweep shards={shards}: no cut into {shards} shards fits the device budget of {budget} B; "
                          + (f"allowed: {fewest} or more (or 0: the fewest that fit)" if fewest else
                             "no cut fits at all: raise the budget"))
    smallest = min(shard_cost(c, i, i + 1, i == n - 1).peak_bytes for i in range(n))
    largest = max(shard_cost(c, i, i + 1, i == n - 1).peak_bytes for i in range(n))
    raise ConfigError(f"memory.device_budget={budget} B is too small for a shard of this model: one block alone "
                      f"needs up to {largest} B (smallest {smallest} B); raise the budget or lower train.micro_batch")


def task_bytes(c: ChainCosts, bounds: list[tuple[int, int]]) -> dict[tuple[str, int], dict[str, int]]:
    """Bytes each task moves host->device (``h2d``) and back (``d2h``) — exactly what the workers count.

    ``F``: the shard's parameters and input in; its saved activations (plus the step input, if the
    first block saves it) and its output out. ``B``: parameters, saved activations and the output's
    gradient in; parameter gradients and the input's gradient out. ``FB``: parameters, input and
    targets in; gradients out. ``E``: parameters and input (targets, last shard) in; output out.
    """
    k = len(bounds)
    out: dict[tuple[str, int], dict[str, int]] = {}
    for s, (a, b) in enumerate(bounds):
        cost = shard_cost(c, a, b, s == k - 1)
        inp = c.input_bytes if a == 0 else c.blocks[a - 1].out_bytes
        saved = sum(c.storage_bytes[x] for x in {x for i in range(a, b) for x in c.blocks[i].saved})
        saved += c.input_bytes if s == 0 and c.input_saved else 0
        grad_in = inp if s > 0 else 0
        p = cost.param_bytes
        if s < k - 1:
            out[("F", s)] = {"h2d": p + inp, "d2h": saved + cost.out_bytes}
            out[("B", s)] = {"h2d": p + saved + cost.out_bytes, "d2h": p + grad_in}
            out[("E", s)] = {"h2d": p + inp, "d2h": cost.out_bytes}
        else:
            out[("FB", s)] = {"h2d": p + inp + c.target_bytes, "d2h": p + grad_in}
            out[("E", s)] = {"h2d": p + inp + c.target_bytes, "d2h": 0}
    return out
