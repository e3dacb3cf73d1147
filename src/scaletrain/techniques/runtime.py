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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.measure.comm import LEDGER
from scaletrain.models.adapters.base import logits_of


@dataclass
class RunContext:
    """What a runtime may know of the run — the narrow context the stack and every runtime get
    instead of the trainer. Set once at construction except the fields marked *step state*,
    which the trainer keeps current."""

    device: torch.device
    rank: int = 0
    world: int = 1
    dp_world: int = 1
    """Data-parallel replicas: processes / (pp x tp x cp)."""
    micro_batch: int = 1
    """Samples per micro-batch on one data-parallel replica."""
    accum: int = 1
    """Micro-batches per optimizer step (pipeline: ``parallel.microbatches``)."""
    seq_len: int | None = None
    """Tokens per sample of a language model (None for other tasks)."""
    task: str = "lm"
    precision: str = "fp32"
    """Compute precision: fp32, bf16 or fp16 (autocast)."""
    model_name: str = "model"
    seed: int = 0
    grad_clip: float = 0.0
    """Global-norm clipping threshold (0 = off)."""
    optim_hyper: dict = field(default_factory=dict)
    """Hyperparameters that decide the optimizer's state bytes (e.g. SGD/LARS momentum)."""
    log_every: int = 1
    steps: int = 1
    timeout_s: float = 600.0
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(default=lambda out, y: out)
    """Task loss of a micro-batch's output and targets (mean over its samples / tokens)."""
    log: Callable[[str], None] = field(default=lambda s: None)
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    """Builds the configured optimizer over a module's parameters (its param groups and order)."""
    example_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    """The first training micro-batch (shapes and dtypes for probing), on ``device``."""
    # step state
    step: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None
    forward_backward: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    """One micro-batch's forward and backward of ``loss * weight``; returns the unscaled loss."""

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    def counts_traffic(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based, about to run) is one the trainer logs: the
        steps whose traffic is counted op by op (a counter costs ~6 % of a CPU step)."""
        return (step + 1) % self.log_every == 0 or step + 1 >= self.steps


class Strategy:
    """Single process (and the interface of every runtime).

    The trainer calls, per optimizer step: :meth:`run_micro_batches` (by default: for each
    micro-batch ``micro_batch(last)`` around the context's forward/backward, ``after_backward(last)``
    after it), then ``prepare_step`` -> ``clip_grad_norm`` -> :meth:`optimizer_step` ->
    ``after_step`` -> ``zero_grad``. Runtimes that are not pure data parallelism (pipeline,
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
    def run_micro_batches(self, ctx: RunContext, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward and backward of one optimizer step's ``ctx.accum`` micro-batches (gradients of
        the mean loss accumulate into ``.grad``); returns this rank's mean micro-batch loss."""
        step_loss = 0.0
        assert ctx.forward_backward is not None
        for j in range(ctx.accum):
            last = j == ctx.accum - 1
            x, y = next(it)
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with self.micro_batch(last):
                step_loss += float(ctx.forward_backward(x, y, 1.0 / ctx.accum)) / ctx.accum
            self.after_backward(last)
        return step_loss

    def loss_and_backward(self, ctx: RunContext, x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
        """The plain micro-batch: forward through :attr:`forward_module`, the task loss (+ a mixture
        of experts' load-balancing loss), backward of the (fp16: scaled) ``loss * weight``."""
        with ctx.autocast():
            loss = ctx.loss_fn(self.forward_module(x), y)
            aux = getattr(self.model, "aux_loss", None)
            if callable(aux):  # mixture of experts: the load-balancing loss trains the routers
                loss = loss + aux()
        scaled = loss * weight
        (ctx.scaler.scale(scaled) if ctx.scaler is not None else scaled).backward()
        return loss.detach()

    def eval_batch(self, ctx: RunContext, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """(summed loss, correct predictions, samples) of one validation micro-batch on this rank
        (through :attr:`forward_module`: FSDP's root and DDP see the forward; without grad a remat
        tree is the plain forward)."""
        with ctx.autocast():
            out = self.forward_module(x)
        loss = float(ctx.loss_fn(out, y)) * len(y)
        correct = int((logits_of(out).argmax(-1) == y).sum()) if ctx.task != "lm" else 0
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
    def rng_state(self) -> torch.Tensor:
        """The CPU RNG stream this run's dropout draws from (checkpointed). A runtime whose model
        computes elsewhere (a sweep's shards) carries the model's own stream instead of the process's."""
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

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


Runtime = Strategy


class _RankMean(float):
    """A logged loss already averaged over the ranks (marks where the pending entries begin)."""


def average_pending(runtime: Strategy, losses: list[float], due: bool) -> tuple[float, bool]:
    """Average the logged losses over the data-parallel ranks only when ``due`` (a logging step):
    the trailing entries of ``losses`` not yet averaged (one per step since the last logging step,
    this rank's own) are replaced, in place, by their rank means in ONE all-reduce of
    ``8 x steps`` bytes, so no step outside the logging ones runs a collective the plan does not
    price. Bookkeeping: kept out of the traffic ledger like every logged-value reduction (its
    ``8 x log_every`` bytes once per ``log_every`` steps are not part of a step's traffic).
    Returns (the latest loss, whether every rank holds that same value: a decision such as
    stopping on divergence taken on it is then taken by all ranks alike)."""
    if runtime.world == 1:
        return losses[-1], True
    if not due:
        return losses[-1], False
    start = len(losses)
    while start > 0 and not isinstance(losses[start - 1], _RankMean):
        start -= 1
    losses[start:] = [_RankMean(v) for v in runtime.mean(losses[start:])]
    return losses[-1], True
