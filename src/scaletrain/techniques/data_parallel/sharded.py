"""What ZeRO stages 1-3 share (:class:`ShardedStrategy`): the row layout of shards, the optimizer's
*proxies* (plain tensors sharing storage with this rank's rows, so every optimizer runs unchanged on
its shard), global-norm clipping, and consolidation of sharded model / optimizer states into the
single-process layout, so that checkpoints load at any world size and stage (the complaint of
DeepSpeed #2898 / #3810, torchtitan #811)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.techniques.runtime import Strategy


def check_state_keys(model: nn.Module, state: dict[str, Any]) -> None:
    """Raise as ``load_state_dict(strict=True)`` would when ``state``'s keys are not the model's."""
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict: missing keys {missing[:3]}, unexpected keys "
                           f"{unexpected[:3]}")


def shard_rows(rows: int, n: int, r: int) -> tuple[int, int, int]:
    """(chunk, start, length) of rank ``r``'s rows: torch.chunk / DTensor ``Shard(0)`` layout."""
    chunk = max(1, math.ceil(rows / n))
    start = min(rows, r * chunk)
    return chunk, start, max(0, min(chunk, rows - start))



# --------------------------------------------------------------------------- shared by stages 1-3


@dataclass
class _Entry:
    """One parameter tensor: its full shape and this rank's rows, and the optimizer's proxy."""

    param: nn.Parameter
    shape: torch.Size
    chunk: int
    start: int
    length: int
    proxy: nn.Parameter | None = None

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    def local_shape(self) -> tuple[int, ...]:
        return (self.length, *self.shape[1:]) if len(self.shape) else (self.length,)


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _swap_params(model: nn.Module, mapping: dict[int, nn.Parameter]) -> list[tuple[nn.Module, str, Any]]:
    """Register ``mapping[id(p)]`` in place of every parameter p (tied ones stay tied)."""
    undo = []
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in mapping:
                undo.append((mod, name, p))
                mod._parameters[name] = mapping[id(p)]
    return undo


