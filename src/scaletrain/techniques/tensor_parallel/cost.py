"""Tensor parallelism's cost face (Megatron, Korthikanti et al. 2022): parameter elements,
activation bytes, per-rank memory and communication per step for the GPT-2 family.

The derivations are in each function's docstring; the apply face is :mod:`.megatron`.
"""

from __future__ import annotations

from typing import Any

# --------------------------------------------------------------------------- cost face
#
# Shapes: l layers, h hidden, a heads, V vocabulary, P positions, b micro-batch, s sequence,
# t TP degree. "Units" of activation are b·s·h elements.


def tp_param_elements(cfg: Any, t: int) -> dict[str, int]:
    """Parameter elements one TP rank holds: ``{"sharded": .., "replicated": .., "total": ..}``.

    Sharded (divided by t): wte (= lm_head, tied) V·h; per layer c_attn 3h²+3h, attn c_proj h²,
    c_fc 4h²+4h, mlp c_proj 4h² — i.e. 12h² + 7h. Replicated: wpe P·h; per layer two LayerNorms
    (4h) and the two row-parallel biases (2h); ln_f 2h.
    """
    h, V, P, l = cfg.n_embd, cfg.vocab_size, cfg.n_positions, cfg.n_layer
    sharded = (V * h + l * (12 * h * h + 7 * h)) // t
    replicated = P * h + l * 6 * h + 2 * h
    return {"sharded": sharded, "replicated": replicated, "total": sharded + replicated}


