"""The offload runtime: one micro-batch's forward/backward and the optimizer step, with activations,
parameters and optimizer states placed as an :class:`OffloadOptions` says.

Order inside ``forward_backward`` (block by block over the Chain, one autograd graph, so
gradients are those of the plain model):

1. weight streaming claims block i (+ window) — parameters fetched into the device pool;
2. block i runs: plainly (keep), under ``torch.utils.checkpoint`` (recompute: only its input is
   kept, the rest recomputed in backward), or under the activation offloader's saved-tensor
   hooks (offload: its saved tensors go to the host when the block ends);
3. a hook on block i's output gradient marks "block i's backward starts": claims its parameters
   (+ window, released after), prefetches the offloaded activations of blocks i..i-d;
4. gradients leave for the host as soon as they are accumulated (host/disk optimizer);
5. loss, backward.

``step()`` runs the optimizer (on the device, on the host CPU, or with states on disk; with DPU
in the background) and records the measured device peak and bytes moved next to their
predictions (:meth:`last_stats`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain import schema
from scaletrain.chain import Chain, to_chain
from scaletrain.errors import UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.activations import ActivationOffloader, parse_blocks
from scaletrain.techniques.offload.disk import DiskStates
from scaletrain.techniques.offload.optimizer import HostOptimizer
from scaletrain.techniques.offload.pools import make_pools
from scaletrain.techniques.offload.probe import ChainCosts, chain_params, runtime_costs
from scaletrain.techniques.offload.weights import WeightStreamer
from scaletrain.techniques.remat.schedule import parse_bytes

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class OffloadOptions:
    """What goes where: the ``memory.offload.*`` keys (declared in :mod:`scaletrain.schema`) read into bytes."""

    plan: str = "manual"
    activations: str = "none"
    recompute: str = "none"
    prefetch: int = 1
    params: str = "device"
    param_window: int = 1
    optimizer: str = "device"
    dpu: bool = False
    disk_dir: str = ""
    disk_max_bytes: int | None = None
    disk_chunk_bytes: int = 4 * 2**20
    disk_masters: bool = False
    chunk_bytes: int | None = None
    """plan=chunks: bytes of one chunk (None: searched, see :func:`.chunks.pack_chunks`)."""
    device_budget: int | None = None
    host_budget: int | None = None
    strict: bool = True
    track: bool = True
    """Measure the device peak on the CPU's logical pool (off for timing runs)."""
    measure_times: bool = True
    """Time each block in the first micro-batch (copies excluded) and predict step times from those."""
    modes: list[str] | None = None
    """Resolved per-block activation mode ("keep" | "recompute" | "offload"); set by the runtime/planner."""

    def validate(self) -> None:
        """Each key against its declaration (:mod:`scaletrain.schema`: choices and range, one line naming the
        config key), then the rules that tie keys together."""
        for name in ("plan", "params", "optimizer", "prefetch", "param_window"):
            schema.check(f"offload.{name}", getattr(self, name))
        if self.params == "host" and self.optimizer == "device":
            raise UserError("memory.offload.params=host needs memory.offload.optimizer=host or disk "
                            "(streamed weights are updated where their master copy lives)")
        if self.dpu and self.optimizer == "device":
            raise UserError("memory.offload.dpu needs memory.offload.optimizer=host or disk")
        if self.plan == "chunks":
            other = [f"{k}={getattr(self, k)}" for k in CHUNKS_FIXED if getattr(self, k) != getattr(OffloadOptions, k)]
            if other:
                raise UserError(f"memory.offload.plan=chunks places every model state itself; leave "
                                f"memory.offload.{other[0]} at its default")


CHUNKS_FIXED = ("activations", "recompute", "params", "optimizer", "dpu", "disk_masters")
"""Keys plan=chunks decides itself (they must stay at their defaults)."""


def options_from_cfg(cfg_like: Any) -> OffloadOptions:
    """Options from a Config-like object (``.memory.offload.*``, ``.memory.device_budget``) or a flat dict."""
    if isinstance(cfg_like, OffloadOptions):
        return cfg_like
    if isinstance(cfg_like, dict):
        get = lambda k, d: cfg_like.get(k, d)  # noqa: E731
    else:
        mem = getattr(cfg_like, "memory", cfg_like)
        off = getattr(mem, "offload", None)

        def get(k, d):
            if k == "device_budget":
                return getattr(mem, "device_budget", d)
            return getattr(off, k, d) if off is not None else d
    o = OffloadOptions()
    for f in dataclasses.fields(OffloadOptions):
        if f.name == "modes":
            continue
        v = get(f.name, getattr(o, f.name))
        if f.name == "chunk_bytes":
            v = None if v in (None, "", "auto") else parse_bytes(v)
        elif f.name in ("device_budget", "host_budget", "disk_max_bytes", "disk_chunk_bytes"):
            unset = None if f.name != "disk_chunk_bytes" else o.disk_chunk_bytes
            v = parse_bytes(v) if v not in (None, "") else unset
        setattr(o, f.name, v)
    o.validate()
    return o


