"""The trainer's strategy for intra-layer parallelism: tensor (+ sequence), context and expert
parallelism with data parallelism and ZeRO-1/2, on the mesh of :func:`setup_intralayer`.

What one optimizer step does on each rank (``world = dp x cp x tp``, ``dp = dp_rep x ep``):

1. for each of ``accum`` micro-batches: read this data-parallel replica's samples (TP and CP
   ranks of one replica read the same ones; CP keeps its 1/cp of the sequence,
   :meth:`IntraLayer.shard_batch`), forward, loss through :meth:`IntraLayer.loss` (vocabulary-
   parallel cross-entropy under TP, never the full logits; plus the MoE load-balancing loss),
   backward of ``loss / accum``;
2. gradient reduction over the replicas of every local tensor: ``dp x cp`` ranks for the dense
   parameters (TP shards included), ``dp_rep x cp`` for the experts (sum, then / dp·cp; see
   :mod:`~scaletrain.techniques.intralayer`) —
   ``parallel.zero=0``: one flat all-reduce per group (:meth:`IntraLayer.reduce_gradients`);
   ``zero=1``: one flat reduce-scatter per group after the last micro-batch, into the rows this
   rank owns of each local tensor (``torch.chunk`` row layout, :func:`shard_rows`); full local
   gradients stay (ZeRO-1); ``zero=2``: the reduce-scatter after every micro-batch, the full
   local gradients freed and only the owned rows kept (the full ones exist during each backward:
   no per-bucket hooks here);
3. clip by the global norm: each rank's sum of squares weighted by 1 / (how many ranks hold the
   same values), one fp64 all-reduce over all ranks;
4. the optimizer updates *proxies* — plain tensors sharing storage with the owned rows of the
   local tensors (all rows for zero=0), so every scaletrain optimizer runs unchanged and never
   sees a DTensor; with zero>=1 the rows are all-gathered back afterwards (one flat all-gather
   per group).

Traffic. The trainer's ledger only sees ``torch.distributed`` calls; DTensor's functional
collectives and the ring's send/recv are not among them. So the forward/backward runs under a
:class:`~scaletrain.measure.comm.CommCounter` (ledger paused) and its bytes are added to
the ledger (ring algorithms: bytes sent = bytes received per rank) — on the steps the trainer
logs, since the counter sees every op (~6 % of a CPU step here). The prediction
(:meth:`metrics`) is built from the cost faces: ``tp_comm_bytes_per_step``,
``cp_comm_bytes_per_step``, ``ep_comm_bytes_per_step`` (its load-balancing all-reduces taken over
the ``dp x cp`` group they really use), ZeRO's ``comm_bytes_per_step`` per reduction group on the
local parameter counts (``tp_param_elements`` / ``ep_param_elements``) and 8 bytes for the norm.
Predicted per-rank model states: ZeRO's ``model_state_bytes`` on the local counts, optimizer states
by ``optim.state_bytes`` on the owned shards' shapes. Both are exact for fp32; under bf16 autocast
the activation collectives mix bf16 (matmul outputs) and fp32 (LayerNorm, embedding), and the
intra-layer prediction, which counts 4 bytes per activation, is an upper bound.

Checkpoints are the single-process layout both ways: the model through
:meth:`IntraLayer.full_state_dict`, optimizer states gathered (rows, then TP / EP shards, the fused
QKV rows un-permuted) when every state tensor is parameter-shaped (else per-rank, loadable only
with the same layout); a single-process checkpoint is sharded back on load.

Parity with one process needs what the techniques need: no dropout under CP, MoE capacity that
drops nothing (``capacity_factor >= n_experts / top_k``, since capacities are per-rank token
counts) and, for MoE, one micro-batch per step (``train.micro_batch=0``: the load-balancing
statistics are over one forward's tokens).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.errors import ConfigError, UserError
from scaletrain.measure.comm import LEDGER
from scaletrain.techniques.runtime import Strategy
from scaletrain.techniques.intralayer import check_config, local_param_counts, predict
from scaletrain.techniques.data_parallel.sharded import ShardedStrategy, _Entry, check_state_keys, shard_rows

# --------------------------------------------------------------------------- local tensors


@dataclass
class _Local(_Entry):
    """One parameter: this rank's tensor of it (``shape`` is that tensor's), the rows of it this
    rank owns (inherited ``local_shape()`` is their shape: the proxy's), its proxy."""

    name: str = ""
    local: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """This rank's values (a DTensor's local shard, an expert slice, or the parameter itself)."""
    expert: bool = False
    tp_shard_dim: int | None = None
    """The dim a TP ``Shard`` placement splits (None: replicated over TP)."""

    def as_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.rows, self.row_numel)


