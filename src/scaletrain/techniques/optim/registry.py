"""Optimizers by name (``optim.name`` in the config): apply face ``build_optimizer`` and cost face
``state_bytes`` / ``state_bytes_per_param`` (exact bytes of the state each optimizer allocates)
and ``step_transient_bytes`` (temporary bytes of a step, in closed form for the 8-bit ones).

| name       | class                      | state bytes per parameter (fp32 params)          |
|------------|----------------------------|--------------------------------------------------|
| sgd        | torch.optim.SGD (foreach)  | 4 with momentum, else 0                          |
| adam       | torch.optim.Adam (foreach) | 8 (+4 amsgrad), + 4 bytes per tensor (step)      |
| adamw      | torch.optim.AdamW (foreach)| as adam                                          |
| adam8bit   | Adam8bit                   | 2 + 8/2048 for tensors >= 4096 values, else 8    |
| adamw8bit  | AdamW8bit                  | as adam8bit                                      |
| adafactor  | Adafactor                  | 4 (n + m) per [n, m] matrix (+4 nm with beta1)   |
| came       | CAME                       | 4 nm + 8 (n + m) per [n, m] matrix               |
| lamb       | LAMB                       | 8                                                |
| lars       | LARS                       | 4 with momentum (default 0.9), else 0            |
| zo-sgd     | ZOSGD (zero-order, MeZO)   | 0 (and no gradients: two forwards, no backward)  |
| zo-adam    | ZOAdam (zero-order Adam)   | 8 (and no gradients)                             |

torch's optimizers keep their state in the parameter dtype; scaletrain's keep fp32 statistics
(8-bit codes for Adam8bit) whatever the parameter dtype. Bytes are those present after the
first step (state is allocated lazily), counted as numel * element_size over the tensors in
``optimizer.state`` — see :func:`measured_state_bytes`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.techniques.optim.adafactor import Adafactor
from scaletrain.techniques.optim.adam8bit import Adam8bit, AdamW8bit
from scaletrain.techniques.optim.came import CAME
from scaletrain.techniques.optim.lamb import LAMB
from scaletrain.techniques.optim.lars import LARS
from scaletrain.techniques.optim.quantize import BLOCK_SIZE
from scaletrain.techniques.optim.zero_order import ZOSGD, ZOAdam, is_zero_order


@dataclass(frozen=True)
class OptimizerSpec:
    """One selectable optimizer: its class, the common arguments it takes, its documentation."""

    cls: type[torch.optim.Optimizer]
    common: tuple[str, ...]
    """Which of lr, weight_decay, betas, eps, momentum it accepts (others are a UserError)."""
    fixed: dict[str, Any]
    """Arguments always passed (foreach=True for torch's own)."""
    doc: str


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "sgd": OptimizerSpec(torch.optim.SGD, ("lr", "weight_decay", "momentum"), {"foreach": True},
                         "SGD; lr (default 1e-3), momentum (0), weight_decay (0, coupled L2)"),
    "adam": OptimizerSpec(torch.optim.Adam, ("lr", "weight_decay", "betas", "eps"), {"foreach": True},
                          "Adam (Kingma & Ba); lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0 (L2)"),
    "adamw": OptimizerSpec(torch.optim.AdamW, ("lr", "weight_decay", "betas", "eps"), {"foreach": True},
                           "AdamW (Loshchilov & Hutter); lr 1e-3, betas (0.9, 0.999), eps 1e-8, "
                           "weight_decay 1e-2 (decoupled)"),
    "adam8bit": OptimizerSpec(Adam8bit, ("lr", "weight_decay", "betas", "eps"), {},
                              "Adam with 8-bit block-wise moments (Dettmers et al. 2021); as adam, plus "
                              "min_8bit_size 4096, block_size 2048, fused None"),
    "adamw8bit": OptimizerSpec(AdamW8bit, ("lr", "weight_decay", "betas", "eps"), {},
                               "AdamW with 8-bit block-wise moments; as adamw, plus min_8bit_size, "
                               "block_size, fused"),
    "adafactor": OptimizerSpec(Adafactor, ("lr", "weight_decay", "eps"), {},
                               "Adafactor (Shazeer & Stern 2018); lr = cap of the relative step (1e-2), "
                               "beta1 None, decay_rate -0.8, eps (1e-30, 1e-3), clip_threshold 1, "
                               "relative_step, scale_parameter, factored (all True)"),
    "came": OptimizerSpec(CAME, ("lr", "weight_decay", "betas", "eps"), {},
                          "CAME (Luo et al. 2023); lr 2e-4, betas (0.9, 0.999, 0.9999), "
                          "eps (1e-30, 1e-16), clip_threshold 1, weight_decay 0 (decoupled)"),
    "lamb": OptimizerSpec(LAMB, ("lr", "weight_decay", "betas", "eps"), {},
                          "LAMB (You et al. 2020); lr 1e-3, betas (0.9, 0.999), eps 1e-6, "
                          "weight_decay 0.01, bias_correction True, trust_clamp None"),
    "lars": OptimizerSpec(LARS, ("lr", "weight_decay", "momentum", "eps"), {},
                          "LARS (You et al. 2017); lr 0.1, momentum 0.9, weight_decay 5e-4, "
                          "trust_coefficient 1e-3, eps 0, nesterov False"),
    "zo-sgd": OptimizerSpec(ZOSGD, ("lr", "weight_decay"), {},
                            "zero-order SGD (MeZO, Malladi et al. 2023): two forwards at theta +- eps*z, no "
                            "backward; lr (1e-6), perturbation eps 1e-3, seed 0, weight_decay 0 (decoupled)"),
    "zo-adam": OptimizerSpec(ZOAdam, ("lr", "weight_decay", "betas", "eps"), {},
                             "zero-order Adam: Adam's moments over MeZO's estimate g*z; lr (1e-4), betas (0.9, "
                             "0.999), eps 1e-8, perturbation 1e-3, seed 0, weight_decay 0 (decoupled)"),
}

NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def names() -> list[str]:
    """Selectable optimizer names (``optim.name``)."""
    return list(NAMES)


def backward_free(name: str) -> bool:
    """Whether ``name`` trains without gradients (zero-order: :mod:`.zero_order`)."""
    return is_zero_order(name)


def _spec(name: str) -> OptimizerSpec:
    key = name.lower() if isinstance(name, str) else name
    if key not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}; allowed: {', '.join(NAMES)}")
    return OPTIMIZERS[key]


def param_groups(model: nn.Module, weight_decay: float | None) -> list[dict[str, Any]]:
    """Decay / no-decay groups: parameters with >= 2 dims decay, 1-D ones (biases, norm gains
    and offsets) and scalars do not (the GPT-2/BERT/nanoGPT convention). Empty groups dropped;
    parameters that do not require grad are left out."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay} if weight_decay is None else
                      {"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    name: str,
    params_or_model: nn.Module | Iterable[Any],
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
    betas: tuple[float, ...] | None = None,
    eps: float | tuple[float, float] | None = None,
    momentum: float | None = None,
    **extra: Any,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` (one of :data:`NAMES`) over a model or parameters/groups.

    Arguments left as None take the optimizer's own default (see :data:`OPTIMIZERS`); one it
    does not take (e.g. ``momentum`` for adam, ``betas`` for adafactor) is a UserError rather
    than silently ignored. ``extra`` goes to the constructor (e.g. ``fused`` for adam8bit,
    ``beta1`` for adafactor, ``trust_coefficient`` for lars). Given a model, parameters are
    split by :func:`param_groups` (no weight decay on 1-D parameters).
    """
    spec = _spec(name)
    given = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum)
    kwargs = {k: v for k, v in given.items() if v is not None}
    bad = [k for k in kwargs if k not in spec.common]
    if bad:
        raise UserError(f"optimizer {name!r} takes no {bad[0]!r}; it takes "
                        f"{', '.join(spec.common)} and extras {', '.join(_extras(spec)) or 'none'}")
    unknown = [k for k in extra if k not in _extras(spec)]
    if unknown:
        raise UserError(f"optimizer {name!r} has no option {unknown[0]!r}; extras allowed: "
                        f"{', '.join(_extras(spec)) or 'none'}")
    if isinstance(params_or_model, nn.Module):
        params: Any = param_groups(params_or_model, weight_decay)
    else:
        params = list(params_or_model)
    if not params:
        raise UserError(f"optimizer {name!r}: no parameters to optimize")
    try:
        return spec.cls(params, **kwargs, **extra, **spec.fixed)
    except (ValueError, TypeError) as exc:
        raise UserError(f"optimizer {name!r}: {exc}") from exc


build = build_optimizer
"""Alias used by :mod:`scaletrain.measure.optimizers` (``reg.build(name, params, **kw)``)."""


