"""ZeRO-Offload's optimizer side: fp32 master weights, gradients and optimizer states on the host,
the update on the CPU (Ren et al. 2021, "ZeRO-Offload", §4; the survey's §4.1).

Apply face:

- :class:`CPUAdam` — Adam / AdamW for host tensors through PyTorch's fused CPU kernel
  (``torch._fused_adamw_``: vectorised, split over all cores with ``at::parallel_for``). When a
  group's parameters are consecutive views of one flat buffer (as :class:`HostOptimizer` lays
  them out) and all have a gradient, the whole group is **one** kernel call over the flat
  buffer; per-tensor calls otherwise. Same kernel and arguments as
  ``torch.optim.AdamW(fused=True)``, so the update is the same elementwise arithmetic.
  ``impl="torch"`` instead runs torch's own (foreach or for-loop) Adam per parameter view, the
  code a non-fused ``torch.optim.AdamW`` runs: :class:`HostOptimizer` picks it when the user's
  optimizer is not fused, so offloaded training equals the plain run bitwise (fused and foreach
  Adam differ in the last bits).
- :class:`HostOptimizer` — owns the host copies: per optimizer group one flat fp32 master
  buffer, one (or, with DPU, two) flat gradient buffers; gradients arrive from the device
  as soon as each parameter's gradient is accumulated (post-accumulate-grad hooks, installed by
  the runtime), the update runs on the CPU, then the new parameters are copied to the device
  (unless weights are streamed, which fetch from the masters themselves). Adam/AdamW use
  :class:`CPUAdam`; any other optimizer the factory builds (e.g. 8-bit Adam) is rebound to the
  master buffers and stepped there. Optimizer states may live on disk instead
  (:mod:`scaletrain.techniques.offload.disk`).
- Delayed parameter update (DPU, ZeRO-Offload §4.2): ``step()`` waits for the previous update,
  uploads its parameters, and starts the update with the gradients just computed in a background
  thread, so the CPU update of step t overlaps the forward/backward of step t+1, which runs on
  parameters one update old. Gradient buffers are doubled so the next backward does not write
  what the update reads.

Cost face — :func:`predict_optimizer`: host bytes (master 4Ψ, grads 4Ψ (8Ψ with DPU), Adam
states 8Ψ or 8-bit), bytes moved per step (grads Ψ·4 device->host per micro-batch, params Ψ·4
host->device per step when the parameters stay resident), and the update time Ψ /
``Platform.cpu_adam_params_per_s`` (hidden behind the next forward/backward with DPU).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.optim.adam import adam as _torch_adam

from scaletrain.errors import UserError
from scaletrain.techniques.offload.pools import Pools


class CPUAdam(torch.optim.Optimizer):
    """Adam (``adamw=False``, L2 added to the gradient) or AdamW for CPU tensors, fused kernel."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw: bool = True,
                 flat: list[torch.Tensor | None] | None = None,
                 alloc: Callable[[torch.Tensor], torch.Tensor] | None = None, impl: str = "fused",
                 foreach: bool | None = None):
        if impl not in ("fused", "torch"):
            raise ValueError(f"CPUAdam impl={impl!r}; allowed: fused, torch")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw, foreach=foreach)
        super().__init__(params, defaults)
        self.impl = impl
        """fused: one fused kernel (per flat group); torch: torch.optim.adam.adam per parameter (foreach/for-loop)."""
        self._flat = list(flat) if flat is not None else [None] * len(self.param_groups)
        self._flat_state: dict[int, dict[str, torch.Tensor]] = {}
        """Per flat group: the whole m / v buffers (the per-parameter states are views of them)."""
        self._alloc = alloc or torch.zeros_like
        """Makes a zeroed state tensor like its argument (the host pool's, to count the bytes)."""

    @staticmethod
    def _views_of(flat: torch.Tensor | None, params: list[torch.Tensor]) -> bool:
        """True when ``params`` are consecutive views tiling ``flat`` in order."""
        if flat is None:
            return False
        off = 0
        ptr = flat.untyped_storage().data_ptr()
        for p in params:
            if p.untyped_storage().data_ptr() != ptr or p.storage_offset() != flat.storage_offset() + off \
                    or not p.is_contiguous():
                return False
            off += p.numel()
        return off == flat.numel()

    def _state_for(self, group_i: int, params: list[torch.Tensor]) -> None:
        """Lazily create states: flat m/v buffers viewed per parameter when the group is flat."""
        if all(self.state[p] for p in params):
            return
        flat = self._flat[group_i]
        if self._views_of(flat, params):
            m = self._alloc(flat)
            v = self._alloc(flat)
            off = 0
            for p in params:
                n = p.numel()
                self.state[p] = {"exp_avg": m[off:off + n].view_as(p), "exp_avg_sq": v[off:off + n].view_as(p),
                                 "step": torch.zeros((), dtype=torch.float32)}
                off += n
            self._flat_state[group_i] = {"exp_avg": m, "exp_avg_sq": v}
            return
        for p in params:
            if not self.state[p]:
                self.state[p] = {"exp_avg": self._alloc(p), "exp_avg_sq": self._alloc(p),
                                 "step": torch.zeros((), dtype=torch.float32)}

    @torch.no_grad()
    def step(self, closure: Callable | None = None, grads: list[torch.Tensor | None] | None = None,
             lrs: list[float] | None = None):
        """One update (see :meth:`update`), through torch's optimizer hooks."""
        loss = closure() if closure is not None else None
        self.update(grads, lrs)
        return loss

    @torch.no_grad()
    def update(self, grads: list[torch.Tensor | None] | None = None, lrs: list[float] | None = None) -> None:
        """One update without the global optimizer hooks (which a memory tracker on another thread
        would otherwise see). ``grads[g]``: an optional flat gradient for group g (else ``p.grad``);
        ``lrs``: learning rates to use instead of the groups' (a snapshot taken by DPU)."""
        for gi, group in enumerate(self.param_groups):
            lr = float(group["lr"] if lrs is None else lrs[gi])
            params = group["params"]
            flat = self._flat[gi]
            fg = grads[gi] if grads is not None else None
            if fg is not None and self._views_of(flat, params):
                self._state_for(gi, params)
                steps = [self.state[p]["step"] for p in params]
                if self.impl == "torch":  # per parameter view, as torch's non-fused Adam does
                    views, off = [], 0
                    for p in params:
                        views.append(fg[off:off + p.numel()].view_as(p))
                        off += p.numel()
                    self._torch_kernel(group, lr, list(params), views, [self.state[p]["exp_avg"] for p in params],
                                       [self.state[p]["exp_avg_sq"] for p in params], steps)
                    continue
                if all(float(s) == float(steps[0]) for s in steps):
                    torch._foreach_add_(steps, 1.0)
                    st = self._flat_state[gi]
                    self._kernel(group, lr, [flat], [fg], [st["exp_avg"]], [st["exp_avg_sq"]], [steps[0]])
                    continue
            live = [p for p in params if p.grad is not None]
            if not live:
                continue
            self._state_for(gi, params)
            steps = [self.state[p]["step"] for p in live]
            args = (group, lr, live, [p.grad for p in live], [self.state[p]["exp_avg"] for p in live],
                    [self.state[p]["exp_avg_sq"] for p in live], steps)
            if self.impl == "torch":
                self._torch_kernel(*args)
                continue
            torch._foreach_add_(steps, 1.0)
            self._kernel(*args)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch-format Adam state *into* the existing (flat-viewed) state tensors."""
        for gi, g in enumerate(self.param_groups):
            self._state_for(gi, g["params"])
        mine = {p: dict(s) for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for p, st in mine.items():
                got = self.state.get(p, {})
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in got:
                        st[k].copy_(got[k])
                if "step" in got:
                    st["step"].copy_(torch.as_tensor(float(got["step"]), dtype=torch.float32))
                self.state[p] = st
        for g in self.param_groups:  # a torch Adam/AdamW state dict says so in decoupled_weight_decay
            g.setdefault("adamw", bool(g.get("decoupled_weight_decay", True)))

    @staticmethod
    def _torch_kernel(group, lr, params, grads, m, v, steps) -> None:
        """torch's own Adam (it increments ``steps`` itself), with the group's foreach choice."""
        b1, b2 = group["betas"]
        _torch_adam(params, grads, m, v, [], steps, foreach=group.get("foreach"), fused=None,
                    decoupled_weight_decay=bool(group.get("adamw", True)), amsgrad=False, beta1=b1, beta2=b2,
                    lr=lr, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    @staticmethod
    def _kernel(group, lr, params, grads, m, v, steps) -> None:
        b1, b2 = group["betas"]
        fn = torch._fused_adamw_ if group.get("adamw", True) else torch._fused_adam_
        fn(params, grads, m, v, [], steps, lr=lr, beta1=b1, beta2=b2,
           weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)


def clip_grads_(grads: list[torch.Tensor], max_norm: float) -> float:
    """Scale ``grads`` in place to a global 2-norm of at most ``max_norm``; the norm before. The same
    arithmetic as ``torch.nn.utils.clip_grad_norm_(foreach=True)`` over the same tensors in the same order."""
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, foreach=True)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return float(total)


def is_plain_adam(opt: torch.optim.Optimizer) -> bool:
    """True for torch Adam/AdamW without amsgrad/maximize/capturable (what CPUAdam reproduces)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in opt.param_groups)


