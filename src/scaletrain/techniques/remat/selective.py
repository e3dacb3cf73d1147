"""Megatron's selective recomputation: the attention core of every transformer block.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4):
the attention core — ``QK^T``, softmax, dropout, ``x V`` — holds the activations that grow with
``s^2`` (``5 a s^2 b`` bytes per layer in their Table 2) but costs few FLOPs, so it is recomputed
in the backward while everything else (the QKV and output projections, the MLP, the norms) is kept.

Apply face: the attention module's forward runs under PyTorch's selective activation
checkpointing with a policy that keeps the outputs of the linear projections (``mm``/``addmm``/
``linear``: what is expensive to recompute) and recomputes every other op of the module — the
core (every op between the QKV projection and the output projection). Because it wraps the module's
*current* forward, it composes with tensor parallelism (applied first: the core then runs on this
rank's heads), with the data-parallel wrappers and with pipeline stages, and with whole-block
checkpoints (a block checkpointed whole recomputes it anyway).

With a fused attention kernel (``scaled_dot_product_attention``'s flash kernels, the CPU one
included) there is no ``s^2`` matrix to save; what remains is the kernel's output and log-sum-exp
(``b h s (d + 1)`` elements), which is what this then saves — :func:`selective_saved_bytes` measures
both sides so the cost face carries the real figure.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from scaletrain.errors import UserError

_PROJECTIONS = ("aten.mm", "aten.addmm", "aten.linear")


def _policy_factory() -> Callable:
    """A fresh SAC policy for one forward: the *core* is every op between the first projection (the
    fused QKV) and the next one (the output projection) — recomputed; everything else, the
    projections and what follows them (output redistribution, residual dropout) included, is kept,
    so a recomputation replays no communication."""
    seen: dict[bool, int] = {}

    def policy(ctx, func, *args, **kwargs):  # noqa: ANN001 - SAC's callback signature
        phase = bool(ctx.is_recompute)
        name = str(func)
        if name.startswith(_PROJECTIONS):
            seen[phase] = seen.get(phase, 0) + 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE if seen.get(phase, 0) == 1 else CheckpointPolicy.MUST_SAVE

    return policy


def _selective_contexts() -> Any:
    """The (forward, recompute) context pair of one checkpointed call under a fresh policy."""
    return create_selective_checkpoint_contexts(_policy_factory(), allow_cache_entry_mutation=True)


def attention_modules(blocks: list[nn.Module]) -> list[nn.Module]:
    """The attention sub-module of every transformer block (``attn`` — scaletrain's and Hugging
    Face's GPT-2 — or ``self_attn``, Llama-style)."""
    out = []
    for b in blocks:
        for name in ("attn", "self_attn", "attention"):
            m = getattr(b, name, None)
            if isinstance(m, nn.Module):
                out.append(m)
                break
    return out


def apply_selective(blocks: list[nn.Module], allow_none: bool = False) -> int:
    """Wrap the attention of every block (see the module docstring); returns how many were wrapped.
    Blocks a whole-block checkpoint recomputes anyway are not passed here (Megatron: full or selective
    per layer)."""
    mods = attention_modules(blocks)
    if not mods and not allow_none:
        raise UserError("memory.remat.selective=attention found no attention module (attn / self_attn) in the "
                        "model's blocks")
    for m in mods:
        if getattr(m, "_selective_orig_forward", None) is not None:
            continue
        m._selective_orig_forward = m.forward
        m.forward = _wrapped(m._selective_orig_forward)
    return len(mods)


def _wrapped(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        return checkpoint(orig, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
    return forward


def remove_selective(blocks: list[nn.Module]) -> None:
    for m in attention_modules(blocks):
        orig = getattr(m, "_selective_orig_forward", None)
        if orig is not None:
            m.forward = orig
            del m._selective_orig_forward


def selective_saved_bytes(attn: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(bytes the attention keeps for its backward plainly, bytes it keeps under the policy):
    storages alive after one forward beyond its output, its input and its parameters (tracker)."""
    from scaletrain.measure.tracker import MemoryTracker

    orig = getattr(attn, "_selective_orig_forward", attn.forward)

    def kept(fn: Callable) -> int:
        xg = x.detach().requires_grad_(x.is_floating_point())
        with MemoryTracker(model=attn, extra=(xg,), track_saved=False) as tr:
            out = fn(xg)
            b = tr.current_breakdown
            live = b["activations"] + b["temporaries"] - out.untyped_storage().nbytes()
        del out
        return int(live)

    plain = kept(orig)
    sel = kept(lambda xg: checkpoint(orig, xg, use_reentrant=False, context_fn=_selective_contexts))
    return plain, sel