class OffloadRuntime:
    """Runs forward/backward and the optimizer step of ``model`` as ``options`` place things."""

    def __init__(self, model: nn.Module, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
                 options: OffloadOptions, platform: Platform, loss_fn: LossFn,
                 example: tuple[torch.Tensor, torch.Tensor],
                 *, autocast: Callable[[], Any] | None = None, accum: int = 1, device: torch.device | str | None = None,
                 costs: ChainCosts | None = None):
        self.model = model
        self.chain: Chain = to_chain(model)
        self.loss_fn = loss_fn
        self.autocast = autocast or contextlib.nullcontext
        self.accum = accum
        self.platform = platform
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        self.costs = runtime_costs(self.chain, example, loss_fn, self.autocast, platform, costs)
        self.params: list[nn.Parameter] = chain_params(self.chain)
        options = dataclasses.replace(options)  # the caller's object stays as it was
        self.plan = None
        if options.plan == "auto":
            from scaletrain.techniques.offload.planner import plan_offload

            self.plan = plan_offload(self.costs, platform, options, accum=accum)
            options = self.plan.options
        options.validate()
        n = len(self.chain)
        if options.modes is None:
            modes = ["keep"] * n
            for i in parse_blocks(options.recompute, self.chain.names):
                modes[i] = "recompute"
            for i in parse_blocks(options.activations, self.chain.names):
                if modes[i] == "recompute":
                    raise UserError(f"block {self.chain.names[i]!r} is both recomputed and offloaded; choose one")
                modes[i] = "offload"
            options.modes = modes
        self.options = options
        self.pools = make_pools(dev, options.device_budget, options.host_budget, options.strict, options.track)
        self.acts = ActivationOffloader(self.pools, [i for i, m in enumerate(options.modes) if m == "offload"],
                                        options.prefetch)
        self.host_opt: HostOptimizer | None = None
        self.device_opt: torch.optim.Optimizer | None = None
        self.streamer: WeightStreamer | None = None
        self.disk: DiskStates | None = None
        if options.optimizer == "device":
            self.device_opt = optimizer_factory(model)
            self.optimizer = self.device_opt
        else:
            if options.optimizer == "disk":
                self.disk = DiskStates(self.pools, options.disk_dir or None, options.disk_max_bytes,
                                       options.disk_chunk_bytes, options.disk_masters)
            self.host_opt = HostOptimizer(model, optimizer_factory, self.pools,
                                          resident_params=options.params == "device", dpu=options.dpu, disk=self.disk)
            self.optimizer = self.host_opt.optimizer
            self._hooks = [p.register_post_accumulate_grad_hook(self.host_opt.receive_grad)
                           for p in self.params if p.requires_grad]
        if options.params == "host":
            self.streamer = WeightStreamer(self.params, [b.params for b in self.costs.blocks], self.host_opt.master,
                                           self.pools, options.param_window)
        else:
            for p in self.params:
                if p.device != dev:
                    p.data = p.data.to(dev)
        for b in self.chain.buffers():
            if b.device != dev:
                b.data = b.data.to(dev)
        from scaletrain.techniques.offload.planner import predict

        self.prediction = predict(self.costs, self.options, platform, accum=accum)
        self._stats: dict[str, Any] = {}
        self._bwd_started: list[int] = []
        self._t0: float | None = None
        self._marks: list | None = None
        self._want_times = options.measure_times and self.pools.device.type == "cpu"
        self.times_measured = False
        self._host_steps = 0
        self.host_update_rate: float | None = None
        """Parameters per second of the host update as measured in the second step (the first one
        allocates the states); replaces the platform's CPU-Adam rate in the predictions from then on."""

    # ------------------------------------------------------------------ one micro-batch
    def _persistent(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        out = [x, y] + list(self.params) + list(self.chain.buffers())
        return out

    def _copy_s(self) -> float:
        return sum(self.pools.stats.seconds.values())

    def _on_backward_start(self, i: int, grad: torch.Tensor) -> None:
        if self._marks is not None:
            self._marks.append((i, time.perf_counter(), self._copy_s()))
        if self.streamer is not None:
            self.streamer.claims.backward_start(i)
            self.streamer.wait(i)
        self.acts.on_backward_start(i)
        self._bwd_started.append(i)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients of ``loss * weight`` accumulate. Returns the loss."""
        modes = self.options.modes
        if self._t0 is None:
            self._t0 = time.perf_counter()
        persistent = self._persistent(x, y)
        with self.pools.phase(persistent=[x, y], model=self.chain, optimizer=self.device_opt):
            self.acts.begin_step(persistent)
            self._bwd_started = []
            timing = self._marks = [] if self._want_times else None
            fwd = [0.0] * len(modes)
            out = x
            for i, blk in enumerate(self.chain.blocks):
                if timing is not None:
                    t0, c0 = time.perf_counter(), self._copy_s()
                if self.streamer is not None:
                    self.streamer.claims.forward_start(i)
                    self.streamer.wait(i)
                with self.autocast():
                    if modes[i] == "recompute":
                        out = checkpoint(blk, out, use_reentrant=False)
                    elif modes[i] == "offload":
                        with self.acts.hooks(i):
                            out = blk(out)
                    else:
                        out = blk(out)
                if modes[i] == "offload":
                    self.acts.end_block(i)
                if self.streamer is not None:
                    self.streamer.claims.forward_end(i)
                if out.requires_grad:
                    out.register_hook(lambda g, i=i: self._on_backward_start(i, g))
                if timing is not None:
                    fwd[i] = time.perf_counter() - t0 - (self._copy_s() - c0)
            if timing is not None:
                timing.append((-1, time.perf_counter(), self._copy_s()))
            with self.autocast():
                loss = self.loss_fn(out, y)
            del out
            (loss * weight).backward()
            if timing is not None:
                timing.append((-2, time.perf_counter(), self._copy_s()))
                self._apply_times(fwd, timing)
            if self.streamer is not None:
                self.streamer.claims.finish()
            self.acts.end_step()
        return loss.detach()

    def _apply_times(self, fwd: list[float], marks: list[tuple[int, float, float]]) -> None:
        """Block times from the first micro-batch (copy time excluded) replace the estimates."""
        self._want_times = False
        self._marks = None
        bwd = [0.0] * len(fwd)
        for (i, t, c), (_, t2, c2) in zip(marks, marks[1:]):
            dt = max(t2 - t - (c2 - c), 0.0)
            if i == -1:
                self.costs.loss_time_s = dt
            elif i >= 0:
                bwd[i] = max(dt - (fwd[i] if self.options.modes[i] == "recompute" else 0.0), 0.0)
        self.costs.set_times(fwd, bwd)
        from scaletrain.techniques.offload.planner import predict

        self.prediction = predict(self.costs, self.options, self.platform, accum=self.accum)
        self.times_measured = True

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference forward (evaluation): streamed weights pass through the device block by block."""
        self.flush()
        out = x
        for i, blk in enumerate(self.chain.blocks):
            if self.streamer is not None:
                self.streamer.claims.forward_start(i)
                self.streamer.wait(i)
            with self.autocast():
                out = blk(out)
            if self.streamer is not None:
                self.streamer.claims.forward_end(i)
        if self.streamer is not None:
            self.streamer.claims.finish()
        return out

    # ------------------------------------------------------------------ the step
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm wherever the gradients are; returns the norm before clipping."""
        if self.host_opt is not None:
            return self.host_opt.clip_grad_norm_(max_norm)
        src = getattr(self.chain, "source", None) or self.model
        return float(nn.utils.clip_grad_norm_(src.parameters(), max_norm, foreach=True))

    def step(self) -> None:
        """Optimizer step, then zero the gradients, then record this step's figures."""
        if self.device_opt is not None:
            with self.pools.phase(model=self.chain, optimizer=self.device_opt):
                self.device_opt.step()
                self.device_opt.zero_grad(set_to_none=True)
        else:  # host compute: outside any device phase (nothing is allocated on the device)
            t0, c0 = time.perf_counter(), self._copy_s()
            self.host_opt.step()
            self._host_steps += 1
            if self.options.measure_times and self._host_steps == 2 and not self.options.dpu and self.disk is None:
                self._measured_update(time.perf_counter() - t0 - (self._copy_s() - c0))
        self.pools.synchronize()
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        self._t0 = None
        st = self.pools.stats
        self._stats = {
            "step_time_s": elapsed,
            "transfer_s": sum(st.seconds.values()),
            "device_peak_bytes": self.pools.device_peak_bytes,
            "offload_bytes": st.total("h2d") + st.total("d2h"),
            "h2d_bytes": st.total("h2d"), "d2h_bytes": st.total("d2h"),
            "disk_read_bytes": st.total("disk_read"), "disk_write_bytes": st.total("disk_write"),
            "host_peak_bytes": self.pools.host.peak_bytes,
            "transfers": st.as_dict(),
            "late_fetches": self.acts.late_fetches,
            **self.prediction.as_row(),
        }
        st.reset()
        self.pools.reset_peak()

    def _measured_update(self, seconds: float) -> None:
        """Predict with the host update rate just measured (the optimizer actually run: fused, foreach...)."""
        if seconds <= 0 or self.platform is None:
            return
        from scaletrain.techniques.offload.planner import predict

        self.host_update_rate = self.costs.total_params / seconds
        self.platform = self.platform.with_(cpu_adam_params_per_s=self.host_update_rate)
        self.prediction = predict(self.costs, self.options, self.platform, accum=self.accum)

    def last_stats(self) -> dict[str, Any]:
        """Measured and predicted figures of the last optimizer step (for metrics.jsonl)."""
        return dict(self._stats)

    def flush(self) -> None:
        """Finish a delayed update (DPU) so the device parameters are current."""
        if self.host_opt is not None:
            self.host_opt.flush()

    # ------------------------------------------------------------------ state
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> current full parameter (host copies for streamed weights)."""
        self.flush()
        src = getattr(self.chain, "source", None) or self.model
        out = {}
        for name, p in src.named_parameters():
            if self.streamer is not None and self.host_opt is not None and id(p) in self.host_opt.master:
                out[name] = self.host_opt.master[id(p)].detach().clone()
            else:
                out[name] = p.detach().clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"model": like model.state_dict(), "optimizer": ...}`` with full (host) copies of streamed
        weights; the optimizer part is torch's format except for the disk tier (its files' contents)."""
        return {"model": self.model_state_dict(), "optimizer": self.optimizer_state_dict()}

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Like ``model.state_dict()`` (same keys), streamed weights taken from their host masters."""
        self.flush()
        src = getattr(self.chain, "source", None) or self.model
        masters = self.host_opt.master if self.host_opt is not None and self.streamer is not None else {}
        return {k: (masters.get(id(v), v)).detach().clone() for k, v in src.state_dict(keep_vars=True).items()}

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state: torch's format (the disk tier: its files' contents, steps and lrs)."""
        self.flush()
        if self.disk is not None:
            return {"disk": [self.disk.state_tensors(g) for g in range(len(self.disk.files))],
                    "steps": list(self.disk.steps), "lr": [g["lr"] for g in self.optimizer.param_groups]}
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (the model part also accepts a plain model.state_dict())."""
        self.load_model_state_dict(state["model"])
        self.load_optimizer_state_dict(state["optimizer"])

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a ``model.state_dict()`` (strict: the same keys and shapes, else RuntimeError)."""
        self.flush()
        src = getattr(self.chain, "source", None) or self.model
        own = src.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict: missing keys {missing[:3]}, unexpected keys "
                               f"{unexpected[:3]}")
        master = self.host_opt.master if self.host_opt is not None else {}
        with torch.no_grad():
            for k, v in state.items():
                t = own[k]
                if tuple(v.shape) != tuple(t.shape):
                    raise RuntimeError(f"size mismatch for {k}: checkpoint {tuple(v.shape)}, model {tuple(t.shape)}")
                if self.streamer is not None and id(t) in master:
                    master[id(t)].copy_(v)
                else:
                    t.copy_(v)
                    if id(t) in master:
                        master[id(t)].copy_(t)

    def load_optimizer_state_dict(self, opt: dict[str, Any]) -> None:
        """Load what :meth:`optimizer_state_dict` returned."""
        self.flush()
        if self.disk is not None:
            for g, tensors in enumerate(opt["disk"]):
                self.disk.load_state_tensors(g, tensors, opt["steps"][g])
            for g, lr in zip(self.optimizer.param_groups, opt["lr"]):
                g["lr"] = lr
        else:
            self.optimizer.load_state_dict(opt)

    def close(self) -> None:
        """Flush and remove the disk tier's files."""
        self.flush()
        if self.disk is not None:
            self.disk.close()


def build_offload_runtime(model: nn.Module, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
                          cfg_like: Any, platform: Platform | None, *, loss_fn: LossFn,
                          example: tuple[torch.Tensor, torch.Tensor], autocast: Callable[[], Any] | None = None,
                          accum: int = 1, device: torch.device | str | None = None) -> OffloadRuntime:
    """The trainer's entry point: a runtime with ``forward_backward(x, y, weight)``, ``clip_grad_norm_``,
    ``step()``, ``optimizer`` (for the LR scheduler), ``last_stats()`` and ``close()``.

    ``example`` is a batch (real or meta tensors of the right shapes and dtypes) used to probe
    the chain; ``platform`` defaults to a quick calibration of this machine.
    """
    from scaletrain.platform import calibrate

    opts = options_from_cfg(cfg_like)
    plat = platform or calibrate(quick=True)
    if opts.plan == "chunks":
        from scaletrain.techniques.offload.chunk_runtime import ChunkRuntime

        return ChunkRuntime(model, optimizer_factory, opts, plat, loss_fn, example, autocast=autocast, accum=accum,
                            device=device)
    return OffloadRuntime(model, optimizer_factory, opts, plat, loss_fn, example, autocast=autocast, accum=accum,
                          device=device)
