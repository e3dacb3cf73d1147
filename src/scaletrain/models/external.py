"""Models scaletrain did not write, by name: ``hf:<family>``, ``hf:/path/to/dir`` and
``py:package.module:factory`` (see :func:`build`).

- ``hf:gpt2``, ``hf:llama``, ``hf:mistral``, ``hf:bert``: a ``transformers`` model of that family,
  randomly initialised from a config of small CPU-sized defaults (each family's ``ModelSpec.hf``) with
  ``model.overrides.*`` applied (names as in the transformers config: ``n_layer``, ``n_embd`` for
  GPT-2; ``num_hidden_layers``, ``hidden_size`` for the others). Nothing is downloaded. The
  vocabulary defaults to the shipped text's 256 bytes (257 for BERT: one mask token more), and
  dropout to 0 so that runs of any world size give the same losses.
- ``hf:/path/to/dir``: a local directory with ``config.json`` and safetensors weights, loaded by
  the class its ``architectures`` names (``model.overrides.*`` go to ``from_pretrained``); on the meta
  device (estimates) built from ``config.json`` alone, the weights unread.
- ``py:package.module:factory``: ``factory(**model.overrides)`` must return an ``nn.Module``; the
  current directory is importable.

Model files know nothing of parallelism: these are the plain objects a user would build.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.errors import UserError

PREFIXES = ("hf:", "py:")


@dataclass(frozen=True)
class HFFamily:
    """An ``hf:<name>`` family (declared in its folder's ``ModelSpec.hf``): the transformers model and
    config classes, and the small defaults it is built with."""

    model_class: str
    config_class: str
    defaults: dict[str, Any]
    description: str
    default_data: str = "shakespeare"
    extra_tokens: int = 0
    """Token ids past the data's vocabulary that the family's objective adds (BERT: one mask id)."""


def is_external(name: str) -> bool:
    return name.startswith(PREFIXES)


def default_data(name: str, task: str) -> str:
    """The shipped dataset an external model trains on by default: text for language models, digits otherwise."""
    return "shakespeare" if task == "lm" else "digits"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError("hf: models need the transformers package: pip install 'scaletrain[test]' "
                        "(or transformers)") from None
    transformers.logging.set_verbosity_error()  # config sanity notes would print once per process
    transformers.logging.disable_progress_bar()  # "Loading weights" bars of hf:/dir
    return transformers


def _hf_family(family: str, overrides: dict[str, Any]) -> nn.Module:
    from scaletrain.models.spec import hf_families

    T = _transformers()
    fam = hf_families()[family]
    cfg_cls = getattr(T, fam.config_class)
    known = set(cfg_cls().to_dict()) | set(fam.defaults)
    bad = sorted(set(overrides) - known)
    if bad:
        sample = ", ".join(sorted(fam.defaults)[:12])
        raise UserError(f"model 'hf:{family}' has no config option {bad[0]!r}; e.g. {sample} "
                        f"(any {fam.config_class} field)")
    try:
        cfg = cfg_cls(**{**fam.defaults, **overrides})
        return getattr(T, fam.model_class)(cfg)
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"model 'hf:{family}': {str(e).splitlines()[0]}") from None


def _hf_dir(path: str, overrides: dict[str, Any]) -> nn.Module:
    T = _transformers()
    d = Path(path).expanduser()
    if not (d / "config.json").is_file():
        raise UserError(f"model 'hf:{path}': no config.json in {str(d)!r}; allowed: hf:gpt2, hf:llama, hf:mistral, "
                        "hf:bert or a local directory with config.json and safetensors weights")
    cfg = T.AutoConfig.from_pretrained(str(d), local_files_only=True)
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    cls = getattr(T, arch, None) if arch else None
    if cls is None:
        raise UserError(f"model 'hf:{path}': config.json names no known architecture ({arch!r})")
    try:
        if torch.get_default_device().type == "meta":  # shapes only (estimate, remat, profile, pipeline)
            return _hf_dir_shape(path, cls, cfg, overrides)
        return cls.from_pretrained(str(d), local_files_only=True, **overrides)
    except (OSError, TypeError, ValueError) as e:
        raise UserError(f"model 'hf:{path}': {str(e).splitlines()[0]}") from None


def _hf_dir_shape(path: str, cls: Any, cfg: Any, overrides: dict[str, Any]) -> nn.Module:
    """The model of ``hf:path`` built from its config alone, on the meta device: what the estimators need,
    since ``from_pretrained`` refuses a meta device (it wants to load weights, which no estimate reads).
    ``overrides`` set config fields, as ``from_pretrained`` would; a name the config lacks is refused."""
    bad = sorted(k for k in overrides if not hasattr(cfg, k))
    if bad:
        raise UserError(f"its config has no field {bad[0]!r}; e.g. "
                        f"{', '.join(sorted(cfg.to_dict())[:12])}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cls(cfg)


def _py_factory(spec: str, overrides: dict[str, Any]) -> nn.Module:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise UserError(f"model 'py:{spec}': write py:package.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the user's own module, next to where they run scaletrain
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"model 'py:{spec}': cannot import {mod_name!r} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"model 'py:{spec}': {mod_name!r} has no callable {attr!r}")
    try:
        model = factory(**overrides)
    except TypeError as e:
        raise UserError(f"model 'py:{spec}': {e}") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"model 'py:{spec}': the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build(name: str, overrides: dict[str, Any], device: str | torch.device | None = None) -> nn.Module:
    """The model ``name`` (``hf:...`` or ``py:...``) with ``overrides``; ``device="meta"`` allocates nothing."""
    from scaletrain.models.spec import hf_families

    kind, rest = name[:3], name[3:]
    families = hf_families()
    if kind == "hf:" and rest not in families and not ("/" in rest or rest.startswith((".", "~"))):
        raise UserError(f"unknown model {name!r}; allowed hf: names: {', '.join('hf:' + f for f in families)}, "
                        "hf:/path/to/dir")
    with torch.device(device) if device is not None else contextlib.nullcontext():
        if kind == "py:":
            return _py_factory(rest, overrides)
        if rest in families:
            return _hf_family(rest, overrides)
        return _hf_dir(rest, overrides)


def __getattr__(name: str) -> Any:
    if name == "HF_FAMILIES":  # the former table, now each family's ModelSpec.hf
        from scaletrain.models.spec import hf_families

        return hf_families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
