"""Reference models: plain PyTorch modules whose body is a sequence of single-tensor blocks."""

from scaletrain.models.registry import MODELS, check_name, count_params, default_data, entry, get, names

__all__ = ["MODELS", "check_name", "count_params", "default_data", "entry", "get", "names"]
