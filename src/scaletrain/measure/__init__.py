"""Measurement and estimation of memory and time (tracker, block profiler, estimator, formulas).

The heavy parts are imported on first use, so ``import scaletrain.measure`` stays cheap.
"""

from importlib import import_module
from typing import Any, Callable

from scaletrain.measure.types import BlockProfile, Profile

_LAZY = {
    "MemoryTracker": "tracker", "profile_chain": "profiler", "measure_step": "profiler",
    "estimate_chain": "estimate", "estimate_step": "estimate", "simulate_step": "estimate",
    "StepEstimate": "compose", "plot_timeline": "plot",
}

__all__ = ["BlockProfile", "Profile", "optimizer_source", "use_optimizers", *_LAZY]

_OPTIMIZERS: Callable[[], Any] | None = None


def use_optimizers(source: Callable[[], Any] | None) -> None:
    """Where the estimator's optimizers come from (:mod:`scaletrain.measure.optimizers`): ``source()`` returns an
    object with ``names()``, ``build_optimizer(name, params, **kw)``, ``state_bytes(name, shapes_and_dtypes,
    **kw)`` and optionally ``step_transient_bytes`` — the optimizer technique's registry, which the package root
    (``scaletrain/__init__.py``) wires here so that measuring names no layer above it. ``None``: torch's sgd,
    adam and adamw only."""
    global _OPTIMIZERS
    _OPTIMIZERS = source


def optimizer_source() -> Any:
    """The installed optimizer registry (:func:`use_optimizers`), or None."""
    return _OPTIMIZERS() if _OPTIMIZERS is not None else None


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"scaletrain.measure.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'scaletrain.measure' has no attribute {name!r}")
