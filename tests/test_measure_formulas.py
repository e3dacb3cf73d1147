"""The seeds' closed forms (measure/formulas.py) against published figures and against the estimator.

Table 2 of the seed "Training large-scale (language) models with limited GPU memory: a survey"
(Tang et al., FITEE 2025) could not be retrieved here (only its bibliographic record); its
M_p / M_s columns are the formulas M_p = bytes/param × Ψ and M_s = 16Ψ (mixed-precision Adam),
which are checked below against the figures of the ZeRO paper they come from.
"""

from __future__ import annotations

import pytest
import torch

from scaletrain import models
from scaletrain.chain import to_chain
from scaletrain.measure import formulas as f
from scaletrain.measure.blocks import flop_counter
from scaletrain.measure.estimate import estimate_chain, estimate_step


pytestmark = pytest.mark.usefixtures("one_thread")


def test_zero_paper_figures() -> None:
    """ZeRO §3.1: GPT-2 1.5B needs 24 GB of model states; Figure 1: Ψ = 7.5B, N_d = 64, K = 12."""
    assert f.mixed_adam_bytes(1.5e9) / f.GB == 24
    psi = 7.5e9
    assert f.zero_stage_bytes(psi, 64, 0) / f.GB == 120  # baseline (2 + 2 + K)Ψ
    assert round(f.zero_stage_bytes(psi, 64, 1) / f.GB, 1) == 31.4  # P_os
    assert round(f.zero_stage_bytes(psi, 64, 2) / f.GB, 1) == 16.6  # P_os+g
    assert round(f.zero_stage_bytes(psi, 64, 3) / f.GB, 1) == 1.9  # P_os+g+p
    assert f.fp32_adam_bytes(psi) == f.mixed_adam_bytes(psi)  # both 16 bytes/parameter


@pytest.mark.parametrize("name", ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_transformer_parameter_formula(name: str) -> None:
    m = models.get(name, device="meta")
    c = m.config
    psi = f.transformer_params(c.n_layer, c.n_embd, c.vocab_size, positions=c.n_positions, final_norm=True)
    assert psi == models.count_params(m) == models.entry(name).published_params


def test_model_states_m_p_and_m_s_from_the_estimator() -> None:
    """M_p = 2Ψ (16-bit weights) and M_s = 16Ψ (2 + 2 + 12), from an estimate of gpt2-xl shapes."""
    est = estimate_step("gpt2-xl", 1, 64, precision="bf16", optimizer="adamw", params_dtype="bf16")
    psi = est.parameters
    n_tensors = len(list(models.get("gpt2-xl", device="meta").parameters()))
    assert est.bytes["parameters"] == f.weights_bytes(psi, 2)
    at_step = dict(est.timeline)["optimizer step"]  # after backward, before the fp32 master gradients
    assert at_step["gradients"] == 2 * psi
    m_s = at_step["parameters"] + at_step["gradients"] + at_step["optimizer_states"]
    assert m_s == f.mixed_adam_bytes(psi) + 4 * n_tensors  # + Adam's 4-byte step counter per tensor (CPU)
    # the step itself adds the fp32 master gradients (4Ψ) on top of M_s
    assert est.bytes["gradients"] == 6 * psi


def test_korthikanti_activations_match_the_estimator() -> None:
    """sbh(34 + 5as/h) specialised to this GPT-2 (no dropout, flash attention) is 32·sbh per layer.

    The estimator sees the same bytes per block (16-bit parameters, no autocast), plus what the
    formula leaves out: the attention's logsumexp (b·a·s fp32) and the LayerNorm statistics.
    """
    s, b = 256, 2
    m = models.get("gpt2-small", device="meta", n_layer=2)
    h, a = m.config.n_embd, m.config.n_head
    prof = estimate_chain(m, torch.zeros(b, s, dtype=torch.long), params_dtype="bf16")
    layer = prof.blocks[1]
    formula = f.korthikanti_activation_bytes(s, b, h, a, dropout=False, flash=True)
    assert formula == 32 * s * b * h
    extra = layer.saved_bytes + layer.input_bytes - formula  # the input is part of the layer's activations
    assert 0 <= extra <= 4 * b * a * s + 2 * 2 * b * s * 4
    # the published form, with dropout and a materialised softmax
    assert f.korthikanti_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def test_training_flops_formula() -> None:
    """FlopCounter on a gpt2-tiny step = 6Ψ_matmul per token + attention.

    nanoGPT/PaLM count attention as 12·l·h·s per token (backward = 2 × forward); FlopCounter's
    flash-attention backward also recomputes the scores (2.5 × forward), so 14·l·h·s here.
    """
    m = models.get("gpt2-tiny")
    c = m.config
    b, s = 2, 64
    x = torch.randint(0, c.vocab_size, (b, s))
    with flop_counter() as fc:
        m(x).sum().backward()
    psi_matmul = c.n_layer * 12 * c.n_embd**2 + c.vocab_size * c.n_embd
    tokens = b * s
    attention = 14 * c.n_layer * c.n_embd * s
    assert fc.get_total_flops() == tokens * (6 * psi_matmul + attention)
    nanogpt = 6 * psi_matmul + 12 * c.n_layer * c.n_embd * s
    assert f.training_flops_per_token(psi_matmul, c.n_layer, c.n_embd, s) == nanogpt
    # the estimator's per-block FLOPs add up to the same total
    prof = estimate_chain(to_chain(m), x)
    total = sum(bp.flops_fwd + bp.flops_bwd for bp in prof.blocks)
    assert total == fc.get_total_flops()


def test_grouped_query_attention_flops_count_the_repeated_heads():
    """GQA (2 KV heads for 8 query heads) costs what 8 full heads cost; unequal heads never raise."""
    from scaletrain.measure.blocks import _sdpa_cpu_bwd_flop, _sdpa_cpu_flop

    q, kv = (2, 8, 64, 16), (2, 2, 64, 16)
    assert _sdpa_cpu_flop(q, kv, kv) == _sdpa_cpu_flop(q, q, q) == 4 * 2 * 8 * 64 * 64 * 16
    assert _sdpa_cpu_bwd_flop(q, q, kv, kv) == _sdpa_cpu_bwd_flop(q, q, q, q)
