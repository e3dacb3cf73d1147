"""The runtime of every plan without pipeline stages on several processes: :class:`MeshRuntime`.

Every process runs the whole model's step on its part of the data (and of the model, under
tensor / context / expert parallelism). What one optimizer step does on each rank
(``world = dp x cp x tp``):

1. for each of ``accum`` micro-batches: this data-parallel replica's samples (TP and CP ranks of
   one replica read the same ones; CP keeps its 1/cp of the sequence), forward through the
   stack's forward module (the model, or its blocks under nested activation checkpoints), the
   loss (vocabulary-parallel cross-entropy under TP — never the full logits — plus the MoE
   load-balancing loss), backward of ``loss / accum``;
2. gradient reduction and ZeRO-1/2 sharding by :class:`~.data_parallel.zero.GradSync` over the
   replicas of every local tensor (``dp x cp`` ranks for dense parameters, TP shards included;
   ``dp/ep x cp`` for experts), bucketed and overlapped with the backward;
3. clipping by the global norm (every element once: one fp64 all-reduce);
4. the optimizer on proxies of the owned rows (never a DTensor); ZeRO-1/2 all-gather the rows back.

Traffic. The ledger sees ``torch.distributed`` calls; DTensor's functional collectives and the ring's
send/recv are counted by a :class:`~scaletrain.measure.comm.CommCounter` on the steps the trainer
logs and added to it (``comm_bytes_intra_layer``). Predictions (``predicted_*``) come from the cost
faces (:mod:`scaletrain.techniques.cost`).

Checkpoints are the single-process layout both ways (owned rows gathered over the data-parallel
group, then TP / EP shards gathered with the fused-QKV rows un-permuted); optimizer states that are
not parameter-shaped (8-bit codes, factored moments) are kept per rank, loadable only with the same
layout.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.errors import ConfigError
from scaletrain.measure.comm import LEDGER
from scaletrain.models.adapters.base import logits_of
from scaletrain.techniques.data_parallel.zero import Entry, GradSync, swap_in_proxies
from scaletrain.techniques.mesh import ModelParallel
from scaletrain.techniques.runtime import RunContext, Strategy


class MeshRuntime(Strategy):
    """Model parallelism on a mesh + data parallelism with ZeRO 0-2 (see the module docstring)."""

    name = "mesh"

    def __init__(self, model: nn.Module, mp: ModelParallel, ctx: RunContext, *, zero: int, bucket_mb: float,
                 forward_module: nn.Module | None = None, param_dtype: torch.dtype | None = None,
                 predictions: dict[str, float] | None = None, offload: bool = False, fsdp_group: str = "auto") -> None:
        super().__init__(model, ctx.rank, ctx.world)
        self.mp, self.ctx, self.stage = mp, ctx, zero
        self.device = ctx.device
        self.data_rank, self.data_world = mp.dp_rank, mp.dp
        self.forward_module = forward_module if forward_module is not None else model
        self.predictions = dict(predictions or {})
        self.intra_bytes = 0.0
        from scaletrain.techniques.experts import is_expert_param

        self.fsdp = zero == 3
        if self.fsdp:  # ZeRO-3: FSDP2 over the data-parallel dims, rooted at what runs the forward
            from scaletrain.techniques.data_parallel.fsdp import FSDPSync

            self.sync: Any = FSDPSync(model, self.forward_module, mp.fsdp_mesh(), param_dtype=param_dtype,
                                      tp_replicas=mp.replicas, group=fsdp_group, accum=ctx.accum,
                                      keep_last=mp.tp == 1 and mp.ep == 1)
        else:
            groups = mp.sync_groups()
            params = []
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                key = "expert" if is_expert_param(p) and "expert" in groups else "dense"
                params.append((name, p, key, mp.replicas(p)))
            self.sync = GradSync(params, groups, stage=zero, device=ctx.device, bucket_mb=bucket_mb,
                                 param_dtype=param_dtype, offload=offload)
        self.entries: list[Any] = self.sync.entries
        self._fsdp_groups: set[str] = set()
        """Names of the process groups FSDP communicates on (its traffic is data-parallel, not TP's)."""
        if self.fsdp:
            m = mp.fsdp_mesh()
            self._fsdp_groups = {str(m.get_group(i).group_name) for i in range(m.ndim)}
        self._by_name = {e.name: e for e in self.entries}
        self._by_proxy = {id(e.proxy): e for e in self.entries}

    # -- construction --------------------------------------------------------------------
    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        return swap_in_proxies(self.model, self.sync.proxies_for(self.model.parameters()), build)

    def make_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        if not enabled:
            return torch.amp.GradScaler(device.type, enabled=False)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # inf/NaN found on any rank skips the step on every rank (found_inf all-reduced over the world)
        scaler = ShardedGradScaler(device.type, process_group=dist.group.WORLD)
        scaler.scale(torch.ones((), device=device))  # its scale exists on ranks that never scale a loss
        return scaler

    def expect_accumulations(self, counts: dict[int, int]) -> None:
        self.sync.expect_accumulations(counts)

    # -- the micro-batch loop ------------------------------------------------------------
    def run_micro_batches(self, ctx: RunContext, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        from scaletrain.measure.comm import CommCounter

        mp, step_loss = self.mp, 0.0
        self.intra_bytes = 0.0
        count = ctx.counts_traffic(ctx.step) and (mp.tp > 1 or mp.cp > 1 or mp.ep > 1)
        assert ctx.forward_backward is not None
        for j in range(ctx.accum):
            last = j == ctx.accum - 1
            x, y = next(it)
            x, y = mp.shard_batch(x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True))
            counter = CommCounter() if count else contextlib.nullcontext(None)
            self.sync.begin_micro_batch(last)
            # counting op by op: the counter sees everything, the ledger pauses (no double count); otherwise
            # the ledger sees what torch.distributed calls (FSDP2's collectives, MoE's all-to-alls)
            with LEDGER.paused() if count else contextlib.nullcontext(), counter:
                loss = ctx.forward_backward(x, y, 1.0 / ctx.accum)
            if count and counter.records:  # FSDP's collectives (on its data-parallel groups) are not intra-layer
                fsdp = self._fsdp_groups
                intra = counter.wire_bytes(exclude=fsdp)
                LEDGER.add("intra_layer", intra, len(counter.records))
                if fsdp:
                    LEDGER.add("fsdp", counter.wire_bytes(groups=fsdp))
                self.intra_bytes += intra
            step_loss += float(loss) / ctx.accum
            self.sync.end_micro_batch(last)
        return step_loss

    def loss_and_backward(self, ctx: RunContext, x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
        """One micro-batch's forward, loss (vocabulary-parallel under TP) and backward of the
        (fp16: scaled) ``loss * weight``; returns the detached loss."""
        mp = self.mp
        with ctx.autocast(), mp.loss_context():
            out = self.forward_module(x)
            loss = mp.loss(self.model, out, y, None if mp.tp > 1 else ctx.loss_fn)
            scaled = loss * weight
            if ctx.scaler is not None and ctx.scaler.is_enabled():  # fp16: the loss scale (a power of two)
                scale = ctx.scaler.scale(torch.ones((), device=ctx.device))
                scaled = scaled * float(scale) if isinstance(scaled, DTensor) else ctx.scaler.scale(scaled)
            scaled.backward()
        loss = loss.detach()
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def eval_batch(self, ctx: RunContext, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """Loss without the auxiliary term (as one process); under CP the mean over this rank's S/cp
        tokens, so the sum over the ``dp x cp`` group divided by its samples is the mean."""
        mp = self.mp
        x, y = mp.shard_batch(x, y)
        with ctx.autocast(), mp.loss_context():
            out = logits_of(self.forward_module(x))  # (FSDP's root; without grad a remat tree is the plain forward)
            if mp.tp > 1:
                loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())
            else:
                loss = ctx.loss_fn(out, y)
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        correct = 0
        if ctx.task != "lm":
            correct = int((out.argmax(-1) == y).sum())
        return float(loss) * len(y), correct, len(y)

    # -- the step ------------------------------------------------------------------------
    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.sync.prepare_step()

    @torch.no_grad()
    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        sq = self.sync.square_norm()
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        self.sync.scale_grads(max_norm / (norm + 1e-6))
        return norm

    def after_step(self) -> None:
        self.sync.after_step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.sync.zero_grad()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.sync.state_tensors()

    # -- logging ---------------------------------------------------------------------------
    def _all_reduce(self, values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with LEDGER.paused():
            dist.all_reduce(t, group=self.mp.dense_group)
        return t.cpu()

    def mean(self, values: list[float]) -> list[float]:
        """Over the ``dp x cp`` ranks (TP ranks already agree): the global batch's mean."""
        return (self._all_reduce(values) / self.mp.dense_size).tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values).tolist()

    def metrics(self) -> dict[str, Any]:
        out = {k: v for k, v in self.predictions.items() if k.startswith("predicted_")}
        if getattr(self.sync, "offload", False):  # ZeRO-Offload: this rank's shard moved each step
            d2h, h2d = self.sync.moved["d2h"], self.sync.moved["h2d"]
            own = sum(e.length * e.row_numel for e in self.entries)
            grad_b = self.entries[0].local.element_size() if self.entries else 4
            out.update(offload_d2h_bytes=d2h, offload_h2d_bytes=h2d, offload_bytes=d2h + h2d,
                       offload_pred_bytes=own * grad_b * 2)  # owned gradient rows down, updated rows up
        if self.mp.tp > 1 or self.mp.cp > 1 or self.mp.ep > 1:
            out["comm_bytes_intra_layer"] = self.intra_bytes
        return out

    def describe(self) -> str:
        mp = self.mp
        half = f", {str(self.sync.param_dtype).split('.')[-1]} parameters + fp32 masters" if self.sync.param_dtype \
            else ""
        if self.fsdp:
            half = f", {str(self.sync.param_dtype).split('.')[-1]} compute" if self.sync.param_dtype else ""
        if mp.tp == mp.cp == mp.ep == 1:
            h = f", HSDP shard groups of {mp.hsdp}" if mp.hsdp else ""
            how = f" (FSDP2, {len(self.sync.blocks)} block groups + root)" if self.fsdp else ""
            return f"ZeRO stage {self.stage}{how} over {self.world} ranks{half}{h}"
        parts = [f"{k}={v}" for k, v in (("tp", mp.tp), ("cp", mp.cp), ("ep", mp.ep)) if v > 1]
        if mp.sequence_parallel:
            parts[0] += " (sequence parallel)"
        h = f" (HSDP shard groups of {mp.hsdp})" if mp.hsdp else ""
        return f"{' x '.join(parts)} x dp={mp.dp}{h}, zero={self.stage}{half}"

    # -- state: the single-process layout -----------------------------------------------
    def _param_of_key(self) -> dict[str, Entry]:
        """Every state-dict key of a parameter (tied ones under both names) -> its entry."""
        by_id = {id(e.param): e for e in self.entries}
        return {n: by_id[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False) if id(p) in by_id}

    def _full(self, e: Any) -> torch.Tensor:
        """The single-process value of entry ``e``'s parameter (collective)."""
        if self.fsdp:
            return self.mp.from_tp_layout(self.model, e.name, self.sync.full_value(e))
        return self.mp.globalize(self.model, e.name, e.param, self.sync.master_local(e))

    def model_state_dict(self) -> dict[str, Any]:
        keys = self._param_of_key()
        full = {e.name: self._full(e).cpu() for e in self.entries}
        out: dict[str, Any] = {}
        for name, v in self.model.state_dict().items():
            if name in keys:
                out[name] = full[keys[name].name]
            else:
                v = v.full_tensor() if isinstance(v, DTensor) else v
                out[name] = v.detach().clone()
        return out

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        from scaletrain.techniques.data_parallel.sharded import check_state_keys

        check_state_keys(self.model, state)
        keys = self._param_of_key()
        with torch.no_grad():
            for e in self.entries:
                if self.fsdp:
                    full = state[e.name].to(self.device)
                    if tuple(full.shape) != tuple(e.param.shape):
                        raise RuntimeError(f"size mismatch for {e.name}: checkpoint {tuple(full.shape)}, model "
                                           f"{tuple(e.param.shape)}")
                    self.sync.load_value(e, self.mp.to_tp_layout(self.model, e.name, full))
                    continue
                local = self.mp.localize(self.model, e.name, e.param, state[e.name].to(self.device))
                if tuple(local.shape) != tuple(e.local.shape):
                    raise RuntimeError(f"size mismatch for {e.name}: checkpoint {tuple(state[e.name].shape)} does "
                                       f"not shard to this rank's {tuple(e.local.shape)}")
                self.sync.load_local(e, local)
            for name, b in self.model.named_buffers():
                if name in state and name not in keys:
                    (b.to_local() if isinstance(b, DTensor) else b).copy_(state[name])

    def _proxy_entries(self, optimizer: torch.optim.Optimizer) -> list[Entry]:
        return [self._by_proxy[id(p)] for grp in optimizer.param_groups for p in grp["params"]]

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        sd = optimizer.state_dict()
        entries = self._proxy_entries(optimizer)
        ok = all(not torch.is_tensor(v) or v.ndim == 0 or tuple(v.shape) == entries[i].local_shape()
                 for i, st in sd["state"].items() for v in st.values())
        flags = torch.tensor([0.0 if ok else 1.0])
        with LEDGER.paused():
            dist.all_reduce(flags)
        if float(flags) > 0:  # 8-bit codes, factored moments: per-rank states with their layout
            ranks: list[Any] = [None] * self.world
            dist.all_gather_object(ranks, sd)
            return {"sharded": True, "layout": self.describe(), "dp": self.mp.dp, "stage": self.stage,
                    "ranks": ranks}
        # every rank has state for the same parameters (the owned rows may be empty)
        state: dict[int, dict[str, Any]] = {}
        for i in range(len(entries)):
            e = entries[i]
            st = sd["state"].get(i)
            if st is None:
                continue
            state[i] = {}
            for k in sorted(st):
                v = st[k]
                if torch.is_tensor(v) and v.ndim > 0 and self.fsdp:  # a local shard of a parameter-shaped state
                    v = self.mp.from_tp_layout(self.model, e.name, self.sync.state_full(e, v)).cpu()
                elif torch.is_tensor(v) and v.ndim > 0:  # owned rows of a parameter-shaped state
                    v = self.mp.globalize(self.model, e.name, e.param, self.sync.gather_rows(e, v)).cpu()
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
        entries = self._proxy_entries(optimizer)
        local: dict[Any, dict[str, Any]] = {}
        for i, st in state["state"].items():
            e = entries[int(i)]
            full_shape = tuple(e.param.shape) if self.fsdp else tuple(self.mp.globalize_shape(e.param, e.local))
            local[i] = {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim > 0 and tuple(v.shape) == full_shape and self.fsdp:
                    v = self.sync.state_local(e, self.mp.to_tp_layout(self.model, e.name, v.to(self.device)))
                elif torch.is_tensor(v) and v.ndim > 0 and tuple(v.shape) == full_shape:
                    v = self.sync.owned_rows(e, self.mp.localize(self.model, e.name, e.param, v.to(self.device)))
                    v = v.clone()
                elif torch.is_tensor(v) and v.numel() > 1:
                    raise ConfigError(f"optimizer state {k!r} of shape {tuple(v.shape)} cannot be sharded for "
                                      f"{self.describe()}; resume with another optimizer or this run's layout")
                local[i][k] = v
        optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})

    def close(self) -> None:
        self.sync.close()
        super().close()
        self.entries = []
