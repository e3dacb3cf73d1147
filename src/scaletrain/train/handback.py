"""Hand the user's model back trained and usable, whatever ran it.

Techniques change the model they are given: FSDP2 (ZeRO-3) swaps parameters for sharded DTensors,
changes module classes and adds hooks; tensor parallelism replaces layers; offloading leaves each
parameter with 0-byte storage between its uses. A user who passed ``Trainer(cfg, model=m)``
expects ``m`` afterwards to be their model with the trained weights, as after a Lightning or
Accelerate ``fit``. So the trainer takes a :class:`Snapshot` of the structure before anything
is applied, and :func:`hand_back` restores it and copies the trained values — the runtime's full
single-process state dict — into the user's *original* parameter and buffer objects (so
references the user holds, e.g. in their own optimizer, see the trained values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Snapshot:
    """The model's structure before the runtime touched it."""

    model: nn.Module
    classes: list[tuple[nn.Module, type]] = field(default_factory=list)
    children: list[tuple[nn.Module, str, nn.Module | None]] = field(default_factory=list)
    tensors: list[tuple[str, nn.Module, str, torch.Tensor, bool]] = field(default_factory=list)
    """(state-dict key, owning module, attribute, original tensor, is a parameter)."""
    hooks: list[tuple[nn.Module, tuple[set[int], ...]]] = field(default_factory=list)
    forwards: list[tuple[nn.Module, Any]] = field(default_factory=list)
    """(module, its own ``forward`` attribute or None): TP swaps some modules' forward per instance."""


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_load_state_dict_pre_hooks")


def take(model: nn.Module) -> Snapshot:
    """Record classes, children, parameters, buffers and hooks of every module of ``model``."""
    snap = Snapshot(model)
    for prefix, mod in model.named_modules(remove_duplicate=False):
        snap.classes.append((mod, type(mod)))
        snap.children += [(mod, n, c) for n, c in mod._modules.items()]
        snap.hooks.append((mod, tuple(set(getattr(mod, d, {})) for d in _HOOK_DICTS)))
        snap.forwards.append((mod, mod.__dict__.get("forward")))
        dot = f"{prefix}." if prefix else ""
        snap.tensors += [(dot + n, mod, n, p, True) for n, p in mod._parameters.items() if p is not None]
        snap.tensors += [(dot + n, mod, n, b, False) for n, b in mod._buffers.items() if b is not None]
    return snap


def _value_for(orig: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``v`` in ``orig``'s shape, dtype and device (a Conv1D weight replaced by a Linear comes back transposed)."""
    if hasattr(v, "full_tensor"):
        v = v.full_tensor()
    v = v.detach()
    if v.shape != orig.shape and v.dim() == 2 and v.t().shape == orig.shape:
        v = v.t()
    return v.to(device=orig.device, dtype=orig.dtype).clone().reshape(orig.shape)


@torch.no_grad()
def hand_back(snap: Snapshot, state: dict[str, Any], structure: bool = True) -> int:
    """Copy the trained ``state`` (full, single-process keys) into the original tensors; with
    ``structure``, also restore the original classes, children, parameter objects and hooks.
    Returns the number of tensors whose values were written."""
    if structure:
        for mod, cls in snap.classes:
            if type(mod) is not cls:
                mod.__class__ = cls
        for parent, name, child in snap.children:
            parent._modules[name] = child
        for mod, keys in snap.hooks:
            for d, before in zip(_HOOK_DICTS, keys):
                hooks = getattr(mod, d, None)
                for k in [k for k in (hooks or {}) if k not in before]:
                    del hooks[k]
        for mod, forward in snap.forwards:
            if forward is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.__dict__["forward"] = forward
    written = 0
    for key, mod, attr, orig, is_param in snap.tensors:
        v = state.get(key)
        if isinstance(v, torch.Tensor) and (v.data_ptr() != orig.data_ptr() or orig.untyped_storage().nbytes() == 0):
            orig.data = _value_for(orig, v)
            written += 1
        if structure:
            (mod._parameters if is_param else mod._buffers)[attr] = orig
    return written
