"""A decoder-only transformer as the planner sees it: a handful of integers, no module.

Two families, one type: GPT-2 (LayerNorm, biases, GELU MLP of two matrices, learned positions, the
head tied to the embedding) and Llama (RMSNorm, no biases, SwiGLU MLP of three matrices, grouped-query
attention with fewer key/value heads, rotary positions, an untied head).

``Shape.of("gpt2-xl", n_layer=96, ...)`` reads a gpt2-* reference model's config (with ``--set``
overrides, checked by the model registry); ``Shape.of("hf:llama", hidden_size=4096, ...)`` reads a
transformers ``LlamaConfig`` (or Mistral's) with the same overrides; ``Shape.of("llama3.1-8b")`` is a
named published shape (:data:`NAMED`). None builds a module, so any size is free to price.
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

HF_DECODERS = ("hf:llama", "hf:mistral")


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
        """The shape of ``model`` (a gpt2-* name, hf:llama / hf:mistral, or a :data:`NAMED` shape) with
        config ``overrides``."""
        if model in NAMED:
            family, fields = NAMED[model]
            return cls._of_hf_decoder(model, family, {**fields, **overrides})
        if model in HF_DECODERS:
            return cls._of_hf_decoder(model, model, overrides)
        return cls._of_gpt2(model, overrides)

    @classmethod
    def _of_gpt2(cls, model: str, overrides: dict[str, Any]) -> "Shape":
        from scaletrain.models import registry

        if model.startswith("hf:") or model.startswith("py:"):
            raise UserError(f"scaletrain plan prices decoder shapes on paper; {model!r} is not one (allowed: gpt2-*, "
                            f"{', '.join(HF_DECODERS)}, {', '.join(NAMED)})")
        entry = registry.entry(model)
        if entry.builder is not registry._gpt2:
            gpt = [n for n in registry.names() if n.startswith("gpt2-") and n != "gpt2-moe"]
            raise UserError(f"scaletrain plan prices decoder shapes on paper; {model!r} is not one "
                            f"(allowed: {', '.join(gpt + list(HF_DECODERS) + list(NAMED))})")
        import dataclasses

        from scaletrain.models.gpt2 import GPT2Config

        a = {**dataclasses.asdict(GPT2Config()), **registry.resolve_args(model, **overrides)}
        _positive(model, a, ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"), "n_embd", "n_head")
        return cls(layers=a["n_layer"], hidden=a["n_embd"], heads=a["n_head"], vocab=a["vocab_size"],
                   positions=a["n_positions"], dropout=float(a.get("dropout", 0.0) or 0.0))

    @classmethod
    def _of_hf_decoder(cls, model: str, family: str, overrides: dict[str, Any]) -> "Shape":
        """A Llama-style config: the registry's small defaults (``models.external.HF_FAMILIES``), then
        ``overrides``, checked against the transformers config class when transformers is installed."""
        from scaletrain.models.external import HF_FAMILIES

        fam = HF_FAMILIES[family[3:]]
        a: dict[str, Any] = {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                             "head_dim": None, **fam.defaults}
        try:
            import transformers

            known = set(getattr(transformers, fam.config_class)().to_dict()) | set(a)
        except ImportError:
            known = set(a)
        bad = sorted(set(overrides) - known)
        if bad:
            raise UserError(f"model {model!r} has no config option {bad[0]!r}; e.g. "
                            f"{', '.join(sorted(k for k in a if not k.endswith('_id'))[:12])}")
        a.update(overrides)
        if a.get("num_key_value_heads") in (None, 0):
            a["num_key_value_heads"] = a["num_attention_heads"]
        _positive(model, a, ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                             "vocab_size", "intermediate_size", "max_position_embeddings"),
                  "hidden_size", "num_attention_heads")
        if a["num_attention_heads"] % a["num_key_value_heads"]:
            raise UserError(f"model {model!r}: num_key_value_heads={a['num_key_value_heads']} must divide "
                            f"num_attention_heads={a['num_attention_heads']}")
        hd = a.get("head_dim")
        if hd not in (None, a["hidden_size"] // a["num_attention_heads"]):
            raise UserError(f"model {model!r}: head_dim={hd} is priced only as hidden_size / num_attention_heads "
                            f"= {a['hidden_size'] // a['num_attention_heads']}")
        if bool(a["attention_bias"]) != bool(a["mlp_bias"]):
            raise UserError(f"model {model!r}: attention_bias and mlp_bias must agree (both true or both false)")
        return cls(layers=a["num_hidden_layers"], hidden=a["hidden_size"], heads=a["num_attention_heads"],
                   vocab=a["vocab_size"], positions=a["max_position_embeddings"], ffn=a["intermediate_size"],
                   dropout=float(a.get("attention_dropout", 0.0) or 0.0), kv_heads=a["num_key_value_heads"],
                   gated=True, rmsnorm=True, bias=bool(a["attention_bias"]), rotary=True,
                   tied=bool(a["tie_word_embeddings"]))

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


def analytic(model: Any) -> bool:
    """Whether :meth:`Shape.of` prices ``model`` on paper (a gpt2-* decoder, hf:llama / hf:mistral, a
    :data:`NAMED` shape); every other model is priced by its trace (:mod:`.traced`)."""
    if not isinstance(model, str):
        return False
    if model in NAMED or model in HF_DECODERS:
        return True
    if model.startswith(("hf:", "py:")):
        return False
    from scaletrain.models import registry

    try:
        return registry.entry(model).builder is registry._gpt2
    except UserError:
        return False


def _positive(model: str, a: dict[str, Any], keys: tuple[str, ...], hidden: str, heads: str) -> None:
    """One-line UserError unless every ``keys`` value is a positive integer and heads divide hidden."""
    for k in keys:
        if not isinstance(a[k], int) or isinstance(a[k], bool) or a[k] < 1:
            raise UserError(f"model {model!r}: {k} must be a positive integer (got {a[k]!r})")
    if a[hidden] % a[heads]:
        raise UserError(f"model {model!r}: {hidden}={a[hidden]} must be divisible by {heads}={a[heads]}")
