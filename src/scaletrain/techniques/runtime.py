"""The one interface between the trainer and whatever runs a plan: :class:`Runtime`.

The trainer calls, per optimizer step: :meth:`Runtime.run_micro_batches` (by default: for each
micro-batch ``micro_batch(last)`` around the context's forward/backward, ``after_backward(last)``
after it), then ``prepare_step`` -> ``clip_grad_norm`` -> :meth:`Runtime.optimizer_step` ->
``after_step`` -> ``zero_grad``; evaluation goes through :meth:`Runtime.eval_batch`; checkpoints
through the state-dict methods, always in the *full* single-process layout so a checkpoint loads
under any plan. A runtime never sees the trainer: it gets a :class:`RunContext`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.measure.comm import LEDGER


class Strategy:
    """Single process (and the interface of every data-parallel strategy).

    The trainer calls, per optimizer step: :meth:`run_micro_batches` (by default: for each
    micro-batch ``micro_batch(last)`` around the trainer's forward/backward, ``after_backward(last)``
    after it), then ``prepare_step`` -> ``clip_grad_norm`` -> :meth:`optimizer_step` ->
    ``after_step`` -> ``zero_grad``. Strategies that are not pure data parallelism (pipeline,
    tensor/context/expert parallelism, offloading) override the hooks they need: their own
    micro-batch loop (a pipeline schedule), their own evaluation forward (:meth:`eval_batch`),
    their own optimizer step (a host-side optimizer), and say which slice of the data this rank
    reads (:attr:`data_rank` of :attr:`data_world` data-parallel replicas).
    """

    name = "single"
    stage = 0

    def __init__(self, model: nn.Module, rank: int = 0, world: int = 1) -> None:
        self.model = model
        self.rank, self.world = rank, world
        self.data_rank, self.data_world = rank, world
        """This rank reads data shard ``data_rank`` of ``data_world`` (the data-parallel replicas)."""
        self.forward_module: nn.Module = model

    # -- the trainer's loop, overridable as a whole ----------------------------------------
    def run_micro_batches(self, trainer: Any, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward and backward of one optimizer step's ``trainer.accum`` micro-batches (gradients of
        the mean loss accumulate into ``.grad``); returns this rank's mean micro-batch loss."""
        step_loss = 0.0
        for j in range(trainer.accum):
            last = j == trainer.accum - 1
            x, y = next(it)
            x, y = x.to(trainer.device, non_blocking=True), y.to(trainer.device, non_blocking=True)
            with self.micro_batch(last):
                step_loss += float(trainer.forward_backward(x, y, 1.0 / trainer.accum)) / trainer.accum
            self.after_backward(last)
        return step_loss

    def eval_batch(self, trainer: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """(summed loss, correct predictions, samples) of one validation micro-batch on this rank."""
        with trainer.autocast():
            out = self.model(x)
        loss = float(trainer.loss_fn(out, y)) * len(y)
        correct = int((out.argmax(-1) == y).sum()) if trainer.task != "lm" else 0
        return loss, correct, len(y)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        """The update (skipped by the fp16 loss scaler on inf/NaN gradients)."""
        scaler.step(optimizer)
        scaler.update()

    def metrics(self) -> dict[str, Any]:
        """Extra per-step figures for the metrics rows (measured next to predicted), if any."""
        return {}

    # -- construction --------------------------------------------------------------------
    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        return build(self.model)

    def make_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device.type, enabled=enabled)

    # -- the step ------------------------------------------------------------------------
    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_backward(self, last: bool) -> None:
        pass

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the global gradient norm (L2 over all parameters) to ``max_norm``; return it."""
        return float(nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True))

    def after_step(self) -> None:
        pass

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    # -- reductions for logging ----------------------------------------------------------
    def mean(self, values: list[float]) -> list[float]:
        """Average ``values`` over the data-parallel ranks (bookkeeping: not counted as traffic)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        with LEDGER.paused():
            dist.all_reduce(t)
        return (t / self.world).tolist()

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        with LEDGER.paused():
            dist.all_reduce(t)
        return t.tolist()

    # -- state ---------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Any]:
        """Full (single-process layout) model state; collective in sharded strategies."""
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if state.get("sharded"):  # written by a ZeRO run whose states could not be consolidated
            raise ConfigError(f"the checkpoint's optimizer states are sharded for parallel.dp={state['dp']} "
                              f"parallel.zero={state['stage']} (8-bit or factored states cannot be re-sharded); "
                              f"resume with those values")
        optimizer.load_state_dict(state)

    def describe(self) -> str:
        return "single process"

    def close(self) -> None:
        """Drop references to wrappers so that garbage collection can free them before teardown."""
        self.forward_module = self.model
