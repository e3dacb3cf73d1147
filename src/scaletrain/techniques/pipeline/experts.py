"""Expert parallelism inside pipeline stages (``parallel.ep`` with ``parallel.pp``).

Layout: the world mesh's ``(pp, dp_rep, dp_in)`` dimensions (pp outermost, global rank ``r·dp + d``, no TP),
``dp_in = ep``. The ``dp`` replicas of pipeline rank ``r`` split into blocks of ``ep`` consecutive replicas
(its ``dp_in`` groups); a block is one expert-parallel group (each member keeps E/ep experts of every MoE
layer of the stages and sends tokens to their experts by all-to-all, :mod:`scaletrain.techniques.experts`).
Members run the same action list, so their stage forwards — and the all-to-alls in them — meet in the same
order. The replicas holding the *same* experts (same index in their block, ``dp/ep`` of them) are the
expert-data-parallel group: an expert's gradient already sums its EP group's tokens through the all-to-all's
backward, so it is summed over that group and divided by dp (:meth:`.grads.ParamPlan.reduce`).

The load-balancing loss is each rank's own, per micro-batch (routing is local): Megatron's default,
and what one process computes with the same micro-batches, so the run equals one process with
``train.micro_batch`` = the pipeline's micro-batch.

Checkpoints stay in the single-process layout: expert tensors (parameters and their optimizer
states) are all-gathered over the EP group before the pipeline gathers its stages, and sliced back
on load.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def ep_replicas(dp_rank: int, dp: int, ep: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(EP group, expert-data-parallel group) of data-parallel replica ``dp_rank`` of a stage, as
    replica indices (the same for every pipeline rank)."""
    block, j = divmod(dp_rank, ep)
    return tuple(block * ep + i for i in range(ep)), tuple(b * ep + j for b in range(dp // ep))


def apply_stage_experts(model: nn.Module, world: Any) -> None:
    """Keep this rank's E/ep experts of every MoE layer (of the whole model: the pipeline frees the
    other stages' tensors afterwards) and route through its EP group, the world mesh's inner
    data-parallel dimension (:func:`.p2p.world`); per-rank load-balancing loss."""
    from scaletrain.techniques.experts import shard_experts

    ep = world.dims.dp_in
    shard_experts(model, world.group("dp_in"), rank=world.local_rank("dp_in"), size=ep, aux_group=None)


def gather_experts(t: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The whole expert tensor from each EP rank's slice (dim 0). Collective over ``group``."""
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def slice_experts(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This EP rank's experts (dim 0) of a whole expert tensor."""
    return full.chunk(size)[rank]


# --------------------------------------------------------------------------- cost face


def moe_layers_per_block(blocks: Any) -> list[int]:
    """Mixture-of-experts layers inside each block of a chain."""
    from scaletrain.models.spec import is_moe_layer

    return [sum(is_moe_layer(m) for m in blk.modules()) for blk in blocks]


def rank_ep_bytes(cfg: Any, sched: Any, bounds: list[int], moe_per_block: list[int], rank: int, micro_batch: int,
                  seq: int, ep: int, precision: str = "fp32", remat: list | None = None) -> float:
    """Wire bytes of the all-to-alls one pipeline rank's stages run per step: per micro-batch and MoE
    layer the dispatch and combine all-to-alls and their transposes in the backward
    (:func:`scaletrain.techniques.experts.ep_comm_bytes_per_step`; no statistics all-reduce: each rank's
    load-balancing loss is its own). Under 16-bit autocast the experts' output — the combine
    all-to-all and its gradient — is 16-bit; the dispatched tokens stay fp32 (LayerNorm's output).
    ``remat``: each stage's rematerialization schedule (or None): a recomputed MoE layer replays its
    forward's two all-to-alls (half of a layer's four, the same 16-bit share)."""
    from scaletrain.techniques.experts import ep_comm_bytes_per_step
    from scaletrain.techniques.remat.tree import recompute_counts, tree_of

    total = 0.0
    for st in sorted({a.stage for a in sched.actions[rank] if a.kind == "F"}):
        moe = moe_per_block[bounds[st]:bounds[st + 1]]
        if not sum(moe):
            continue
        forwards = sum(1 for a in sched.actions[rank] if a.kind == "F" and a.stage == st)
        layer = ep_comm_bytes_per_step(1, micro_batch * seq, cfg.n_embd, cfg.n_experts, cfg.top_k,
                                       cfg.capacity_factor, ep, act_bytes=4, shared_aux=False)["wire_bytes"]
        half = (4 + 2) / 8 if precision in ("bf16", "fp16") else 1.0  # two of the four all-to-alls 16-bit
        sch = remat[st] if remat else None
        rec = recompute_counts(tree_of(sch), len(moe)) if sch is not None else [0] * len(moe)
        total += forwards * layer * half * (sum(moe) + sum(n * r for n, r in zip(moe, rec)) / 2)
    return total
