"""Optimizer memory, in one place: state bytes and the transient bytes of ``optimizer.step()``.

Optimizers come from the project's registry (sgd, adam, adamw, adam8bit, adamw8bit, adafactor, came,
lamb, lars), which the optimizer technique provides and the package root installs with
:func:`scaletrain.measure.use_optimizers` (measuring sits below the techniques and names none of
them); their *state* bytes are the registry's cost face ``state_bytes`` (for torch's own, the
closed form below, which a test checks equal to the registry's on CPU and which also knows where
Adam's step counters live and CUDA's 512-byte rounding). This module adds what the registry does not
give: the *transient* bytes of a step, which decide whether the optimizer step is the peak.

PyTorch's own optimizers (``sgd``, ``adam``, ``adamw``; the registry builds them with
``foreach=True``) are modelled in closed form from their source (torch/optim/{sgd,adam}.py,
torch 2.x); a test checks the model against the real step run on fake tensors, in both
implementations. The registry's own optimizers are measured by running two steps on fake
tensors (exact, allocation-free) — except the 8-bit ones, whose transient is the registry's
closed form (``registry.step_transient_bytes`` / ``Adam8bit.step_transient_nbytes``): a fake run
would only show the eager block update, while on a real device ``fused=None`` compiles the update
of tensors >= 64 Ki values, which allocates 8 bytes per value of a chunk instead of 57.

What the torch optimizers keep (Ψ_i = bytes of parameter i in its own dtype):

- ``sgd`` with momentum: one ``momentum_buffer`` per parameter (Ψ_i); none without momentum.
- ``adam`` / ``adamw``: ``exp_avg`` and ``exp_avg_sq`` (2Ψ_i, +Ψ_i with amsgrad) and a scalar
  ``step`` tensor (float32: 4 bytes, on the parameter's device only when fused/capturable,
  otherwise on the CPU — so it costs device memory only for CPU training).

Transient bytes of one step (above params + grads + states):

- for-loop implementation (PyTorch's default on CPU): Adam computes
  ``denom = (exp_avg_sq.sqrt() / bc).add_(eps)`` — two parameter-sized temporaries while the
  previous parameter's ``denom`` is still referenced: max_i (2Ψ_i + Ψ_{i-1}), +Ψ_i for Adam's L2
  weight-decay copy of the gradient. SGD copies the gradient for weight decay and for nesterov
  (two copies alive at once when both).
- foreach implementation (the registry's choice; PyTorch's default on CUDA): the same
  temporaries for *all* parameters of a (device, dtype) group at once: ΣΨ_i per temporary list
  (Adam: one ``_foreach_sqrt`` list, while the previous group's list is still referenced; SGD: a
  copy only for weight decay).
- fused: no parameter-sized temporaries.

One parameter group is assumed (the estimator builds optimizers over a parameter list).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import torch

from scaletrain.errors import UserError

ShapeDtype = tuple[Sequence[int], torch.dtype]

TORCH_OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 1e-3}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
}
"""torch's own optimizers with the registry's defaults (SGD: lr 1e-3, no momentum unless given)."""

CLOSED_FORM = ("adam8bit", "adamw8bit")
"""Registry optimizers whose step transient is the registry's closed form, not a fake run."""


def _registry() -> Any:
    """The optimizer registry installed with :func:`scaletrain.measure.use_optimizers`, or None (torch's only)."""
    from scaletrain import measure

    return measure.optimizer_source()


def names() -> list[str]:
    """Every optimizer name the estimator knows (the registry's, else torch's)."""
    reg = _registry()
    return list(reg.names()) if reg is not None else list(TORCH_OPTIMIZERS)


def check(name: str) -> str:
    key = name.lower()
    if key not in names():
        raise UserError(f"unknown optimizer {name!r}; allowed: {', '.join(names())}")
    return key


def build(name: str, params: Iterable[torch.nn.Parameter], **kw: Any) -> torch.optim.Optimizer:
    """Optimizer ``name`` over ``params`` as the project builds it (the registry).

    For torch's own, ``foreach``/``fused`` in ``kw`` select the implementation directly (the
    registry fixes ``foreach=True``).
    """
    name = check(name)
    reg = _registry()
    if name in TORCH_OPTIMIZERS and (reg is None or "foreach" in kw or "fused" in kw):
        cls_name, defaults = TORCH_OPTIMIZERS[name]
        return getattr(torch.optim, cls_name)(list(params), **{**defaults, **kw})
    return reg.build_optimizer(name, list(params), **kw)  # type: ignore[union-attr]


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * _dtype_size(dtype)


