"""The trainer's face of offloading: a :class:`~scaletrain.techniques.data_parallel.Strategy` that runs
every micro-batch, the clipping, the optimizer step and evaluation through an
:class:`~scaletrain.techniques.offload.runtime.OffloadRuntime`.

Chosen by the trainer when any ``memory.offload.*`` key differs from its default or
``memory.device_budget`` is set. With ``memory.offload.plan=auto`` the joint planner picks where
parameters, optimizer states and each block's activations live so the predicted device peak fits
``memory.device_budget``; a budget no plan meets is a one-line :class:`ConfigError` naming the
smallest budget that works.

What the trainer sees is the single-process run: the same losses and parameters (fp32 on CPU:
bitwise; the host optimizer runs the very Adam code the configured optimizer runs), checkpoints in
the single-process layout (``model.state_dict()`` and the configured torch optimizer's
``state_dict()``), so a checkpoint of an offload run resumes a plain run and vice versa. Each
metrics row carries the measured device-pool peak and the bytes moved host<->device (and disk) in
the last optimizer step next to their predictions (``offload_*`` / ``offload_*_pred`` keys).

Not supported (one-line ConfigError): several processes, ``memory.remat`` (the offload planner
chooses recomputation itself: ``memory.offload.recompute``), ``memory.activation_compression``
(both install saved-tensor hooks), fp16 loss scaling (gradients leave the device as soon as they
are accumulated, before a GradScaler could unscale or check them; use bf16) and models adding an
auxiliary loss (mixture of experts).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator

import torch
from torch import nn

from scaletrain.errors import ConfigError, UserError
from scaletrain.models.adapters.base import logits_of
from scaletrain.techniques.runtime import Strategy
from scaletrain.techniques.offload.pools import DeviceOutOfMemory
from scaletrain.techniques.offload.runtime import OffloadRuntime, build_offload_runtime

_PLATFORMS: dict[str, Any] = {}
"""Calibrated platforms per device type, measured once per process (a few seconds)."""


def local_platform(device: torch.device):
    """This machine's platform (``calibrate(quick=True)``), cached for the process."""
    from scaletrain.platform import calibrate

    if device.type not in _PLATFORMS:
        with torch.random.fork_rng(devices=[]):  # calibration must not move the training RNG
            _PLATFORMS[device.type] = calibrate(quick=True)
    return _PLATFORMS[device.type]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


