"""Row-wise sharded embedding tables with model-parallel lookups (DLRM's hybrid parallelism:
Naumov et al. 2019 §4; Mudigere et al. 2021, "Software-hardware co-design for fast and scalable
training of DLRM models"; TorchRec's row-wise sharding).

The tables are too large to replicate; the dense MLPs are small and run data-parallel. With W
ranks, table t of N_t rows is cut into W blocks of R_t = ceil(N_t / W) rows; rank r holds block r of
every table, fused into one local parameter [Σ_t R_t, d] (the last block is padded; padding rows
are never looked up). Each rank has its own batch of B samples. One step:

1. **input all-to-all**: every row id goes to the rank owning its row: a counts all-to-all
   ([W] int64), then the (bag, local row) pairs (int64 [n, 2]) with uneven splits;
2. **model-parallel lookup**: the owner sum-pools the rows it holds into partial bags,
   [W (source), B·T, d];
3. **output all-to-all back to the data-parallel layout**: rank s receives the partial sums of its
   own bags from every owner, [W (owner), B·T, d], and adds them: [B, T, d] (this pair of steps is
   a reduce-scatter, done as an all-to-all);
4. backward: the pooled gradients [B·T, d] are all-gathered (the transpose of step 3), and each
   owner forms the gradient of its shard as a **sparse COO tensor — indices + values** — of the rows
   it served, never a dense [Σ R_t, d] tensor. It is scaled by ``grad_scale`` (default 1/W, so that
   with the dense gradients averaged over the W ranks the step is the global-batch mean's).

Sparse-aware optimizers (``torch.optim.Adagrad``, ``SparseAdam``, plain ``SGD``) update only the
touched rows. The dense parameters stay replicated: average their gradients over the group.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import UserError


def rows_per_rank(table_sizes: tuple[int, ...] | list[int], world: int) -> list[int]:
    """R_t = ceil(N_t / W): rows of table t on each rank (the last rank's block is padded)."""
    return [math.ceil(n / world) for n in table_sizes]


class _ShardedBagLookup(torch.autograd.Function):
    """Pooled bags [B, T, d] of ids [B, T, L] from row-wise sharded tables (see module docstring)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, sparse: torch.Tensor, mod: "RowWiseShardedEmbeddingBags") -> torch.Tensor:
        group, W = mod.group, mod.world
        B, T, L = sparse.shape
        d = weight.shape[1]
        R = mod.rows.to(sparse.device)  # [T] rows per rank per table
        off = mod.offsets.to(sparse.device)  # [T] offset of each table's block in the fused shard
        owner = sparse // R.view(1, T, 1)  # [B, T, L]
        local_row = sparse - owner * R.view(1, T, 1) + off.view(1, T, 1)
        bag = (torch.arange(B * T, device=sparse.device).view(B, T, 1)).expand(B, T, L)
        owner, local_row, bag = owner.reshape(-1), local_row.reshape(-1), bag.reshape(-1)
        order = torch.argsort(owner, stable=True)
        send = torch.stack([bag[order], local_row[order]], dim=1)  # [B·T·L, 2] grouped by owner
        send_counts = torch.bincount(owner, minlength=W)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        recv = send.new_empty(int(recv_counts.sum()), 2)
        dist.all_to_all_single(recv, send, recv_counts.tolist(), send_counts.tolist(), group=group)
        # Model-parallel lookup: partial pooled bags of every source rank, [W, B·T, d].
        src = torch.repeat_interleave(torch.arange(W, device=sparse.device), recv_counts)
        slot = src * (B * T) + recv[:, 0]
        partial = weight.new_zeros(W * B * T, d).index_add_(0, slot, weight[recv[:, 1]])
        pooled = torch.empty_like(partial)
        dist.all_to_all_single(pooled, partial, group=group)  # back to the data-parallel layout
        ctx.save_for_backward(slot, recv[:, 1])
        ctx.mod, ctx.shape = mod, (B, T, d, weight.shape[0])
        return pooled.view(W, B, T, d).sum(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slot, rows = ctx.saved_tensors
        mod = ctx.mod
        B, T, d, n_rows = ctx.shape
        g = grad.contiguous().view(B * T, d)
        gathered = g.new_empty(mod.world * B * T, d)
        dist.all_gather_single(gathered, g, group=mod.group)  # transpose of the reduce-scatter
        values = gathered[slot] * mod.grad_scale  # one row of gradient per id served: [n, d]
        dw = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (n_rows, d))
        return dw, None, None


class RowWiseShardedEmbeddingBags(nn.Module):
    """Sum-pooled lookups into T tables row-wise sharded over ``group``: ids [B, T, L] -> [B, T, d]."""

    def __init__(self, tables: list[nn.EmbeddingBag] | nn.ModuleList, group: dist.ProcessGroup,
                 grad_scale: float | None = None):
        super().__init__()
        for t in tables:
            if t.mode != "sum":
                raise UserError(f"row-wise sharding pools partial sums, so it needs mode='sum' bags; got {t.mode!r}")
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.table_sizes = [t.num_embeddings for t in tables]
        rows = rows_per_rank(self.table_sizes, self.world)
        self.register_buffer("rows", torch.tensor(rows), persistent=False)
        self.register_buffer("offsets", torch.tensor([0] + rows[:-1]).cumsum(0), persistent=False)
        self.grad_scale = 1.0 / self.world if grad_scale is None else grad_scale
        d = tables[0].embedding_dim
        blocks = []
        for t, R in zip(tables, rows):
            w = t.weight.detach()
            blk = w[self.rank * R:(self.rank + 1) * R]
            if blk.shape[0] < R:  # padding of the last block (never looked up)
                blk = torch.cat([blk, w.new_zeros(R - blk.shape[0], d)])
            blocks.append(blk)
        self.weight = nn.Parameter(torch.cat(blocks).clone())

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        return _ShardedBagLookup.apply(self.weight, sparse, self)

    def full_tables(self) -> list[torch.Tensor]:
        """Every table, whole (collective: all ranks call it) — for checkpoints and tests."""
        parts = [torch.empty_like(self.weight) for _ in range(self.world)]
        dist.all_gather(parts, self.weight.detach().contiguous(), group=self.group)
        out = []
        for t, (R, o) in enumerate(zip(self.rows.tolist(), self.offsets.tolist())):
            out.append(torch.cat([p[o:o + R] for p in parts])[: self.table_sizes[t]])
        return out


def _sharded_lookup(self: nn.Module, sparse: torch.Tensor) -> torch.Tensor:
    return self.sharded_embeddings(sparse)


def apply_embedding_sharding(model: nn.Module, group: dist.ProcessGroup | None = None,
                             grad_scale: float | None = None) -> nn.Module:
    """Shard ``model.embeddings`` (a DLRM's tables) row-wise over ``group`` (default: world).

    The model's ``lookup`` is replaced by the model-parallel one; ``model.embeddings`` is removed
    (its parameters no longer exist on any rank in full).
    """
    if not hasattr(model, "embeddings") or not hasattr(model, "lookup"):
        raise UserError(f"embedding sharding supports DLRM-style models (embeddings + lookup); "
                        f"{type(model).__name__} has neither")
    group = group or dist.group.WORLD
    model.sharded_embeddings = RowWiseShardedEmbeddingBags(model.embeddings, group, grad_scale)
    del model.embeddings
    model.lookup = types.MethodType(_sharded_lookup, model)
    return model


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    """The replicated (data-parallel) parameters of a sharded model."""
    sharded = {id(p) for m in model.modules() if isinstance(m, RowWiseShardedEmbeddingBags) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in sharded]


# --------------------------------------------------------------------------- cost face


def sharded_embedding_bytes_per_rank(table_sizes: tuple[int, ...] | list[int], embed_dim: int, world: int, *,
                                     param_bytes: int = 4, optim_states: int = 1) -> dict[str, int]:
    """Bytes of the table shards on one rank: Σ_t ceil(N_t / W) · d, times (1 + optimizer states
    per element; Adagrad keeps 1). Sparse gradients add only the rows touched in a step."""
    n = sum(rows_per_rank(table_sizes, world)) * embed_dim
    return {"parameters": n * param_bytes, "optimizer_states": n * param_bytes * optim_states,
            "total": n * param_bytes * (1 + optim_states)}


def sharded_embedding_comm(batch: int, n_tables: int, bag_size: int, embed_dim: int, world: int, *,
                           act_bytes: int = 4) -> dict[str, Any]:
    """Payloads one rank moves per step (B local samples), by collective.

    Forward: counts all-to-all (W int64), ids all-to-all (B·T·L pairs of int64; with uniformly
    spread ids (W-1)/W of them leave the rank), pooled all-to-all (W·B·T·d values; (W-1)/W leave).
    Backward: all-gather of the pooled gradients (B·T·d in, W·B·T·d out).
    """
    pooled = world * batch * n_tables * embed_dim * act_bytes
    ids = batch * n_tables * bag_size * 2 * 8
    f = (world - 1) / world
    return {"all_to_all": {"count": 3, "payload_bytes": world * 8 + ids + pooled},
            "all_gather": {"count": 1, "payload_bytes": pooled},
            "expected_wire_bytes": f * (world * 8 + ids + pooled) + f * pooled}