class ShardedStrategy(Strategy):
    """What stages 1-3 share: proxies for the optimizer, global-norm clipping, full state dicts."""

    def __init__(self, model: nn.Module, rank: int, world: int, device: torch.device, *, hsdp: int = 0) -> None:
        super().__init__(model, rank, world)
        self.device = device
        G = hsdp or world
        if world % G:
            raise ConfigError(f"parallel.hsdp={hsdp} must divide the {world} data-parallel ranks")
        self.mesh = None
        self.shard_group: Any = dist.group.WORLD
        self.replicate_group: Any = None
        if G != world:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (world // G, G), mesh_dim_names=("replicate", "shard"))
            self.shard_group = self.mesh.get_group("shard")
            self.replicate_group = self.mesh.get_group("replicate")
        self.N = G
        self.r = dist.get_rank(self.shard_group)
        self.entries: list[_Entry] = []
        self.names: dict[str, int] = {}  # state-dict key of every parameter -> entry index

    def _broadcast_params(self) -> None:
        """Start from rank 0's weights (init is seeded identically, this makes it certain)."""
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t.data, src=0)

    def _index_names(self) -> None:
        ids = {id(e.param): i for i, e in enumerate(self.entries)}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in ids:
                self.names[name] = ids[id(p)]

    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        undo = _swap_params(self.model, {id(e.param): e.proxy for e in self.entries})  # type: ignore[misc]
        try:
            return build(self.model)
        finally:
            for mod, name, p in undo:
                mod._parameters[name] = p

    def make_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        if not enabled:
            return torch.amp.GradScaler(device.type, enabled=False)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, process_group=self.shard_group)  # inf checks agree on all ranks

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Global L2 norm: each element is owned by exactly one rank of the shard group."""
        grads = [e.proxy.grad for e in self.entries if e.proxy is not None and e.proxy.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        nonempty = [g for g in grads if g.numel()]
        if nonempty:  # sum of squares of this rank's rows, then over the shard group
            sq = torch.stack(torch._foreach_norm(nonempty)).float().pow(2).sum()
        dist.all_reduce(sq, group=self.shard_group)
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return float(norm)

    def sharded_optimizer_warning(self, optim_name: str) -> str | None:
        if optim_name in ("lamb", "lars", "adafactor", "came"):
            return (f"optim.name={optim_name} computes per-tensor statistics; under parallel.zero={self.stage} it "
                    f"sees each rank's row shard of a tensor, so updates differ from one process")
        return None

    # -- consolidation (every rank calls; rank 0 keeps the result) -------------------------
    def _local_full(self, e: _Entry) -> torch.Tensor:
        raise NotImplementedError

    def _gather_rows(self, e: _Entry, local: torch.Tensor) -> torch.Tensor:
        """All-gather rank shards (padded to ``chunk`` rows) over the shard group -> full tensor."""
        shape = (e.chunk, *e.shape[1:]) if len(e.shape) else (e.chunk,)
        pad = local.new_zeros(shape)
        pad[: e.length].copy_(local.reshape(e.local_shape()))
        out = local.new_empty((self.N * e.chunk, *shape[1:]))
        dist.all_gather_single(out, pad, group=self.shard_group)
        return out[: e.rows].reshape(e.shape).clone()

    def _slice_rows(self, e: _Entry, full: torch.Tensor) -> torch.Tensor:
        return full.reshape(e.rows, *e.shape[1:])[e.start: e.start + e.length]

    def _load_param(self, e: _Entry, full: torch.Tensor) -> None:
        raise NotImplementedError

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(self.model, state)
        with torch.no_grad():
            for name, i in self.names.items():
                e = self.entries[i]
                full = state[name]
                if tuple(full.shape) != tuple(e.shape):
                    raise RuntimeError(f"size mismatch for {name}: checkpoint {tuple(full.shape)}, model "
                                       f"{tuple(e.shape)}")
                self._load_param(e, full)
            buffers = dict(self.model.named_buffers())
            for name, b in buffers.items():
                if name in state:
                    b.copy_(state[name])

    def model_state_dict(self) -> dict[str, Any]:
        sd = self.model.state_dict()
        full = [self._local_full(e) for e in self.entries]
        for name, i in self.names.items():
            if name in sd:
                sd[name] = full[i]
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Single-process layout when every state tensor is parameter-shaped or a scalar;
        otherwise (8-bit codes, factored moments) the per-rank states with their layout."""
        sd = optimizer.state_dict()
        proxies = [p for g in optimizer.param_groups for p in g["params"]]
        by_proxy = {id(e.proxy): e for e in self.entries}
        meta = {i: {k: (tuple(v.shape), str(v.dtype), _kind(v, by_proxy[id(proxies[i])]))
                    for k, v in st.items() if torch.is_tensor(v)} for i, st in sd["state"].items()}
        metas: list[Any] = [None] * self.N
        dist.all_gather_object(metas, meta, group=self.shard_group)
        keys = sorted({(i, k) for m in metas for i, st in m.items() for k in st})
        kinds = {(i, k): {m[i][k][2] for m in metas if i in m and k in m[i]} for i, k in keys}
        if any(v - {"rows", "scalar"} or len(v) != 1 for v in kinds.values()):
            shards: list[Any] = [None] * self.N
            dist.all_gather_object(shards, sd, group=self.shard_group)
            return {"sharded": True, "dp": self.N, "stage": self.stage, "ranks": shards}
        state: dict[int, dict[str, Any]] = {i: {k: v for k, v in st.items() if not torch.is_tensor(v)}
                                            for i, st in sd["state"].items()}
        for i, k in keys:
            e = by_proxy[id(proxies[i])]
            local = sd["state"].get(i, {}).get(k)
            if kinds[(i, k)] == {"scalar"}:
                if local is None:  # this rank had no state for it: take any rank's value
                    local = torch.tensor(0.0)
                state.setdefault(i, {})[k] = local
                continue
            if local is None:
                dtype = next(getattr(torch, m[i][k][1].split(".")[1]) for m in metas if i in m and k in m[i])
                local = torch.zeros(e.local_shape(), dtype=dtype, device=self.device)
            state.setdefault(i, {})[k] = self._gather_rows(e, local)
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if state.get("sharded"):
            if state["dp"] != self.N or state["stage"] != self.stage:
                raise ConfigError(f"the checkpoint's optimizer states are sharded for parallel.dp={state['dp']} "
                                  f"parallel.zero={state['stage']} (8-bit or factored states cannot be re-sharded); "
                                  f"resume with those values")
            optimizer.load_state_dict(state["ranks"][self.r])
            return
        proxies = [p for g in optimizer.param_groups for p in g["params"]]
        by_proxy = {id(e.proxy): e for e in self.entries}
        local: dict[int, dict[str, Any]] = {}
        for i, st in state["state"].items():
            e = by_proxy[id(proxies[int(i)])]
            local[i] = {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim > 0 and tuple(v.shape) == tuple(e.shape):
                    v = self._slice_rows(e, v).clone()
                elif torch.is_tensor(v) and v.numel() > 1:
                    raise ConfigError(f"optimizer state {k!r} of shape {tuple(v.shape)} cannot be re-sharded for "
                                      f"parallel.zero={self.stage}; resume without ZeRO or with another optimizer")
                local[i][k] = v
        optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})


def _kind(v: torch.Tensor, e: _Entry) -> str:
    if v.ndim == 0 or (v.numel() == 1 and tuple(v.shape) != e.local_shape()):
        return "scalar"
    return "rows" if tuple(v.shape) == e.local_shape() else "other"
