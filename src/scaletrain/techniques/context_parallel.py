"""Context parallelism: the *tokens* of one sequence split over ranks, attention as a ring.

**Context parallelism by ring attention** (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"; Li et al. 2021 "ring self-attention"; the load-balanced causal layout of
Megatron-Core's context parallelism). ``parallel.cp = C`` ranks each hold S/C tokens of every
sequence; everything but attention is token-wise and runs locally. Attention runs blockwise with an
online softmax (Milakov & Gimelshein 2018; FlashAttention's running max / log-sum-exp) while the
key/value blocks travel around the ring by point-to-point send/recv: after C steps every query has
seen every key. Causal balance: the sequence is cut into 2C chunks and rank i holds chunks i and
2C-1-i, so every rank does the same number of unmasked (query-chunk, key-chunk) pairs: at the step
holding its own block 2 causal-diagonal pairs + 1 full, at each other step exactly 2 full pairs.
The backward recomputes each block's probabilities from the saved log-sum-exp (no s×s matrix is
kept) and sends dK/dV around the ring with K/V, then one last hop home.

Parameters stay replicated over the CP group: gradients are averaged over it like data parallelism
(each rank's loss is the mean over its S/C tokens, all ranks hold equally many).
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.errors import UserError

# --------------------------------------------------------------------------- balanced layout


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two of 2·cp sequence chunks rank ``rank`` holds: (rank, 2 cp - 1 - rank)."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (e.g. ids [b, S]) in the balanced layout: [b, S / cp]."""
    if x.shape[dim] % (2 * cp):
        raise UserError(f"context parallelism with cp={cp} needs the sequence length ({x.shape[dim]}) to be a "
                        f"multiple of 2*cp={2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence` given every rank's part, in rank order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, p in enumerate(parts):
        a, b = chunk_ids(r, cp)
        chunks[a], chunks[b] = p.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def local_positions(n_local: int, rank: int, cp: int, device: Any = None) -> torch.Tensor:
    """Global positions of this rank's ``n_local`` tokens (two chunks of n_local / 2)."""
    c = n_local // 2
    a, b = chunk_ids(rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


# --------------------------------------------------------------------------- ring attention


def _pair_kind(qc: int, kc: int) -> str:
    """Causal relation of query chunk qc and key chunk kc: full, diag or skip."""
    return "full" if kc < qc else ("diag" if kc == qc else "skip")


def _block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, diag: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, nh, c, c]
    if diag:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


class _Ring:
    """Point-to-point shifts around the CP ring (to rank+1, from rank-1)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_shift(self, t: torch.Tensor) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)


class RingAttention(torch.autograd.Function):
    """Causal attention of balanced-layout local q, k, v [b, nh, n, d] over a CP ring.

    Forward: for step j = 0..C-1 the rank holds the K/V block of rank (r - j) mod C; the next
    block is already in flight while this one is computed. Output and log-sum-exp are merged
    online: lse' = logaddexp(lse, lse_blk), out' = out·e^(lse-lse') + out_blk·e^(lse_blk-lse').
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ring = _Ring(group)
        C, r = ring.size, ring.rank
        b, nh, n, d = q.shape
        c = n // 2
        scale = 1.0 / math.sqrt(d)
        my_chunks = chunk_ids(r, C)
        out = torch.zeros(b, nh, n, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, nh, n), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # [2, b, nh, n, d]: one message per hop
        for step in range(C):
            src = (r - step) % C
            pending = ring.start_shift(kv) if step < C - 1 else None
            kk, vv = kv[0], kv[1]
            for qi, qc in enumerate(my_chunks):
                qs = slice(qi * c, (qi + 1) * c)
                for ki, kc in enumerate(chunk_ids(src, C)):
                    kind = _pair_kind(qc, kc)
                    if kind == "skip":
                        continue
                    ks = slice(ki * c, (ki + 1) * c)
                    s = _block_scores(q[:, :, qs].float(), kk[:, :, ks].float(), scale, kind == "diag")
                    blk_lse = torch.logsumexp(s, dim=-1)  # [b, nh, c]
                    blk_out = torch.matmul(torch.exp(s - blk_lse.unsqueeze(-1)), vv[:, :, ks].float())
                    new = torch.logaddexp(lse[:, :, qs], blk_lse)
                    out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - new).unsqueeze(-1)
                                     + blk_out * torch.exp(blk_lse - new).unsqueeze(-1))
                    lse[:, :, qs] = new
            if pending is not None:
                kv, works = pending
                for w in works:
                    w.wait()
        # Output laid out as [b, n, nh, d] so the caller's transpose + reshape is a view (as SDPA's).
        o = torch.empty(b, n, nh, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        o.copy_(out)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group = group
        return o

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        C, r = ring.size, ring.rank
        b, nh, n, d = q.shape
        c = n // 2
        scale = 1.0 / math.sqrt(d)
        my_chunks = chunk_ids(r, C)
        dout = dout.float()
        D = (dout * o.float()).sum(-1)  # [b, nh, n]: rowsum(dO ∘ O) of the softmax backward
        dq = torch.zeros(b, nh, n, d, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(2, b, nh, n, d, dtype=torch.float32, device=q.device)  # travels with kv
        for step in range(C):
            src = (r - step) % C
            pending = ring.start_shift(kv) if step < C - 1 else None
            kk, vv = kv[0], kv[1]
            for qi, qc in enumerate(my_chunks):
                qs = slice(qi * c, (qi + 1) * c)
                for ki, kc in enumerate(chunk_ids(src, C)):
                    kind = _pair_kind(qc, kc)
                    if kind == "skip":
                        continue
                    ks = slice(ki * c, (ki + 1) * c)
                    qf, kf, vf = q[:, :, qs].float(), kk[:, :, ks].float(), vv[:, :, ks].float()
                    p = torch.exp(_block_scores(qf, kf, scale, kind == "diag") - lse[:, :, qs].unsqueeze(-1))
                    do = dout[:, :, qs]
                    dkv[1, :, :, ks] += torch.matmul(p.transpose(-1, -2), do)  # dV = Pᵀ dO
                    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - D[:, :, qs].unsqueeze(-1))
                    dq[:, :, qs] += torch.matmul(ds, kf) * scale
                    dkv[0, :, :, ks] += torch.matmul(ds.transpose(-1, -2), qf) * scale
            # dK/dV of block src now hold every rank's contribution so far: pass them on with it.
            if pending is not None:
                dkv_next, dworks = ring.start_shift(dkv)
                kv, works = pending
                for w in works + dworks:
                    w.wait()
                dkv = dkv_next
        # After C steps this rank holds the finished dK/dV of block (r+1) mod C: one hop home.
        if C > 1:
            dkv, works = ring.start_shift(dkv)
            for w in works:
                w.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention over a context-parallel group; q, k, v: [b, heads, S/C, head_dim] local."""
    return RingAttention.apply(q, k, v, group)


# --------------------------------------------------------------------------- apply face


def _cp_attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Ring attention over this rank's S/C tokens — and, under tensor parallelism (applied first), over
    this rank's ``n_head / t`` heads: the fused QKV output is then [b, S/C, 3h/t] = [q_r | k_r | v_r]
    (rows permuted head-aligned by :mod:`.tensor_parallel`), and ``c_proj`` is row-parallel."""
    qkv = self.c_attn(x)  # [b, n, 3 hl], hl = h / t
    b, n, three = qkv.shape
    hl = three // 3
    nh = self.n_head // getattr(self, "_tp_size", 1)
    q, k, v = (t.view(b, n, nh, hl // nh).transpose(1, 2) for t in qkv.split(hl, dim=2))
    y = ring_attention(q, k, v, self._cp_group)
    return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(b, n, hl)))


def _cp_embedding_forward(self: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    pos = local_positions(idx.shape[1], self._cp_rank, self._cp_size, device=idx.device)
    return self.drop(self.wte(idx) + self.wpe(pos))


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make a GPT-2 run on this rank's S/C tokens (balanced layout) with ring attention.

    Feed it ``shard_sequence(ids, rank, C)`` and compute the loss against
    ``shard_sequence(targets, rank, C)``; average gradients over ``cp_mesh`` (fold it into the
    data-parallel reduction, or call :func:`average_gradients`). Attention dropout is not
    implemented in the ring (a UserError when the model has it).
    """
    for attr in ("embed", "h", "config"):
        if not hasattr(model, attr):
            raise UserError(f"context parallelism supports the GPT-2 layout; {type(model).__name__} has no {attr!r}")
    if model.config.dropout > 0:
        raise UserError(f"context parallelism (ring attention) does not implement attention dropout; "
                        f"model dropout={model.config.dropout}, allowed: 0")
    group = cp_mesh.get_group()
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    model.embed._cp_rank, model.embed._cp_size = rank, size
    model.embed.forward = types.MethodType(_cp_embedding_forward, model.embed)
    for block in model.h:
        block.attn._cp_group = group
        block.attn.forward = types.MethodType(_cp_attention_forward, block.attn)
    model._scaletrain_cp = (rank, size)
    return model


def average_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Mean of every gradient over ``group`` (one flat all-reduce): the CP/DP reduction."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


# --------------------------------------------------------------------------- cost face


def cp_comm_bytes_per_step(cfg: Any, cp: int, batch: int, seq: int, *, act_bytes: int = 4,
                           micro_batches: int = 1) -> dict[str, float]:
    """Bytes one CP rank sends per step for ring attention (gradient averaging not included).

    With A = b·(S/C)·h·act_bytes, per layer: forward C-1 hops of K and V (2A each hop); backward
    C-1 hops of K, V and the fp32 dK, dV travelling with them (2A + 2A·4/act_bytes), plus one
    final hop of dK, dV home.
    """
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0, "total": 0.0}
    A = batch * (seq // cp) * cfg.n_embd * act_bytes
    dA = batch * (seq // cp) * cfg.n_embd * 4
    fwd = cfg.n_layer * (cp - 1) * 2 * A
    bwd = cfg.n_layer * ((cp - 1) * (2 * A + 2 * dA) + 2 * dA)
    return {"forward": float(fwd * micro_batches), "backward": float(bwd * micro_batches),
            "total": float((fwd + bwd) * micro_batches)}


def cp_activation_bytes(cfg: Any, cp: int, batch: int, seq: int, *, act_bytes: int = 4) -> int:
    """Bytes saved for backward per CP rank: the single-device model's at S/C tokens (ring
    attention keeps q, k, v, its output and the log-sum-exp, like the flash kernel)."""
    from scaletrain.techniques.tensor_parallel.cost import tp_activation_bytes

    return tp_activation_bytes(cfg, 1, batch, seq // cp, act_bytes=act_bytes)["total"]