def tp_activation_bytes(cfg: Any, t: int, batch: int, seq: int, *, sequence_parallel: bool = False,
                        regather: bool = True, act_bytes: int = 4) -> dict[str, int]:
    """Bytes saved for backward on one TP rank at the end of the forward (dropout off).

    Derived for this GPT-2 (pre-LN, SDPA flash kernel that keeps its output and a log-sum-exp,
    not the s×s scores) under DTensor's TP, and checked storage by storage with
    :class:`~scaletrain.measure.comm.DTensorMemoryTracker`. Per layer, in units of
    b·s·h elements:

    - without SP: 4 + 12/t — LayerNorm inputs (2) and the replicated inputs of c_attn and c_fc (2)
      are whole; q, k, v (3), the attention output (1, also c_proj's input), the GELU input (4)
      and the GELU output (4) are split by heads / columns. This is Korthikanti et al.'s
      ``sbh(10 + 24/t)`` bytes in fp16 minus its 2 dropout-mask bytes, in elements.
    - with SP and ``regather`` (Megatron): 16/t — everything is split: the LayerNorm inputs and
      the residual along the sequence, and the inputs of c_attn and c_fc are kept as their s/t
      slices and all-gathered again in the backward. Korthikanti's ``34 sbh / t`` (fp16 bytes,
      with 2 dropout-mask bytes) is 16/t elements + masks: the same count.
    - with SP, ``regather=False`` (plain DTensor): 2 + 14/t — the all-gathered inputs of c_attn
      and c_fc (2 units) stay whole, because DTensor's Linear saves the gathered tensor.

    plus per layer the LayerNorm statistics (4 b·s fp32, /t under SP) and the attention
    log-sum-exp (b·(a/t)·s fp32). Embedding: the token ids (b·s int64) and positions (s int64,
    s/t under SP). Head: ln_f's input and lm_head's input (2 units; SP: 2/t, or 1/t + 1 without
    ``regather``), ln_f
    statistics (2 b·s), targets (b·s int64), the vocab-parallel log-softmax (b·s·V/t fp32) and a
    scalar.
    """
    h, a, V, l = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer
    b, s = batch, seq
    unit = b * s * h * act_bytes
    sp = sequence_parallel
    rg = sp and regather
    per_layer_units = (16 / t if rg else 2 + 14 / t) if sp else (4 + 12 / t)
    ln_stats = 4 * b * s * 4 // (t if sp else 1)
    lse = b * (a // t) * s * 4
    layer = int(round(per_layer_units * unit)) + ln_stats + lse
    embed = b * s * 8 + (s // t if sp else s) * 8
    head_units = (2 / t if rg else 1 / t + 1) if sp else 2
    head = int(round(head_units * unit)) + 2 * b * s * 4 // (t if sp else 1) + b * s * 8 + b * s * (V // t) * 4 + 4
    return {"per_layer": layer, "layers": l * layer, "embedding": embed, "head": head,
            "total": l * layer + embed + head}


def tp_memory_per_rank(cfg: Any, t: int, batch: int, seq: int, *, sequence_parallel: bool = False,
                       regather: bool = True, param_bytes: int = 4, grad_bytes: int = 4,
                       optim_bytes_per_param: int = 8, act_bytes: int = 4, grads_kept: bool = False) -> dict[str, int]:
    """Predicted bytes per TP rank: parameters, gradients, optimizer states (Adam fp32: 8 B per
    parameter element; SGD with momentum: 4), activations at the end of the forward, and
    ``peak``.

    ``peak`` is early in the backward: parameters + optimizer states + activations + the largest
    transient of the head's backward (+ gradients when ``grads_kept``, i.e. not
    ``zero_grad(set_to_none=True)``).
    The loss's backward holds 2 fp32 [b, s, V] buffers on one device (grad of the log-softmax
    and of the logits); ``loss_parallel`` holds 3 of [b, s, V/t] plus 32 B per token of
    bookkeeping (target masks and indices) — counted storage by storage with the tracker.
    """
    n = tp_param_elements(cfg, t)["total"]
    act = tp_activation_bytes(cfg, t, batch, seq, sequence_parallel=sequence_parallel, regather=regather,
                              act_bytes=act_bytes)["total"]
    out = {"parameters": n * param_bytes, "gradients": n * grad_bytes, "optimizer_states": n * optim_bytes_per_param,
           "activations": act}
    tokens = batch * seq
    loss_bwd = 2 * tokens * cfg.vocab_size * 4 if t == 1 else 3 * tokens * (cfg.vocab_size // t) * 4 + 32 * tokens
    transient = loss_bwd
    if sequence_parallel and t > 1:
        # lm_head's backward under SP: the vocab-parallel logits' gradient (1 of the 3 loss buffers)
        # + its full [b, s, h] input (re-gathered: the gathered buffer and its re-ordered copy, else
        # the saved one is already counted) + the full input gradient + its reduce-scattered 1/t.
        A = tokens * cfg.n_embd * act_bytes
        transient = max(loss_bwd, loss_bwd // 3 + int((2 + 1 / t if regather else 1 + 1 / t) * A))
    out["total"] = sum(out.values())
    out["loss_backward"] = loss_bwd
    out["backward_transient"] = transient
    out["peak"] = (out["parameters"] + out["optimizer_states"] + act + transient
                   + (out["gradients"] if grads_kept else 0))
    return out


def tp_comm_bytes_per_step(cfg: Any, t: int, batch: int, seq: int, *, sequence_parallel: bool = False,
                           regather: bool = True, act_bytes: int = 4, micro_batches: int = 1,
                           moe_layers: int = 0) -> dict[str, Any]:
    """Collectives one TP rank issues for the forward and backward of ``micro_batches``
    micro-batches, and the bytes it sends (ring model, see :mod:`scaletrain.measure.comm`).

    A = b·s·h·act_bytes. Without SP: 2l + 1 all-reduces of A in the forward (embedding, and
    attention-out and MLP-out of every layer) and 2l + 1 in the backward (the inputs of c_attn,
    c_fc and lm_head); with SP each becomes an all-gather / reduce-scatter pair (same wire bytes
    as the ring all-reduce), plus the all-reduce of the replicated parameters' gradients that saw
    only s/t tokens: 4 LayerNorm vectors of h per layer, ln_f's 2, and wpe (P·h); with
    ``regather`` 2l + 1 more all-gathers of A in the backward (c_attn, c_fc, lm_head inputs). The
    vocabulary-parallel loss all-reduces 3 fp32 vectors of b·s (row max, sum of exponentials,
    target logit) in the forward. ``moe_layers`` (no SP): layers whose MLP is a mixture of experts, run
    whole on every TP rank — one all-reduce fewer in each pass.
    """
    h, l, P = cfg.n_embd, cfg.n_layer, cfg.n_positions
    A = batch * seq * h * act_bytes
    f = (t - 1) / t
    loss_ar = 3 * batch * seq * 4
    if sequence_parallel:
        ag = 4 * l + 2 + ((2 * l + 1) if regather else 0)
        big = {"all_gather": (ag, ag * A), "reduce_scatter": (4 * l + 2, (4 * l + 2) * A)}
        grad_ar_bytes = (4 * l * h + 2 * h + P * h) * 4
        ar_count, ar_bytes = 3 + 4 * l + 2 + 1, loss_ar + grad_ar_bytes
        wire = f * (ag + 4 * l + 2) * A + 2 * f * ar_bytes
    else:
        big = {}
        big_ar = 4 * l + 2 - 2 * moe_layers
        ar_count, ar_bytes = big_ar + 3, big_ar * A + loss_ar
        wire = 2 * f * ar_bytes
    kinds = {k: {"count": c * micro_batches, "payload_bytes": b * micro_batches} for k, (c, b) in big.items()}
    kinds["all_reduce"] = {"count": ar_count * micro_batches, "payload_bytes": ar_bytes * micro_batches}
    if t == 1:
        return {"kinds": {}, "wire_bytes": 0.0}
    return {"kinds": kinds, "wire_bytes": wire * micro_batches}


def tp_forward_bytes_per_block(cfg: Any, t: int, batch: int, seq: int, *, sequence_parallel: bool = False,
                               act_bytes: int = 4, moe_blocks: frozenset[int] = frozenset()) -> list[float]:
    """Wire bytes of the forward collectives of each Chain block (embedding, layers, head) of one
    micro-batch on one TP rank: what a recomputation of that block replays.

    A = b·s·h·act_bytes. Without SP: the embedding's all-reduce of A, two per layer
    (attention-out, MLP-out), none in the head (its input is replicated). With SP: the embedding's
    reduce-scatter, per layer two all-gathers and two reduce-scatters, the head's all-gather — each
    (t-1)/t·A on the wire, so twice the all-reduce's bytes per pair, as without SP.
    """
    if t == 1:
        return [0.0] * (cfg.n_layer + 2)
    A = batch * seq * cfg.n_embd * act_bytes
    f = (t - 1) / t
    if sequence_parallel:
        return [f * A] + [4 * f * A] * cfg.n_layer + [f * A]
    # a layer whose MLP is a mixture of experts (``moe_blocks``: layer indices) all-reduces its attention only
    return [2 * f * A] + [(2 if i in moe_blocks else 4) * f * A for i in range(cfg.n_layer)] + [0.0]
