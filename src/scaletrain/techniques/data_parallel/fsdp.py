"""ZeRO stage 3 with torch's FSDP2 ``fully_shard``.

One group per Chain block whose parameters no other block uses, then the root (which takes shared
ones such as GPT-2's tied embedding). Parameters are row-sharded DTensors, all-gathered before a
block runs and freed after it, in forward and again in backward (``reshard_after_forward=True``,
root included, which is ZeRO-3's 3 Psi of traffic); gradients are reduce-scattered per block. The
next block's all-gather is prefetched explicitly in both directions.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.techniques.data_parallel.sharded import ShardedStrategy, _Entry, _unique_params, shard_rows

def shardable_blocks(model: nn.Module) -> list[nn.Module]:
    """Chain blocks that own parameters no other block uses (each becomes one FSDP group)."""
    from scaletrain.chain import to_chain

    try:
        blocks = list(to_chain(model).blocks)
    except Exception:  # noqa: BLE001 - no chain: the root alone is one group
        return []
    users: dict[int, int] = {}
    for b in blocks:
        for p in b.parameters():
            users[id(p)] = users.get(id(p), 0) + 1
    return [b for b in blocks if any(True for _ in b.parameters())
            and all(users[id(p)] == 1 for p in b.parameters()) and b is not model]


class FSDPStrategy(ShardedStrategy):
    """ZeRO stage 3 with FSDP2 ``fully_shard`` (see the module docstring)."""

    name = "fsdp"
    stage = 3

    def __init__(self, model: nn.Module, rank: int, world: int, device: torch.device, *,
                 param_dtype: torch.dtype | None = None, hsdp: int = 0, reshard_root: bool = True,
                 prefetch: bool = True, root: nn.Module | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__(model, rank, world, device, hsdp=hsdp)
        self.param_dtype = param_dtype
        self._broadcast_params()
        mesh = self.mesh if self.mesh is not None else init_device_mesh(device.type, (world,))
        # ZeRO's mixed precision: compute and communicate in the half dtype, shards stay fp32.
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)
        self.blocks = shardable_blocks(model)
        for b in self.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        # the root is what runs the forward: the model, or its blocks under nested checkpoints
        root = root if root is not None else model
        fully_shard(root, mesh=mesh, reshard_after_forward=reshard_root, mp_policy=mp)
        self.forward_module = root
        if prefetch:
            for i, b in enumerate(self.blocks):
                if i + 1 < len(self.blocks):
                    b.set_modules_to_forward_prefetch([self.blocks[i + 1]])  # type: ignore[operator]
                if i > 0:
                    b.set_modules_to_backward_prefetch([self.blocks[i - 1]])  # type: ignore[operator]
        for p in _unique_params(model):
            e = _Entry(p, p.shape, *shard_rows(p.shape[0] if p.ndim else 1, self.N, self.r))
            local = self._local(e)
            if tuple(local.shape) != e.local_shape():
                raise RuntimeError(f"FSDP shard of shape {tuple(local.shape)} is not the row layout "
                                   f"{e.local_shape()} expected for a {tuple(p.shape)} parameter")
            e.proxy = nn.Parameter(local)
            self.entries.append(e)
        self._index_names()

    @staticmethod
    def _local(e: _Entry) -> torch.Tensor:
        with torch.no_grad():
            return e.param.to_local().detach()  # type: ignore[attr-defined]

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        for e in self.entries:
            assert e.proxy is not None
            local = self._local(e)
            if local.data_ptr() != e.proxy.data_ptr():  # FSDP re-padded its shard: follow it
                e.proxy.data = local
            g = e.param.grad
            e.proxy.grad = (g.to_local() if g is not None else  # type: ignore[attr-defined]
                            torch.zeros_like(e.proxy))

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _local_full(self, e: _Entry) -> torch.Tensor:
        return self._gather_rows(e, self._local(e))

    def _load_param(self, e: _Entry, full: torch.Tensor) -> None:
        self._local(e).copy_(self._slice_rows(e, full.to(self.device)))

    def describe(self) -> str:
        mp = f", {str(self.param_dtype).split('.')[-1]} compute" if self.param_dtype else ""
        h = f", HSDP shard groups of {self.N}" if self.N != self.world else ""
        return f"ZeRO stage 3 (FSDP2, {len(self.blocks)} block groups + root) over {self.world} ranks{mp}{h}"
