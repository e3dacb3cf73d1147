"""Tensor parallelism inside pipeline stages (TP × PP, optionally × DP): the glue.

Sequence parallelism (``sequence_parallel``): the blocks' outputs are this rank's s/t positions,
so each TP rank sends only its slice across a stage boundary (Megatron's scatter/gather of
pipeline messages, for free) — the boundary specs say [b, s/t, h].

Layout. ``world = pp · dp · tp`` processes on the job's world mesh (:mod:`scaletrain.techniques.world`),
pp outermost and tp innermost (Megatron's placement: a stage's TP ranks are neighbours): global rank
``(p·D + d)·T + t``. Every process
builds the whole model and :func:`~scaletrain.techniques.tensor_parallel.apply_tensor_parallel`
shards *all* of it over its TP group before the runtime cuts it into stages (simple and exact);
then :func:`free_nonlocal` empties the shards of the blocks this rank's stages do not use, so a
process keeps 1/T of its own stages' parameters only (transiently, at construction, 1/T of the
whole model).

Each TP index ``t`` runs its own pp × dp pipeline over the ranks with that index
(:func:`layouts`), with the runtime's usual ``ranks[r·dp + d]`` order: a stage's boundary
activation is replicated over its TP group (without sequence parallelism), so every TP rank
sends its own copy to the same-index rank of the next stage. Collectives of the pipeline (tied ``wte``
gradient between first and last stage, data-parallel all-reduce and initial broadcast, Chimera's
GRAD_SYNC, checkpoint broadcasts) run on the local shards (``to_local()``) within one TP index;
the gradient norm sums sharded parameters' squares over the TP group and counts replicated ones
once (:meth:`.grads.ParamPlan.clip_`). The last stage's loss is the vocabulary-parallel
cross-entropy under ``loss_parallel`` (forward and backward), the logits never gathered.

Checkpoints stay in the single-process layout: each stage's TP group gathers its tensors (fused
QKV rows un-permuted) and one rank per stage shares them with every process
(:func:`gather_model_state`); a full state is sharded back on load, each rank taking its own
stages' shards (:func:`load_full_state`, :func:`shard_full`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TPLayout:
    """This process's place in the world mesh's (pp, dp, tp) dimensions, as the pipeline runtime needs it."""

    tp: int
    tp_rank: int
    tp_group: Any
    """The process group of this rank's TP peers (same dp and pp index)."""
    layouts: tuple[tuple[int, ...], ...]
    """One pipeline rank order per TP index (``ranks[r·dp + d]``); ``layouts[tp_rank]`` is this rank's."""
    mesh: Any = None
    """The world mesh (:class:`scaletrain.techniques.world.World`)."""

    @property
    def ranks(self) -> list[int]:
        return list(self.layouts[self.tp_rank])


def layouts(dp: int, pp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """Pipeline rank orders of the ``tp`` pipelines: global rank ``(r·dp + d)·tp + t`` (the world mesh's
    order) at position ``r·dp + d`` of pipeline ``t``."""
    return tuple(tuple((r * dp + d) * tp + t for r in range(pp) for d in range(dp)) for t in range(tp))


def setup(model: nn.Module, world: Any, *, sequence_parallel: bool = False) -> TPLayout:
    """Shard ``model`` (whole, in place) over the TP dimension of the pipeline's world mesh
    (:func:`.p2p.world`). Collective over the world; every process passes the same weights."""
    from scaletrain.techniques.tensor_parallel import apply_tensor_parallel

    tp_mesh = world["tp"]
    apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)
    replicate_moe(model, tp_mesh)
    d = world.dims
    return TPLayout(d.tp, tp_mesh.get_local_rank(), tp_mesh.get_group(), layouts(d.dp, d.pp, d.tp), world)


def is_moe_block(block: nn.Module) -> bool:
    """A block holding a mixture-of-experts MLP (its TP collectives are the attention's only)."""
    return any(type(m).__name__ == "MoEFeedForward" for m in block.modules())


