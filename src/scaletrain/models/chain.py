"""The model seen as an ordered list of single-tensor blocks.

A :class:`Chain` is what rematerialization, offloading and pipeline partitioning cut: block i
takes one tensor and returns one tensor, and running the blocks in order is the model's forward.
The Chain *shares* the model's modules and parameters (nothing is copied), so training the chain
trains the model.

How a Chain is found (:func:`to_chain`), first match wins:

1. a :class:`Chain` is returned as is;
2. the model's family (:func:`scaletrain.models.spec.spec_of`) lists its blocks (``ModelSpec.blocks``:
   Hugging Face GPT-2, Llama/Mistral and BERT layouts, torchvision ResNet, ...);
3. a module with ``chain_blocks()`` (all reference models) lists its own blocks;
4. ``nn.Sequential``: its children.

Anything else is declared in one line: ``Chain([model.embed, *model.layers, model.head])``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from scaletrain.errors import UserError


class Chain(nn.Module):
    """Blocks run in order; ``chain(x)`` equals the source model's forward."""

    def __init__(self, blocks: Iterable[nn.Module | tuple[str, nn.Module]], source: nn.Module | None = None):
        super().__init__()
        names, mods = [], []
        for i, b in enumerate(blocks):
            name, mod = b if isinstance(b, tuple) else (str(i), b)
            if not isinstance(mod, nn.Module):
                raise UserError(f"chain block {name!r} is a {type(mod).__name__}, not an nn.Module")
            names.append(name)
            mods.append(mod)
        if not mods:
            raise UserError("a chain needs at least one block")
        self.blocks = nn.ModuleList(mods)
        self.names: list[str] = names
        # Kept outside the module tree so parameters are not registered twice.
        self.__dict__["source"] = source

    def __len__(self) -> int:
        return len(self.blocks)

    def run(self, x: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Apply blocks ``start`` (inclusive) to ``end`` (exclusive) to ``x``."""
        for b in self.blocks[start:end]:
            x = b(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)

    def owned_params(self) -> list[list[nn.Parameter]]:
        """Parameters per block, each shared (tied) parameter assigned to the first block using it."""
        seen: set[int] = set()
        out = []
        for b in self.blocks:
            own = []
            for p in b.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    own.append(p)
            out.append(own)
        return out


class FirstOutput(nn.Module):
    """Wraps a layer that returns a tuple (HF style) so the chain sees only the hidden state.

    With ``causal_mask=True`` the layer is given an explicit additive causal mask
    [1, 1, seq, seq] (0 on and below the diagonal, the dtype's minimum above), which is what
    HF builds at model level for its "eager" attention; its SDPA attention is causal by itself
    when no mask is given.
    """

    def __init__(self, layer: nn.Module, causal_mask: bool = False):
        super().__init__()
        self.layer = layer
        self.causal_mask = causal_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.causal_mask:
            out = self.layer(x, attention_mask=causal_mask(x.shape[1], x.dtype, x.device))
        else:
            out = self.layer(x)
        return out[0] if isinstance(out, (tuple, list)) else out


class Seq(nn.Module):
    """Applies existing modules in order without re-registering them under new names' ownership."""

    def __init__(self, *mods: nn.Module, flatten_before_last: bool = False):
        super().__init__()
        self.mods = nn.ModuleList(mods)
        self.flatten_before_last = flatten_before_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, m in enumerate(self.mods):
            if self.flatten_before_last and i == len(self.mods) - 1:
                x = torch.flatten(x, 1)
            x = m(x)
        return x


def causal_mask(s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask [1, 1, s, s]: 0 on and below the diagonal, the dtype's minimum above
    (what HF builds at model level for "eager" attention; SDPA is causal without a mask)."""
    upper = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(s, s, dtype=dtype, device=device).masked_fill(upper, torch.finfo(dtype).min)[None, None]


def to_chain(model: nn.Module | Sequence[nn.Module]) -> Chain:
    """Find the chain of blocks of ``model`` (see the module docstring for the rules)."""
    if isinstance(model, Chain):
        return model
    if isinstance(model, (list, tuple)):
        return Chain(model)
    from scaletrain.models.spec import spec_of, specs

    spec = spec_of(model)
    blocks = spec.blocks(model) if spec is not None and spec.blocks is not None else None
    if blocks is not None:
        return Chain(blocks, source=model)
    if hasattr(model, "chain_blocks"):
        return Chain(model.chain_blocks(), source=model)
    if isinstance(model, nn.Sequential):
        return Chain(list(model.named_children()), source=model)
    families = ", ".join(s.name for s in specs()[::-1] if s.blocks is not None)
    raise UserError(
        f"cannot find the blocks of {type(model).__name__}: supported are nn.Sequential, modules with "
        f"chain_blocks(), and the registered families' layouts ({families}); otherwise declare them: "
        "scaletrain.chain.Chain([embed, *layers, head])"
    )
