"""Megatron tensor parallelism (Shoeybi et al. 2019) for the GPT-2 family, on PyTorch DTensor.

Apply face — :func:`apply_tensor_parallel(model, tp_mesh, sequence_parallel=False)`:

- attention: ``c_attn`` (fused QKV, h -> 3h) column-parallel, ``c_proj`` row-parallel; each rank
  owns ``n_head / t`` whole heads, so attention itself needs no communication;
- MLP: ``c_fc`` (h -> 4h) column-parallel, ``c_proj`` (4h -> h) row-parallel;
- vocabulary-parallel embedding: ``wte`` is split along the vocabulary (rows); a lookup of a row
  another rank owns gives zeros there, and the partial sums are all-reduced (DTensor's
  ``MaskPartial``); ``lm_head`` (tied to ``wte``) is column-parallel with its output left as a
  vocabulary-sharded DTensor, so the cross-entropy runs under ``loss_parallel`` and no rank ever
  holds the full [batch, seq, vocab] logits (Megatron's vocab-parallel cross-entropy: all-reduce
  of the row max, of the sum of exponentials and of the target logit — 3 x [batch, seq] floats);
- LayerNorms, position embeddings and row-parallel biases are replicated.

Per layer this gives Megatron's two all-reduces of [b, s, h] in the forward (attention-out,
MLP-out) and two in the backward (the inputs of the column-parallel layers), plus one each for
the embedding and the head. With ``sequence_parallel=True`` (Korthikanti et al. 2022, see
:mod:`scaletrain.techniques.sequence_parallel`) every all-reduce becomes a reduce-scatter / all-gather
pair and the LayerNorm/dropout/residual regions hold only ``s / t`` tokens; with ``regather``
(the default) the column-parallel layers also keep only their input's ``s / t`` slice for the
backward and all-gather it again there, as Megatron does.

The fused QKV. ``c_attn.weight`` is [3h, h] with rows ordered ``[q (h) | k (h) | v (h)]``; a plain
column split (``Shard(0)`` of the rows) would give rank 0 all of q and a part of k. At parallelize
time the rows (and bias) are permuted to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` where ``q_r`` are the
rows of heads ``r a/t ... (r+1) a/t - 1``, so the contiguous ``Shard(0)`` of rank r is exactly its
heads' q, k and v. The attention forward is swapped for one that splits the *local* [.., 3h/t]
output in three and uses ``n_head / t`` heads. :func:`full_state_dict` gathers the shards and
undoes the permutation, so checkpoints load into the plain single-device model.

Cost face — :func:`tp_memory_per_rank` and :func:`tp_comm_bytes_per_step` (see their docstrings
for the derivations). The model files know nothing of any of this.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from scaletrain.errors import UserError

_TP_ATTR = "_scaletrain_tp"  # set on the model: TPInfo


@dataclass(frozen=True)
class TPInfo:
    """What :func:`apply_tensor_parallel` did to a model (kept on it for the trainer and export)."""

    tp: int
    sequence_parallel: bool
    mesh: DeviceMesh
    regather: bool = False


# --------------------------------------------------------------------------- the fused QKV


def qkv_permutation(n_embd: int, n_head: int, tp: int) -> torch.Tensor:
    """Row order of the fused QKV weight that makes a contiguous ``t``-way split head-aligned.

    Returns ``perm`` with ``new_rows = old_rows[perm]``: block r of the result is
    ``[q rows of heads of rank r | k rows of them | v rows of them]``.
    """
    if n_head % tp:
        raise UserError(f"parallel.tp={tp} must divide the number of attention heads ({n_head})")
    local = n_embd // tp  # rows of q (or k or v) per rank = (n_head / t) heads x head_dim
    idx = []
    for r in range(tp):
        for part in range(3):  # q, k, v
            start = part * n_embd + r * local
            idx.append(torch.arange(start, start + local))
    return torch.cat(idx)


def _tp_attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Attention over this rank's heads. x: [b, s, h] (replicated) -> [b, s, h] (after c_proj)."""
    qkv = self.c_attn(x)  # local [b, s, 3h/t] = [q_r | k_r | v_r]
    b, s, three_hl = qkv.shape
    hl = three_hl // 3
    nh = self.n_head // self._tp_size
    q, k, v = (t.view(b, s, nh, hl // nh).transpose(1, 2) for t in qkv.split(hl, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       dropout_p=self.attn_dropout if self.training else 0.0)
    y = y.transpose(1, 2).reshape(b, s, hl)  # [b, s, h/t]: sharded on the last dim
    return self.resid_drop(self.c_proj(y))


def _sp_embedding_forward(self: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Sequence-parallel embedding: the token lookup comes back reduce-scattered along the
    sequence ([b, s/t, h]), so only this rank's positions are added."""
    tok = self.wte(idx)  # local [b, s/t, h]
    s_local = tok.shape[1]
    start = self._tp_rank * s_local
    pos = torch.arange(start, start + s_local, device=idx.device)
    return self.drop(tok + self.wpe(pos))  # wpe: replicated weight, Shard(0) positions


# --------------------------------------------------------------------------- apply face


def replicate_module(module: nn.Module, mesh: DeviceMesh, input_placement: Placement = Replicate()) -> None:
    """Make ``module``'s own parameters replicated DTensors (rank 0's values broadcast).

    Why: the optimizer's and ``clip_grad_norm_``'s foreach kernels refuse a mix of DTensor and
    plain tensors, so every parameter of a TP model is a DTensor. Plain-tensor inputs are wrapped
    with ``input_placement`` (``Shard(0)`` for this rank's slice of positions under SP, in which
    case the weight gradient comes out Partial and DTensor all-reduces it) and the output is
    returned as a local tensor.
    """
    def partition(name: str, mod: nn.Module, m: DeviceMesh) -> None:
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), m, [Replicate()]),
                                                           requires_grad=p.requires_grad))

    def inputs(mod: nn.Module, args: tuple, m: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(a, m, [input_placement], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    def outputs(mod: nn.Module, out: Any, m: DeviceMesh) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, partition, inputs, outputs)


def _replicate_leftovers(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate every module that still owns plain parameters (LayerNorms without SP, wpe)."""
    for mod in model.modules():
        if any(not isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
            replicate_module(mod, mesh)


def _check_model(model: nn.Module, tp: int) -> None:
    for attr in ("embed", "h", "head", "config"):
        if not hasattr(model, attr):
            raise UserError(f"tensor parallelism supports the GPT-2 layout (embed, h, head); "
                            f"{type(model).__name__} has no {attr!r}")
    cfg = model.config
    if cfg.n_head % tp:
        raise UserError(f"parallel.tp={tp} must divide n_head={cfg.n_head}")
    if cfg.vocab_size % tp:
        raise UserError(f"parallel.tp={tp} must divide vocab_size={cfg.vocab_size} (vocabulary-parallel embedding)")
    for i, block in enumerate(model.h):
        if not isinstance(getattr(block.mlp, "c_fc", None), nn.Linear):
            raise UserError(f"tensor parallelism splits dense MLPs; block {i} has a {type(block.mlp).__name__} "
                            f"(mixture of experts: use parallel.ep instead of parallel.tp)")


def _reduce_partial_grads_eagerly(model: nn.Module) -> None:
    """All-reduce a replicated parameter's gradient as soon as it is accumulated.

    Why: under sequence parallelism a replicated parameter (LayerNorm, wpe) that sees only this
    rank's tokens gets a ``Partial`` gradient; DTensor would reduce it lazily, and again in every
    consumer (the norm for clipping, then the optimizer). Reducing once in the backward is
    Megatron's "all-reduce the LayerNorm gradients" and leaves plain replicated gradients for
    clipping, the optimizer and data parallelism.
    """
    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=p.placements)

    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad and all(pl.is_replicate() for pl in p.placements):
            p.register_post_accumulate_grad_hook(hook)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          regather: bool = True) -> nn.Module:
    """Shard a GPT-2 (``scaletrain.models.gpt2.GPT2`` or a subclass, or a Hugging Face
    ``GPT2LMHeadModel`` — see :mod:`tensor_parallel_hf`) over ``tp_mesh`` in place.

    ``tp_mesh`` is a 1-D DeviceMesh (e.g. ``mesh["tp"]`` of a 2-D (dp, tp) mesh). Every rank must
    hold the same initial weights (rank 0's are scattered). The model's output becomes a DTensor
    sharded on the vocabulary: compute the loss with :func:`vocab_parallel_cross_entropy` inside
    :func:`loss_context` (forward *and* backward). With ``sequence_parallel`` the token-id input
    stays [batch, seq] on every TP rank (the embedding's reduce-scatter splits the sequence).
    ``regather`` (SP only): the column-parallel layers (c_attn, c_fc, lm_head) keep only this
    rank's sequence slice of their all-gathered input for the backward and all-gather it again
    there, as Megatron does (one more all-gather each in the backward; activations 16/t instead
    of 2 + 14/t units per layer); ``False`` keeps DTensor's behaviour (the gathered input saved).
    """
    t = tp_mesh.size()
    if getattr(model, _TP_ATTR, None) is not None:
        raise UserError("apply_tensor_parallel was already applied to this model")
    from scaletrain.techniques.tensor_parallel_hf import apply_tensor_parallel_hf, is_hf_gpt2

    if is_hf_gpt2(model):  # Hugging Face GPT-2: same split, HF's own forward
        if sequence_parallel:
            raise UserError("sequence parallelism is not supported for Hugging Face GPT-2; use parallel.tp alone")
        return apply_tensor_parallel_hf(model, tp_mesh)
    _check_model(model, t)
    rank = tp_mesh.get_local_rank()
    sp = bool(sequence_parallel)
    seq_in = Shard(1) if sp else Replicate()

    # Vocabulary-parallel embedding (rows of wte); reduce-scatter along the sequence under SP.
    embed_plan: dict[str, Any] = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_in)}
    parallelize_module(model.embed, tp_mesh, embed_plan)
    if sp:
        model.embed._tp_rank = rank
        model.embed.forward = types.MethodType(_sp_embedding_forward, model.embed)
        replicate_module(model.embed.wpe, tp_mesh, Shard(0))

    for block in model.h:
        attn = block.attn
        # Permute the fused QKV rows so that Shard(0) keeps q, k, v and whole heads together.
        perm = qkv_permutation(model.config.n_embd, attn.n_head, t)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[perm])
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(attn.c_attn.bias[perm])
        attn._tp_size = t
        attn.forward = types.MethodType(_tp_attention_forward, attn)
        plan: dict[str, Any] = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=seq_in),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=seq_in),
        }
        if sp:
            plan.update({
                "ln_1": SequenceParallel(use_local_output=True),
                "ln_2": SequenceParallel(use_local_output=True),
                # all-gather the sequence before the column-parallel layers (Megatron's g)
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)

    if sp and regather:
        from scaletrain.techniques.sequence_parallel import keep_sequence_shard_for_backward

        for block in model.h:
            keep_sequence_shard_for_backward(block.attn.c_attn, tp_mesh)
            keep_sequence_shard_for_backward(block.mlp.c_fc, tp_mesh)
    head_plan: dict[str, Any] = {
        "lm_head": ColwiseParallel(input_layouts=seq_in, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        head_plan["ln_f"] = SequenceParallel(use_local_output=True)
    parallelize_module(model.head, tp_mesh, head_plan)
    if sp and regather:
        keep_sequence_shard_for_backward(model.head.lm_head, tp_mesh)
    # parallelize_module replaced wte.weight and lm_head.weight by two DTensors: tie them again
    # (both are Shard(0) over the vocabulary, so one parameter serves both uses).
    model.head.lm_head.weight = model.embed.wte.weight
    _replicate_leftovers(model, tp_mesh)
    _reduce_partial_grads_eagerly(model)
    setattr(model, _TP_ATTR, TPInfo(t, sp, tp_mesh, sp and regather))
    return model


def tp_info(model: nn.Module) -> TPInfo | None:
    """The :class:`TPInfo` of a tensor-parallel model, ``None`` for a plain one."""
    return getattr(model, _TP_ATTR, None)


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """Context for the loss's forward *and* backward: ``loss_parallel()`` on a TP model, else a no-op."""
    return loss_parallel() if tp_info(model) is not None else contextlib.nullcontext()


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of vocabulary-sharded logits [b, s, V] (DTensor Shard(-1)).

    Must run inside :func:`loss_context`. The result is a replicated scalar DTensor; the
    log-softmax is computed per shard with all-reduces of max, sum-exp and target logit, so the
    full logits never exist on one rank. Works on plain tensors too (ordinary cross-entropy).
    """
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def qkv_row_permutation(model: nn.Module, name: str, tp: int) -> torch.Tensor | None:
    """The row permutation :func:`apply_tensor_parallel` applied to parameter ``name`` of a GPT-2
    (the fused QKV weight and bias), None for every other parameter or without TP. A TP shard of
    the single-process tensor ``full`` is ``full[perm]`` chunked; ``gathered[argsort(perm)]``
    goes back."""
    if tp <= 1 or not (name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias")):
        return None
    return qkv_permutation(model.config.n_embd, model.config.n_head, tp)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain single-device state dict of a TP model: shards gathered, fused QKV un-permuted.

    Collective: every TP rank must call it. Loads into the unparallelised model.
    """
    info = tp_info(model)
    from scaletrain.techniques.tensor_parallel_hf import hf_full_state_dict, is_hf_gpt2

    if info is not None and is_hf_gpt2(model):
        return hf_full_state_dict(model)
    out: dict[str, torch.Tensor] = {}
    for name, v in model.state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[name] = v.detach().clone()
    if info is not None:
        for key in list(out):
            perm = qkv_row_permutation(model, key, info.tp)
            if perm is not None:
                out[key] = out[key][torch.argsort(perm)]
    return out


def local_numel(model: nn.Module) -> int:
    """Parameter elements held by this rank (local shards of DTensors), tied ones once."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n += (p.to_local() if isinstance(p, DTensor) else p).numel()
    return n


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
    :class:`~scaletrain.techniques.comm_count.DTensorMemoryTracker`. Per layer, in units of
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
                           regather: bool = True, act_bytes: int = 4, micro_batches: int = 1) -> dict[str, Any]:
    """Collectives one TP rank issues for the forward and backward of ``micro_batches``
    micro-batches, and the bytes it sends (ring model, see :mod:`comm_count`).

    A = b·s·h·act_bytes. Without SP: 2l + 1 all-reduces of A in the forward (embedding, and
    attention-out and MLP-out of every layer) and 2l + 1 in the backward (the inputs of c_attn,
    c_fc and lm_head); with SP each becomes an all-gather / reduce-scatter pair (same wire bytes
    as the ring all-reduce), plus the all-reduce of the replicated parameters' gradients that saw
    only s/t tokens: 4 LayerNorm vectors of h per layer, ln_f's 2, and wpe (P·h); with
    ``regather`` 2l + 1 more all-gathers of A in the backward (c_attn, c_fc, lm_head inputs). The
    vocabulary-parallel loss all-reduces 3 fp32 vectors of b·s (row max, sum of exponentials,
    target logit) in the forward.
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
        ar_count, ar_bytes = (4 * l + 2) + 3, (4 * l + 2) * A + loss_ar
        wire = 2 * f * ar_bytes
    kinds = {k: {"count": c * micro_batches, "payload_bytes": b * micro_batches} for k, (c, b) in big.items()}
    kinds["all_reduce"] = {"count": ar_count * micro_batches, "payload_bytes": ar_bytes * micro_batches}
    if t == 1:
        return {"kinds": {}, "wire_bytes": 0.0}
    return {"kinds": kinds, "wire_bytes": wire * micro_batches}
