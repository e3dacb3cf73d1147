"""One training step, the same code for measuring (real tensors) and simulating (fake tensors).

A step is: for each of ``accum`` micro-batches, forward under the precision's autocast, loss
(divided by ``accum``), backward; then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.
The micro-batches are built before the step (they are the caller's data, held for the whole
step). Precision (see :func:`autocast`):

- ``fp32``: no autocast.
- ``bf16`` / ``fp16``: ``torch.autocast`` with fp32 parameters — matmuls and convolutions run in
  16 bits and save 16-bit copies of their inputs and weights for backward; parameters, grads and
  optimizer states stay fp32 (there is no separate master copy). fp16 adds a ``GradScaler``.
- ``params_dtype`` bf16/fp16 (ZeRO's "2 + 2 + 12" case): parameters and gradients stored in 16
  bits, and :class:`MasterWeights` keeps an fp32 master copy that the optimizer updates.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError
from scaletrain.measure import optimizers
from scaletrain.measure.types import PRECISIONS  # torch-free, for the CLI's parser

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    return precision


def autocast(precision: str, device_type: str):
    """The forward's precision context: ``torch.autocast`` for bf16/fp16, nothing for fp32."""
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the vocabulary. logits [b, s, V], target [b, s] int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def classify_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over classes. logits [b, classes], target [b] int64."""
    return F.cross_entropy(logits, target)


def loss_for(model: nn.Module) -> LossFn:
    """The reference loss of a model by its ``task`` attribute ("lm" or "classify")."""
    task = getattr(model, "task", None) or getattr(getattr(model, "source", None), "task", None)
    if task == "lm":
        return lm_loss
    if task == "classify":
        return classify_loss
    from scaletrain.models.adapters import adapt  # a model scaletrain did not write: its adapter's loss

    return adapt(_source(model)).loss


def _source(model: nn.Module) -> nn.Module:
    return getattr(model, "source", None) or model


def make_batch(model: nn.Module, batch: int, seq: int | None = None, *, device: str | torch.device = "cpu",
               generator: torch.Generator | None = None) -> Batch:
    """A random (input, target) pair of the shapes the model trains on.

    ``model.input_spec(batch, seq)`` gives the input's shape and dtype; targets are token ids
    [batch, seq] for "lm" models and class ids [batch] for "classify" models.
    """
    src = _source(model)
    if not hasattr(src, "input_spec"):  # a model scaletrain did not write: its adapter knows the shapes
        from scaletrain.models.adapters import adapt

        return adapt(src).example_inputs(batch, seq, device=device, generator=generator)
    spec = src.input_spec(batch, seq)
    task = getattr(src, "task", None)
    if task == "lm":
        vocab = src.config.vocab_size
        x = torch.randint(0, vocab, tuple(spec.shape), device=device, generator=generator)
        y = torch.randint(0, vocab, tuple(spec.shape), device=device, generator=generator)
        return x, y
    if spec.dtype.is_floating_point:
        # images take the parameters' dtype (16-bit when parameters are stored in 16 bits)
        pdt = next((p.dtype for p in src.parameters() if p.is_floating_point()), spec.dtype)
        x = torch.randn(tuple(spec.shape), dtype=pdt, device=device, generator=generator)
    else:
        x = torch.zeros(tuple(spec.shape), dtype=spec.dtype, device=device)
    n_cls = getattr(src, "num_classes", 10)
    y = torch.randint(0, n_cls, (batch,), device=device, generator=generator)
    return x, y


class MasterWeights:
    """fp32 master copies for 16-bit parameters (mixed precision as in ZeRO §3.1, K = 12).

    The model's parameters and gradients are 16-bit; ``step()`` copies each gradient to an fp32
    master gradient, runs the inner optimizer on the fp32 masters, copies them back and drops the
    fp32 gradients. State: master (4 B/param) + the inner optimizer's fp32 states.
    """

    def __init__(self, params: Iterable[nn.Parameter], name: str, **kw: Any):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float()) for p in self.params]
        self.inner = optimizers.build(name, self.masters, **kw)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything this wrapper keeps: masters and the inner optimizer's states."""
        out = list(self.masters)
        for st in self.inner.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out


def make_optimizer(model: nn.Module, name: str, *, params_dtype: str = "fp32", **kw: Any):
    """Optimizer ``name`` over the model's parameters; :class:`MasterWeights` for 16-bit params."""
    params = [p for p in model.parameters() if p.requires_grad]
    if params_dtype == "fp32":
        return optimizers.build(name, params, **kw)
    return MasterWeights(params, name, **kw)


def make_scaler(precision: str, device_type: str):
    """A GradScaler for fp16 (bf16 needs none), else None."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device_type)


def train_step(model: nn.Module, optimizer: Any, micro_batches: Sequence[Batch], *, precision: str = "fp32",
               loss_fn: LossFn | None = None, scaler: Any = None, mark: Callable[[str], None] | None = None) -> float:
    """Run one optimizer step over ``micro_batches`` (gradient accumulation when more than one).

    ``mark`` (e.g. ``MemoryTracker.mark``) is called with phase names for timelines.
    Returns the summed loss as a float (0.0 on fake tensors).
    """
    loss_fn = loss_fn or loss_for(model)
    k = len(micro_batches)
    dev = next(model.parameters()).device.type
    total = 0.0
    mark = mark or (lambda _label: None)
    if hasattr(optimizer, "estimate"):  # zero-order (the registry's zo-sgd): two forwards per micro-batch, no backward
        return _forward_only_step(model, optimizer, micro_batches, precision, loss_fn, mark)
    for i, (x, y) in enumerate(micro_batches):
        mark(f"forward {i}")
        with autocast(precision, dev):
            loss = loss_fn(model(x), y) / k
        mark(f"backward {i}")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if not _is_fake(loss):
            total += float(loss.detach())
        del loss
    mark("optimizer step")
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    mark("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    mark("end")
    return total


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _forward_only_step(model: nn.Module, optimizer: Any, micro_batches: Sequence[Batch], precision: str,
                       loss_fn: LossFn, mark: Callable[[str], None]) -> float:
    """A zero-order optimizer's step: ``optimizer.estimate(loss_of, weight)`` per micro-batch (forwards at
    perturbed parameters, no autograd graph), then ``optimizer.step()`` (the update along the seeded
    direction). Returns the summed loss (0.0 on fake tensors)."""
    dev = next(model.parameters()).device.type
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        mark(f"forward {i}")

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            with autocast(precision, dev):
                return loss_fn(model(x), y)

        loss = optimizer.estimate(loss_of, 1.0 / len(micro_batches))
        if not _is_fake(loss):
            total += float(loss) / len(micro_batches)
    mark("optimizer step")
    optimizer.step()
    mark("end")
    return total
