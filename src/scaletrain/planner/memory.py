"""Per-rank memory of a transformer plan, on paper: model states by ZeRO stage and activations by
Korthikanti et al. (2022), in bytes.

Model states reuse ZeRO's cost face (:func:`scaletrain.techniques.data_parallel.cost.model_state_bytes`)
on the parameters one rank holds after tensor and pipeline splitting. Activations per layer and
micro-batch (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, §4, 16-bit, derived again here for an element size ``e`` and MLP width ``f``):

* per layer, no parallelism: sbh(34 + 5as/h) with e = 2, f = 4h, dropout. Split as
  *replicated under TP* — two LayerNorm inputs 2e, QKV input e, MLP input e, two dropout masks 1+1
  (= 10) — and *split under TP* — Q and K 2e, V e, projection input e, GELU input (f/h)e, second
  linear input (f/h)e (= 24) — plus the s² terms a·s/h·(softmax output e + dropout mask 1 + dropout
  output e) (= 5as/h).
* tensor parallel t: sbh(10 + 24/t + 5as/(ht)); + sequence parallel: sbh(34/t + 5as/(ht));
  selective recompute (the attention core) drops the s² term; full recompute keeps the layer's
  input only, 2sbh (/t with SP).
* flash attention (``F.scaled_dot_product_attention`` on GPUs, what scaletrain's GPT-2 runs) saves
  no s² tensor: its output is the projection input, already counted.
* Llama (GQA, SwiGLU, RMSNorm, rotary): the same count with K and V kv = kv_heads·h/a wide (Q, K, V
  and the projection input: (2h + 2kv)/h instead of 4) and the SwiGLU's 4f (w1's and w3's outputs,
  silu's output, the product fed to w2) instead of GELU's 2f; RMSNorm keeps its input as LayerNorm
  does; rotary keeps nothing (a rotation by constants). The fp32 temporaries eager RMSNorm and
  rotary make are not counted.
* torchtitan's op-level selective checkpointing (``selective="op"``: save the output of every other
  matmul and of the attention, recompute the rest): block input h (/t with SP), the saved matmul
  outputs and the attention output (/t) per token; flash's logsumexp (a·s fp32) is left out.

In-flight micro-batches on pipeline rank 0: GPipe m; 1F1B min(p, m) (Narayanan et al. 2021);
interleaved 1F1B with v chunks per rank: Megatron's warm-up runs 2(p − 1) + (v − 1)p forward chunks
before the first backward, so 2(p − 1) + (v − 1)p + 1 chunks of 1/v of the rank's layers are alive,
i.e. p + (p − 1)/v micro-batches' worth (capped by m). The last rank holds 1 (1F1B) or
((v − 1)p + 1)/v (interleaved).
"""

from __future__ import annotations

from scaletrain.planner.shape import Shape


def layer_activation_bytes(shape: Shape, seq: int, micro_batch: int, *, tp: int = 1, sp: bool = False,
                           remat: str = "none", elem: int = 2, flash: bool = True,
                           selective: str = "attention") -> float:
    """Bytes one transformer layer keeps for backward per micro-batch on one TP rank (module docstring).

    ``remat``: none, selective or full (layer input only). ``selective``: what selective recompute
    drops — ``attention`` (Megatron: the attention core, i.e. the s² terms) or ``op`` (torchtitan's
    op-level policy: only the block input, every other matmul's output and the attention output stay).
    ``elem``: bytes of an activation element (2 under bf16/fp16 autocast, 4 in fp32).
    """
    s, b, h, a, t = seq, micro_batch, shape.hidden, shape.heads, tp
    sbh = s * b * h
    if remat == "full":
        return elem * sbh / (t if sp else 1)
    if remat == "selective" and selective == "op":
        return elem * s * b * (h / (t if sp else 1) + (op_saved_width(shape) + h) / t)
    masks = 2.0 if shape.dropout > 0 else 0.0
    replicated = 4 * elem + masks
    # Q, K, V and the projection's input (GQA: K and V kv wide); the MLP keeps GELU's input and fc2's
    # (2f), SwiGLU w1's and w3's outputs, silu's and the product fed to w2 (4f)
    qkvo = (2 * h + 2 * shape.kv_width) / h
    split = qkvo * elem + (4 if shape.gated else 2) * (shape.ffn_width / h) * elem
    quad = 0.0
    if remat != "selective" and not flash:
        quad = ((2 * elem + 1) if shape.dropout > 0 else elem) * a * s / h
    return sbh * ((replicated / t if sp else replicated) + split / t + quad / t)


def op_saved_width(shape: Shape) -> int:
    """Elements per token of the matmul outputs torchtitan's op-level selective checkpointing keeps:
    every odd-numbered matmul of the layer's forward (1st, 3rd, ...; the 2nd, 4th, ... are recomputed)."""
    return sum(o for i, (_, o, _, _) in enumerate(shape.matmuls()) if i % 2 == 0)


def inflight(schedule: str, pp: int, microbatches: int, virtual: int = 1, last: bool = False,
             rank: int | None = None) -> float:
    """Micro-batches' worth of a pipeline rank's activations alive at its peak (module docstring);
    ``rank`` k (default: 0, or pp − 1 when ``last``): 1F1B holds min(p − k, m), interleaved
    2(p − 1 − k) + (v − 1)p + 1 chunks (the warm-up of rank k)."""
    m, p, v = microbatches, pp, max(virtual, 1)
    if p <= 1:
        return 1.0
    k = rank if rank is not None else (p - 1 if last else 0)
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and v > 1:
        chunks = 2 * (p - 1 - k) + (v - 1) * p + 1
        return min(chunks, m * v) / v
    return float(min(p - k, m))


def rank_params(shape: Shape, *, tp: int, pp: int, first: bool, last: bool, layers: float | None = None) -> float:
    """Parameter elements one rank holds: its l/pp layers split over tp (Megatron's split: the
    replicated biases and norms are few), the vocabulary-parallel embedding (V/t rows) and learned
    positions on the first stage, the final norm and the head on the last (the tied head's copy of the
    embedding when the last stage is not the first; an untied head always). ``layers``: the rank's
    layer count under an uneven split (:mod:`.stages`; default l/pp)."""
    h = shape.hidden
    n = (shape.layers / pp if layers is None else layers) * shape.layer_params() / tp
    if first:
        n += shape.vocab * h / tp + shape.position_rows * h
    if last:
        n += shape.norm_params + (shape.vocab * h / tp if not (first and shape.tied) else 0)
    return n


def logits_bytes(shape: Shape, seq: int, micro_batch: int, *, tp: int = 1, elem: int = 2) -> float:
    """Bytes of the last stage's logits of one micro-batch on one TP rank: the 16-bit (``elem``) logits,
    their fp32 copy and its gradient (V/t columns, vocabulary-parallel)."""
    return seq * micro_batch * shape.vocab / tp * (elem + 8)
