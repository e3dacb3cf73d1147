"""A decoder-only transformer as the planner sees it: a handful of integers, no module.

Two layouts, one type: GPT-2 (LayerNorm, biases, GELU MLP of two matrices, learned positions, the
head tied to the embedding) and Llama (RMSNorm, no biases, SwiGLU MLP of three matrices, grouped-query
attention with fewer key/value heads, rotary positions, an untied head).

Which models have a shape is their family's to say (``ModelSpec.shape`` in ``models/<family>/``: the
fields below from a model name and ``--set`` overrides): ``Shape.of("gpt2-xl", n_layer=96, ...)``,
``Shape.of("hf:llama", hidden_size=4096, ...)``; ``Shape.of("llama3.1-8b")`` is a named published shape
(:data:`NAMED`). None builds a module, so any size is free to price.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import UserError

NAMED: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1 8B (Meta's config.json for meta-llama/Llama-3.1-8B): 8.03B parameters
    "llama3.1-8b": ("hf:llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                     max_position_embeddings=131072, tie_word_embeddings=False)),
}
"""Published shapes by name: the family they are read as and its config fields (``--set`` still applies)."""


@dataclass(frozen=True)
class Shape:
    """l layers, h hidden, a heads, V vocabulary; the defaults are GPT-2's choices."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    positions: int = 0
    """Longest sequence (n_positions / max_position_embeddings); learned rows of h parameters unless
    ``rotary``."""
    ffn: int = 0
    """MLP inner width f; 0 = 4h (GPT-2)."""
    dropout: float = 0.0
    kv_heads: int = 0
    """Key/value heads (grouped-query attention, Ainslie et al. 2023); 0 = ``heads`` (multi-head)."""
    gated: bool = False
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x), three h x f matrices instead of two."""
    rmsnorm: bool = False
    """RMSNorm (a scale per feature, h parameters) instead of LayerNorm (scale and shift, 2h)."""
    bias: bool = True
    """Biases on the linear layers (GPT-2 yes, Llama no)."""
    rotary: bool = False
    """Rotary positions (no parameters, an elementwise rotation of q and k) instead of learned ones."""
    tied: bool = True
    """The output head shares the embedding matrix (GPT-2); False: a separate V x h matrix (Llama)."""

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: kv_heads x head dim."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def position_rows(self) -> int:
        """Learned position-embedding rows (0 with rotary positions)."""
        return 0 if self.rotary else self.positions

    @property
    def norm_params(self) -> int:
        """Parameters of one norm layer: 2h (LayerNorm) or h (RMSNorm)."""
        return self.hidden if self.rmsnorm else 2 * self.hidden

    # ---------------------------------------------------------------- construction
    @classmethod
    def of(cls, model: str, **overrides: Any) -> "Shape":
        """The shape of ``model`` (a model or ``hf:`` name whose family declares ``ModelSpec.shape``, or a
        :data:`NAMED` shape) with config ``overrides``."""
        if model in NAMED:
            name, fields = NAMED[model]
            return cls(**_shape_fn(name)(name, {**fields, **overrides}))
        return cls(**_shape_fn(model)(model, overrides))

    # ---------------------------------------------------------------- parameters
    @functools.lru_cache(maxsize=None)  # noqa: B019  (frozen, hashable, few shapes: the search calls it per plan)
    def matmuls(self) -> list[tuple[str, int, int, str]]:
        """The layer's weight matmuls in forward order: (name, out width, in width, how TP splits it —
        ``col``umn: the output over t ranks, ``row``: the input). GPT-2 fuses Q, K and V in one matmul
        (c_attn); Llama runs wq, wk, wv apart and the SwiGLU as w1, w3 then w2."""
        h, f, kv = self.hidden, self.ffn_width, self.kv_width
        if self.gated:
            return [("wq", h, h, "col"), ("wk", kv, h, "col"), ("wv", kv, h, "col"), ("wo", h, h, "row"),
                    ("w1", f, h, "col"), ("w3", f, h, "col"), ("w2", h, f, "row")]
        return [("qkv", h + 2 * kv, h, "col"), ("proj", h, h, "row"), ("fc", f, h, "col"), ("fc2", h, f, "row")]

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def layer_params(self) -> int:
        """One block: its matmul weights (GPT-2: 4h^2 + 2hf; Llama: 2h^2 + 2h·kv + 3hf), their biases
        (GPT-2: 3h + h + f + h) and two norms (4h LayerNorm, 2h RMSNorm). GPT-2 with f = 4h: 12h^2 + 13h."""
        weights = sum(o * i for _, o, i, _ in self.matmuls())
        biases = sum(o for _, o, _, _ in self.matmuls()) if self.bias else 0
        return weights + biases + 2 * self.norm_params

    def outer_params(self) -> int:
        """Outside the blocks: the embedding Vh, learned positions, the final norm and an untied head Vh."""
        h = self.hidden
        return self.vocab * h + self.position_rows * h + self.norm_params + (0 if self.tied else self.vocab * h)

    def params(self) -> int:
        """l · layer_params + outer_params (GPT-2: l(12h^2 + 13h) + Vh + positions·h + 2h)."""
        return self.layers * self.layer_params() + self.outer_params()

    # ---------------------------------------------------------------- FLOPs
    def flops_per_token(self, seq: int) -> float:
        """Model FLOPs per token of one training step without recomputation: 6N + 12·l·s·h, N the
        parameters a token multiplies (every layer's matmul weights and the head: not the embedding lookup,
        norms or biases); 12·l·s·h the attention scores and their weighted sum, 2 matmuls of 2·s·h FLOPs
        forward and twice that backward, the causal mask not discounted (torchtitan's
        ``get_num_flop_per_token``; Narayanan et al. SC21 eq. (3) divided by B·s)."""
        return 3 * self._fwd_flops_per_token(seq)

    def _fwd_flops_per_token(self, seq: int) -> float:
        mm = self.layers * sum(o * i for _, o, i, _ in self.matmuls())
        return 2 * mm + 4 * self.layers * seq * self.hidden + 2 * self.vocab * self.hidden

    def flops_per_iteration(self, batch: int, seq: int, recompute: bool = True) -> float:
        """FLOPs of one step on ``batch`` sequences of ``seq`` tokens; ``recompute``: full recomputation
        (one more forward of every layer, not of the head). For GPT-2 with f = 4h this is Narayanan et al.
        (SC21) eq. (3): 96·B·s·l·h^2·(1 + s/(6h) + V/(16·l·h)) with recomputation, 72·... without."""
        layer_fwd = self._fwd_flops_per_token(seq) - 2 * self.vocab * self.hidden
        head_fwd = 2 * self.vocab * self.hidden
        return batch * seq * ((4 if recompute else 3) * layer_fwd + 3 * head_fwd)


def _shape_fn(model: str) -> Any:
    """The family's ``ModelSpec.shape`` of model name ``model``; one-line UserError when it has none."""
    from scaletrain.models.spec import spec_named

    family = None if model.startswith("py:") else spec_named(model)
    if family is None and not model.startswith(("hf:", "py:")):
        from scaletrain.models import registry

        registry.entry(model)  # an unknown name: the registry's one line, naming every model
    if family is None or family.shape is None:
        raise UserError(f"scaletrain plan prices decoder shapes on paper; {model!r} is not one "
                        f"(allowed: {', '.join(analytic_names())})")
    return family.shape


def analytic_names() -> list[str]:
    """Every name :meth:`Shape.of` prices on paper: the models and ``hf:`` families whose family declares a
    shape, and the :data:`NAMED` shapes."""
    from scaletrain.models.spec import specs

    out: list[str] = []
    for s in specs():
        if s.shape is not None:
            out += list(s.models) + ["hf:" + f for f in s.hf]
    return out + list(NAMED)


def analytic(model: Any) -> bool:
    """Whether :meth:`Shape.of` prices ``model`` on paper (its family declares a shape, or a :data:`NAMED`
    shape); every other model is priced by its trace (:mod:`.traced`)."""
    return isinstance(model, str) and model in analytic_names()
