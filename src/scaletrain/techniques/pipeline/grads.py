"""Who holds which parameter in a pp × dp pipeline, and where its gradient is summed.

A parameter is *held* by every pipeline rank with a stage replica that uses it. Most are held
by one rank; two kinds are held by several and need their gradients summed before the update
so training stays exact:

* tied weights used by stages on different ranks — GPT-2's ``wte`` (embedding on the first
  stage, LM head on the last). Megatron keeps an "embedding group" of the first and last
  pipeline ranks and all-reduces the embedding gradient there; we do the same for any parameter
  shared across ranks, grouped by holder set, in one canonical order on every rank;
* Chimera's two replicas of each stage (ranks s and P−1−s): summed at the schedule's
  ``GRAD_SYNC`` of the stage that first uses them — under ZeRO-3 at the update instead, after each
  replica's reduce-scatter over dp (the sum of the two shards is the shard of the sum), as the tied
  weights are.

Then every local gradient is averaged over the data-parallel replicas of the same pipeline rank.
Layout: pipeline rank r of replica d is global rank ``ranks[r·dp + d]`` (pp outermost). Under
tensor parallelism (:mod:`.tensor_parallel`) each TP index has its own ``ranks``; collectives
run on the local shards within one TP index, and every process creates every TP index's groups.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.techniques.data_parallel.zero import squared_norm

from . import p2p
from .schedules import Schedule
from .tensor_parallel import TPLayout, is_replicated, local


def flat_collective(tensors: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], None]) -> None:
    """Apply an in-place collective to ``tensors`` through one flat buffer per dtype (one message
    instead of one per tensor)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        t = local(t)  # a DTensor's shard (tensor parallelism): collectives run per TP index
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        fn(flat)
        off = 0
        for t in ts:
            n = t.numel()
            t.detach().copy_(flat[off:off + n].view_as(t))
            off += n