def replicate_moe(model: nn.Module, tp_mesh: Any) -> None:
    """Make the parameters of every mixture-of-experts MLP replicated DTensors over ``tp_mesh``.

    Why: TP leaves a MoE layer whole on every TP rank (replicated input, output and gradients, no
    collective) as plain tensors; a stage's optimizer and its gradient bookkeeping then meet plain
    tensors beside the DTensors of the same stage (the foreach kernels refuse the mix). Wrapped like
    the LayerNorms (:func:`~scaletrain.techniques.tensor_parallel.megatron.replicate_module`: plain
    inputs become Replicate DTensors, outputs local tensors), the router and the experts compute the
    same values and gradients as before, and the routing between them stays on plain tensors.
    No collective beyond the initial broadcast (every rank already holds the same weights)."""
    from scaletrain.techniques.tensor_parallel.megatron import replicate_module

    for moe in [m for m in model.modules() if type(m).__name__ == "MoEFeedForward"]:
        for mod in moe.modules():
            if any(not isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
                replicate_module(mod, tp_mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing storage), other tensors as they are."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_replicated(t: torch.Tensor) -> bool:
    """True for plain tensors and DTensors replicated over every mesh dimension."""
    return not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements)


def vocab_parallel_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` on vocabulary-sharded logits under ``loss_parallel``, returned as a plain scalar
    (its backward must run under :func:`backward_context` too)."""
    from torch.distributed.tensor.parallel import loss_parallel

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            return local(loss_fn(out, y))

    return loss


def backward_context() -> contextlib.AbstractContextManager:
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def tp_comm_counter() -> Any:
    """A :class:`~scaletrain.measure.comm.CommCounter` keeping only DTensor's functional
    collectives (the TP traffic inside the stages): the pipeline's own ``torch.distributed``
    calls are in the ledger already and its point-to-point bytes in ``p2p_bytes``."""
    from scaletrain.measure.comm import CommCounter, _classify

    class _TPCounter(CommCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor lower the op; its collectives come back here
            out = func(*args, **(kwargs or {}))
            if getattr(func, "namespace", "") == "_c10d_functional":
                rec = _classify(func, args)
                if rec is not None:
                    self.records.append(rec)
            return out

    return _TPCounter()


def stage_tp_bytes(cfg: Any, t: int, micro_batch: int, seq: int, kinds: list[str], *, forwards: int,
                   recomputes: list[int] | None = None, act_bytes: int = 4, sequence_parallel: bool = False,
                   precision: str = "fp32") -> float:
    """Wire bytes of one stage replica's DTensor collectives over ``forwards`` micro-batches (ring
    model, as :func:`scaletrain.techniques.tensor_parallel.tp_comm_bytes_per_step`, counted per block;
    f = (t-1)/t, A = b·s·h·act_bytes). ``kinds``: the stage's blocks, each "embed", "layer", "moe" (a
    layer whose MLP is a mixture of experts, run whole on every TP rank: its attention's half of a layer's
    collectives) or "head".
    Without SP: the embedding all-reduces A in the forward, a transformer block 2 A in the forward and
    2 A in the backward (inputs of c_attn and c_fc), the head A in the backward (lm_head's input) —
    2 f each. With SP every one becomes a reduce-scatter / all-gather pair (f A each, twice as many
    ops, the same bytes), plus the all-reduce of the replicated parameters that saw s/t positions: wpe
    (P·h), 2 LayerNorms per block (4 h), ln_f (2 h); the re-gathers of ``regather`` are
    ``torch.distributed`` calls (in the ledger, not here). The vocabulary-parallel loss all-reduces 3
    fp32 vectors of b·s. ``recomputes``: extra forwards of each block per micro-batch (remat), which
    replay the block's forward collectives
    (:func:`~scaletrain.techniques.tensor_parallel.cost.tp_forward_bytes_per_block`).
    Under 16-bit autocast (``precision`` bf16 / fp16, no SP) a layer's two forward all-reduces carry the
    row-parallel matmuls' 16-bit outputs (half the bytes); the embedding's, the backward's (gradients
    of fp32 LayerNorm outputs) and the loss's stay fp32."""
    from scaletrain.techniques.tensor_parallel.cost import tp_forward_bytes_per_block

    f = (t - 1) / t
    h = cfg.n_embd
    A = micro_batch * seq * h * act_bytes
    ar = (lambda n: 2 * f * n * 4) if sequence_parallel else (lambda n: 0.0)  # replicated params' grads
    loss = 2 * f * 3 * micro_batch * seq * 4
    half = 0.5 if precision in ("bf16", "fp16") and not sequence_parallel else 1.0  # forward outputs of matmuls
    cost = {"embed": 2 * f * A + ar(cfg.n_positions * h), "layer": (4 * half + 4) * f * A + ar(4 * h),
            "moe": (2 * half + 2) * f * A + ar(4 * h), "head": 2 * f * A + ar(2 * h) + loss}
    fwd = tp_forward_bytes_per_block(cfg, t, micro_batch, seq, sequence_parallel=sequence_parallel,
                                     act_bytes=act_bytes)
    layer = (fwd[1] if len(fwd) > 2 else 0.0) * half
    replay = {"embed": fwd[0], "layer": layer, "moe": layer / 2, "head": fwd[-1]}
    per = sum(cost[k] for k in kinds) + sum(n * replay[k] for k, n in zip(kinds, recomputes or []))
    return forwards * per


def predicted_tp_bytes(model: nn.Module, runtime: Any, micro_batch: int, seq: int, act_bytes: int = 4,
                       sequence_parallel: bool = False, precision: str = "fp32") -> float:
    """:func:`stage_tp_bytes` of this rank's stage replicas in one window: times the forwards of each
    local stage in the schedule, with its remat tree's recomputations. Exact for fp32 and the
    synchronous schedules (an asynchronous stream's window holds the forwards up to its pause, not
    exactly M)."""
    from scaletrain.techniques.remat.tree import recompute_counts, tree_of

    acts = runtime.schedule_for(1).actions[runtime.pp_rank]
    total = 0.0
    for (pipe, stage), rep in runtime.replicas.items():
        forwards = sum(1 for a in acts if a.kind == "F" and a.stage == stage and a.pipe == pipe)
        kinds = ["embed" if blk is model.embed else "head" if blk is model.head else
                 "moe" if is_moe_block(blk) else "layer" for blk in rep.module]
        sched = runtime.remat_schedules.get(stage)
        rec = recompute_counts(tree_of(sched), len(kinds)) if sched is not None else None
        total += stage_tp_bytes(model.config, runtime.tp.tp, micro_batch, seq, kinds, forwards=forwards,
                                recomputes=rec, act_bytes=act_bytes, sequence_parallel=sequence_parallel,
                                precision=precision)
    return total


# --------------------------------------------------------------------------- single-process layout
def _qkv_perm(model: nn.Module, name: str) -> torch.Tensor | None:
    from scaletrain.techniques.tensor_parallel import qkv_row_permutation, tp_info

    info = tp_info(model)
    return None if info is None else qkv_row_permutation(model, name, info.tp)


def shard_full(model: nn.Module, name: str, like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The value of ``like`` (parameter ``name`` of the TP model, or its optimizer state) from a
    single-process-layout ``full``: rows permuted for the fused QKV, this rank's shard taken; a
    DTensor with ``like``'s placements when ``like`` is one."""
    if not isinstance(like, DTensor):
        return full
    from torch.distributed.tensor import distribute_tensor

    perm = _qkv_perm(model, name)
    if perm is not None:
        full = full[perm]
    # no communication (src_data_rank=None); DTensor's own split, so FSDP's strided dp x tp rows come out right
    mine = distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()
    return DTensor.from_local(mine.contiguous(), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def gather_full(model: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`shard_full` (collective over the TP group when ``t`` is a DTensor)."""
    if not isinstance(t, DTensor):
        return t
    return unpermute(model, name, t.full_tensor())


def unpermute(model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """A gathered whole tensor of parameter ``name`` in the single-process layout (the fused QKV's rows
    put back in order; other tensors as they are)."""
    perm = _qkv_perm(model, name)
    return full[torch.argsort(perm)] if perm is not None else full


@torch.no_grad()
def free_nonlocal(model: nn.Module, keep: list[torch.Tensor]) -> None:
    """Empty every parameter/buffer of ``model`` not in ``keep`` (the tensors this rank's stages use):
    their storage is released (a DTensor's local shard, a plain tensor's storage), their shape stays,
    and any use of them would fail loudly. A pipeline rank then holds its own stages only."""
    kept = {id(t) for t in keep}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in kept and isinstance(t, DTensor):
            t._local_tensor.set_()
        elif id(t) not in kept:  # a plain tensor (a pipeline without TP): its storage released, shape kept
            t.detach().untyped_storage().resize_(0)


@torch.no_grad()
def gather_model_state(model: nn.Module, local_tensors: list[torch.Tensor], share: bool,
                       expand: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The single-process-layout model state on every process. ``local_tensors``: this rank's
    stages' tensors; ``share``: whether this rank contributes them (one rank per stage: TP rank
    0 of data-parallel replica 0); ``expand``: applied to each local tensor on every rank (expert
    slices gathered over their EP group). Collective over the world (TP groups, then all processes)."""
    import torch.distributed as dist

    mine = {id(t) for t in local_tensors}
    own = model.state_dict(keep_vars=True)
    part = {}
    for name, t in own.items():
        if id(t) in mine:
            full = gather_full(model, name, t)  # collective over the TP group, same order on its ranks
            full = expand(full) if expand is not None else full
            if share:
                part[name] = full.detach().cpu().clone()
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part if share else None)
    state: dict[str, torch.Tensor] = {}
    for p in parts:
        state.update(p or {})
    missing = [k for k in own if k not in state]
    if missing:
        raise RuntimeError(f"no pipeline stage holds {missing[:3]}")
    return {k: state[k] for k in own}


@torch.no_grad()
def load_full_state(model: nn.Module, state: dict[str, torch.Tensor], local_tensors: list[torch.Tensor],
                    narrow: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Load a single-process-layout model state into the TP model: this rank's shards of
    ``local_tensors`` (its stages'; the other blocks hold nothing). ``narrow(t, full)``: this
    rank's part of ``full`` for tensor ``t`` (expert slices)."""
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise KeyError(f"state dict keys differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    mine = {id(t) for t in local_tensors}
    for name, t in own.items():
        if id(t) not in mine:
            continue
        full = state[name] if narrow is None else narrow(t, state[name])
        if tuple(full.shape) != tuple(t.shape):
            raise RuntimeError(f"size mismatch for {name}: checkpoint {tuple(full.shape)}, model {tuple(t.shape)}")
        local(t).copy_(local(shard_full(model, name, t, full.to(t.dtype))))


def rank_tp_bytes(plan: Any, cfg: Any, bounds: list[int], b: int, seq: int, sched: Any, rank: int,
                  remat: list | None) -> float:
    """The TP collectives' bytes of one pipeline rank's stages per step
    (:func:`.pipeline.tensor_parallel.stage_tp_bytes`, recomputed forwards included)."""
    from scaletrain.techniques.remat.tree import recompute_counts, tree_of

    total = 0.0
    for st in sorted({a.stage for a in sched.actions[rank] if a.kind == "F"}):
        every = getattr(cfg, "moe_every", 0) if getattr(cfg, "n_experts", 0) else 0  # block i is layer i - 1
        kinds = ["embed" if i == 0 else "head" if i == bounds[-1] - 1 else "moe" if every and i % every == 0
                 else "layer" for i in range(bounds[st], bounds[st + 1])]
        forwards = sum(1 for a in sched.actions[rank] if a.kind == "F" and a.stage == st)
        rec = recompute_counts(tree_of(remat[st]), len(kinds)) if remat else None
        total += stage_tp_bytes(cfg, plan.tp, b, seq, kinds, forwards=forwards, recomputes=rec,
                                sequence_parallel=plan.sp, precision=plan.precision)
    return total
