"""A GPT-style transformer as the planner sees it: a handful of integers, no module.

``Shape.of("gpt2-xl", n_layer=96, ...)`` reads a gpt2-* reference model's config (with ``--set``
overrides, checked by the model registry) without building it, so any size is free to price.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletrain.errors import UserError


@dataclass(frozen=True)
class Shape:
    """l layers, h hidden, a heads, V vocabulary, ``positions`` learned positions (GPT-2: tied head)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    positions: int = 0
    ffn: int = 0
    """MLP inner width; 0 = 4h (GPT-2)."""
    dropout: float = 0.0

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @classmethod
    def of(cls, model: str, **overrides: Any) -> "Shape":
        """The shape of reference model ``model`` (a gpt2-* name) with config ``overrides``."""
        from scaletrain.models import registry

        entry = registry.entry(model)
        if entry.builder is not registry._gpt2:
            raise UserError(f"scaletrain plan prices GPT-2-style transformers on paper; {model!r} is not one "
                            f"(allowed: {', '.join(n for n in registry.names() if n.startswith('gpt2-') and n != 'gpt2-moe')})")
        import dataclasses

        from scaletrain.models.gpt2 import GPT2Config

        a = {**dataclasses.asdict(GPT2Config()), **registry.resolve_args(model, **overrides)}
        for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
            if not isinstance(a[k], int) or a[k] < 1:
                raise UserError(f"model {model!r}: {k} must be a positive integer (got {a[k]!r})")
        if a["n_embd"] % a["n_head"]:
            raise UserError(f"model {model!r}: n_embd={a['n_embd']} must be divisible by n_head={a['n_head']}")
        return cls(layers=a["n_layer"], hidden=a["n_embd"], heads=a["n_head"], vocab=a["vocab_size"],
                   positions=a["n_positions"], dropout=float(a.get("dropout", 0.0) or 0.0))

    # ---------------------------------------------------------------- parameters
    def layer_params(self) -> int:
        """One block: QKV 3h^2+3h, projection h^2+h, MLP 2·h·f + f + h, two LayerNorms 4h (= 12h^2 + 13h)."""
        h, f = self.hidden, self.ffn_width
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def params(self) -> int:
        """l(12h^2 + 13h) + Vh + positions·h + 2h (final LayerNorm); the head is tied to the embedding."""
        h = self.hidden
        return self.layers * self.layer_params() + self.vocab * h + self.positions * h + 2 * h

    def flops_per_iteration(self, batch: int, seq: int, recompute: bool = True) -> float:
        """Narayanan et al. (SC21) eq. (3): 96·B·s·l·h^2·(1 + s/(6h) + V/(16·l·h)) FLOPs with full
        recomputation (one extra forward), 72·... without — matmuls only, a 4h MLP."""
        l, h, V = self.layers, self.hidden, self.vocab
        k = 96 if recompute else 72
        return k * batch * seq * l * h * h * (1 + seq / (6 * h) + V / (16 * l * h))
