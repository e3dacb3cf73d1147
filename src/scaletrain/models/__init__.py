"""Reference models: plain PyTorch modules whose body is a sequence of single-tensor blocks."""

from scaletrain.models.registry import MODELS, count_params, entry, get, names

__all__ = ["MODELS", "count_params", "entry", "get", "names"]
