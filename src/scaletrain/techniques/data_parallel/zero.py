"""Data-parallel gradient reduction and ZeRO stages 1-2 over *local* tensors: :class:`GradSync`.

One implementation serves every runtime that is not plain torch DDP or FSDP2: a whole model,
a tensor/context/expert-parallel shard of one (DTensor parameters: their local shards), a
pipeline stage. What it does, per group of parameters reduced over the same ranks (dense ones
over ``dp x cp``, experts over ``dp/ep x cp``):

- stage 0: gradients all-reduced and divided by the group's ``divisor`` (the data-parallel sample
  shares), every rank keeping the whole gradient;
- stage 1 (Rajbhandari et al. SC20): one reduce-scatter per optimizer step (after accumulation)
  into the rows this rank owns of each local tensor (``torch.chunk`` / DTensor ``Shard(0)``
  layout: :func:`.sharded.shard_rows`); full local gradients stay; optimizer states only for the
  owned rows; after the step the updated rows are all-gathered back;
- stage 2: the reduce-scatter after every micro-batch, full gradients freed as soon as their
  bucket is sent, only the owned rows kept.

Buckets (``bucket_mb``, Li et al. VLDB 2020) are filled in reverse registration order (about
the order backward produces gradients) and, with ``hooks=True``, launched asynchronously from
post-accumulate-grad hooks as soon as their last gradient is ready, so communication overlaps
the rest of the backward; ``expect_accumulations`` handles parameters whose gradient is
accumulated several times per micro-batch (a tied weight under an op-by-op remat schedule). With
``hooks=False`` (pipelines: a stage's micro-batches interleave) the caller runs :meth:`reduce`.
HSDP (``replicate`` groups): shards are reduce-scattered in the shard group, then all-reduced over
the replicas.

The optimizer sees *proxies* — plain tensors sharing storage with the owned rows (all rows at
stage 0) — so every scaletrain optimizer runs unchanged, 8-bit states included, and never sees
a DTensor. With ``param_dtype`` (16-bit parameters, ZeRO's mixed precision), the proxies are fp32
masters of the owned rows and the parameters are rounded from them after the step.

Clipping: the global L2 norm over every element exactly once — each rank's sum of squares of its
proxies' gradients divided by how many ranks hold the same values (``replicas``: TP-replicated
tensors, stage-0 replication, HSDP replicas, a tied weight's other holders), one fp64 all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.errors import ConfigError
from scaletrain.measure.comm import ledger_owned
from scaletrain.techniques.data_parallel.sharded import shard_rows


def squared_norm(g: torch.Tensor) -> torch.Tensor:
    """Σ g² as a float64 scalar, reduced in the tensor's dtype (fp32 for 16-bit ones) without a
    parameter-sized copy: ``g.double().pow(2)`` would allocate 4x an fp32 gradient's bytes at the
    clip, the step's peak for a stage whose largest tensor is big (measured: a MoE stage's expert
    weights, +16 % over the cost face's peak)."""
    dt = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None
    return torch.linalg.vector_norm(g, dtype=dt).double() ** 2


@dataclass
class SyncGroup:
    """Ranks a set of parameters' gradients are reduced over."""

    group: Any
    """Process group of the reduction (ZeRO shards over it); None = a group of one."""
    divisor: int
    """Gradients are divided by this: the data-parallel sample shares (dp x cp for dense ones)."""
    replicate: Any = None
    """HSDP: the group the shard-group results are all-reduced over (None: no replicas)."""

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replicate) if self.replicate is not None else 1


@dataclass
class Entry:
    """One parameter: its local values, the rows this rank owns of them, and the optimizer's proxy."""

    name: str
    param: nn.Parameter
    local: torch.Tensor
    """This rank's values (a DTensor's local shard, or the parameter's data), sharing storage."""
    group: str
    chunk: int
    start: int
    length: int
    replicas: int = 1
    """Other ranks holding the same values outside the reduction (TP replication, tied copies)."""
    proxy: nn.Parameter | None = None

    @property
    def shape(self) -> torch.Size:
        return self.local.shape

    @property
    def rows(self) -> int:
        return self.local.shape[0] if self.local.ndim else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.local.shape[1:]) if self.local.ndim > 1 else 1

    def local_shape(self) -> tuple[int, ...]:
        """Shape of the owned rows (the proxy's)."""
        return (self.length, *self.local.shape[1:]) if self.local.ndim else (self.length,)

    def as_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.rows, self.row_numel)


