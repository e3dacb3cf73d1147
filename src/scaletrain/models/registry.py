"""Models by name: ``scaletrain.models.get(name, **overrides)``.

Each registered family (:mod:`scaletrain.models.spec`) names its models; each is a builder plus its
default arguments; overrides replace defaults and are checked
against them, so a typo gives a one-line error listing what may be overridden.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models import spec as _spec
from scaletrain.models.catalog import LISTED
from scaletrain.models.external import build as build_external
from scaletrain.models.external import default_data as external_default_data
from scaletrain.models.external import is_external
from scaletrain.models.spec import ModelEntry

__all__ = ["ModelEntry", "check_name", "count_params", "default_data", "entry", "get", "names",
           "resolve_args"]


def _models() -> dict[str, ModelEntry]:
    """Every registered family's models: the shipped ones in the catalog's order, then the rest."""
    _spec.specs()  # loads the shipped families
    order = list(LISTED)
    return dict(sorted(_spec.MODELS.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def __getattr__(name: str) -> object:
    if name == "MODELS":
        return _models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> list[str]:
    return list(_models())


def entry(name: str) -> ModelEntry:
    models = _models()
    if name not in models:
        hf = ", ".join("hf:" + f for f in _spec.hf_families())
        raise UserError(f"unknown model {name!r}; allowed: {', '.join(models)}, {hf}, hf:/path/to/dir, "
                        "py:package.module:factory")
    return models[name]


def check_name(name: str) -> None:
    """One-line UserError unless ``name`` is a reference model or an ``hf:`` / ``py:`` name."""
    if not is_external(name):
        entry(name)


def default_data(name: str, model: nn.Module | None = None) -> str:
    """The shipped dataset model ``name`` trains on when ``data.name`` is empty."""
    models = _models()
    if name in models:
        return models[name].default_data
    if is_external(name) and model is not None:
        from scaletrain.models.adapters import task_of

        return external_default_data(name, task_of(model))
    return "synthetic-text"


def resolve_args(name: str, **overrides: Any) -> dict[str, Any]:
    """Defaults of ``name`` with ``overrides`` applied; unknown keys give a UserError."""
    e = entry(name)
    allowed = set(e.defaults) | set(e.options)
    bad = sorted(set(overrides) - allowed)
    if bad:
        raise UserError(f"model {name!r} has no option {bad[0]!r}; allowed: {', '.join(sorted(allowed))}")
    args = dict(e.defaults)
    for k, v in overrides.items():
        _check_override(name, k, v, e.defaults.get(k, e.options.get(k)))
        args[k] = tuple(v) if isinstance(v, list) else v
    return args


def _check_override(name: str, key: str, value: Any, default: Any) -> None:
    """One-line UserError unless ``value`` fits its default's kind: a size or count (an int default > 0) is an
    integer >= 1, an int default of 0 (off) an integer >= 0, a float a finite number (``n_layer=-1`` would build
    an empty model and predict nothing)."""
    if isinstance(default, bool) or default is None:
        return
    if isinstance(default, int):
        low = 1 if default > 0 else 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 40:
            raise UserError(f"model {name!r}: {key}={value!r} is not allowed; expected an integer from {low} "
                            f"to {1 << 40:,}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"model {name!r}: {key}={value!r} is not allowed; expected a finite number")


def get(name: str, *, device: str | torch.device | None = None, **overrides: Any) -> nn.Module:
    """Build reference model ``name`` with ``overrides`` (e.g. ``n_layer=2``).

    ``device="meta"`` builds it without allocating memory (for estimates of any size).
    """
    if is_external(name):  # hf:... / py:...: models scaletrain did not write (models/external.py)
        return build_external(name, overrides, device)
    args = resolve_args(name, **overrides)
    try:
        if device is not None:
            with torch.device(device):
                return entry(name).builder(**args)
        return entry(name).builder(**args)
    except (TypeError, ValueError) as e:
        raise UserError(f"model {name!r}: {e}") from None


def count_params(model: nn.Module) -> int:
    """Number of parameter elements, shared (tied) parameters counted once."""
    return sum(p.numel() for p in model.parameters())