@dataclass
class _Group:
    """Tensors reduced (and, with ZeRO, sharded) over one process group."""

    group: Any
    size: int
    rank: int
    entries: list[_Local] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    seg: int = 0
    """Values per rank in the flat reduce-scatter / all-gather buffers (rows padded to ``chunk``)."""
    shard_grads: torch.Tensor | None = None
    """ZeRO-2: the reduced owned rows, accumulated over micro-batches (flat, ``seg`` values)."""


class IntraLayerStrategy(Strategy):
    """TP (+SP) / CP / EP x DP with ZeRO 0-2 (see the module docstring)."""

    name = "intralayer"

    def __init__(self, model: nn.Module, il: Any, *, rank: int, world: int, device: torch.device, zero: int,
                 predictions: dict[str, float] | None = None) -> None:
        super().__init__(model, rank, world)
        self.il = il
        self.device = device
        self.stage = zero
        self.data_rank, self.data_world = il.dp_rank, il.dp
        self.predictions = dict(predictions or {})
        self.intra_bytes = 0.0
        self.dense = _Group(il.grad_group, dist.get_world_size(il.grad_group), dist.get_rank(il.grad_group))
        self.experts = _Group(il.expert_grad_group, dist.get_world_size(il.expert_grad_group),
                              dist.get_rank(il.expert_grad_group))
        self.entries = self._build_entries()

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_trainer(cls, trainer: Any) -> "IntraLayerStrategy":
        from scaletrain.techniques.intralayer import setup_intralayer

        cfg, model = trainer.cfg, trainer.model
        p = cfg.parallel
        check_config(cfg, model, trainer.world)
        counts = local_param_counts(model, tp=p.tp, ep=p.ep)
        try:
            il = setup_intralayer(model, tp=p.tp, cp=p.cp, ep=p.ep, sequence_parallel=p.sequence_parallel,
                                  world=trainer.world, device_type=trainer.device.type)
        except ConfigError:
            raise
        except UserError as e:
            raise ConfigError(str(e)) from None
        s = cls(model, il, rank=trainer.rank, world=trainer.world, device=trainer.device, zero=p.zero)
        o = cfg.optim
        if o.name in ("lamb", "lars", "adafactor", "came"):
            trainer.log(f"warning: optim.name={o.name} computes per-tensor statistics; here it sees this rank's "
                        f"shard of each tensor ({s.describe()}), so updates differ from one process")
        hyper = {"momentum": o.momentum} if o.name in ("sgd", "lars") else {}
        s.predictions = predict(model.config, il, stage=p.zero, micro_batch=trainer.micro_batch,
                                accum=trainer.accum, seq=cfg.data.seq_len, counts=counts,
                                grad_clip=o.grad_clip > 0, world=trainer.world,
                                optim=(o.name, [e.local_shape() for e in s.entries], hyper))
        return s

    def _build_entries(self) -> list[_Local]:
        from scaletrain.techniques.experts import expert_params

        experts = {id(p) for p in expert_params(self.model)}
        out = []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            with torch.no_grad():
                local = p.to_local() if isinstance(p, DTensor) else p.data
            if not local.is_contiguous():
                raise RuntimeError(f"parameter {name}: local tensor of shape {tuple(local.shape)} is not contiguous")
            shard_dim = None
            if isinstance(p, DTensor):
                shard_dim = next((pl.dim for pl in p.placements if pl.is_shard()), None)
            g = self.experts if id(p) in experts else self.dense
            n = g.size if self.stage >= 1 else 1
            r = g.rank if self.stage >= 1 else 0
            rows = local.shape[0] if local.ndim else 1
            e = _Local(p, local.shape, *shard_rows(rows, n, r), name=name, local=local, expert=id(p) in experts,
                       tp_shard_dim=shard_dim)
            own = (local if local.ndim else local.view(1)).narrow(0, e.start, e.length)
            e.proxy = nn.Parameter(own, requires_grad=True)  # shares storage with the owned rows
            g.offsets.append(g.seg)
            g.seg += e.chunk * e.row_numel
            g.entries.append(e)
            out.append(e)
        return out

    # the optimizer is built over the proxies (swapped in for the parameters meanwhile), as in ZeRO
    build_optimizer = ShardedStrategy.build_optimizer

    # -- the micro-batch loop ------------------------------------------------------------
    def run_micro_batches(self, trainer: Any, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        from scaletrain.measure.comm import CommCounter

        il, step_loss = self.il, 0.0
        self.intra_bytes = 0.0
        t = trainer.cfg.train  # count on the steps the trainer logs (the counter sees every op)
        count = (trainer.step + 1) % t.log_every == 0 or trainer.step + 1 >= t.steps
        for j in range(trainer.accum):
            last = j == trainer.accum - 1
            x, y = next(it)
            x, y = il.shard_batch(x.to(trainer.device, non_blocking=True), y.to(trainer.device, non_blocking=True))
            counter = CommCounter() if count else contextlib.nullcontext(None)
            with LEDGER.paused(), counter:
                with trainer.autocast(), il.loss_context():
                    logits = self.model(x)
                    loss = il.loss(self.model, logits.float(), y)
                    (loss / trainer.accum).backward()
            calls = len(counter.records) if count else 0
            if calls:
                LEDGER.add("intra_layer", counter.wire_bytes(), calls)
                self.intra_bytes += counter.wire_bytes()
            loss = loss.detach()
            step_loss += float(loss.to_local() if isinstance(loss, DTensor) else loss) / trainer.accum
            self.after_backward(last)
        return step_loss

    def eval_batch(self, trainer: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """Cross-entropy only (as the one-process evaluation); under CP the mean over this rank's
        S/cp tokens, so the sum over the ``dp x cp`` group, divided by its samples, is the mean."""
        il = self.il
        x, y = il.shard_batch(x, y)
        with trainer.autocast(), il.loss_context():
            loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        return float(loss) * len(y), 0, len(y)

    # -- gradients -----------------------------------------------------------------------
    def _local_grad(self, e: _Local) -> torch.Tensor | None:
        g = e.param.grad
        if g is None:
            return None
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):  # not left by our TP plans; be safe
                g = e.param.grad = g.redistribute(placements=e.param.placements)
            with torch.no_grad():
                g = g.to_local()
        return g

    def after_backward(self, last: bool) -> None:
        if self.stage == 0:
            if last:
                self.il.reduce_gradients(self.model)
            return
        if self.stage == 1 and not last:
            return
        for g in (self.dense, self.experts):
            if g.entries:
                self._reduce_scatter(g)

    @torch.no_grad()
    def _reduce_scatter(self, g: _Group) -> None:
        N, D = g.size, self.dense.size  # every gradient is divided by dp x cp (see intralayer.py)
        inp = torch.zeros(N, g.seg, dtype=g.entries[0].local.dtype, device=self.device)
        for e, off in zip(g.entries, g.offsets):
            grad = self._local_grad(e)
            if grad is None:
                continue
            rows = e.as_rows(grad)
            for q in range(N):
                _, s, n = shard_rows(e.rows, N, q)
                torch.mul(rows[s:s + n], 1.0 / D, out=inp[q, off:off + n * e.row_numel].view(n, e.row_numel))
        out = torch.empty(g.seg, dtype=inp.dtype, device=self.device)
        if N > 1:
            dist.reduce_scatter_single(out, inp.view(-1), group=g.group)
        else:
            out.copy_(inp.view(-1))
        if self.stage == 1:  # into the owned rows of the full local gradient (ZeRO-1 keeps it)
            for e, off in zip(g.entries, g.offsets):
                grad = self._local_grad(e)
                if grad is None:
                    grad = torch.zeros_like(e.local)
                    e.param.grad = _like_param(e.param, grad)
                own = e.as_rows(grad)[e.start:e.start + e.length]
                own.copy_(out[off:off + e.length * e.row_numel].view(e.length, e.row_numel))
        else:  # ZeRO-2: keep the owned rows only
            g.shard_grads = out if g.shard_grads is None else g.shard_grads.add_(out)
            for e in g.entries:
                e.param.grad = None

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        for g in (self.dense, self.experts):
            for e, off in zip(g.entries, g.offsets):
                assert e.proxy is not None
                if self.stage == 2:
                    flat = g.shard_grads
                    e.proxy.grad = (flat[off:off + e.length * e.row_numel].view(e.local_shape()) if flat is not None
                                    else torch.zeros_like(e.proxy))
                    continue
                grad = self._local_grad(e)
                if grad is None:
                    e.proxy.grad = torch.zeros_like(e.proxy)
                    continue
                rows = (grad if grad.ndim else grad.view(1)).narrow(0, e.start, e.length)
                e.proxy.grad = rows

    def _replicas(self, e: _Local) -> int:
        """How many ranks hold the same values as this rank's proxy (for the global norm)."""
        tp_rep = self.il.tp if e.tp_shard_dim is None else 1
        if self.stage >= 1:  # owned rows are disjoint within the reduction group
            return tp_rep
        return tp_rep * (self.experts.size if e.expert else self.dense.size)

    @torch.no_grad()
    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Global L2 norm over every parameter element exactly once: one fp64 all-reduce."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for e in self.entries:
            g = e.proxy.grad if e.proxy is not None else None
            if g is None or g.numel() == 0:
                continue
            grads.append(g)
            sq += g.double().pow(2).sum() / self._replicas(e)
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        return norm

    @torch.no_grad()
    def after_step(self) -> None:
        """ZeRO 1/2: all-gather the updated owned rows into every rank's local tensors."""
        if self.stage == 0:
            return
        for g in (self.dense, self.experts):
            if not g.entries or g.size == 1:
                continue
            inp = torch.zeros(g.seg, dtype=g.entries[0].local.dtype, device=self.device)
            for e, off in zip(g.entries, g.offsets):
                inp[off:off + e.length * e.row_numel].copy_(e.proxy.detach().reshape(-1))  # type: ignore[union-attr]
            out = torch.empty(g.size * g.seg, dtype=inp.dtype, device=self.device)
            dist.all_gather_single(out, inp, group=g.group)
            ov = out.view(g.size, g.seg)
            for e, off in zip(g.entries, g.offsets):
                rows = e.as_rows(e.local)
                for q in range(g.size):
                    _, s, n = shard_rows(e.rows, g.size, q)
                    if n:
                        rows[s:s + n].copy_(ov[q, off:off + n * e.row_numel].view(n, e.row_numel))

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.dense.shard_grads = self.experts.shard_grads = None

    def state_tensors(self) -> list[torch.Tensor]:
        """Gradient shards held outside ``param.grad`` (ZeRO-2), for the model-state measurement."""
        return [t for t in (self.dense.shard_grads, self.experts.shard_grads) if t is not None]

    # -- logging ---------------------------------------------------------------------------
    def _all_reduce(self, values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with LEDGER.paused():
            dist.all_reduce(t, group=self.il.grad_group)
        return t.cpu()

    def mean(self, values: list[float]) -> list[float]:
        """Over the ``dp x cp`` ranks (TP ranks already agree): the global batch's mean."""
        return (self._all_reduce(values) / self.dense.size).tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values).tolist()

    def metrics(self) -> dict[str, Any]:
        out = {k: v for k, v in self.predictions.items() if k.startswith("predicted_")}
        out["comm_bytes_intra_layer"] = self.intra_bytes
        return out

    def describe(self) -> str:
        il = self.il
        parts = [f"{k}={v}" for k, v in (("tp", il.tp), ("cp", il.cp), ("ep", il.ep)) if v > 1]
        if il.sequence_parallel:
            parts[0] += " (sequence parallel)"
        return f"{' x '.join(parts)} x dp={il.dp}, zero={self.stage}"

    # -- state -----------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Any]:
        return self.il.full_state_dict(self.model)

    def _tp_perm(self, e: _Local) -> torch.Tensor | None:
        from scaletrain.techniques.tensor_parallel import qkv_row_permutation

        return qkv_row_permutation(self.model, e.name, self.il.tp)

    def _localize(self, e: _Local, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor of a single-process-layout ``full`` value of ``e``'s shape."""
        full = full.to(self.device)
        perm = self._tp_perm(e)
        if perm is not None:
            full = full[perm]
        if e.tp_shard_dim is not None:
            full = full.chunk(self.il.tp, dim=e.tp_shard_dim)[self.il.mesh["tp"].get_local_rank()]
        if e.expert:
            n = full.shape[0] // self.il.ep
            r = self.il.mesh["ep"].get_local_rank()
            full = full[r * n:(r + 1) * n]
        return full

    def _globalize(self, e: _Local, local: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_localize` (collective over the TP or EP group)."""
        def gather(t: torch.Tensor, dim_name: str, dim: int) -> torch.Tensor:
            m = self.il.mesh[dim_name]
            parts = [torch.empty_like(t) for _ in range(m.size())]
            dist.all_gather(parts, t.contiguous(), group=m.get_group())
            return torch.cat(parts, dim=dim)

        if e.tp_shard_dim is not None:
            local = gather(local, "tp", e.tp_shard_dim)
        if e.expert and self.il.ep > 1:
            local = gather(local, "ep", 0)
        perm = self._tp_perm(e)
        if perm is not None:
            local = local[torch.argsort(perm)]
        return local

    def _gather_rows(self, e: _Local, own: torch.Tensor) -> torch.Tensor:
        """All owned rows of the shard group -> this rank's full local tensor."""
        g = self.experts if e.expert else self.dense
        if self.stage == 0 or g.size == 1:
            return own.reshape(e.local.shape).clone()
        pad = own.new_zeros((g.size * e.chunk, e.row_numel))
        mine = pad.view(g.size, e.chunk * e.row_numel)[g.rank, :e.length * e.row_numel]
        mine.copy_(own.reshape(-1))
        dist.all_reduce(pad, group=g.group)  # disjoint rows: the sum is the concatenation
        return pad[:e.rows].reshape(e.local.shape)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(self.model, state)
        with torch.no_grad():
            for e in self.entries:
                local = self._localize(e, state[e.name])
                if tuple(local.shape) != tuple(e.local.shape):
                    raise RuntimeError(f"size mismatch for {e.name}: checkpoint {tuple(state[e.name].shape)} does "
                                       f"not shard to this rank's {tuple(e.local.shape)}")
                e.local.copy_(local)
            for name, b in self.model.named_buffers():
                if name in state:
                    (b.to_local() if isinstance(b, DTensor) else b).copy_(state[name])

    def _proxies(self, optimizer: torch.optim.Optimizer) -> list[_Local]:
        by_proxy = {id(e.proxy): e for e in self.entries}
        return [by_proxy[id(p)] for grp in optimizer.param_groups for p in grp["params"]]

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        sd = optimizer.state_dict()
        entries = self._proxies(optimizer)
        ok = all(not torch.is_tensor(v) or v.ndim == 0 or tuple(v.shape) == entries[i].local_shape()
                 for i, st in sd["state"].items() for v in st.values())
        flags = torch.tensor([0.0 if ok else 1.0])
        with LEDGER.paused():
            dist.all_reduce(flags)
        if float(flags) > 0:  # 8-bit codes, factored moments: per-rank states with their layout
            ranks: list[Any] = [None] * self.world
            dist.all_gather_object(ranks, sd)
            return {"sharded": True, "layout": self.describe(), "ranks": ranks}
        state: dict[int, dict[str, Any]] = {}
        for i in sorted(sd["state"]):
            e = entries[i]
            state[i] = {}
            for k in sorted(sd["state"][i]):
                v = sd["state"][i][k]
                if torch.is_tensor(v) and v.ndim > 0:  # owned rows of a parameter-shaped state
                    v = self._globalize(e, self._gather_rows(e, v)).cpu()
                state[i][k] = v
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if state.get("sharded"):
            if state.get("layout") != self.describe() or len(state.get("ranks", [])) != self.world:
                raise ConfigError(f"the checkpoint's optimizer states are per-rank for {state.get('layout', '?')!r} "
                                  f"(8-bit or factored states cannot be re-sharded); resume with that layout, "
                                  f"not {self.describe()!r}")
            optimizer.load_state_dict(state["ranks"][self.rank])
            return
        entries = self._proxies(optimizer)
        local: dict[Any, dict[str, Any]] = {}
        for i, st in state["state"].items():
            e = entries[int(i)]
            full_shape = tuple(e.param.shape)  # DTensors report the global shape; expert slices do not
            if e.expert:
                full_shape = (full_shape[0] * self.il.ep, *full_shape[1:])
            local[i] = {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim > 0 and tuple(v.shape) == full_shape:
                    v = e.as_rows(self._localize(e, v))[e.start:e.start + e.length].reshape(e.local_shape()).clone()
                elif torch.is_tensor(v) and v.numel() > 1:
                    raise ConfigError(f"optimizer state {k!r} of shape {tuple(v.shape)} cannot be sharded for "
                                      f"{self.describe()}; resume with another optimizer or without parallel.tp/cp/ep")
                local[i][k] = v
        optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})

    def close(self) -> None:
        super().close()
        self.entries = []


def _like_param(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return local