def adamw_flag(opt: torch.optim.Optimizer, group: dict) -> bool:
    return type(opt) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))


@dataclass
class OptimizerCost:
    """Predicted bytes and seconds of the host optimizer for one optimizer step."""

    host_bytes: int
    d2h_bytes_per_microbatch: int
    h2d_bytes_per_step: int
    update_time_s: float


def adam_state_bytes(numel: int, eight_bit: bool = False) -> int:
    """Adam's moment bytes for ``numel`` fp32 parameters (8-bit: Adam8bit.state_nbytes)."""
    if eight_bit:
        from scaletrain.techniques.optim.adam8bit import Adam8bit

        return Adam8bit.state_nbytes(numel)
    return 8 * numel


def predict_optimizer(param_numels: list[int], cpu_adam_params_per_s: float, *, resident_params: bool,
                      dpu: bool = False, eight_bit: bool = False, states_on_disk: bool = False,
                      element_size: int = 4) -> OptimizerCost:
    """Cost face of :class:`HostOptimizer` (exact bytes; time from the platform's CPU-Adam rate)."""
    n = sum(param_numels)
    states = 0 if states_on_disk else sum(adam_state_bytes(k, eight_bit) for k in param_numels)
    grads = n * 4 * (2 if dpu else 1)
    return OptimizerCost(host_bytes=4 * n + grads + states, d2h_bytes_per_microbatch=n * element_size,
                         h2d_bytes_per_step=n * element_size if resident_params else 0,
                         update_time_s=n / cpu_adam_params_per_s)


