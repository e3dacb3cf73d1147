"""Measurement and estimation of memory and time (tracker, block profiler, estimator, formulas).

The heavy parts are imported on first use, so ``import scaletrain.measure`` stays cheap.
"""

from importlib import import_module
from typing import Any

from scaletrain.measure.types import BlockProfile, Profile

_LAZY = {
    "MemoryTracker": "tracker", "profile_chain": "profiler", "measure_step": "profiler",
    "estimate_chain": "estimate", "estimate_step": "estimate", "simulate_step": "estimate",
    "StepEstimate": "compose", "plot_timeline": "plot",
}

__all__ = ["BlockProfile", "Profile", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"scaletrain.measure.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'scaletrain.measure' has no attribute {name!r}")