def _extras(spec: OptimizerSpec) -> list[str]:
    """Constructor keywords beyond the common ones (documented options)."""
    sig = inspect.signature(spec.cls.__init__)
    skip = {"self", "params", *spec.common, *spec.fixed, "differentiable", "capturable"}
    if spec.cls.__module__.startswith("torch."):
        skip.add("fused")  # torch's own run with foreach=True
    return [n for n, p in sig.parameters.items()
            if n not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _numel(shape: Iterable[int]) -> int:
    return math.prod(int(s) for s in shape)


def _shape_dtype_pairs(shapes: Iterable[Any], dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Accept shapes (with one ``dtype``) or (shape, dtype) pairs (the estimator's convention)."""
    out = []
    for item in shapes:
        item = tuple(item) if not isinstance(item, torch.Size) else item
        if len(item) == 2 and isinstance(item[1], torch.dtype):
            out.append((tuple(int(s) for s in item[0]), item[1]))
        else:
            out.append((tuple(int(s) for s in item), dtype))
    return out


def state_bytes(name: str, shapes: Iterable[Any], dtype: torch.dtype = torch.float32,
                **hyper: Any) -> int:
    """Exact optimizer-state bytes for parameters of ``shapes`` (cost face).

    ``shapes``: parameter shapes (all of ``dtype``) or ``(shape, dtype)`` pairs. ``hyper`` are
    the keyword arguments given to :func:`build_optimizer` (those that change the state:
    momentum, amsgrad, beta1, factored, min_8bit_size, block_size; others are ignored), so a
    config can be passed through unchanged. Equals :func:`measured_state_bytes` after the first
    step.
    """
    _spec(name)
    key = name.lower()
    total = 0
    for shape, dt in _shape_dtype_pairs(shapes, dtype):
        n = _numel(shape)
        elem = torch.empty((), dtype=dt, device="meta").element_size()
        if key == "sgd":
            total += n * elem if (hyper.get("momentum") or 0) != 0 else 0
        elif key in ("adam", "adamw"):
            # exp_avg, exp_avg_sq (and max_exp_avg_sq) in the param dtype + a float32 0-d step.
            total += (3 if hyper.get("amsgrad") else 2) * n * elem + 4
        elif key in ("adam8bit", "adamw8bit"):
            total += Adam8bit.state_nbytes(n, hyper.get("min_8bit_size") or 4096,
                                           hyper.get("block_size") or BLOCK_SIZE)
        elif key == "adafactor":
            total += Adafactor.state_nbytes(shape, hyper.get("beta1"), hyper.get("factored", True))
        elif key == "came":
            total += CAME.state_nbytes(shape)
        elif key == "lamb":
            total += LAMB.state_nbytes(n)
        elif key == "lars":
            mom = hyper.get("momentum")
            total += LARS.state_nbytes(n, 0.9 if mom is None else mom)
        # zo-sgd: no state (z is regenerated from a seed, never stored)
        elif key == "zo-adam":
            total += ZOAdam.state_nbytes(n, elem)
    return total


def step_transient_bytes(name: str, shapes: Iterable[Any], dtype: torch.dtype = torch.float32, *,
                         device_type: str = "cpu", **hyper: Any) -> int | None:
    """Peak bytes one ``step()`` allocates above params + grads + states, in closed form (cost face).

    Given for adam8bit / adamw8bit (:meth:`Adam8bit.step_transient_nbytes`: ``fused``,
    ``min_8bit_size``, ``block_size``, ``weight_decay`` and ``maximize`` in ``hyper`` matter; on
    CUDA every allocation is rounded to 512 bytes). None for the others: torch's own are modelled
    by :mod:`scaletrain.measure.optimizers`, and adafactor, came, lamb and lars are plain torch ops
    that run on fake tensors, so the estimator measures their step exactly instead.
    """
    _spec(name)
    key = name.lower()
    if key not in ("adam8bit", "adamw8bit"):
        return None
    wd = hyper.get("weight_decay")
    return Adam8bit.step_transient_nbytes(
        _shape_dtype_pairs(shapes, dtype),
        min_8bit_size=hyper.get("min_8bit_size") or 4096,
        block_size=hyper.get("block_size") or BLOCK_SIZE,
        fused=hyper.get("fused"),
        decoupled=key == "adamw8bit",
        weight_decay=0.0 if wd is None else wd,
        maximize=bool(hyper.get("maximize")),
        granularity=512 if device_type == "cuda" else 1,
    )


def state_bytes_per_param(name: str, shape: Iterable[int], dtype: torch.dtype = torch.float32,
                          **hyper: Any) -> float:
    """:func:`state_bytes` of one tensor divided by its number of values."""
    shape = tuple(shape)
    return state_bytes(name, [shape], dtype, **hyper) / max(1, _numel(shape))


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer holds in ``optimizer.state`` (numel * element_size,
    each storage counted once), i.e. what the memory tracker attributes to optimizer states."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                key = (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes())
                if key not in seen:
                    seen.add(key)
                    total += v.numel() * v.element_size()
    return total


# Bytes each fp32 parameter moves in torch's foreach AdamW step (scaletrain's default, foreach=True),
# one term per _foreach kernel as torch/optim/adamw.py runs them: lerp_ m<-g (r8 w4), mul_ v (r4 w4),
# addcmul_ v<-g,g (r8 w4), decoupled decay mul_ p (r4 w4), sqrt v -> d (r4 w4), div_ d (r4 w4),
# add_ eps (r4 w4), addcdiv_ p<-m,d (r12 w4) = 80; plus clipping (train.grad_clip, on by default):
# the norm reads g (4), the scale reads and writes g (8). 92 B at 4.3 TB/s for gpt2-medium = 7.6 ms;
# measured on one H200: 8.8 ms of multi_tensor_apply kernels per step (planner_gpu_h200_profile.json).
ADAM_FOREACH_BYTES = 80.0
CLIP_BYTES = 12.0


def optimizer_step_bytes(name: str, state_bytes: float) -> float:
    """Bytes moved per parameter by one optimizer step with gradient clipping: Adam/AdamW as torch's
    foreach kernels run it (:data:`ADAM_FOREACH_BYTES`); any other optimizer read p, g and write p (12 B)
    and read + write its ``state_bytes`` once — a lower bound where its kernels are not counted."""
    if name.lower() in ("adam", "adamw"):
        return ADAM_FOREACH_BYTES + CLIP_BYTES
    return 12 + 2 * state_bytes + CLIP_BYTES
