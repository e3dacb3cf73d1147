"""A run without pipeline stages on the world mesh, and what model parallelism does per step.

Mesh dims (:mod:`.world`, the job's one mesh, here with ``pp = 1``), outermost first:
``("pp", "dp_rep", "dp_in", "cp", "tp")`` with ``dp = dp_rep x dp_in``.
TP is innermost so that its ranks are neighbours (the fastest links: Megatron's placement). The
inner data-parallel dim ``dp_in`` is the expert-parallel group (each EP rank has its own tokens
and experts) or the HSDP shard group; CP ranks share a batch and split its sequence. World =
dp x cp x tp.

Who averages what (each rank's loss is the mean over its own tokens, all ranks hold equally many):

- replicated parameters (everything but experts; TP shards included — a TP shard is replicated
  over dp x cp): mean over the ``dp x cp`` group (``dense``);
- expert parameters: each already sums its EP group's tokens' contributions, so sum over the ranks
  holding the same experts (``dp_rep x cp``) and divide by ``dp x cp`` (``expert``).

:meth:`ModelParallel.sync_groups` gives these as :class:`~.data_parallel.zero.SyncGroup` s for
:class:`~.data_parallel.zero.GradSync`; with HSDP the dense group shards over ``dp_in`` and
all-reduces over ``dp_rep``. State dicts: :meth:`ModelParallel.localize` /
:meth:`ModelParallel.globalize` map a single-process tensor to this rank's local one and back
(TP shards with the fused-QKV permutation, expert slices).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from scaletrain.models.adapters.base import logits_of
from scaletrain.techniques.data_parallel.zero import SyncGroup

@dataclass
class ModelParallel:
    """The mesh and groups of one run, and the per-step helpers of TP / CP / EP."""

    mesh: DeviceMesh
    dp: int
    tp: int
    cp: int
    ep: int
    hsdp: int
    sequence_parallel: bool
    dp_rank: int
    """This rank's index among the data-parallel ranks: the data loader's ``rank``."""
    dense_group: Any
    """dp x cp: the group replicated parameters' gradients are averaged over."""
    expert_group: Any
    """dp_rep x cp: the ranks holding the same experts."""
    dp_mesh: Any = None
    """The data-parallel ranks as a 1-D DeviceMesh (sub-mesh of :attr:`mesh`)."""
    dense_mesh: Any = None
    """dp x cp as a 1-D DeviceMesh."""

    def fsdp_mesh(self) -> Any:
        """Where FSDP2 shards: 2-D (replicate, shard) for HSDP, else dp x cp (CP ranks share parameters)."""
        if self.hsdp:
            return self.mesh["dp_rep", "dp_in"]
        return self.dense_mesh if self.cp > 1 else self.dp_mesh

    @property
    def dense_size(self) -> int:
        return dist.get_world_size(self.dense_group)

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    def sync_groups(self) -> dict[str, SyncGroup]:
        """Reduction groups for :class:`GradSync`: ``dense`` and ``expert`` (see the module docstring)."""
        D = self.dense_size
        if self.hsdp:  # shard within dp_in (x cp), replicate over dp_rep
            shard = self.mesh["dp_in", "cp"]._flatten("hsdp_shard").get_group()
            rep = self.mesh["dp_rep"].get_group() if self.mesh["dp_rep"].size() > 1 else None
            return {"dense": SyncGroup(shard, D, rep)}
        return {"dense": SyncGroup(self.dense_group, D), "expert": SyncGroup(self.expert_group, D)}

    # -------------------------------------------------------------- per micro-batch
    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a data-parallel batch: under CP its tokens in the balanced layout."""
        if self.cp == 1:
            return x, y
        from scaletrain.techniques.context_parallel import shard_sequence

        r = self.mesh["cp"].get_local_rank()
        return shard_sequence(x, r, self.cp), shard_sequence(y, r, self.cp)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Wrap the loss's forward and backward (``loss_parallel`` under TP)."""
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss(self, model: nn.Module, logits: torch.Tensor, y: torch.Tensor, loss_fn: Any = None) -> torch.Tensor:
        """The task loss (vocabulary-parallel cross-entropy under TP; ``loss_fn`` otherwise) plus the
        model's MoE auxiliary loss when it has one. Call inside :meth:`loss_context`."""
        if self.tp > 1 or loss_fn is None:
            loss = F.cross_entropy(logits_of(logits).float().flatten(0, 1), y.flatten())
        else:
            loss = loss_fn(logits, y)
        aux = getattr(model, "aux_loss", None)
        if callable(aux):
            a = aux()
            if isinstance(loss, DTensor) and not isinstance(a, DTensor):  # TP: the same value on every TP rank
                from torch.distributed.tensor import Replicate

                a = DTensor.from_local(a, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
            loss = loss + a
        return loss

    def replicas(self, p: torch.Tensor) -> int:
        """Ranks of this TP group holding the same values as this rank's local tensor of ``p``."""
        if self.tp > 1 and (not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)):
            return self.tp
        return 1

    # -------------------------------------------------------------- state in the single-process layout
    def localize(self, model: nn.Module, name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor of parameter ``name`` from its single-process value ``full``."""
        from scaletrain.techniques.experts import is_expert_param

        full = self.to_tp_layout(model, name, full)
        if isinstance(p, DTensor):
            dim = next((pl.dim for pl in p.placements if pl.is_shard()), None)
            if dim is not None:
                full = full.chunk(self.tp, dim=dim)[self.tp_rank]
        if is_expert_param(p) and self.ep > 1:
            n = full.shape[0] // self.ep
            r = self.mesh["dp_in"].get_local_rank()
            full = full[r * n:(r + 1) * n]
        return full

    def globalize(self, model: nn.Module, name: str, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`localize` (collective over the TP or EP group)."""
        from scaletrain.techniques.experts import is_expert_param

        def gather(t: torch.Tensor, dim_name: str, dim: int) -> torch.Tensor:
            m = self.mesh[dim_name]
            parts = [torch.empty_like(t) for _ in range(m.size())]
            dist.all_gather(parts, t.contiguous(), group=m.get_group())
            return torch.cat(parts, dim=dim)

        if isinstance(p, DTensor):
            dim = next((pl.dim for pl in p.placements if pl.is_shard()), None)
            if dim is not None:
                local = gather(local, "tp", dim)
        if is_expert_param(p) and self.ep > 1:
            local = gather(local, "dp_in", 0)
        return self.from_tp_layout(model, name, local)

    def to_tp_layout(self, model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
        """A single-process tensor in the TP model's (unsharded) layout: fused-QKV rows permuted
        head-aligned, Hugging Face's Conv1D weights transposed to Linear's."""
        from scaletrain.techniques.tensor_parallel import conv1d_transposed, qkv_row_permutation

        if self.tp > 1 and conv1d_transposed(model, name) and full.dim() == 2:
            full = full.t().contiguous()
        perm = qkv_row_permutation(model, name, self.tp)
        return full[perm.to(full.device)] if perm is not None else full

    def from_tp_layout(self, model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_tp_layout`."""
        from scaletrain.techniques.tensor_parallel import conv1d_transposed, qkv_row_permutation

        perm = qkv_row_permutation(model, name, self.tp)
        if perm is not None:
            full = full[torch.argsort(perm.to(full.device))]
        if self.tp > 1 and conv1d_transposed(model, name) and full.dim() == 2:
            full = full.t().contiguous()
        return full

    def globalize_shape(self, p: torch.Tensor, local: torch.Tensor) -> torch.Size:
        """The single-process shape of parameter ``p`` whose local tensor is ``local``."""
        from scaletrain.techniques.experts import is_expert_param

        if isinstance(p, DTensor):
            return p.shape
        if is_expert_param(p) and self.ep > 1:
            return torch.Size((local.shape[0] * self.ep, *local.shape[1:]))
        return local.shape

    def describe(self) -> str:
        parts = [f"dp={self.dp}"]
        parts += [f"{k}={v}" for k, v in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.sequence_parallel:
            parts[-1] += " (sequence parallel)"
        return " x ".join(parts)


def build_mesh(*, world: int, tp: int = 1, cp: int = 1, ep: int = 1, hsdp: int = 0,
               sequence_parallel: bool = False, device_type: str = "cpu") -> ModelParallel:
    """This run's slices of the world mesh (:mod:`.world`, ``pp = 1``) over the initialised process
    group (collective)."""
    from scaletrain.techniques.world import Dims, world_mesh

    inner = ep if ep > 1 else (hsdp or 1)
    what = f"parallel.ep={ep}" if ep > 1 else f"parallel.hsdp={hsdp}"
    w = world_mesh(Dims.of(world=world, tp=tp, cp=cp, inner=inner, what=what), device_type)
    dp = w.dims.dp
    dp_mesh, dense = w["dp"], w["dp_cp"]
    return ModelParallel(w.mesh, dp, tp, cp, ep, hsdp if ep == 1 else 0, sequence_parallel,
                         dp_mesh.get_local_rank(), dense.get_group(), w.group("edp_cp"), dp_mesh, dense)


def apply_model_parallel(model: nn.Module, mp: ModelParallel) -> None:
    """Tensor (+ sequence), context and expert parallelism on ``model`` in place, in that order
    (every rank passes the same initial weights)."""
    if mp.tp > 1:
        from scaletrain.techniques.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mp.mesh["tp"], sequence_parallel=mp.sequence_parallel)
    if mp.cp > 1:
        from scaletrain.techniques.context_parallel import apply_context_parallel

        apply_context_parallel(model, mp.mesh["cp"])
    if mp.ep > 1 or (mp.cp > 1 and has_moe(model)):
        from scaletrain.techniques.experts import apply_expert_parallel

        # load-balancing statistics over all dp x cp ranks: the global batch's auxiliary loss
        apply_expert_parallel(model, mp.mesh["dp_in"], aux_group=mp.dense_group)


def has_moe(model: nn.Module) -> bool:
    """Whether the model has mixture-of-experts layers (its family's ``ModelSpec.moe``)."""
    from scaletrain.models.spec import moe_layers

    return bool(moe_layers(model))
