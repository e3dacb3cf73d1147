"""ZeRO stage 0: torch DDP (replicated everything, gradients all-reduced in buckets)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from scaletrain.techniques.runtime import Strategy


class DDPStrategy(Strategy):
    """ZeRO stage 0: replicated everything, gradients all-reduced by torch DDP.

    DDP all-reduces gradients in buckets of ``bucket_mb`` MiB (25 by default, Li et al. VLDB
    2020), launching each bucket's all-reduce as soon as backward has produced all its
    gradients, so communication overlaps the rest of backward. ``gradient_as_bucket_view``
    makes ``param.grad`` views of the buckets (no second gradient copy: 4 Psi bytes of fp32
    gradients, not 8). Gradient accumulation runs the first micro-batches under ``no_sync``.
    A Python comm hook (plain all-reduce, or a compressor from
    :mod:`scaletrain.techniques.compression`) routes the traffic through the ledger.
    """

    name = "ddp"

    def __init__(self, model: nn.Module, rank: int, world: int, device: torch.device, *, bucket_mb: float,
                 compression: str = "none", compression_rank: int = 4, topk_ratio: float = 0.01,
                 compression_warmup_steps: int = 10, seed: int = 0, module: nn.Module | None = None) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from scaletrain.techniques.data_parallel import compression as comp

        super().__init__(model, rank, world)
        ids = [device.index] if device.type == "cuda" else None
        # ``module``: what runs the forward (the model, or its blocks under nested checkpoints)
        self.ddp = DDP(module if module is not None else model, device_ids=ids, bucket_cap_mb=bucket_mb,
                       gradient_as_bucket_view=True, init_sync=True)
        self.compressor = comp.make_hook(compression, world=world, rank=compression_rank, topk_ratio=topk_ratio,
                                         warmup_steps=compression_warmup_steps, seed=seed)
        self.ddp.register_comm_hook(self.compressor.state, self.compressor.hook)
        self.forward_module = self.ddp
        self.compression = compression

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def after_step(self) -> None:
        self.compressor.step_done()

    def describe(self) -> str:
        extra = f", {self.compression} compression" if self.compression != "none" else ""
        return f"DDP over {self.world} ranks (zero=0{extra})"

    def close(self) -> None:
        super().close()
        self.ddp = None  # type: ignore[assignment]
        self.compressor = None  # type: ignore[assignment]
