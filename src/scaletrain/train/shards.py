"""What each rank holds of the single-process state, as pieces of it: the save side of sharded checkpoints.

A sharded checkpoint stores every tensor of the single-process layout (the *canonical* one: the
keys and shapes of ``model.state_dict()`` and of the one-process optimizer) as rectangular pieces,
each with its offsets in the canonical tensor. Every runtime's local tensors map onto such pieces
without communication:

- a DTensor's local shard (TP, FSDP2's ZeRO-3, both at once, HSDP) is a box of the DTensor's
  global tensor (``compute_local_shape_and_global_offset``);
- ZeRO-1/2 owned rows are a row window of that box; an expert slice a window of dim 0;
- the TP layout differs from the canonical one by the fused-QKV row permutation and, for Hugging
  Face GPT-2, a transposition: a box of the TP layout is one or a few canonical boxes (rows split
  where the permutation is not consecutive).

Replicas (DDP, TP-replicated norms, ZeRO-0, pipeline replicas, a tied weight on two stages) offer
identical boxes; :func:`assign` gives each of the k holders 1/k of the rows, so every element is
written exactly once and the bytes spread evenly over the ranks. Nothing here gathers: a rank only
ever copies (at most) its own local tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.techniques.data_parallel.sharded import shard_rows


@dataclass
class Piece:
    """A rectangular part of one canonical tensor (``key``: ``model/<fqn>``, ``optim/<fqn>/<state>``,
    ``rng/<rank>/<name>``) that this rank can write."""

    key: str
    shape: tuple[int, ...]
    """The canonical tensor's whole shape."""
    offsets: tuple[int, ...]
    data: torch.Tensor
    """The values of the box ``[offsets, offsets + data.shape)``, canonical orientation."""


@dataclass
class View:
    """Where a local tensor of this rank sits in the canonical tensor of parameter/buffer ``name``."""

    name: str
    offsets: tuple[int, ...]
    """Offsets of the local tensor in the TP-layout tensor (``tp_shape``)."""
    tp_shape: tuple[int, ...]
    perm: torch.Tensor | None = None
    """Fused-QKV rows: TP-layout row r is canonical row ``perm[r]`` (of the transposed tensor if
    ``transposed``)."""
    transposed: bool = False
    """Hugging Face Conv1D weights: the TP layout is the canonical tensor transposed."""

    def pieces(self, key: str, data: torch.Tensor) -> list[Piece]:
        """Canonical pieces of ``data`` (the local tensor's values, or a state shaped like it)."""
        data = data.detach()
        if data.ndim == 0:  # a scalar (e.g. the optimizer's step): the same on every holder
            return [Piece(key, (), (), data.clone().cpu())]
        if data.numel() == 0:
            return []
        n = data.shape[0]
        r0 = self.offsets[0]
        if self.perm is None:
            runs = [(0, r0, n)]
        else:
            rows = self.perm[r0:r0 + n].tolist()
            runs, i = [], 0
            while i < n:
                j = i + 1
                while j < n and rows[j] == rows[j - 1] + 1:
                    j += 1
                runs.append((i, rows[i], j - i))
                i = j
        out = []
        for i, row, length in runs:
            sub = data.narrow(0, i, length)
            off = (row, *self.offsets[1:])
            shape = self.tp_shape
            if self.transposed:
                sub, off, shape = sub.t(), tuple(reversed(off)), tuple(reversed(shape))
            out.append(Piece(key, tuple(shape), tuple(off), sub.contiguous().cpu()))
        return out

    def rows(self, start: int, length: int) -> "View":
        """The view of rows ``[start, start + length)`` of this local tensor (ZeRO's owned rows)."""
        if not self.tp_shape:
            return self
        return View(self.name, (self.offsets[0] + start, *self.offsets[1:]), self.tp_shape, self.perm,
                    self.transposed)


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def view_of(model: nn.Module, name: str, t: torch.Tensor, tp: int, expert_rank: tuple[int, int] | None = None
            ) -> View:
    """The :class:`View` of tensor ``t`` (parameter or buffer ``name`` of ``model``, maybe a DTensor)
    under ``tp``-way tensor parallelism; ``expert_rank``: (this rank's expert slice, slices) of an
    expert-parallel parameter."""
    from scaletrain.techniques.tensor_parallel import conv1d_transposed, qkv_row_permutation

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        shape = tuple(t.shape)
    else:
        off, shape = (0,) * t.ndim, tuple(t.shape)
        if expert_rank is not None and expert_rank[1] > 1 and t.ndim:
            r, n = expert_rank
            off = (r * t.shape[0], *off[1:])
            shape = (t.shape[0] * n, *shape[1:])
    perm = qkv_row_permutation(model, name, tp)
    transposed = tp > 1 and conv1d_transposed(model, name) and len(shape) == 2
    return View(name, tuple(int(o) for o in off), shape, perm, transposed)


def canonical_names(model: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """(id(parameter) -> its first name, alias -> first name) for tied parameters."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[n] = first[id(p)]
        else:
            first[id(p)] = n
    return first, aliases


def canonical_groups(model: nn.Module) -> list[list[str]]:
    """The one-process optimizer's parameter groups by name (its numbering: the checkpoint layout)."""
    from scaletrain.techniques.optim.registry import param_groups

    first, _ = canonical_names(model)
    return [[first[id(p)] for p in g["params"]] for g in param_groups(model, None)]


def assign(offers: list[list[tuple[str, tuple[int, ...], tuple[int, ...]]]], rank: int
           ) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[int, int]]:
    """Which rows of its offered boxes ``rank`` writes: ``offers[r]`` lists rank r's (key, offsets,
    sizes); a box offered by k ranks is split by rows, the j-th holder (in rank order) writing row
    chunk j of k. Returns box -> (start row, rows) for this rank's boxes (rows 0: nothing)."""
    holders: dict[tuple, list[int]] = {}
    for r, boxes in enumerate(offers):
        for b in boxes:
            holders.setdefault(b, []).append(r)
    mine = {}
    for b in offers[rank]:
        hs = holders[b]
        j, k = hs.index(rank), len(hs)
        sizes = b[2]
        if not sizes:
            mine[b] = (0, 1 if j == 0 else 0)
            continue
        _, start, length = shard_rows(sizes[0], k, j)
        mine[b] = (start, length)
    return mine


def coverage_errors(index: dict[str, dict[str, Any]]) -> list[str]:
    """Keys whose written pieces do not add up to the whole tensor (each element exactly once)."""
    bad = []
    for key, t in index.items():
        total = sum(math.prod(p["size"]) for p in t["pieces"])
        if total != math.prod(t["shape"]):
            bad.append(f"{key}: {total} of {math.prod(t['shape'])} elements")
    return bad
