"""scaletrain: train an unmodified PyTorch model as fast as possible without running out of memory.

The flow (docs/ARCHITECTURE.md): nn.Module -> Chain -> Profile -> planner -> Plan -> runtime -> Trainer,
with the measurement tools checking every prediction against what happened.

The stable public surface (the internal layout may move behind it)::

    from scaletrain import Trainer, Config, Plan, load_config, adapt, to_chain
    from scaletrain.optim import AdamW8bit, Adafactor, CAME, LAMB, LARS, CPUAdam
    from scaletrain import remat, offload, estimate
    scaletrain.plan("vgg-mini", platform="a100-80g", devices=8, global_batch=64)  # ranked plans, best first

Names are imported on first use, so ``import scaletrain`` stays cheap.
"""

import types
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Trainer": "scaletrain.train.trainer", "TrainResult": "scaletrain.train.trainer",
    "Config": "scaletrain.train.config", "load_config": "scaletrain.train.config",
    "Plan": "scaletrain.plan", "adapt": "scaletrain.models.adapters", "Adapter": "scaletrain.models.adapters",
    "Chain": "scaletrain.chain", "to_chain": "scaletrain.chain", "UserError": "scaletrain.errors",
    "ConfigError": "scaletrain.errors",
}

__all__ = [*_LAZY, "estimate", "models", "offload", "optim", "plan", "remat"]


class _CallablePlanModule(types.ModuleType):
    """``scaletrain.plan`` is the module of the :class:`Plan` value type and, called, the planner:
    ``scaletrain.plan(model, platform=..., devices=..., global_batch=..., seq=...)`` ranks the plans that
    fit (:func:`scaletrain.planner.api.plan`, the list ``scaletrain plan --json`` prints). Wired here, at the
    top, so that the value type never imports the planner above it."""

    def __call__(self, model: Any, **kw: Any) -> list[dict[str, Any]]:
        return import_module("scaletrain.planner.api").plan(model, **kw)


import_module("scaletrain.plan").__class__ = _CallablePlanModule  # stdlib-only module: cheap to import
# The estimator's optimizers are the optimizer technique's registry, wired here at the top (imported on first use)
# so that measuring, below the techniques, names none of them.
import_module("scaletrain.measure").use_optimizers(lambda: import_module("scaletrain.techniques.optim.registry"))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name in ("estimate", "models", "offload", "optim", "plan", "remat"):  # plan: a module, callable
        return import_module(f"scaletrain.{name}")
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
