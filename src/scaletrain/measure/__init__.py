"""Measurement and estimation of memory and time (tracker, block profiler, estimator, formulas)."""

from scaletrain.measure.types import BlockProfile, Profile

__all__ = ["BlockProfile", "Profile"]