@dataclass
class _Bucket:
    group: str
    entries: list[int]
    offsets: list[int]
    seg: int
    """Values per rank (rows padded to ``chunk``) — the whole bucket at stage 0."""
    ready: int = 0
    launched: bool = False


def bucket_chunks(sizes: list[int], cap: float) -> list[list[int]]:
    """Indices (into ``sizes``, bytes of each tensor in registration order) of every bucket: filled in
    reverse order — about the order backward produces gradients — up to ``cap`` bytes each."""
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i in reversed(range(len(sizes))):
        if current and size + sizes[i] > cap:
            chunks.append(current)
            current, size = [], 0.0
        current.append(i)
        size += sizes[i]
    if current:
        chunks.append(current)
    return chunks


def bucket_segments(shapes: list[tuple[int, int, int]], n: int, cap: float) -> list[int]:
    """Values per rank of each ZeRO-1/2 bucket (rows padded to whole chunks, as :class:`GradSync` lays
    them out) for tensors given as (rows, elements per row, bytes per element) in registration order."""
    out = []
    for c in bucket_chunks([r * k * e for r, k, e in shapes], cap):
        out.append(sum(shard_rows(shapes[i][0], n, 0)[0] * shapes[i][1] for i in c))
    return out


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing storage), other tensors as they are."""
    return t.to_local() if isinstance(t, DTensor) else t


class GradSync:
    """ZeRO stage 0-2 over the local tensors of ``params`` (see the module docstring).

    ``params``: (name, parameter, group key, replicas) for every trainable parameter this rank
    holds, each once. ``groups``: group key -> :class:`SyncGroup`.
    """

    def __init__(self, params: Iterable[tuple[str, nn.Parameter, str, int]], groups: dict[str, SyncGroup], *,
                 stage: int, device: torch.device, bucket_mb: float = 25.0, hooks: bool = True,
                 param_dtype: torch.dtype | None = None, offload: bool = False) -> None:
        if stage not in (0, 1, 2):
            raise ConfigError(f"GradSync runs parallel.zero=0, 1 or 2, not {stage}")
        self.stage, self.device, self.groups = stage, device, groups
        self.param_dtype = param_dtype
        self.offload = offload
        """ZeRO-Offload (Ren et al. 2021): fp32 masters of the owned rows and the optimizer states on the
        host; each step copies the owned gradient rows device -> host and the updated rows host ->
        device (counted in :attr:`moved`)."""
        self.masters = param_dtype is not None or offload
        """The proxies are separate fp32 copies (16-bit parameters, or masters on the host)."""
        self.host = torch.device("cpu")
        self.moved = {"d2h": 0, "h2d": 0}
        """Bytes copied between device and host in the last step (offload)."""
        self.entries: list[Entry] = []
        for name, p, key, reps in params:
            with torch.no_grad():
                local = local_of(p.data if not isinstance(p, DTensor) else p)
            if not local.is_contiguous():
                if isinstance(p, DTensor):
                    raise RuntimeError(f"parameter {name}: local shard {tuple(local.shape)} is not contiguous")
                p.data = p.data.contiguous()
                local = p.data
            g = groups[key]
            n, r = (g.size, g.rank) if stage >= 1 else (1, 0)
            e = Entry(name, p, local, key, *shard_rows(local.shape[0] if local.ndim else 1, n, r), replicas=reps)
            own = (local if local.ndim else local.view(1)).narrow(0, e.start, e.length)
            if self.masters:
                own = own.to(self.host if offload else own.device, torch.float32, copy=True)  # fp32 master rows
                if param_dtype is not None:
                    p.data = p.data.to(param_dtype)
                    e.local = p.data
            e.proxy = nn.Parameter(own, requires_grad=True)
            self.entries.append(e)
        self.buckets = self._make_buckets(bucket_mb * 2**20)
        self._where = {id(self.entries[i].param): b for b in self.buckets for i in b.entries}
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.entries)
        self._sync = True
        self._expected: dict[int, int] = {}
        self._fired: dict[int, int] = {}
        self._inflight: list[tuple[_Bucket, torch.Tensor, torch.Tensor, Any]] = []
        self._hooks = ([e.param.register_post_accumulate_grad_hook(self._on_grad) for e in self.entries]
                       if hooks else [])

    # -------------------------------------------------------------- buckets
    def _make_buckets(self, cap: float) -> list[_Bucket]:
        out: list[_Bucket] = []
        for key in self.groups:
            idx = [i for i, e in enumerate(self.entries) if e.group == key]
            sizes = [self.entries[i].local.numel() * self.entries[i].local.element_size() for i in idx]
            for c in bucket_chunks(sizes, cap):
                c = [idx[j] for j in c]
                offs, seg = [], 0
                for i in c:
                    offs.append(seg)
                    e = self.entries[i]
                    seg += e.chunk * e.row_numel if self.stage >= 1 else e.local.numel()
                out.append(_Bucket(key, c, offs, seg))
        return out

    def expect_accumulations(self, counts: dict[int, int]) -> None:
        """``id(param) -> gradient accumulations per micro-batch`` where it is not 1 (a tied weight
        under an op-by-op schedule); its bucket launches after the last one."""
        self._expected = {k: v for k, v in counts.items() if v != 1}

    # -------------------------------------------------------------- backward
    def begin_micro_batch(self, last: bool) -> None:
        """Stage 0 and 1 reduce after the last micro-batch of a step, stage 2 after every one."""
        self._sync = self.stage == 2 or last
        self._fired.clear()
        for b in self.buckets:
            b.ready, b.launched = 0, False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        need = self._expected.get(id(p), 1)
        if need != 1:
            self._fired[id(p)] = self._fired.get(id(p), 0) + 1
            if self._fired[id(p)] < need:
                return
        b = self._where[id(p)]
        b.ready += 1
        if b.ready == len(b.entries):
            self._launch(b)

    def end_micro_batch(self, last: bool) -> None:
        """Launch what the hooks did not (unused parameters, or no hooks), in a fixed order, and wait."""
        if not self._sync:
            return
        self.reduce()

    def reduce(self) -> None:
        """Reduce every bucket not yet launched (fixed order on every rank) and wait for all."""
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        self._drain(block=True)
        for b in self.buckets:  # ready for the next reduction (pipelines call reduce() once a step)
            b.ready, b.launched = 0, False

    def local_grad(self, e: Entry) -> torch.Tensor | None:
        g = e.param.grad
        if g is None:
            return None
        if isinstance(g, DTensor):
            if g.placements != e.param.placements:  # e.g. a Partial or Replicate grad of a sharded weight
                g = e.param.grad = g.redistribute(placements=e.param.placements)
            with torch.no_grad():
                g = g.to_local()
        return g

    def _launch(self, b: _Bucket) -> None:
        with ledger_owned():  # counted by the ledger even inside a paused (model-parallel) forward/backward
            self._launch_bucket(b)

    @torch.no_grad()
    def _launch_bucket(self, b: _Bucket) -> None:
        g = self.groups[b.group]
        dtype = self.entries[b.entries[0]].local.dtype
        scale = 1.0 / g.divisor  # gloo has no AVG: the division is fused into the copy
        if self.stage == 0:
            buf = torch.empty(b.seg, dtype=dtype, device=self.device)
            for i, off in zip(b.entries, b.offsets):
                e = self.entries[i]
                dst = buf[off: off + e.local.numel()]
                grad = self.local_grad(e)
                dst.zero_() if grad is None else torch.mul(grad.reshape(-1), scale, out=dst)
            work = dist.all_reduce(buf, group=g.group, async_op=True) if g.size > 1 else None
            self._inflight.append((b, buf, buf, work))
            b.launched = True
            return
        N = g.size
        inp = torch.empty(N * b.seg, dtype=dtype, device=self.device)
        view = inp.view(N, b.seg)
        for i, off in zip(b.entries, b.offsets):
            e = self.entries[i]
            dst = view[:, off: off + e.chunk * e.row_numel]
            grad = self.local_grad(e)
            if grad is None:
                dst.zero_()
                continue
            g2 = e.as_rows(grad)
            if e.rows == N * e.chunk:
                torch.mul(g2.view(N, -1), scale, out=dst)
            else:
                for q in range(N):
                    _, s, n = shard_rows(e.rows, N, q)
                    d = dst[q].view(e.chunk, e.row_numel)
                    torch.mul(g2[s: s + n], scale, out=d[:n])
                    d[n:].zero_()
            if self.stage == 2:
                e.param.grad = None  # ZeRO-2: the full gradient lives only until its bucket is sent
        out = torch.empty(b.seg, dtype=dtype, device=self.device)
        work = dist.reduce_scatter_single(out, inp, group=g.group, async_op=True) if N > 1 else None
        if N == 1:
            out.copy_(inp)
        self._inflight.append((b, inp, out, work))
        b.launched = True
        if g.replicate is None:  # (HSDP's replica all-reduce blocks: only after backward)
            self._drain(block=False)

    def _drain(self, block: bool) -> None:
        """Take the results of finished buckets, oldest first (all of them if ``block``)."""
        while self._inflight and (block or self._inflight[0][3] is None or self._inflight[0][3].is_completed()):
            b, _, out, work = self._inflight.pop(0)
            if work is not None:
                work.wait()
            g = self.groups[b.group]
            if g.replicate is not None:  # HSDP: average the shard across replicas
                with ledger_owned():
                    dist.all_reduce(out, group=g.replicate)
            for i, off in zip(b.entries, b.offsets):
                e = self.entries[i]
                if self.stage == 0:
                    full = self.local_grad(e)
                    red = out[off: off + e.local.numel()].view(e.local.shape)
                    if full is None:
                        e.param.grad = _like_param(e.param, red.clone())
                    else:
                        full.copy_(red)
                    continue
                own = out[off: off + e.length * e.row_numel].view(e.local_shape())
                if self.stage == 1:  # in place into the owned rows of the full gradient
                    full = self.local_grad(e)
                    if full is None:
                        full = torch.zeros_like(e.local)
                        e.param.grad = _like_param(e.param, full)
                    rows = (full if full.ndim else full.view(1)).narrow(0, e.start, e.length)
                    rows.copy_(own)
                    self.grad_shards[i] = rows
                elif self.grad_shards[i] is None:
                    self.grad_shards[i] = own  # a view of the bucket's output: no copy
                else:
                    self.grad_shards[i].add_(own)  # type: ignore[union-attr]

    # -------------------------------------------------------------- the step
    def prepare_step(self) -> None:
        """Give every proxy its gradient (owned rows; fp32 with 16-bit parameters; on the host with offload)."""
        self.moved = {"d2h": 0, "h2d": 0}
        for i, e in enumerate(self.entries):
            assert e.proxy is not None
            if self.stage >= 1:
                g = self.grad_shards[i]
            else:
                g = self.local_grad(e)
            if g is None:
                g = torch.zeros(e.local_shape(), dtype=e.proxy.dtype, device=self.device)
            elif self.stage == 0:
                g = g if g.ndim else g.view(1)
            if self.offload:  # the owned gradient rows to the host, where the optimizer runs
                self.moved["d2h"] += g.numel() * g.element_size()
                e.proxy.grad = g.to(self.host, e.proxy.dtype, copy=True)
                continue
            e.proxy.grad = g if g.dtype == e.proxy.dtype else g.to(e.proxy.dtype)

    @torch.no_grad()
    def square_norm(self) -> torch.Tensor:
        """This rank's share of the squared global norm (fp64; sum it over every rank)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for e in self.entries:
            g = e.proxy.grad if e.proxy is not None else None
            if g is None or g.numel() == 0:
                continue
            copies = e.replicas * (self.groups[e.group].size if self.stage == 0 else self.groups[e.group].replicas)
            sq += squared_norm(g) / copies
        return sq

    def scale_grads(self, coef: float) -> None:
        grads = [e.proxy.grad for e in self.entries if e.proxy is not None and e.proxy.grad is not None]
        if grads and coef < 1.0:
            torch._foreach_mul_(grads, coef)

    @torch.no_grad()
    def after_step(self) -> None:
        """Stage 1/2: all-gather the updated rows into every rank's local tensors; 16-bit
        parameters: round the masters into them."""
        if self.stage == 0:
            if self.masters:
                for e in self.entries:
                    self._count_upload(e)
                    (e.local if e.local.ndim else e.local.view(1)).copy_(e.proxy.detach())  # type: ignore[union-attr]
            return
        pending = []
        for b in self.buckets:
            g = self.groups[b.group]
            dt = self.entries[b.entries[0]].local.dtype
            inp = torch.zeros(b.seg, dtype=dt, device=self.device)
            for i, off in zip(b.entries, b.offsets):
                e = self.entries[i]
                self._count_upload(e)
                inp[off: off + e.length * e.row_numel].copy_(e.proxy.detach().reshape(-1))  # type: ignore[union-attr]
            out = torch.empty(g.size * b.seg, dtype=dt, device=self.device)
            if g.size > 1:
                pending.append((b, out, dist.all_gather_single(out, inp, group=g.group, async_op=True)))
            else:
                out.copy_(inp)
                pending.append((b, out, None))
        for b, out, work in pending:
            if work is not None:
                work.wait()
            N = self.groups[b.group].size
            ov = out.view(N, b.seg)
            for i, off in zip(b.entries, b.offsets):
                e = self.entries[i]
                full = e.as_rows(e.local)
                if e.rows == N * e.chunk:  # even split: one strided copy
                    full.view(N, -1).copy_(ov[:, off: off + e.chunk * e.row_numel])
                    continue
                for q in range(N):
                    _, s, n = shard_rows(e.rows, N, q)
                    if n:
                        full[s: s + n].copy_(ov[q, off: off + n * e.row_numel].view(n, e.row_numel))

    def _count_upload(self, e: Entry) -> None:
        """Offload: the updated owned rows go host -> device (in the parameter's dtype)."""
        if self.offload:
            self.moved["h2d"] += e.length * e.row_numel * e.local.element_size()

    def zero_grad(self) -> None:
        for e in self.entries:
            e.param.grad = None
            if e.proxy is not None:
                e.proxy.grad = None
        self.grad_shards = [None] * len(self.entries)

    def state_tensors(self) -> list[torch.Tensor]:
        """Gradient shards held outside ``param.grad`` (stage 2), for the model-state measurement."""
        return [g for g in self.grad_shards if g is not None]

    # -------------------------------------------------------------- optimizer and state
    def proxies_for(self, module_params: Iterable[nn.Parameter]) -> dict[int, nn.Parameter]:
        """``id(param) -> proxy`` for swapping the proxies in while the optimizer is built."""
        wanted = {id(p) for p in module_params}
        return {id(e.param): e.proxy for e in self.entries if id(e.param) in wanted}  # type: ignore[misc]

    def gather_rows(self, e: Entry, own: torch.Tensor) -> torch.Tensor:
        """This rank's full local tensor from the owned rows of the shard group (collective)."""
        g = self.groups[e.group]
        own = own.to(self.device)  # host masters / states: gathered on the device
        if self.stage == 0 or g.size == 1:
            return own.reshape(e.local.shape).clone()
        pad = own.new_zeros((g.size, e.chunk * e.row_numel))
        pad[g.rank, : e.length * e.row_numel].copy_(own.reshape(-1))
        out = torch.empty_like(pad)
        dist.all_gather_into_tensor(out.view(-1), pad[g.rank].contiguous(), group=g.group)
        return out.view(g.size * e.chunk, e.row_numel)[: e.rows].reshape(e.local.shape)

    def owned_rows(self, e: Entry, local_full: torch.Tensor) -> torch.Tensor:
        """The rows of a local-shaped tensor this rank owns."""
        return e.as_rows(local_full)[e.start: e.start + e.length].reshape(e.local_shape())

    def master_local(self, e: Entry) -> torch.Tensor:
        """The parameter's current local values at full precision (masters gathered with 16-bit params)."""
        if not self.masters:
            return e.local.detach().clone()
        return self.gather_rows(e, e.proxy.detach().to(self.device))  # type: ignore[union-attr]

    def load_local(self, e: Entry, value: torch.Tensor) -> None:
        """Set the parameter's local values (and the master rows) from a local-shaped tensor."""
        with torch.no_grad():
            e.local.copy_(value.reshape(e.local.shape))
            if self.masters:
                e.proxy.data.copy_(self.owned_rows(e, value.float()).to(e.proxy.device))  # type: ignore[union-attr]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _like_param(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``param`` from local values (a DTensor with the parameter's layout if it is one)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return local


def swap_in_proxies(model: nn.Module, mapping: dict[int, nn.Parameter], build: Callable[[nn.Module], Any]) -> Any:
    """Call ``build(model)`` with every parameter p registered as ``mapping[id(p)]`` meanwhile (tied
    ones stay tied), so an optimizer is built over proxies in the one-process parameter order."""
    undo = []
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in mapping:
                undo.append((mod, name, p))
                mod._parameters[name] = mapping[id(p)]
    try:
        return build(model)
    finally:
        for mod, name, p in undo:
            mod._parameters[name] = p
