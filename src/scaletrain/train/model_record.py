"""What a run records of a model passed from Python (``Trainer(cfg, out, model=m)``).

Why: the run directory's ``config.toml`` (and every checkpoint's copy of it) is what
``scaletrain train --out RUN --resume`` and ``scaletrain checkpoint export --to hf`` rebuild the
model from. A model passed as an object has no name in the config, so the trainer writes one that
rebuilds the same class with the same parameter names and shapes, or says plainly that none does:

1. a ``transformers`` model of a known family (GPT-2, Llama, Mistral, BERT heads that
   :func:`~scaletrain.models.spec.hf_families` names): ``model.name = "hf:<family>"`` and
   ``model.overrides`` = every field of its HF config that differs from the family's defaults —
   so ``--resume`` and ``export --to hf`` work from the command line;
2. the config's own ``model.name`` (with its overrides) when it builds the same class with the same
   parameter names and shapes (e.g. ``py:mymodels:make_classifier`` given with the object);
3. otherwise ``model.name = "python:<module>:<qualname>"``: the class, for the record; the command
   line refuses it in one line (:func:`refusal`) and the run resumes from Python, passing the model.

Every candidate is checked by building it on the meta device (no memory, no weights) and comparing
class, parameter names and shapes with the object; the dataset the run used is recorded too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.train.config import Config

PYTHON = "python:"
"""Prefix of a recorded model that only Python can rebuild (it is not a model name)."""

_HF_META_KEYS = {"transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype", "model_type",
                 "_attn_implementation_autoset", "_commit_hash", "_attn_implementation"}
"""HF config entries that say nothing about the architecture or its computation."""


def _shapes(model: nn.Module) -> tuple[type, dict[str, tuple[int, ...]]]:
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return type(model), {k: tuple(v.shape) for k, v in named.items()}


def _rebuilds(name: str, overrides: dict[str, Any], want: tuple[type, dict]) -> bool:
    """True when ``name`` with ``overrides`` builds (on the meta device) what ``want`` describes."""
    from scaletrain import models

    try:
        return _shapes(models.get(name, device="meta", **overrides)) == want
    except Exception:  # noqa: BLE001 - any builder failure means: it does not rebuild this model
        return False


def _tomlable(v: Any) -> bool:
    if v is None:
        return False
    if isinstance(v, dict):
        return all(isinstance(k, str) and _tomlable(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(_tomlable(x) for x in v)
    return isinstance(v, (str, int, float, bool))


def _hf_family(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """(``hf:<family>``, config overrides) for a transformers model of a known family, else None."""
    config = getattr(model, "config", None)
    if not type(model).__module__.startswith("transformers.") or not hasattr(config, "to_dict"):
        return None
    from scaletrain.models.spec import hf_families

    for family, fam in hf_families().items():
        if type(model).__name__ != fam.model_class or type(config).__name__ != fam.config_class:
            continue
        base = type(config)(**fam.defaults).to_dict()
        mine = config.to_dict()
        over = {k: v for k, v in mine.items() if k not in _HF_META_KEYS and base.get(k, object()) != v}
        if all(_tomlable(v) for v in over.values()):  # TOML has no null: such a config is not recordable
            return f"hf:{family}", over
    return None


def recorded(cfg: Config, model: nn.Module, data_name: str) -> Config:
    """``cfg`` with the model section naming ``model`` (see the module docstring) and ``data.name``
    the dataset the run trains on."""
    want = _shapes(model)
    candidates = [c for c in (_hf_family(model), (cfg.model.name, dict(cfg.model.overrides))) if c is not None]
    name, overrides = next(((n, o) for n, o in candidates if _rebuilds(n, o, want)),
                           (f"{PYTHON}{type(model).__module__}:{type(model).__qualname__}", {}))
    section = dataclasses.replace(cfg.model, name=name, overrides=overrides)
    return dataclasses.replace(cfg, model=section, data=dataclasses.replace(cfg.data, name=data_name))


def is_python_only(name: str) -> bool:
    return name.startswith(PYTHON)


def check_buildable(name: str) -> None:
    """One line for a model that only Python can rebuild: how to go on with it."""
    if is_python_only(name):
        cls = name[len(PYTHON):]
        raise ConfigError(f"model.name={name!r}: this run trained a model passed from Python, which its config "
                          f"cannot rebuild; resume it from Python: Trainer(load_config('RUN/config.toml'), 'RUN', "
                          f"model={cls.rpartition(':')[2]}(...), resume=True), or train it by name "
                          f"(model.name=py:module:factory with model.overrides)")
