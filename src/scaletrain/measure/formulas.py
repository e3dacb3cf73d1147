"""Closed-form memory and FLOP formulas from the seeds, as an independent cross-check.

Units: bytes (decimal GB = 1e9 bytes where a paper quotes GB), FLOPs (2 per multiply-add).
Ψ = parameter count; l layers, h hidden, a heads, s sequence, b micro-batch, V vocabulary.

Sources (each cited with its section below):

- ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC20 — §3.1 model states: fp32 weights 4Ψ, gradients 4Ψ, Adam moments 8Ψ; mixed
  precision Adam (2 + 2 + K)Ψ with K = 12 (fp32 master, momentum, variance); §5 the three
  ZeRO-DP stages over N_d ranks.
- Parameters of a GPT-style transformer: l(12h² + 13h) + Vh (+ s_max·h learned positions,
  + 2h final LayerNorm) — seed "Training large-scale models with limited GPU memory" §2.
- Activations per transformer layer, 16-bit, no parallelism: sbh(34 + 5as/h) — Korthikanti
  et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.1.
- Training FLOPs per token ≈ 6Ψ + 12·l·h·s (nanoGPT ``estimate_mfu``; PaLM appendix B).
"""

from __future__ import annotations

# --- bytes per parameter (ZeRO §3.1) -------------------------------------------------------
FP32_WEIGHT = 4
FP32_GRAD = 4
ADAM_FP32_STATES = 8
"""Adam momentum + variance in fp32."""
MIXED_ADAM_K = 12
"""Mixed-precision Adam optimizer states per parameter: fp32 master + momentum + variance."""


def weights_bytes(psi: float, bytes_per_param: int = FP32_WEIGHT) -> float:
    """M_p, memory of the parameters: Ψ × bytes per parameter (4 fp32, 2 fp16/bf16)."""
    return psi * bytes_per_param


def fp32_adam_bytes(psi: float) -> float:
    """fp32 weights + fp32 gradients + Adam (m, v): (4 + 4 + 8)Ψ = 16Ψ (ZeRO §3.1)."""
    return psi * (FP32_WEIGHT + FP32_GRAD + ADAM_FP32_STATES)


def mixed_adam_bytes(psi: float, k: int = MIXED_ADAM_K) -> float:
    """M_s, model states under mixed-precision Adam: 2Ψ + 2Ψ + KΨ = 16Ψ with K = 12 (ZeRO §3.1)."""
    return psi * (2 + 2 + k)


def zero_stage_bytes(psi: float, n_d: int, stage: int, k: int = MIXED_ADAM_K) -> float:
    """Model states per rank with ZeRO-DP (mixed precision), ZeRO §5 / Figure 1.

    stage 0: (2 + 2 + K)Ψ; 1 (P_os): 2Ψ + 2Ψ + KΨ/N_d; 2 (P_os+g): 2Ψ + (2 + K)Ψ/N_d;
    3 (P_os+g+p): (2 + 2 + K)Ψ/N_d.
    """
    if stage == 0:
        return (4 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n_d
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n_d
    if stage == 3:
        return (4 + k) * psi / n_d
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")


# --- transformer shapes ----------------------------------------------------------------------
def transformer_params(l: int, h: int, vocab: int, positions: int = 0, final_norm: bool = False) -> int:
    """l(12h² + 13h) + Vh, plus learned position embeddings (positions·h) and a final LayerNorm (2h).

    Per layer: QKV 3h² + 3h, output projection h² + h, MLP 8h² + 5h, two LayerNorms 4h.
    """
    return l * (12 * h * h + 13 * h) + vocab * h + positions * h + (2 * h if final_norm else 0)


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, *, dropout: bool = True,
                                 flash: bool = False) -> float:
    """Bytes saved for backward by one transformer layer in 16 bits, no parallelism.

    Korthikanti et al. §4.1, dropout and materialised softmax: sbh(34 + 5as/h), where 34 =
    attention 11 (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1) + MLP 19
    (input 2, GELU input 8, second linear input 8, dropout mask 1) + LayerNorms 4, and 5as/h =
    softmax output 2 + its dropout mask 1 + dropout output 2 (per as²b).
    Our derivation of the variants (same accounting): without dropout the two 1-byte masks go
    (32) and the softmax output is the only s² tensor (2as/h); flash attention saves no s²
    tensor, and its output is the projection's input (already counted), so 34 or 32.
    """
    base = 34 if dropout else 32
    if flash:
        quad = 0.0
    else:
        quad = (5 if dropout else 2) * a * s / h
    return s * b * h * (base + quad)


def training_flops_per_token(psi_matmul: float, l: int, h: int, s: int) -> float:
    """6Ψ + 12·l·h·s: forward 2Ψ and backward 4Ψ per token for the matmuls, plus attention
    (QKᵀ and AV: 4·s·h forward per token and layer, twice that backward). ``psi_matmul`` counts
    the weights used in matmuls (l·12h² + V·h for GPT-2 with a tied head; no embeddings lookup,
    biases or norms)."""
    return 6 * psi_matmul + 12 * l * h * s


GB = 1e9
"""The decimal gigabyte the ZeRO paper quotes."""
