"""The apply face of ``memory.offload.plan=chunks`` (PatrickStar): model states in equal-size chunks
moved between host and device by :class:`~.chunks.ChunkPlacer` (see :mod:`.chunks` for the policy).

How the tensors are laid out: every chunk tensor has a host copy (the pools' host memory) and a
device storage that is resized to 0 bytes while the chunk is not resident and back when it is
fetched (FSDP's trick, as :mod:`.weights`); each trainable parameter's ``.data`` is a view into its
P chunk's device storage, so the model, autograd's saved views and the parameter objects never
change. A parameter's gradient is added into its G chunk as soon as autograd has accumulated it
(post-accumulate-grad hook) and freed. The update of chunk c runs torch's own Adam/AdamW code
(``torch.optim.adam.adam``, the configured ``foreach`` choice) over the chunk's flat tensors, on the
device when the placer put them there, else on the host copies (the CPU Adam of ZeRO-Offload).

The first optimizer step is the warm-up: it keeps only the needed chunks on the device, updates on
the host, and measures each moment's non-model device bytes (:class:`MomentMeter`); the placement
of every later step is planned from those measurements. Each step's bytes moved are predicted
by replaying the placer from the state the step starts in (:func:`.chunks.replay`) before it runs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.adam import adam as _torch_adam
from torch.utils._python_dispatch import _disable_current_modes

from scaletrain.chain import Chain, to_chain
from scaletrain.errors import UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.chunks import (G, KINDS, M, P, V, Action, ChunkPlacer, ChunkState, Moment,
                                                  capacities, moments, pack_chunks, probe_non_model, replay, walk)
from scaletrain.techniques.offload.optimizer import adamw_flag, clip_grads_, is_plain_adam
from scaletrain.techniques.offload.planner import ADAM_DEVICE_BYTES_PER_PARAM, Prediction
from scaletrain.techniques.offload.pools import make_pools
from scaletrain.techniques.offload.probe import ChainCosts, chain_params, runtime_costs

CATEGORY = ("parameters", "gradients", "optimizer_states", "optimizer_states")
"""Device-accounting category of chunk kinds P, G, M, V."""


class MomentMeter:
    """Non-model device bytes of each moment: the most live device bytes in the moment minus the chunks
    resident then. Logical pool: from the tracker's event log; CUDA: the allocator's peak per moment."""

    def __init__(self, pools, n_moments: int):
        self.pools = pools
        self.values = [0] * n_moments
        self._open: tuple[int, Any, int, int] | None = None  # (moment, tracker, first event, resident bytes)
        self._peak = 0

    def begin(self, k: int, tracker: Any, resident: int) -> None:
        self.end()
        if self.pools.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.pools.device)
            self._open = (k, None, 0, resident)
        elif tracker is not None:
            self._open = (k, tracker, len(tracker.events), resident)

    def end(self) -> None:
        if self._open is None:
            return
        k, tr, first, resident = self._open
        self._open = None
        if tr is None:
            top = torch.cuda.max_memory_allocated(self.pools.device)
            self._peak = max(self._peak, top)
        else:
            ev = tr.events
            cur = sum(d for _, _, d in ev[:first])
            top = cur
            for _, _, d in ev[first:]:
                cur += d
                top = max(top, cur)
        self.values[k] = max(self.values[k], top - resident)

    def cuda_peak(self) -> int:
        """The largest allocator peak over the moments (CUDA: the per-moment resets hide it from the pool)."""
        return self._peak


class ChunkRuntime:
    """One process's forward/backward and optimizer step with chunked model states (module docstring)."""

    def __init__(self, model: nn.Module, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
                 options: Any, platform: Platform, loss_fn: Callable, example: tuple[torch.Tensor, torch.Tensor],
                 *, autocast: Callable[[], Any] | None = None, accum: int = 1,
                 device: torch.device | str | None = None, costs: ChainCosts | None = None):
        self.model = model
        self.chain: Chain = to_chain(model)
        self.loss_fn = loss_fn
        self.autocast = autocast or contextlib.nullcontext
        self.accum = accum
        self.platform = platform
        self.options = options
        self.plan = None
        self.disk = None  # (the offload strategy asks: no disk tier here)
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        self.costs = runtime_costs(self.chain, example, loss_fn, self.autocast, platform, costs)
        self.params: list[nn.Parameter] = chain_params(self.chain)
        proto = optimizer_factory(model)
        if not is_plain_adam(proto):
            raise UserError("memory.offload.plan=chunks supports Adam/AdamW (optim.name=adam or adamw): the chunk "
                            "update runs torch's Adam on flat chunks")
        self.optimizer = proto
        """The configured optimizer, never stepped itself: its param groups carry the hyperparameters (and the
        learning rate the scheduler sets); its states live in the M/V chunks."""
        group_of = {id(p): g for g, grp in enumerate(proto.param_groups) for p in grp["params"]}
        groups = [group_of.get(id(p), -1) if p.requires_grad else -1 for p in self.params]
        if any(g < 0 and p.requires_grad for g, p in zip(groups, self.params)):
            raise UserError("the optimizer factory left trainable parameters out of its groups")
        if any(p.dtype != torch.float32 for p in self.params):
            raise UserError("memory.offload.plan=chunks needs fp32 parameters (train.params_dtype=fp32)")
        self.layout = pack_chunks([p.numel() for p in self.params], groups, options.chunk_bytes)
        self.S = self.layout.chunk_bytes
        C = len(self.layout)
        self.pools = make_pools(dev, options.device_budget, options.host_budget, options.strict, options.track)
        n = self.layout.chunk_numel
        self.host: list[torch.Tensor] = []
        self.dev: list[torch.Tensor] = []
        for c in range(C):
            for k in range(4):
                h = self.pools.host.empty(n, torch.float32)
                h.zero_()
                self.host.append(h)
                self.dev.append(self.pools.device_empty((n,), torch.float32, CATEGORY[k]))
        self.gview: dict[int, tuple[int, torch.Tensor]] = {}
        with torch.no_grad():
            for j, (c, off) in self.layout.offsets.items():
                p = self.params[j]
                k = p.numel()
                self.host[4 * c + P][off:off + k].copy_(p.detach().reshape(-1))
                p.data = self.dev[4 * c + P][off:off + k].view(p.shape)
                self.gview[id(p)] = (4 * c + G, self.dev[4 * c + G][off:off + k].view(p.shape))
        for t in self.dev:
            self.pools.free_device_storage(t)
        for b in self.chain.buffers():
            if b.device != dev:
                b.data = b.data.to(dev)
        self._hooks = [p.register_post_accumulate_grad_hook(self._receive_grad)
                       for j, p in enumerate(self.params) if j in self.layout.offsets]
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in range(C)]
        """Adam's step count of each chunk (torch keeps one per parameter; they are all equal)."""
        self.seq: list[Moment] = moments(self.layout, [b.params for b in self.costs.blocks], self.costs.param_owner,
                                         [i for i, b in enumerate(self.costs.blocks) if b.out_requires_grad], accum)
        self.non_model = probe_non_model(self.costs, self.seq, accum)
        """Non-model device bytes per moment: the probe's until the warm-up step has measured them."""
        self.state = ChunkState.initial(C)
        self.warmed = False
        self._walk = None
        self._cur: tuple[int, bool] | None = None
        self._meter: MomentMeter | None = None
        self._tracker = None
        self._micro = 0
        self._t0: float | None = None
        self._stats: dict[str, Any] = {}
        self.replayed = None
        self.prediction = self._predict()
        self.times_measured = False
        budget = options.device_budget
        if budget is not None and self.prediction.device_peak_bytes > budget:  # the warm-up keeps the least
            least = self.prediction.device_peak_bytes
            raise UserError(f"no chunk placement fits memory.device_budget={budget} B: the warm-up step, which "
                            f"keeps only the chunks in use, is predicted to need {least} B ({least / 2**20:.2f} MiB; "
                            f"activations are kept: the chunks manage model states only); raise "
                            f"memory.device_budget, lower memory.offload.chunk_bytes or train.micro_batch")

    # ------------------------------------------------------------------ placement
    def _predict(self) -> Prediction:
        """The next step's figures: the placer replayed from the current state (the cost face)."""
        r = replay(self.seq, self.S, self.state, self.non_model, self.options.device_budget, warmup=not self.warmed)
        self.replayed = r
        plat, c = self.platform, self.costs
        compute = self.accum * (c.loss_time_s + sum(b.fwd_time_s + b.bwd_time_s for b in c.blocks))
        n = self.layout.chunk_numel
        update = (r.host_updates * n / plat.cpu_adam_params_per_s
                  + r.device_updates * n * ADAM_DEVICE_BYTES_PER_PARAM / plat.device_mem_bytes_per_s)
        copies = r.h2d_bytes / plat.h2d_bytes_per_s + r.d2h_bytes / plat.d2h_bytes_per_s
        return Prediction(int(r.device_peak_bytes), int(r.h2d_bytes), int(r.d2h_bytes), 0, 0,
                          4 * self.S * len(self.layout), float(compute + copies + update), float(compute),
                          detail={"bytes": dict(r.bytes), "device_updates": r.device_updates,
                                  "host_updates": r.host_updates, "chunks": len(self.layout),
                                  "chunk_bytes": self.S, "warmup": not self.warmed})

    def _run(self, acts: list[Action]) -> None:
        for a in acts:
            k = a.chunk % 4
            d, h = self.dev[a.chunk], self.host[a.chunk]
            if a.op == "fetch":
                self.pools.alloc_device_storage(d, CATEGORY[k])
                if a.nbytes:
                    self.pools.h2d_into(d, h, KINDS[k], CATEGORY[k]).wait_device()
                else:
                    with torch.no_grad():
                        d.zero_()
            else:
                if a.nbytes:
                    self.pools.d2h_into(h, d, KINDS[k]).wait_host()
                self.pools.free_device_storage(d)

    def _advance(self, expect: str) -> tuple[int, bool]:
        """Enter the next moment of the step: run its placement actions (and start measuring it)."""
        k, acts, on_dev = self._walk.enter()
        if self.seq[k].name != expect:
            raise RuntimeError(f"chunk placement: expected moment {self.seq[k].name!r}, the model ran {expect!r}")
        if self._meter is not None:
            self._meter.end()
        self._run(acts)
        if self._meter is not None:
            self._meter.begin(k, self._tracker, self.S * sum(self.state.on_device))
        self._cur = (k, on_dev)
        return k, on_dev

    def _start_step(self) -> None:
        self.prediction = self._predict()
        placer = ChunkPlacer(self.seq, self.S, self.state)
        self._walk = walk(placer, capacities(self.options.device_budget, self.non_model), warmup=not self.warmed)
        self._meter = None if self.warmed else MomentMeter(self.pools, len(self.seq))
        if not self.warmed:
            self.pools.track = True  # the warm-up measures even in timing runs
        self._t0 = time.perf_counter()

    def _persistent(self) -> list[torch.Tensor]:
        return list(self.dev)

    @contextlib.contextmanager
    def _phase(self, extra: list[torch.Tensor]):
        with self.pools.phase(persistent=extra + self._persistent(), model=self.chain) as tr:
            self._tracker = tr
            try:
                yield
                if self._meter is not None:
                    self._meter.end()
            finally:
                self._tracker = None

    # ------------------------------------------------------------------ one micro-batch
    def _receive_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: add ``p.grad`` into its (resident) G chunk and free it."""
        if p.grad is None:
            return
        c, view = self.gview[id(p)]
        if not self.state.on_device[c]:
            raise RuntimeError(f"chunk placement: gradient chunk {c // 4} is not on the device")
        with torch.no_grad():
            view.add_(p.grad)
        p.grad = None

    def _on_backward_start(self, i: int, grad: torch.Tensor) -> None:
        self._advance(f"backward {i}")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients of ``loss * weight`` accumulate in the G chunks."""
        if self._micro == 0:
            self._start_step()
        with self._phase([x, y]):
            out = x
            for i, blk in enumerate(self.chain.blocks):
                self._advance(f"forward {i}")
                with self.autocast():
                    out = blk(out)
                if out.requires_grad:
                    out.register_hook(lambda g, i=i: self._on_backward_start(i, g))
            with self.autocast():
                loss = self.loss_fn(out, y)
            del out
            (loss * weight).backward()
            self._walk.leave()  # the last backward moment has written its gradients
        self._micro += 1
        return loss.detach()

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference forward (evaluation): each block's parameter chunks fetched, the others evicted."""
        seq = [m for m in self.seq if m.name.startswith("forward ")][:len(self.chain)]
        it = walk(ChunkPlacer(seq, self.S, self.state), [None] * len(seq), warmup=True)
        out = x
        for blk, (_, acts, _) in zip(self.chain.blocks, it):
            self._run(acts)
            with self.autocast():
                out = blk(out)
        for _, acts, _ in it:
            self._run(acts)
        return out

    # ------------------------------------------------------------------ the step
    def _grad_views(self) -> list[torch.Tensor]:
        """Each trainable parameter's gradient where its chunk holds it (model order), zero chunks skipped."""
        out = []
        src = getattr(self.chain, "source", None) or self.model
        index = {id(p): j for j, p in enumerate(self.params)}
        for q in src.parameters():
            j = index.get(id(q))
            if j is None or j not in self.layout.offsets:
                continue
            c, off = self.layout.offsets[j]
            g = 4 * c + G
            if self.state.zero[g]:
                continue
            t = self.dev[g] if self.state.on_device[g] else self.host[g]
            out.append(t[off:off + q.numel()])
        return out

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global-norm clipping on the chunks' gradients (the same arithmetic as ``clip_grad_norm_(foreach)``)."""
        with _disable_current_modes():
            return clip_grads_(self._grad_views(), max_norm)

    def _update(self, c: int, on_dev: bool) -> None:
        """Adam/AdamW on chunk ``c`` where its tensors are (torch's own code, the group's foreach choice)."""
        group = self.optimizer.param_groups[self.layout.group_of[c]]
        ts = self.dev if on_dev else self.host
        ctx = contextlib.nullcontext() if on_dev else _disable_current_modes()
        with ctx, torch.no_grad():
            if self.state.zero[4 * c + G] and not on_dev:
                ts[4 * c + G].zero_()
            b1, b2 = group["betas"]
            _torch_adam([ts[4 * c + P]], [ts[4 * c + G]], [ts[4 * c + M]], [ts[4 * c + V]], [], [self.steps[c]],
                        foreach=group.get("foreach"), fused=None,
                        decoupled_weight_decay=adamw_flag(self.optimizer, group), amsgrad=False, beta1=b1, beta2=b2,
                        lr=float(group["lr"]), weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def step(self) -> None:
        """Every chunk's update (device or host as placed), then this step's measured and predicted figures."""
        if self._walk is None:
            self._start_step()
        with self._phase([]):
            for c in range(len(self.layout)):
                _, on_dev = self._advance(f"update {c}")
                self._update(c, on_dev)
        for _, acts, _ in self._walk:  # the last moment's effects (its gradient chunk dropped)
            self._run(acts)
        self.optimizer._opt_called = True  # what an LR scheduler checks
        self.pools.synchronize()
        if self._meter is not None:
            measured = self._meter.values
            for k, m in enumerate(self.seq):  # an update moment's transient is reserved apart
                measured[k] = measured[k] if m.step_chunk < 0 else max(measured[k], 0)
            if self.pools.device.type == "cuda":
                self.pools._peak = max(self.pools._peak, self._meter.cuda_peak())
            self.non_model = measured
            self.warmed = True
            self.pools.track = self.options.track
        st = self.pools.stats
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        p = self.prediction
        self._stats = {
            "step_time_s": elapsed, "transfer_s": sum(st.seconds.values()),
            "device_peak_bytes": self.pools.device_peak_bytes,
            "h2d_bytes": st.total("h2d"), "d2h_bytes": st.total("d2h"),
            "offload_bytes": st.total("h2d") + st.total("d2h"), "disk_read_bytes": 0, "disk_write_bytes": 0,
            "host_peak_bytes": self.pools.host.peak_bytes, "transfers": st.as_dict(), "late_fetches": 0,
            "device_updates": p.detail["device_updates"], "host_updates": p.detail["host_updates"],
            "warmup": p.detail["warmup"], **p.as_row(), "predicted_transfers": dict(p.detail["bytes"]),
        }
        st.reset()
        self.pools.reset_peak()
        self._walk = None
        self._micro = 0
        self._t0 = None
        self._meter = None

    def last_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def flush(self) -> None:
        """Nothing runs in the background."""

    # ------------------------------------------------------------------ state (the single-process layout)
    def _current(self, cid: int) -> torch.Tensor:
        """The up-to-date copy of chunk tensor ``cid``."""
        return self.dev[cid] if self.state.on_device[cid] else self.host[cid]

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        src = getattr(self.chain, "source", None) or self.model
        index = {id(p): j for j, p in enumerate(self.params)}
        out = {}
        for k, v in src.state_dict(keep_vars=True).items():
            j = index.get(id(v))
            if j is not None and j in self.layout.offsets:
                c, off = self.layout.offsets[j]
                out[k] = self._current(4 * c + P)[off:off + v.numel()].view(v.shape).detach().clone()
            else:
                out[k] = v.detach().clone()
        return out

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        src = getattr(self.chain, "source", None) or self.model
        own = src.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict: missing keys {missing[:3]}, unexpected keys "
                               f"{unexpected[:3]}")
        index = {id(p): j for j, p in enumerate(self.params)}
        with torch.no_grad():
            for k, v in state.items():
                t = own[k]
                if tuple(v.shape) != tuple(t.shape):
                    raise RuntimeError(f"size mismatch for {k}: checkpoint {tuple(v.shape)}, model {tuple(t.shape)}")
                j = index.get(id(t))
                if j is None or j not in self.layout.offsets:
                    t.copy_(v)
                    continue
                c, off = self.layout.offsets[j]
                self.host[4 * c + P][off:off + v.numel()].copy_(v.reshape(-1))
                if self.state.on_device[4 * c + P]:
                    self.dev[4 * c + P][off:off + v.numel()].copy_(v.reshape(-1))

    def _group_params(self) -> list[list[int]]:
        """Parameter indices (into ``self.params``) of each optimizer group, in the optimizer's order."""
        index = {id(p): j for j, p in enumerate(self.params)}
        return [[index[id(p)] for p in g["params"] if id(p) in index] for g in self.optimizer.param_groups]

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The configured torch optimizer's ``state_dict()`` (a plain run's), from the M/V chunks."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        i = 0
        for g, js in zip(self.optimizer.param_groups, self._group_params()):
            for j in js:
                c, off = self.layout.offsets[j]
                p = self.params[j]
                if float(self.steps[c]) > 0:
                    state[i] = {"step": self.steps[c].clone(),
                                "exp_avg": self._current(4 * c + M)[off:off + p.numel()].view(p.shape).clone(),
                                "exp_avg_sq": self._current(4 * c + V)[off:off + p.numel()].view(p.shape).clone()}
                i += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(i - len(js), i))})
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, sd: dict[str, Any]) -> None:
        js_all = self._group_params()
        if len(sd["param_groups"]) != len(js_all):
            raise ValueError(f"checkpoint has {len(sd['param_groups'])} optimizer groups, this run {len(js_all)}")
        with torch.no_grad():
            for g, sg, js in zip(self.optimizer.param_groups, sd["param_groups"], js_all):
                if len(sg["params"]) != len(js):
                    raise ValueError("optimizer group sizes differ from this run's")
                g.update({k: v for k, v in sg.items() if k != "params"})
                for i, j in zip(sg["params"], js):
                    st = sd["state"].get(i)
                    if not st:
                        continue
                    c, off = self.layout.offsets[j]
                    n = self.params[j].numel()
                    self.steps[c].fill_(float(st["step"]))
                    for kind, key in ((M, "exp_avg"), (V, "exp_avg_sq")):
                        cid = 4 * c + kind
                        self.host[cid][off:off + n].copy_(st[key].reshape(-1))
                        if self.state.on_device[cid]:
                            self.dev[cid][off:off + n].copy_(st[key].reshape(-1))
        self.prediction = self._predict()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

