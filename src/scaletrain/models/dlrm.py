"""DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems"), small: the model of the sharded-embedding technique.

Inputs: dense features [B, n_dense] (float) and sparse features [B, T, L] (int64): for each of T
categorical features a bag of L row ids into that feature's embedding table. Each bag is
sum-pooled (``nn.EmbeddingBag(mode="sum", sparse=True)``: the gradient of a table is sparse —
indices + values — and touches only the looked-up rows). The dense features go through the
bottom MLP to a vector of the embedding width d; the T + 1 vectors interact by all pairwise dot
products; those and the bottom vector feed the top MLP, whose single output is the click logit
[B] (train with ``binary_cross_entropy_with_logits``).

Plain PyTorch: the row-wise sharding of the tables is :mod:`scaletrain.techniques.embedding_sharding`,
which replaces :meth:`DLRM.lookup` and reuses :meth:`DLRM.dense_forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scaletrain.models.spec import ModelSpec, listed, register


@dataclass
class DLRMConfig:
    n_dense: int = 13
    """Dense (continuous) input features."""
    table_sizes: tuple[int, ...] = (20000, 10000, 5000, 1000)
    """Rows of each embedding table (one table per categorical feature)."""
    embed_dim: int = 16
    """Embedding width d (also the bottom MLP's output width)."""
    bag_size: int = 4
    """Row ids per categorical feature per sample (multi-hot bag, sum-pooled)."""
    bottom: tuple[int, ...] = (64, 16)
    """Bottom MLP widths after the input; the last must equal embed_dim."""
    top: tuple[int, ...] = (64, 32, 1)
    """Top MLP widths after the interaction; the last must be 1 (the logit)."""


def _mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """(dense [B, n_dense], sparse [B, T, L]) -> click logits [B]."""

    task = "ctr"

    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        if cfg.bottom[-1] != cfg.embed_dim:
            raise ValueError(f"bottom MLP must end at embed_dim={cfg.embed_dim}, got {cfg.bottom[-1]}")
        if cfg.top[-1] != 1:
            raise ValueError(f"top MLP must end at 1 (the logit), got {cfg.top[-1]}")
        self.config = cfg
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(n, cfg.embed_dim, mode="sum", sparse=True)
                                        for n in cfg.table_sizes)
        for e in self.embeddings:  # DLRM's init: U(-1/sqrt(rows), 1/sqrt(rows))
            bound = e.num_embeddings ** -0.5
            nn.init.uniform_(e.weight, -bound, bound)
        self.bottom = _mlp([cfg.n_dense, *cfg.bottom], last_relu=True)
        t = len(cfg.table_sizes) + 1
        self.top = _mlp([cfg.embed_dim + t * (t - 1) // 2, *cfg.top], last_relu=False)
        iu = torch.triu_indices(t, t, offset=1)
        self.register_buffer("_pairs", iu, persistent=False)

    def input_spec(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return (torch.zeros(batch, c.n_dense, device="meta"),
                torch.zeros(batch, len(c.table_sizes), c.bag_size, dtype=torch.long, device="meta"))

    def lookup(self, sparse: torch.Tensor) -> torch.Tensor:
        """Pooled embeddings [B, T, d] of the bags sparse [B, T, L]."""
        return torch.stack([emb(sparse[:, i]) for i, emb in enumerate(self.embeddings)], dim=1)

    def dense_forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Bottom MLP, pairwise dot-product interaction, top MLP -> logits [B]."""
        z = self.bottom(dense)  # [B, d]
        v = torch.cat([z.unsqueeze(1), pooled], dim=1)  # [B, T+1, d]
        dots = torch.bmm(v, v.transpose(1, 2))  # [B, T+1, T+1]
        inter = dots[:, self._pairs[0], self._pairs[1]]  # [B, (T+1)T/2]
        return self.top(torch.cat([z, inter], dim=1)).squeeze(1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.dense_forward(dense, self.lookup(sparse))


def build(**kw: Any) -> DLRM:
    return DLRM(DLRMConfig(**kw))


SPEC = register(ModelSpec(name="dlrm", classes=(DLRM,), models={
    "dlrm-mini": listed("dlrm-mini", build, n_dense=13, table_sizes=(20000, 10000, 5000, 1000), embed_dim=16,
                        bag_size=4, bottom=(64, 16), top=(64, 32, 1))}))
"""The ``dlrm`` family: two inputs (dense features, sparse ids), so no chain of single-tensor blocks."""
