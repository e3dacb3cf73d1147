"""Reference models by name: ``scaletrain.models.get(name, **overrides)``.

Each entry is a builder plus its default arguments; overrides replace defaults and are checked
against them, so a typo gives a one-line error listing what may be overridden.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.catalog import LISTED
from scaletrain.models.external import build as build_external
from scaletrain.models.external import default_data as external_default_data
from scaletrain.models.external import is_external
from scaletrain.models.gpt2 import GPT2, GPT2Config
from scaletrain.models.mlp import MLP
from scaletrain.models.resnet import ResNet
from scaletrain.models.vgg import VGG


def _gpt2(**kw: Any) -> GPT2:
    return GPT2(GPT2Config(**kw))


def _gpt2_moe(**kw: Any) -> nn.Module:
    from scaletrain.models.moe import GPT2MoE, GPT2MoEConfig

    return GPT2MoE(GPT2MoEConfig(**kw))


def _dlrm(**kw: Any) -> nn.Module:
    from scaletrain.models.dlrm import DLRM, DLRMConfig

    return DLRM(DLRMConfig(**kw))


@dataclass(frozen=True)
class ModelEntry:
    builder: Callable[..., nn.Module]
    defaults: dict[str, Any]
    description: str
    default_data: str
    """Name of the shipped dataset this model trains on by default."""
    published_params: int | None = None
    """Published parameter count, when the model reproduces a published one."""
    extra_keys: tuple[str, ...] = field(default=())


_GPT2_KEYS = tuple(f.name for f in dataclasses.fields(GPT2Config))

def _entry(name: str, builder: Callable[..., nn.Module], **defaults: Any) -> ModelEntry:
    """A registry entry; its description, default data and published count are the catalog's."""
    row = LISTED[name]
    return ModelEntry(builder, defaults, row.description, row.default_data, row.published)


MODELS: dict[str, ModelEntry] = {
    "gpt2-tiny": _entry("gpt2-tiny", _gpt2, vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4),
    "gpt2-mini": _entry("gpt2-mini", _gpt2, vocab_size=256, n_positions=512, n_embd=256, n_layer=6, n_head=8),
    "gpt2-small": _entry("gpt2-small", _gpt2, n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": _entry("gpt2-medium", _gpt2, n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": _entry("gpt2-large", _gpt2, n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": _entry("gpt2-xl", _gpt2, n_embd=1600, n_layer=48, n_head=25),
    "resnet50": _entry("resnet50", ResNet, layers=(3, 4, 6, 3), base_width=64, num_classes=1000, image_size=224,
                       imagenet_stem=True),
    "resnet-mini": _entry("resnet-mini", ResNet, layers=(1, 1, 1, 1), base_width=8, num_classes=10, image_size=32,
                          imagenet_stem=False),
    "vgg16": _entry("vgg16", VGG, width_div=1, hidden=4096, num_classes=1000, image_size=224, pool_hw=7, dropout=0.5),
    "vgg-mini": _entry("vgg-mini", VGG, width_div=8, hidden=256, num_classes=10, image_size=32, pool_hw=1, dropout=0.0),
    "gpt2-moe": _entry("gpt2-moe", _gpt2_moe, vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4,
                       dropout=0.0, n_experts=4, top_k=2, capacity_factor=1.25, moe_every=2, aux_loss_coef=0.01),
    "dlrm-mini": _entry("dlrm-mini", _dlrm, n_dense=13, table_sizes=(20000, 10000, 5000, 1000), embed_dim=16,
                        bag_size=4, bottom=(64, 16), top=(64, 32, 1)),
    "mlp": _entry("mlp", MLP, widths=(192, 512, 512, 512, 10), dropout=0.0, image_size=8, channels=3),
}


def names() -> list[str]:
    return list(MODELS)


def entry(name: str) -> ModelEntry:
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}, hf:gpt2, hf:llama, hf:mistral, "
                        "hf:bert, hf:/path/to/dir, py:package.module:factory")
    return MODELS[name]


def check_name(name: str) -> None:
    """One-line UserError unless ``name`` is a reference model or an ``hf:`` / ``py:`` name."""
    if not is_external(name):
        entry(name)


def default_data(name: str, model: nn.Module | None = None) -> str:
    """The shipped dataset model ``name`` trains on when ``data.name`` is empty."""
    if name in MODELS:
        return MODELS[name].default_data
    if is_external(name) and model is not None:
        from scaletrain.models.adapters import task_of

        return external_default_data(name, task_of(model))
    return "synthetic-text"


def resolve_args(name: str, **overrides: Any) -> dict[str, Any]:
    """Defaults of ``name`` with ``overrides`` applied; unknown keys give a UserError."""
    e = entry(name)
    allowed = set(e.defaults) | (set(_GPT2_KEYS) if e.builder is _gpt2 else set())
    bad = sorted(set(overrides) - allowed)
    if bad:
        raise UserError(f"model {name!r} has no option {bad[0]!r}; allowed: {', '.join(sorted(allowed))}")
    args = dict(e.defaults)
    for k, v in overrides.items():
        _check_override(name, k, v, e.defaults.get(k, _GPT2_DEFAULTS.get(k)))
        args[k] = tuple(v) if isinstance(v, list) else v
    return args


_GPT2_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPT2Config)}


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
