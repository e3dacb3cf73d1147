"""Models: one folder (or file) per family, each registered through one
:class:`~scaletrain.models.spec.ModelSpec` (:mod:`.spec`); models by name (:mod:`.registry`); a model as a
chain of blocks (:mod:`.chain`); how scaletrain drives a model it did not write (:mod:`.adapters`).

Names are loaded on first use (PEP 562), so that :mod:`.catalog` — what ``scaletrain models`` prints — is
read without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODELS", "ModelEntry", "ModelSpec", "ShardingPlan", "check_name", "count_params", "default_data",
           "entry", "get", "names", "register"]

_SPEC = ("ModelEntry", "ModelSpec", "ShardingPlan", "register")


def __getattr__(name: str) -> Any:
    if name in _SPEC:
        from scaletrain.models import spec

        return getattr(spec, name)
    if name in __all__:
        from scaletrain.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'scaletrain.models' has no attribute {name!r}")
