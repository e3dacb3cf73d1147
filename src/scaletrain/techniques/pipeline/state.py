"""The pipeline's state in the single-process layout: :class:`PipelineState`, mixed into
:class:`~.strategy.PipelineStrategy`.

Every rank holds its stages only (their TP shards; with ZeRO-1 the optimizer's owned rows, with ZeRO-3
FSDP2's shards). ``model_state_dict`` gathers every stage's parameters to every rank (TP shards and
FSDP2 shards gathered first); ``optimizer_state_dict`` gathers every stage's optimizer state and
renumbers it as the one-process optimizer (``build(model)``) would. So a pipeline checkpoint resumes at
any ``parallel.pp`` (or on one process), and a one-process checkpoint loads into a pipeline; loading
takes each rank's stages (and shards, rows) back out of the full tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError
from scaletrain.measure.comm import LEDGER


class PipelineState:
    """The state-dict face of :class:`~.strategy.PipelineStrategy` (uses its ``model``, ``runtime``,
    ``world``, ``zero`` and the proxy / parameter entry maps)."""

    model: Any
    runtime: Any
    world: int
    zero: Any
    _proxy_entry: dict[int, Any]
    _param_entry: dict[int, Any]

    def _index_parameters(self) -> None:
        """The one-process optimizer's parameter numbering (build(model) groups parameters by
        scaletrain.techniques.optim.registry.param_groups): the checkpoint layout. Re-run when
        parameters are replaced (ZeRO-3's sharded DTensors)."""
        from scaletrain.techniques.optim.registry import param_groups

        groups = param_groups(self.model, None)
        self._full_index: dict[int, int] = {}
        self._full_group: dict[int, int] = {}
        for g, group in enumerate(groups):
            for p in group["params"]:
                self._full_group[len(self._full_index)] = g
                self._full_index[id(p)] = len(self._full_index)
        self._full_groups = len(groups)
        self._names = {id(p): n for n, p in self.model.named_parameters()}

    def _param_of(self, t: torch.Tensor) -> torch.Tensor:
        """The model parameter an optimizer parameter stands for (itself, or the one a proxy shares rows of)."""
        e = self._proxy_entry.get(id(t)) if self.zero is not None else None
        return e.param if e is not None else t

    def _state_in_param_layout(self, t: torch.Tensor, v: Any) -> Any:
        """A proxy's state tensor as the parameter's (its rows gathered over the data-parallel group, a
        DTensor with the parameter's layout under TP). Collective over the data-parallel group."""
        e = self._proxy_entry.get(id(t)) if self.zero is not None else None
        if e is None or not torch.is_tensor(v) or tuple(v.shape) != e.local_shape():
            return v
        local = self.zero.gather_rows(e, v)  # type: ignore[union-attr]
        from torch.distributed.tensor import DTensor

        if isinstance(e.param, DTensor) and self.zero.stage != 3:  # ZeRO-3: gathered whole already
            return DTensor.from_local(local, e.param.device_mesh, e.param.placements, run_check=False,
                                      shape=e.param.shape, stride=e.param.stride())
        if self.runtime.tp is not None:  # ZeRO-3 over TP shards: whole, in the TP layout (fused QKV rows permuted)
            from .tensor_parallel import unpermute

            return unpermute(self.model, self._names[id(e.param)], local)
        return local

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict[str, Any]:
        """The whole model (single-process layout), current on every rank. Collective."""
        rt = self.runtime  # each rank holds its stages only: one rank per stage shares them (TP: gathered first)
        from .tensor_parallel import gather_model_state

        return gather_model_state(self.model, rt.plan.local_tensors,
                                  (rt.tp is None or rt.tp.tp_rank == 0) and rt.dp_rank == 0, self._whole_experts)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        from .tensor_parallel import load_full_state  # this rank's stages (their TP shards, expert slices)

        load_full_state(self.model, state, self.runtime.plan.local_tensors, self._expert_slice)

    # ------------------------------------------------------------------ expert parallelism (:mod:`.experts`)
    def _ep(self) -> tuple[Any, int, int]:
        plan = self.runtime.plan
        return plan.group(plan.ep_ranks), plan.ep, plan.ep_ranks.index(plan.global_rank(plan.pp_rank))

    def _whole_experts(self, t: torch.Tensor) -> torch.Tensor:
        """An expert parameter's (or its state's) slice gathered over the EP group; else ``t``.
        Collective over the EP group (its members hold the same stages: same calls, same order)."""
        from scaletrain.techniques.experts import is_expert_param

        if self.runtime.plan.ep <= 1 or not is_expert_param(t):
            return t
        from .experts import gather_experts

        group, size, _ = self._ep()
        return gather_experts(t, group, size)

    def _whole_expert_state(self, p: torch.Tensor, v: Any) -> Any:
        """A parameter-shaped optimizer state of expert parameter ``p`` gathered over the EP group
        (scalars such as Adam's step stay). Collective over the EP group."""
        if not torch.is_tensor(v) or tuple(v.shape) != tuple(p.shape):
            return v
        from .experts import gather_experts

        group, size, _ = self._ep()
        return gather_experts(v, group, size)

    def _expert_slice(self, t: torch.Tensor, full: Any) -> Any:
        """This EP rank's experts of a whole expert tensor (parameter or parameter-shaped state)."""
        from scaletrain.techniques.experts import is_expert_param

        if self.runtime.plan.ep <= 1 or not is_expert_param(t) or not torch.is_tensor(full) or full.dim() == 0:
            return full
        from .experts import slice_experts

        _, size, rank = self._ep()
        return slice_experts(full, rank, size) if full.shape[0] == t.shape[0] * size else full

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every stage's states renumbered as the one-process optimizer's, on every rank. Collective."""
        rt = self.runtime
        mine: dict[str, Any] | None = None
        sd = optimizer.state_dict()
        local = [p for g in optimizer.param_groups for p in g["params"]]
        if self.zero is not None:  # ZeRO-1: each rank's rows of every state, gathered (every dp rank takes part)
            sd = {"state": {i: {k: self._state_in_param_layout(local[i], v) for k, v in st.items()}
                            for i, st in sorted(sd["state"].items())}, "param_groups": sd["param_groups"]}
            local = [self._param_of(p) for p in local]
        if rt.plan.ep > 1:  # expert states: each EP rank's slice, gathered (every EP rank takes part)
            from scaletrain.techniques.experts import is_expert_param

            sd = {"state": {i: {k: self._whole_expert_state(local[i], v) if is_expert_param(local[i]) else v
                                for k, v in st.items()}
                            for i, st in sorted(sd["state"].items())}, "param_groups": sd["param_groups"]}
        if rt.dp_rank == 0:  # replicas hold equal states: one copy per stage suffices
            from .tensor_parallel import gather_full

            # TP: DTensor states gathered to full tensors (collective over the TP group)
            state = {self._full_index[id(local[i])]: {k: gather_full(self.model, self._names[id(local[i])], v).cpu()
                                                      if torch.is_tensor(v) else v for k, v in st.items()}
                     for i, st in sd["state"].items()}
            hyper = {self._full_group[self._full_index[id(self._param_of(g["params"][0]))]]:
                     {k: v for k, v in gsd.items() if k != "params"}
                     for g, gsd in zip(optimizer.param_groups, sd["param_groups"]) if g["params"]}
            mine = {"state": state, "hyper": hyper} if rt.tp is None or rt.tp.tp_rank == 0 else None
        parts: list[Any] = [None] * self.world
        with LEDGER.paused():
            dist.all_gather_object(parts, mine)
        state, hyper = {}, {}
        for part in parts:
            if part is not None:
                state.update(part["state"])
                hyper.update(part["hyper"])
        members: list[list[int]] = [[] for _ in range(self._full_groups)]
        for i in range(len(self._full_index)):
            members[self._full_group[i]].append(i)
        return {"state": dict(sorted(state.items())),
                "param_groups": [{**hyper[g], "params": members[g]} for g in range(self._full_groups)]}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a single-process-layout optimizer state (from a pipeline run at any pp, or one process)."""
        if state.get("sharded"):
            super().load_optimizer_state_dict(optimizer, state)  # raises its one-line ConfigError
        groups = state["param_groups"]
        n = sum(len(g["params"]) for g in groups)
        if n != len(self._full_index):
            raise ConfigError(f"the checkpoint's optimizer has {n} parameters, this model {len(self._full_index)}; "
                              f"resume with the same model and optimizer")
        group_of = {i: g for g in groups for i in g["params"]}
        sd = optimizer.state_dict()
        new_state: dict[int, Any] = {}
        new_groups = []
        for g, gsd in zip(optimizer.param_groups, sd["param_groups"]):
            params = [self._param_of(p) for p in g["params"]]
            full = [self._full_index[id(p)] for p in params]
            src = group_of[full[0]] if full else {}
            new_groups.append({**{k: v for k, v in src.items() if k != "params"}, "params": gsd["params"]})
            for li, fi, p in zip(gsd["params"], full, params):
                if fi in state["state"]:  # TP: full parameter-shaped states sharded as the parameter
                    new_state[li] = {k: self._owned_rows(p, self._shard_state(p, self._expert_slice(p, v)))
                                     for k, v in state["state"][fi].items()}
        optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})

    def _owned_rows(self, p: torch.Tensor, v: Any) -> Any:
        """ZeRO-1: this rank's rows of a (TP-local) parameter-shaped state."""
        e = self._param_entry.get(id(p)) if self.zero is not None else None
        if e is None or not torch.is_tensor(v):
            return v
        v = v.to_local() if hasattr(v, "to_local") else v
        if tuple(v.shape) != tuple(e.local.shape):
            return v
        return self.zero.owned_rows(e, v.to(e.local.device)).clone()  # type: ignore[union-attr]

    def _shard_state(self, p: torch.Tensor, v: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(p, DTensor) or not torch.is_tensor(v) or tuple(v.shape) != tuple(p.shape):
            return v
        from .tensor_parallel import shard_full

        return shard_full(self.model, self._names[id(p)], p, v)
