"""GPT-2 (Radford et al. 2019) as plain PyTorch: tied embeddings, learned positions, pre-LayerNorm,
GELU (tanh approximation, as the original), causal attention via ``scaled_dot_product_attention``.

The body is embedding -> ``h`` (a ModuleList of identical blocks) -> head, so the model is a chain of
single-tensor blocks. Nothing in here knows about parallelism or memory techniques.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPT2Config:
    """Shape of a GPT-2 model."""

    vocab_size: int = 50257
    """Vocabulary size (tokens); 256 for the byte-level tokenizer of the shipped text."""
    n_positions: int = 1024
    """Context length (tokens): size of the learned position table."""
    n_embd: int = 768
    """Hidden size h."""
    n_layer: int = 12
    """Number of transformer blocks l."""
    n_head: int = 12
    """Attention heads a (n_embd must be divisible by it)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention probabilities and residual branches."""
    layer_norm_eps: float = 1e-5
    rezero: bool = False
    """ReZero residuals (Bachlechner et al. 2020): each block computes x + α·F(x) with one scalar α per
    block (shared by its attention and MLP branches, as the authors' RZTX layers), initialised at 0,
    and without the block's LayerNorms; the head's final LayerNorm stays (it scales the tied logits)."""


class GPT2Embedding(nn.Module):
    """Token + learned position embedding. idx: [batch, seq] int64 -> [batch, seq, hidden]."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        # [batch, heads, seq, head_dim]
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)). [b, s, h] -> [b, s, h]."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ReZeroBlock(nn.Module):
    """ReZero block (:attr:`GPT2Config.rezero`): x + α·attn(x), then x + α·mlp(x); α a one-element
    parameter initialised at 0, so every block starts as the identity. [b, s, h] -> [b, s, h]."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.alpha = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.alpha * self.attn(x)
        return x + self.alpha * self.mlp(x)


class GPT2Head(nn.Module):
    """Final LayerNorm and the language-model head whose weight is the token embedding (tied)."""

    def __init__(self, cfg: GPT2Config, wte: nn.Embedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = wte.weight  # tied: one Parameter shared by two blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # [batch, seq, vocab]


class GPT2(nn.Module):
    """GPT-2 language model: token ids [batch, seq] -> logits [batch, seq, vocab]."""

    task = "lm"

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.embed = GPT2Embedding(cfg)
        block = ReZeroBlock if cfg.rezero else GPT2Block
        self.h = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.head = GPT2Head(cfg, self.embed.wte)
        self.apply(self._init_weights)
        # GPT-2's scaled init of residual projections: std 0.02 / sqrt(2 l).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def chain_blocks(self) -> list[tuple[str, nn.Module]]:
        """The model as single-tensor blocks, in order (used by :func:`scaletrain.chain.to_chain`)."""
        return [("embed", self.embed)] + [(f"h.{i}", b) for i, b in enumerate(self.h)] + [("head", self.head)]

    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        """A meta-device example input of the right shape and dtype (token ids [batch, seq])."""
        return torch.zeros(batch, seq or self.config.n_positions, dtype=torch.long, device="meta")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.config.n_positions:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds n_positions={self.config.n_positions}")
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)