def _materialise(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:  # type: ignore[attr-defined]
            # e.g. the vocabulary-parallel embedding's weight gradient comes back Replicate(): keep
            # the parameter's layout, so that every holder reduces the same local shard
            p.grad = p.grad.redistribute(placements=p.placements)  # type: ignore[attr-defined]
    return [p.grad for p in params]


class ParamPlan:
    """Holders of every parameter/buffer of ``blocks`` under ``bounds`` and ``sched``, this
    rank's share, and the gradient reductions (collectives bounded by the transport's timeout)."""

    def __init__(self, blocks: nn.ModuleList, bounds: list[int], sched: Schedule, ranks: Sequence[int],
                 pp_rank: int, dp_rank: int, dp: int, transport: p2p.Transport, timeout_s: float,
                 tp: TPLayout | None = None, ep: int = 1):
        self.ranks, self.pp, self.pp_rank, self.dp_rank, self.dp = list(ranks), sched.n_ranks, pp_rank, dp_rank, dp
        self.tp = tp
        self.transport, self.timeout_s = transport, timeout_s
        S = sched.n_stages
        stage_of_block = [s for s in range(S) for _ in range(bounds[s], bounds[s + 1])]
        uniq: list[torch.Tensor] = []
        index: dict[int, int] = {}
        users: dict[int, set[int]] = {}
        is_param: list[bool] = []
        for b, blk in enumerate(blocks):
            for param, tensors in ((True, blk.parameters()), (False, blk.buffers())):
                for t in tensors:
                    if id(t) not in index:
                        index[id(t)] = len(uniq)
                        uniq.append(t)
                        is_param.append(param)
                    users.setdefault(index[id(t)], set()).add(stage_of_block[b])
        self.tensors = uniq
        self.holders = [tuple(sorted({sched.rank_of(s, p) for s in users[i] for p in range(sched.n_pipes)}))
                        for i in range(len(uniq))]
        owner_stage = [min(users[i]) for i in range(len(uniq))]
        self.local = [i for i in range(len(uniq)) if pp_rank in self.holders[i]]
        self.local_tensors = [uniq[i] for i in self.local]
        """This rank's parameters and buffers (each once)."""
        mine = [i for i in self.local if is_param[i]]
        self.params: list[nn.Parameter] = [uniq[i] for i in mine]  # type: ignore[misc]
        """This rank's parameters, each once."""
        self.owned = [uniq[i] for i in mine if self.holders[i][0] == pp_rank]
        """The parameters this rank counts in the global gradient norm (first holder)."""
        pair = {s: tuple(sorted({sched.rank_of(s, p) for p in range(sched.n_pipes)})) for s in range(S)}
        self.gradsync: dict[int, list[torch.Tensor]] = {}
        self.pairs = pair
        """Chimera: the two pipeline ranks holding each stage."""
        tied: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for i in mine:
            h = self.holders[i]
            if len(h) == 1:
                continue
            if sched.n_pipes == 2 and h == pair[owner_stage[i]]:
                self.gradsync.setdefault(owner_stage[i], []).append(uniq[i])
            else:
                tied.setdefault(h, []).append(uniq[i])
        self.tied = sorted(tied.items())
        self.mesh_ranks = tuple(sorted(self.ranks))
        self.replica_ranks = tuple(sorted(self.global_rank(r) for r in range(self.pp)))
        self.dp_ranks = tuple(sorted(self.global_rank(pp_rank, d) for d in range(dp)))
        self.ep = ep
        """Expert parallelism inside the stages (:mod:`.experts`): expert parameters are this rank's
        slice; their gradients are summed over the expert-data-parallel group (not averaged over dp)."""
        from scaletrain.techniques.experts import is_expert_param

        self.experts = {id(p) for p in self.params if is_expert_param(p)}
        self.ep_ranks: tuple[int, ...] = ()
        self.expert_dp_ranks: tuple[int, ...] = ()
        if ep > 1:
            from .experts import ep_replicas

            group, same = ep_replicas(dp_rank, dp, ep)
            self.ep_ranks = tuple(sorted(self.global_rank(pp_rank, d) for d in group))
            self.expert_dp_ranks = tuple(sorted(self.global_rank(pp_rank, d) for d in same))
        self.zero_sync: Any = None
        """A :class:`~scaletrain.techniques.data_parallel.zero.GradSync` (ZeRO-1) or a
        :class:`.fsdp.StageFSDP` (ZeRO-3) that replaces the data-parallel all-reduce, or None."""
        self._make_groups()

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, ranks: Sequence[int] | None = None) -> int:
        return (self.ranks if ranks is None else ranks)[pp_rank * self.dp + (self.dp_rank if dp_rank is None
                                                                             else dp_rank)]

    def group(self, ranks: Sequence[int]) -> Any:
        return p2p.group(ranks, self.timeout_s)

    def _make_groups(self) -> None:
        """Create every group of the layout, in one canonical order on every process (p2p.group);
        under tensor parallelism those of every TP index's pipeline."""
        wanted = []
        for L in (self.tp.layouts if self.tp is not None else [self.ranks]):
            wanted.append(tuple(sorted(L)))
            wanted += [tuple(sorted(self.global_rank(r, d, L) for r in range(self.pp))) for d in range(self.dp)]
            wanted += [tuple(sorted(self.global_rank(r, d, L) for d in range(self.dp))) for r in range(self.pp)]
            for d in range(self.dp):
                for h in sorted({h for h in self.holders if len(h) > 1}):
                    wanted.append(tuple(sorted(self.global_rank(r, d, L) for r in h)))
        for g in wanted:
            if len(g) > 1:
                self.group(g)

    def rebind(self, new: dict[int, torch.Tensor]) -> None:
        """Replace parameters by new objects (``id(old) -> new``: FSDP2's sharded DTensors), keeping
        every holder set, group and order."""
        def swap(ts: list) -> list:
            return [new.get(id(t), t) for t in ts]

        self.tensors = swap(self.tensors)
        self.local_tensors = swap(self.local_tensors)
        self.params = swap(self.params)
        self.owned = swap(self.owned)
        self.tied = [(h, swap(ts)) for h, ts in self.tied]
        self.gradsync = {s: swap(ts) for s, ts in self.gradsync.items()}

    # ------------------------------------------------------------------ operations
    def broadcast_replicated(self) -> None:
        """Make replicated tensors equal at the start: shared ones from their first holder, then
        every local tensor from data-parallel replica 0 (as DDP does at construction)."""
        with torch.no_grad():
            for h in sorted({self.holders[i] for i in self.local if len(self.holders[i]) > 1}):
                ts = [self.tensors[i] for i in self.local if self.holders[i] == h]
                g = self.group([self.global_rank(r) for r in h])
                flat_collective(ts, lambda f: self.transport.broadcast(
                    f, self.global_rank(h[0]), g, "initial broadcast of shared parameters"))
            if self.dp > 1:  # expert slices differ between EP ranks by design (all cut from equal weights)
                flat_collective([self.tensors[i] for i in self.local if id(self.tensors[i]) not in self.experts],
                                lambda f: self.transport.broadcast(
                    f, self.global_rank(self.pp_rank, 0), self.group(self.dp_ranks), "initial data-parallel broadcast"))

    def grad_sync(self, stage: int, peer_pp_rank: int) -> None:
        """Chimera's GRAD_SYNC: sum the gradients of ``stage``'s parameters with its other replica."""
        ts = self.gradsync.get(stage, [])
        if ts and self.zero_sync is not None and self.zero_sync.stage == 3:
            return  # ZeRO-3: summed as shards at the update (:meth:`reduce`)
        if ts:
            g = self.group([self.global_rank(self.pp_rank), self.global_rank(peer_pp_rank)])
            flat_collective(_materialise(ts), lambda f: self.transport.all_reduce(
                f, g, f"GRAD_SYNC of stage {stage} with pipeline rank {peer_pp_rank}"))

    def reduce(self) -> None:
        """Before an update: sum shared parameters' gradients over their holders, then average
        every gradient over the data-parallel replicas. ZeRO-3 (FSDP2 in the stages): the
        reduce-scatter over the replicas comes first, then the shared parameters' sharded gradients
        are summed over their holders (each holds the same rows of them)."""
        fsdp = self.zero_sync is not None and self.zero_sync.stage == 3
        if fsdp:
            self.zero_sync.reduce()
        _materialise([p for p in self.params if p.grad is not None])  # TP: gradients in their parameter's layout
        for h, ts in self.tied:
            g = self.group([self.global_rank(r) for r in h])
            flat_collective(_materialise(ts), lambda f: self.transport.all_reduce(
                f, g, f"shared-parameter gradient all-reduce over pipeline ranks {list(h)}"))
        if fsdp:  # Chimera's GRAD_SYNC, deferred: each replica's reduce-scattered shard summed with its twin's
            for stage, ts in sorted(self.gradsync.items()):
                g = self.group([self.global_rank(r) for r in self.pairs[stage]])
                flat_collective(_materialise(ts), lambda f: self.transport.all_reduce(
                    f, g, f"GRAD_SYNC of stage {stage}'s shards over pipeline ranks {list(self.pairs[stage])}"))
            return
        if self.zero_sync is not None:  # ZeRO-1: reduce-scatter into the owned rows (GradSync)
            self.zero_sync.reduce()
            return
        dense = [p for p in self.params if id(p) not in self.experts]
        if self.dp > 1 and dense:
            g = self.group(self.dp_ranks)

            def avg(f: torch.Tensor) -> None:
                self.transport.all_reduce(f, g, "data-parallel gradient all-reduce")
                f.div_(self.dp)

            flat_collective(_materialise(dense), avg)
        experts = [p for p in self.params if id(p) in self.experts]
        if self.dp > 1 and experts:  # each holds its EP group's tokens' sum: sum over the same experts' holders

            def expert_avg(f: torch.Tensor) -> None:
                if len(self.expert_dp_ranks) > 1:
                    self.transport.all_reduce(f, self.group(self.expert_dp_ranks),
                                              "expert-data-parallel gradient all-reduce")
                f.div_(self.dp)

            flat_collective(_materialise(experts), expert_avg)

    def clip_(self, max_norm: float) -> float:
        """Clip the global gradient norm (L2 over all stages, shared parameters counted once) to
        ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` does (coefficient max_norm / (norm +
        1e-6), at most 1); returns the norm before clipping. Collective over the replica (and its
        TP groups: sharded parameters' squares summed over TP, replicated ones counted once)."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.transport.device)
        tp_rank = self.tp.tp_rank if self.tp is not None else 0
        for p in self.owned:
            if p.grad is not None and (tp_rank == 0 or not is_replicated(p)) and id(p) not in self.experts:
                sq += squared_norm(local(p.grad).detach())
        if self.experts:  # each EP rank holds other experts: their squares summed over the EP group
            sq_e = torch.zeros(1, dtype=torch.float64, device=self.transport.device)
            for p in self.owned:
                if p.grad is not None and id(p) in self.experts:
                    sq_e += squared_norm(p.grad.detach())
            if len(self.ep_ranks) > 1:
                self.transport.all_reduce(sq_e, self.group(self.ep_ranks), "expert gradient-norm all-reduce")
            sq += sq_e
        if self.pp > 1:
            self.transport.all_reduce(sq, self.group(self.replica_ranks), "gradient-norm all-reduce")
        if self.tp is not None and self.tp.tp > 1:
            self.transport.all_reduce(sq, self.tp.tp_group, "gradient-norm all-reduce over tensor parallelism")
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    local(p.grad).detach().mul_(coef)
        return norm

    def sync_full_model(self) -> None:
        """Broadcast every parameter and buffer from its first holder to all ranks of this
        replica, so each process's model is the whole, current model. Collective over the replica."""
        if self.tp is not None:
            from scaletrain.errors import UserError

            raise UserError("with tensor parallelism every rank keeps only its stages' shards; gather the model "
                            "with PipelineStrategy.model_state_dict")
        if self.pp == 1:
            return
        g = self.group(self.replica_ranks)
        with torch.no_grad():
            for r in range(self.pp):
                ts = [t for i, t in enumerate(self.tensors) if self.holders[i][0] == r]
                if ts:
                    flat_collective(ts, lambda f: self.transport.broadcast(
                        f, self.global_rank(r), g, "full-model broadcast"))