class OffloadStrategy(Strategy):
    """One process; forward/backward, clipping, the step and evaluation through an offload runtime."""

    name = "offload"

    def __init__(self, model: nn.Module, runtime: OffloadRuntime, budget: int | None = None) -> None:
        super().__init__(model)
        self.rt = runtime
        self.budget = budget
        self._template: list[dict[str, Any]] | None = None
        """The configured optimizer's param-group hyperparameters (the plain checkpoint layout)."""
        self._before_eval: tuple[dict, dict, dict] | None = None
        """Transfer counters as they were when an evaluation began (its weight streaming is not a step's)."""

    # -- construction --------------------------------------------------------------------
    @classmethod
    def build(cls, model: nn.Module, plan: Any, ctx: Any) -> "OffloadStrategy":
        """The offload runtime of ``plan.offload`` over ``model`` (one process; the compatibility
        table has already accepted the plan)."""
        import dataclasses

        assert ctx.example_batch is not None and ctx.build_optimizer is not None
        example = ctx.example_batch()
        state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):  # probing and planning leave the training RNG as it was
                rt = build_offload_runtime(model, ctx.build_optimizer, dataclasses.asdict(plan.offload),
                                           local_platform(ctx.device), loss_fn=ctx.loss_fn, example=example,
                                           autocast=ctx.autocast, accum=ctx.accum, device=ctx.device)
        except ConfigError:
            raise
        except UserError as e:  # no plan fits, bad block list, unsupported optimizer: one line
            raise ConfigError(str(e)) from None
        finally:
            random.setstate(state)
        s = cls(model, rt, rt.options.device_budget)
        ctx.log(f"offload: {s.describe()}")
        pred = rt.prediction.device_peak_bytes
        if s.budget is not None and pred > s.budget:
            ctx.log(f"warning: this manual offload plan's predicted device peak {pred} B exceeds "
                    f"memory.device_budget={s.budget} B; memory.offload.plan=auto chooses one that fits")
        return s

    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The runtime's optimizer (device, host or disk) — what the LR scheduler drives."""
        proto = build(self.model)  # only its hyperparameters (torch optimizers allocate states lazily)
        self._template = [{k: v for k, v in g.items() if k != "params"} for g in proto.param_groups]
        del proto
        return self.rt.optimizer

    # -- the step ------------------------------------------------------------------------
    def _oom(self, e: DeviceOutOfMemory) -> ConfigError:
        pred = self.rt.prediction.device_peak_bytes
        return ConfigError(f"{str(e).splitlines()[0]} (predicted peak {pred} B); memory.offload.plan=auto "
                           f"chooses a plan that fits")

    def run_micro_batches(self, ctx: Any, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self._forget_evaluation()
        step_loss = 0.0
        try:
            for _ in range(ctx.accum):
                x, y = next(it)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                step_loss += float(self.rt.forward_backward(x, y, 1.0 / ctx.accum)) / ctx.accum
        except DeviceOutOfMemory as e:
            raise self._oom(e) from None
        return step_loss

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        return float(self.rt.clip_grad_norm_(max_norm))

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        try:
            self.rt.step()  # also zeroes the gradients (device) / starts the next accumulation (host)
        except DeviceOutOfMemory as e:
            raise self._oom(e) from None

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # done by the runtime's step

    def eval_batch(self, ctx: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        if self._before_eval is None:
            self.rt.flush()  # a delayed update's upload (DPU) still counts for the step that started it
            st = self.rt.pools.stats
            self._before_eval = (dict(st.bytes), dict(st.count), dict(st.seconds))
        out = self.rt.forward(x)  # under the trainer's autocast, streamed weights block by block
        loss = float(ctx.loss_fn(out, y)) * len(y)
        correct = int((logits_of(out).argmax(-1) == y).sum()) if ctx.task != "lm" else 0
        return loss, correct, len(y)

    def _forget_evaluation(self) -> None:
        """Drop what evaluation moved from the counters, so each step's figures are the step's alone."""
        if self._before_eval is None:
            return
        st = self.rt.pools.stats
        for mine, saved in zip((st.bytes, st.count, st.seconds), self._before_eval):
            mine.clear()
            mine.update(saved)
        self._before_eval = None

    def metrics(self) -> dict[str, Any]:
        """The last optimizer step's measured figures next to their predictions (bytes, seconds)."""
        st = self.rt.last_stats()
        if not st:
            return {}
        row: dict[str, Any] = {}
        for key in ("device_peak", "h2d", "d2h", "disk_read", "disk_write", "host_peak"):
            row[f"offload_{key}_bytes"] = int(st[f"{key}_bytes"])
            row[f"offload_{key}_pred_bytes"] = int(st[f"predicted_{key}_bytes"])
        # The names: the device peak (the logical pool's on CPU) and all bytes moved between tiers.
        moved = ("h2d", "d2h", "disk_read", "disk_write")
        row["device_peak_bytes"] = row["offload_device_peak_bytes"]
        row["device_peak_pred_bytes"] = row["offload_device_peak_pred_bytes"]
        row["offload_bytes"] = sum(row[f"offload_{k}_bytes"] for k in moved)
        row["offload_pred_bytes"] = sum(row[f"offload_{k}_pred_bytes"] for k in moved)
        row["offload_step_time_s"] = st["step_time_s"]
        row["offload_step_time_pred_s"] = st["predicted_step_time_s"]
        row["offload_transfer_s"] = st["transfer_s"]
        row["offload_late_fetches"] = st["late_fetches"]
        if self.budget is not None:
            row["offload_device_budget_bytes"] = int(self.budget)
        return row

    def describe(self) -> str:
        o, p = self.rt.options, self.rt.prediction
        modes = o.modes or []
        names = self.rt.chain.names
        picked = {m: [names[i] for i, x in enumerate(modes) if x == m] for m in ("recompute", "offload")}
        acts = ", ".join(f"{m} {len(v)} ({','.join(v)})" for m, v in picked.items() if v) or "all kept"
        how = "auto plan" if self.rt.plan is not None else "manual plan"
        extra = (f", window {o.param_window}" if o.params == "host" else "") + (", DPU" if o.dpu else "")
        budget = f" of budget {_mib(self.budget)}" if self.budget is not None else ""
        return (f"{how}: params on {o.params}{extra}, optimizer on {o.optimizer}, activations of {len(modes)} blocks: "
                f"{acts}, prefetch {o.prefetch}; predicted device peak {_mib(p.device_peak_bytes)}{budget}, "
                f"{_mib(p.h2d_bytes)} host->device + {_mib(p.d2h_bytes)} device->host per step, "
                f"step time {p.step_time_s * 1e3:.1f} ms (estimated; measured block times after the first step)")

    # -- state: always the single-process layout -----------------------------------------
    def model_state_dict(self) -> dict[str, Any]:
        return self.rt.model_state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.rt.load_model_state_dict(state)
        if self.rt.disk is not None and self.rt.disk.masters_on_disk:
            self._write_disk_masters()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The configured torch optimizer's ``state_dict()`` (what a plain run saves)."""
        rt = self.rt
        if rt.device_opt is not None or (rt.host_opt is not None and not rt.host_opt.cpu_adam):
            return rt.optimizer_state_dict()  # the configured optimizer itself (or rebound to host masters)
        groups = rt.optimizer.param_groups
        params = self._group_params()
        state: dict[int, dict[str, torch.Tensor]] = {}
        idx = 0
        out_groups = []
        rt.flush()  # a delayed update (DPU) lands first
        own = rt.optimizer.state_dict() if rt.disk is None else {}
        for g, (group, ps) in enumerate(zip(groups, params)):
            ids = list(range(idx, idx + len(ps)))
            if rt.disk is not None:
                flat = rt.disk.state_tensors(g)
                steps = rt.disk.steps[g]
                off = 0
                for i, p in zip(ids, ps):
                    n = p.numel()
                    if steps:
                        state[i] = {"step": torch.tensor(float(steps)),
                                    "exp_avg": flat["m"][off:off + n].view(p.shape).clone(),
                                    "exp_avg_sq": flat["v"][off:off + n].view(p.shape).clone()}
                    off += n
            else:
                for i in ids:
                    if i in own["state"]:
                        state[i] = {k: v.clone() for k, v in own["state"][i].items()}
            out_groups.append({**self._template_group(g), **{k: v for k, v in group.items()
                                                              if k in ("lr", "initial_lr", "betas", "eps",
                                                                       "weight_decay")},
                               "params": ids})
            idx += len(ps)
        return {"state": state, "param_groups": out_groups}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if state.get("sharded"):
            super().load_optimizer_state_dict(optimizer, state)
        rt = self.rt
        if rt.disk is None:
            rt.load_optimizer_state_dict(state)  # torch format (CPUAdam keeps its flat buffers)
            return
        params = self._group_params()
        if len(state["param_groups"]) != len(params):
            raise ValueError(f"checkpoint has {len(state['param_groups'])} optimizer groups, this run "
                             f"{len(params)}")
        disk_groups, steps = [], []
        for sg, ps in zip(state["param_groups"], params):
            if len(sg["params"]) != len(ps):
                raise ValueError("optimizer group sizes differ from this run's")
            sts = [state["state"].get(i, {}) for i in sg["params"]]
            step = {float(s["step"]) for s in sts if "step" in s}
            if len(step) > 1:
                raise ValueError("the disk tier needs one step count per group; this checkpoint's parameters differ")
            m = torch.cat([s["exp_avg"].reshape(-1).float() if s else torch.zeros(p.numel())
                           for s, p in zip(sts, ps)]) if ps else torch.zeros(0)
            v = torch.cat([s["exp_avg_sq"].reshape(-1).float() if s else torch.zeros(p.numel())
                           for s, p in zip(sts, ps)]) if ps else torch.zeros(0)
            disk_groups.append({"m": m, "v": v})
            steps.append(int(step.pop()) if step else 0)
        rt.load_optimizer_state_dict({"disk": disk_groups, "steps": steps,
                                      "lr": [sg["lr"] for sg in state["param_groups"]]})
        for g, sg in zip(rt.optimizer.param_groups, state["param_groups"]):
            if "initial_lr" in sg:
                g["initial_lr"] = sg["initial_lr"]

    def _group_params(self) -> list[list[nn.Parameter]]:
        """The device parameters of each optimizer group, in the configured optimizer's order."""
        return [ps for _, ps in self.rt.host_opt._groups]

    def _template_group(self, g: int) -> dict[str, Any]:
        return dict(self._template[g]) if self._template is not None and g < len(self._template) else {}

    def _write_disk_masters(self) -> None:
        """After loading the model: the disk tier's fp32 masters are the loaded parameters."""
        disk = self.rt.disk
        for g, ps in enumerate(self._group_params()):
            if ps:
                flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in ps])
                disk.load_state_tensors(g, {"master": flat}, disk.steps[g])

    def close(self) -> None:
        super().close()
        self.rt.close()