class HostOptimizer:
    """Host masters + grads + CPU update for the parameters of ``model`` (see the module doc)."""

    def __init__(self, model: nn.Module, factory: Callable[[nn.Module], torch.optim.Optimizer], pools: Pools,
                 *, resident_params: bool, dpu: bool = False, disk=None):
        self.pools = pools
        self.resident = resident_params
        self.dpu = dpu
        proto = factory(model)
        params = [p for p in model.parameters() if p.requires_grad]
        ids = {id(p) for p in params}
        groups = []
        seen: set[int] = set()
        for g in proto.param_groups:
            ps = [p for p in g["params"] if id(p) in ids and id(p) not in seen]
            seen.update(id(p) for p in ps)
            groups.append((g, ps))
        missing = [p for p in params if id(p) not in seen]
        if missing:
            raise UserError(f"the optimizer factory left {len(missing)} trainable parameters out of its groups")
        self.params: list[nn.Parameter] = params  # model order (for clipping, like the baseline)
        self.disk = disk
        self.cpu_adam = is_plain_adam(proto)
        masters_on_disk = disk is not None and disk.masters_on_disk
        if disk is not None and not self.cpu_adam:
            raise UserError("memory.offload.optimizer=disk supports Adam/AdamW only (optim.name=adam or adamw)")
        if dpu and not (self.cpu_adam or disk is not None):
            raise UserError("memory.offload.dpu needs Adam/AdamW (the delayed update snapshots their learning rate)")
        if masters_on_disk and (dpu or not resident_params):
            raise UserError("master weights on disk need memory.offload.params=device and memory.offload.dpu=false")
        self.master: dict[int, torch.Tensor] = {}
        self.flat_master: list[torch.Tensor] = []
        self._grad_bufs: list[list[torch.Tensor]] = []  # [buffer][group] flat grads
        self._grad_views: list[dict[int, torch.Tensor]] = []
        sizes = [sum(p.numel() for p in ps) for _, ps in groups]
        if not masters_on_disk:
            for (g, ps), n in zip(groups, sizes):
                flat = pools.host.empty(n, torch.float32)
                off = 0
                for p in ps:
                    k = p.numel()
                    view = flat[off:off + k].view(p.shape)
                    with torch.no_grad():
                        view.copy_(p.detach())
                    self.master[id(p)] = view
                    off += k
                self.flat_master.append(flat)
        for _ in range(2 if dpu else 1):
            bufs, views = [], {}
            for (g, ps), n in zip(groups, sizes):
                buf = pools.host.empty(n, torch.float32)
                off = 0
                for p in ps:
                    views[id(p)] = buf[off:off + p.numel()].view(p.shape)
                    off += p.numel()
                bufs.append(buf)
            self._grad_bufs.append(bufs)
            self._grad_views.append(views)
        self._cur = 0  # gradient buffer the backward writes
        self._has_grad: set[int] = set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        hps = [dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"],
                    adamw=adamw_flag(proto, g)) for g, _ in groups] if self.cpu_adam else []
        # A fused optimizer is run by the fused kernel over flat buffers; a foreach / for-loop one by
        # torch's own code per parameter view, so the update is bitwise the one the user configured.
        impl = "fused" if any(g.get("fused") for g, _ in groups) else "torch"
        if disk is not None:
            disk.attach(None if masters_on_disk else self.flat_master, hps,
                        device_params=[ps for _, ps in groups])
            self.optimizer = disk.optimizer
        elif self.cpu_adam:
            pg = [dict(params=[self.master[id(p)] for p in ps], foreach=g.get("foreach"), **hp)
                  for (g, ps), hp in zip(groups, hps)]
            self.optimizer = CPUAdam(pg, flat=self.flat_master, alloc=self._host_zeros, impl=impl)
        else:
            for g, ps in groups:
                g["params"] = [self.master[id(p)] for p in ps]
            proto.param_groups = [g for g, _ in groups]
            self.optimizer = proto
        self._groups = groups
        self._adopted: set[int] = set()

    def _host_zeros(self, like: torch.Tensor) -> torch.Tensor:
        t = self.pools.host.empty(like.shape, like.dtype)
        t.zero_()
        return t

    def _adopt_states(self) -> None:
        """Count the states a generic (rebound) optimizer allocated itself in the host pool."""
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.untyped_storage()._cdata not in self._adopted:
                    self._adopted.add(v.untyped_storage()._cdata)
                    self.pools.host.adopt(v)

    # -- gradients ------------------------------------------------------------------------
    def receive_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move ``p.grad`` to the host buffer and free it on the device."""
        if p.grad is None:
            return
        dst = self._grad_views[self._cur][id(p)]
        self.pools.d2h_into(dst, p.grad, "grads", accumulate=id(p) in self._has_grad)
        self._has_grad.add(id(p))
        p.grad = None

    def host_grads(self) -> list[torch.Tensor]:
        """The current gradients (host views, model order) of parameters that received one."""
        views = self._grad_views[self._cur]
        return [views[id(p)] for p in self.params if id(p) in self._has_grad]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global-norm clipping on the host gradients, the same arithmetic as clip_grad_norm_(foreach)."""
        self.pools.synchronize()
        return clip_grads_(self.host_grads(), max_norm)

    # -- update -------------------------------------------------------------------------------
    def _update(self, buf: int, has: set[int], lrs: list[float] | None = None) -> None:
        try:
            views = self._grad_views[buf]
            all_have = all(id(p) in has for _, ps in self._groups for p in ps)
            if self.disk is not None:
                self.disk.step(None, self._grad_bufs[buf], has_all=all_have, lrs=lrs)
                return
            for _, ps in self._groups:
                for p in ps:
                    self.master[id(p)].grad = views[id(p)] if id(p) in has else None
            if self.cpu_adam:
                self.optimizer.update(self._grad_bufs[buf] if all_have else None, lrs)
            else:
                self.optimizer.step()
                self._adopt_states()
            for _, ps in self._groups:
                for p in ps:
                    self.master[id(p)].grad = None
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            self._error = e

    def _upload(self) -> None:
        if not self.resident or not self.master:  # streamed, or uploaded by the disk tier itself
            return
        for p in self.params:
            self.pools.h2d_into(p.data, self.master[id(p)], "params")

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            self._upload()

    def step(self) -> None:
        """Apply the accumulated gradients (now, or in the background with DPU)."""
        self.pools.synchronize()
        self.optimizer._opt_called = True  # what an LR scheduler checks (we bypass optimizer.step's hooks)
        has, self._has_grad = self._has_grad, set()
        if not self.dpu:
            self._update(self._cur, has)
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            self._upload()
            return
        self._join()
        buf = self._cur
        self._cur = 1 - self._cur
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]  # the scheduler moves on meanwhile
        self._thread = threading.Thread(target=self._update, args=(buf, has, lrs), name="scaletrain-dpu", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Finish a delayed update and upload its parameters (before evaluation or checkpoints)."""
        self._join()

    def master_state(self) -> dict[int, torch.Tensor]:
        """id(param) -> host master tensor (after :meth:`flush`)."""
        return self.master
