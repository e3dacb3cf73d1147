"""Reference models: plain PyTorch modules whose body is a sequence of single-tensor blocks.

The registry's names are loaded on first use (PEP 562), so that :mod:`.catalog` — what
``scaletrain models`` prints — is read without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODELS", "check_name", "count_params", "default_data", "entry", "get", "names"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from scaletrain.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'scaletrain.models' has no attribute {name!r}")
