"""The model seen as an ordered list of single-tensor blocks.

A :class:`Chain` is what rematerialization, offloading and pipeline partitioning cut: block i
takes one tensor and returns one tensor, and running the blocks in order is the model's forward.
The Chain *shares* the model's modules and parameters (nothing is copied), so training the chain
trains the model.

How a Chain is found (:func:`to_chain`), first match wins:

1. a :class:`Chain` is returned as is;
2. a module with ``chain_blocks()`` (all reference models) lists its own blocks;
3. ``nn.Sequential``: its children;
4. Hugging Face GPT-2 layout (``transformer.wte/wpe/h/ln_f`` + ``lm_head``): embedding, each layer of
   ``transformer.h`` (whose tuple output is reduced to the hidden state), final norm + head;
5. torchvision ResNet layout (``conv1 bn1 relu maxpool layer1..4 avgpool fc``): stem, every block
   of ``layer1..layer4``, pooling + classifier;
6. Hugging Face Llama/Mistral and BERT layouts (:func:`llama_chain`, :func:`bert_chain`).

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


class _HFEmbedding(nn.Module):
    """HF GPT-2 glue: token + position embedding, then dropout. ids [b, s] -> [b, s, h]."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(pos))


class _FirstOutput(nn.Module):
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
            s = x.shape[1]
            upper = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            mask = torch.zeros(s, s, dtype=x.dtype, device=x.device).masked_fill(upper, torch.finfo(x.dtype).min)
            out = self.layer(x, attention_mask=mask[None, None])
        else:
            out = self.layer(x)
        return out[0] if isinstance(out, (tuple, list)) else out


class _Seq(nn.Module):
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


def _hf_gpt2(model: nn.Module) -> Chain | None:
    t = getattr(model, "transformer", None)
    if t is None or not all(hasattr(t, a) for a in ("wte", "wpe", "h", "ln_f")) or not hasattr(model, "lm_head"):
        return None
    drop = getattr(t, "drop", nn.Identity())
    blocks: list[tuple[str, nn.Module]] = [("embed", _HFEmbedding(t.wte, t.wpe, drop))]
    eager = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") == "eager"
    blocks += [(f"transformer.h.{i}", _FirstOutput(layer, causal_mask=eager)) for i, layer in enumerate(t.h)]
    blocks.append(("head", _Seq(t.ln_f, model.lm_head)))
    return Chain(blocks, source=model)


_TV_RESNET = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")


def _torchvision_resnet(model: nn.Module) -> Chain | None:
    if not all(hasattr(model, a) for a in _TV_RESNET):
        return None
    blocks: list[tuple[str, nn.Module]] = [("stem", _Seq(model.conv1, model.bn1, model.relu, model.maxpool))]
    for li in range(1, 5):
        for j, b in enumerate(getattr(model, f"layer{li}")):
            blocks.append((f"layer{li}.{j}", b))
    blocks.append(("head", _Seq(model.avgpool, model.fc, flatten_before_last=True)))
    return Chain(blocks, source=model)


# ---------------------------------------------------------------- Hugging Face Llama/Mistral and BERT
# (read by the adapters of scaletrain.models.adapters; kept here, beside _hf_gpt2, so that finding
# blocks never needs the adapters)

def _causal_mask(s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask [1, 1, s, s]: 0 on and below the diagonal, the dtype's minimum above
    (what HF builds at model level for "eager" attention; SDPA is causal without a mask)."""
    upper = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(s, s, dtype=dtype, device=device).masked_fill(upper, torch.finfo(dtype).min)[None, None]


class RotaryLayer(nn.Module):
    """A Llama/Mistral decoder layer as a single-tensor block: hidden [b, s, h] -> hidden [b, s, h],
    positions 0..s-1, the rotary embedding of the model's own ``rotary_emb``."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, eager: bool):
        super().__init__()
        self.layer, self.eager = layer, eager
        self.rotary = rotary  # shared by every layer; no parameters (its inv_freq buffer is not saved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        pe = self.rotary(x, position_ids=pos)
        mask = _causal_mask(x.shape[1], x.dtype, x.device) if self.eager else None
        out = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, (tuple, list)) else out


def llama_chain(model: nn.Module) -> Chain | None:
    """Blocks of a Llama/Mistral-style ``*ForCausalLM``: embed_tokens, each layer, norm + lm_head."""
    body = getattr(model, "model", None)
    if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        return None
    eager = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") == "eager"
    blocks: list[tuple[str, nn.Module]] = [("embed", body.embed_tokens)]
    blocks += [(f"model.layers.{i}", RotaryLayer(layer, body.rotary_emb, eager)) for i, layer in enumerate(body.layers)]
    blocks.append(("head", _Seq(body.norm, model.lm_head)))
    return Chain(blocks, source=model)


def bert_chain(model: nn.Module) -> Chain | None:
    """Blocks of ``BertForMaskedLM``: embeddings, each encoder layer (bidirectional, no mask), ``cls`` head."""
    bert, head = getattr(model, "bert", None), getattr(model, "cls", None)
    if bert is None or head is None or not hasattr(getattr(bert, "encoder", None), "layer"):
        return None
    blocks: list[tuple[str, nn.Module]] = [("embed", bert.embeddings)]
    blocks += [(f"bert.encoder.layer.{i}", _FirstOutput(layer)) for i, layer in enumerate(bert.encoder.layer)]
    blocks.append(("head", head))
    return Chain(blocks, source=model)


def to_chain(model: nn.Module | Sequence[nn.Module]) -> Chain:
    """Find the chain of blocks of ``model`` (see the module docstring for the rules)."""
    if isinstance(model, Chain):
        return model
    if isinstance(model, (list, tuple)):
        return Chain(model)
    if hasattr(model, "chain_blocks"):
        return Chain(model.chain_blocks(), source=model)
    if isinstance(model, nn.Sequential):
        return Chain(list(model.named_children()), source=model)
    for finder in (_hf_gpt2, _torchvision_resnet, llama_chain, bert_chain):
        c = finder(model)
        if c is not None:
            return c
    raise UserError(
        f"cannot find the blocks of {type(model).__name__}: supported are nn.Sequential, the reference models, "
        "Hugging Face GPT-2, Llama/Mistral and BERT, and torchvision ResNet layouts; otherwise declare them: "
        "scaletrain.chain.Chain([embed, *layers, head])"
    )