def _opts(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    return {**TORCH_OPTIMIZERS[name][1], **kw} if name in TORCH_OPTIMIZERS else dict(kw)


def torch_state_bytes(name: str, shapes_and_dtypes: Sequence[ShapeDtype], *, device_type: str = "cpu",
                      **kw: Any) -> int:
    """State bytes of torch's sgd/adam/adamw from their source (see module doc)."""
    o = _opts(name, kw)
    total = 0
    for shape, dtype in shapes_and_dtypes:
        b = _round(_nbytes(shape, dtype), device_type)
        if name == "sgd":
            total += b if o.get("momentum", 0) else 0
        else:
            total += (3 if o.get("amsgrad") else 2) * b
            on_device = device_type == "cpu" or o.get("fused") or o.get("capturable")
            total += _round(4, device_type) if on_device else 0  # scalar float32 ``step``
    return total


def _round(n: int, device_type: str) -> int:
    """CUDA's caching allocator hands out whole 512-byte blocks."""
    return -(-n // 512) * 512 if device_type == "cuda" and n > 0 else n


def state_bytes(name: str, shapes_and_dtypes: Sequence[ShapeDtype], *, device_type: str = "cpu",
                **kw: Any) -> int:
    """Bytes of optimizer state on ``device_type`` for parameters of these shapes/dtypes.

    The registry's ``state_bytes`` (for torch's own, the closed form above, which also places
    Adam's 0-d ``step`` tensors: on the CPU unless fused or capturable, so not device memory on
    a GPU). On CUDA each parameter's state is rounded up to 512-byte blocks (exact for torch's,
    whose state tensors are parameter-sized; per parameter for the others).
    """
    name = check(name)
    reg = _registry()
    if reg is None or name in TORCH_OPTIMIZERS:
        return torch_state_bytes(name, shapes_and_dtypes, device_type=device_type, **kw)
    if device_type != "cuda":
        return int(reg.state_bytes(name, list(shapes_and_dtypes), **kw))
    return sum(_round(int(reg.state_bytes(name, [sd], **kw)), device_type) for sd in shapes_and_dtypes)


def backward_free(name: str) -> bool:
    """Whether optimizer ``name`` trains without a backward pass (the registry's zero-order ones): its step
    is two forwards, so the estimator traces that step (:func:`scaletrain.measure.estimate.estimate_step`)."""
    reg = _registry()
    return bool(getattr(reg, "backward_free", lambda n: False)(check(name)))


def transient_modelled(name: str) -> bool:
    """False where :func:`step_transient_bytes` has no model and answers 0 (see module doc)."""
    reg = _registry()
    return not (check(name) in CLOSED_FORM and getattr(reg, "step_transient_bytes", None) is None)


def default_foreach(device_type: str) -> bool:
    """PyTorch picks foreach by default only for CUDA-like devices (torch/optim/optimizer.py)."""
    return device_type not in ("cpu", "meta")


def step_transient_bytes(name: str, shapes_and_dtypes: Sequence[ShapeDtype], *, device_type: str = "cpu",
                         foreach: bool | None = None, **kw: Any) -> int:
    """Peak bytes ``optimizer.step()`` allocates above params + grads + states (see module doc)."""
    name = check(name)
    reg = _registry()
    if name not in TORCH_OPTIMIZERS:
        fn = getattr(reg, "step_transient_bytes", None)
        closed = fn(name, list(shapes_and_dtypes), device_type=device_type, **kw) if fn is not None else None
        if closed is not None:
            return int(closed)
        if name in CLOSED_FORM:
            return 0  # not modelled (see module doc)
        return _simulated(name, tuple((tuple(s), d) for s, d in shapes_and_dtypes), tuple(sorted(kw.items())))[1]
    o = _opts(name, kw)
    if o.get("fused"):
        return 0
    if foreach is None:
        foreach = o.get("foreach")
    if foreach is None:  # the registry builds torch's optimizers with foreach=True
        foreach = True if reg is not None else default_foreach(device_type)
    sizes = [_nbytes(s, d) for s, d in shapes_and_dtypes]
    groups = _group_totals(shapes_and_dtypes)
    if name == "sgd":
        if foreach:  # weight decay makes a new gradient list; nesterov adds into it in place
            return max(groups, default=0) if o.get("weight_decay") else 0
        copies = int(bool(o.get("weight_decay"))) + int(bool(o.get("nesterov")))
        return min(copies, 2) * max(sizes, default=0)  # ``grad = grad.add(...)``: old and new alive at once
    # Adam/AdamW: L2 weight decay (Adam only; AdamW decays in place) first copies the gradient
    wd = 1 if (name == "adam" and o.get("weight_decay")) else 0
    if foreach:
        # one ``_foreach_sqrt`` list per (device, dtype) group while the previous group's is still
        # referenced (the weight-decay copy is deleted before the sqrt, so it never adds)
        return max((b + (groups[i - 1] if i else 0) for i, b in enumerate(groups)), default=0)
    # for-loop: sqrt and div temporaries of parameter i, plus ``denom`` of parameter i-1
    return max(((2 + wd) * b + (sizes[i - 1] if i else 0) for i, b in enumerate(sizes)), default=0)


def _group_totals(shapes_and_dtypes: Sequence[ShapeDtype]) -> list[int]:
    """Bytes per dtype group, in order of first appearance (torch groups foreach work this way)."""
    groups: dict[torch.dtype, int] = {}
    for s, d in shapes_and_dtypes:
        groups[d] = groups.get(d, 0) + _nbytes(s, d)
    return list(groups.values())


def simulate(name: str, shapes_and_dtypes: Sequence[ShapeDtype], *, device: str = "cpu",
             **kw: Any) -> tuple[int, int]:
    """(state bytes, step transient bytes) measured by running two steps on fake tensors.

    Exact for any optimizer written in torch ops (the same code runs; nothing is allocated).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain.measure.tracker import MemoryTracker

    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [torch.nn.Parameter(torch.empty(tuple(s), dtype=d, device=device)) for s, d in shapes_and_dtypes]
        for p in params:
            p.grad = torch.empty_like(p)
        opt = build(name, params, **kw)
        opt.step()
        with MemoryTracker(optimizer=opt, device=device) as t:
            base = t.current_bytes
            opt.step()
        return t.current_breakdown["optimizer_states"], t.peak_bytes - base


@functools.lru_cache(maxsize=32)
def _simulated(name: str, shapes_and_dtypes: tuple, kw: tuple) -> tuple[int, int]:
    return simulate(name, shapes_and_dtypes, **dict(kw))
