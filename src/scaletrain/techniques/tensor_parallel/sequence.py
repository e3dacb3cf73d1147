"""Megatron sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) on tensor parallelism.

The LayerNorm / dropout / residual regions, which TP leaves replicated, are split along the
sequence, and each TP all-reduce becomes a reduce-scatter (into the sequence-sharded region) plus
an all-gather (out of it) — the same ring bytes, 2 (t-1)/t · A, but activations of those regions
shrink t-fold. It is ``apply_tensor_parallel(model, tp_mesh,
sequence_parallel=True)``, built on DTensor's ``SequenceParallel``), plus
:func:`keep_sequence_shard_for_backward`, which gives DTensor's column-parallel layers Megatron's
activation saving (keep the s/t slice, all-gather it again in the backward); its cost is in
:mod:`.cost`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh



def keep_sequence_shard_for_backward(module: nn.Module, tp_mesh: DeviceMesh, seq_dim: int = 1) -> None:
    """Megatron-SP's activation saving for a column-parallel layer fed by an all-gather.

    DTensor's Linear saves its (all-gathered, replicated) input whole: b·s·h per rank. Megatron
    keeps only this rank's s/t slice and all-gathers it again in the backward (Korthikanti et
    al. 2022), which is what makes TP+SP activations Korthikanti's ``34 sbh / t`` (16/t units of
    b·s·h per layer here) instead of the 2 + 14/t units that saving the gathered inputs costs.
    Done here with ``saved_tensors_hooks`` around the module call: a saved tensor that shares
    storage with the module's replicated input is packed as a clone of this rank's sequence
    slice and unpacked by an all-gather over ``tp_mesh``. Cost: one more all-gather of b·s·h per
    hooked layer in the backward.
    """
    group = tp_mesh.get_group()
    t, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    state: dict[str, Any] = {}

    def unpack(packed: Any) -> torch.Tensor:
        outer_unpack, packed = packed
        if outer_unpack is not None:
            packed = outer_unpack(packed)
        if not (isinstance(packed, tuple) and len(packed) == 6 and packed[0] == "seq-shard"):
            return packed
        _, shard, full_shape, view, spec, as_dtensor = packed
        if isinstance(shard, tuple):  # the outer hooks packed the shard itself
            shard = shard[0](shard[1])
        gathered = shard.new_empty((t * shard.shape[0], *shard.shape[1:]))
        dist.all_gather_single(gathered, shard.contiguous(), group=group)
        full = gathered.view(t, *shard.shape).movedim(0, seq_dim).reshape(full_shape)  # [b, t, s/t, h] -> [b, s, h]
        local = full.as_strided(*view)
        if not as_dtensor:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def pre(mod: nn.Module, args: tuple) -> None:
        from torch.distributed.tensor import DTensor

        x = args[0] if args else None
        if not torch.is_grad_enabled() or not (isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements)):
            return
        local = x._local_tensor
        if not local.is_contiguous() or local.storage_offset() != 0 or local.shape[seq_dim] % t:
            return
        key, device, full_shape = _plain(local).untyped_storage().data_ptr(), local.device, tuple(local.shape)
        # Hooks already active (memory tracker, activation compression) keep applying: chain them.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        shard = local.chunk(t, dim=seq_dim)[rank].clone()  # the closures below must not hold `local`
        cache: dict[str, Any] = {"shard": shard}
        del local, x, args

        def pack(v: torch.Tensor) -> Any:
            is_d = isinstance(v, DTensor)
            lv = v._local_tensor if is_d else v
            if lv.device != device or _plain(lv).untyped_storage().data_ptr() != key:
                return (outer_unpack, outer_pack(v) if outer_pack is not None else v)
            if "packed" not in cache:
                sh = cache.pop("shard")
                cache["packed"] = (outer_unpack, outer_pack(sh)) if outer_pack is not None else sh
            spec = (v.device_mesh, v.placements, v.shape, v.stride()) if is_d else None
            return (None, ("seq-shard", cache["packed"], full_shape,
                           (lv.size(), lv.stride(), lv.storage_offset()), spec, is_d))

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        state.setdefault("stack", []).append(ctx)

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        stack = state.get("stack")
        if stack:
            stack.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)




def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` uses: DTensor's all-gather hands some shapes back as a functional
    collective's ``AsyncCollectiveTensor`` wrapper (seen at micro-batch 1, gathering dim 1 of [1, s/t, h]),
    whose own storage cannot be read; its ``elem`` holds the gathered data."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.elem if isinstance(t, AsyncCollectiveTensor) else t
