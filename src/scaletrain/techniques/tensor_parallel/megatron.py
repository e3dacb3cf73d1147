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
:mod:`scaletrain.techniques.context_parallel`) every all-reduce becomes a reduce-scatter / all-gather
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
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from scaletrain.errors import UserError

from .rng import sharded_region
from .sequence import keep_sequence_shard_for_backward

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
    p = self.attn_dropout if self.training else 0.0
    with sharded_region(self._tp_rank, active=p > 0):  # this rank's heads: their own masks
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
    y = y.transpose(1, 2).reshape(b, s, hl)  # [b, s, h/t]: sharded on the last dim
    return self.resid_drop(self.c_proj(y))


def _sharded_dropout_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Dropout on a sequence-parallel (this rank's positions) activation."""
    with sharded_region(self._tp_rank, active=self.training and self.p > 0):
        return F.dropout(x, self.p, self.training, self.inplace)


def _sp_embedding_forward(self: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Sequence-parallel embedding: the token lookup comes back reduce-scattered along the
    sequence ([b, s/t, h]), so only this rank's positions are added."""
    tok = self.wte(idx)  # local [b, s/t, h]
    s_local = tok.shape[1]
    start = self._tp_rank * s_local
    pos = torch.arange(start, start + s_local, device=idx.device)
    with sharded_region(self._tp_rank, active=self.training and self.drop.p > 0):  # this rank's positions
        return self.drop(tok + self.wpe(pos))  # wpe: replicated weight, Shard(0) positions


# --------------------------------------------------------------------------- apply face


def replicate_module(module: nn.Module, mesh: DeviceMesh, input_placement: Placement = Replicate()) -> None:
    """Make ``module``'s own parameters replicated DTensors (rank 0's values broadcast), computing on
    plain tensors.

    Why DTensors: the optimizer's and ``clip_grad_norm_``'s foreach kernels refuse a mix of DTensor
    and plain tensors, and checkpoints, clipping and data parallelism see one kind of parameter.
    Why plain compute: running the module's operators on DTensors sends each of them (forward and
    backward) through DTensor's Python dispatch, ~0.1 ms an operator on a CPU, with nothing to
    communicate; torch's own TP keeps such modules plain. So the forward swaps each parameter for
    its local tensor (``to_local``, differentiable) and runs the module's own code on its plain
    inputs; the gradient comes back as a DTensor placed like the parameter (``Replicate``: equal on
    every TP rank, no collective) or, when the input is this rank's slice (``input_placement`` a
    ``Shard``: positions or tokens under SP), ``Partial`` — each rank's gradient covers its tokens
    only; :func:`_reduce_partial_grads_eagerly` sums it over the TP group once in the backward.
    A DTensor input (none in the splits here) runs the module on DTensors as before.
    """
    def partition(name: str, mod: nn.Module, m: DeviceMesh) -> None:
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), m, [Replicate()]),
                                                           requires_grad=p.requires_grad))

    distribute_module(module, mesh, partition)
    module._tp_grad_placements = [Partial()] if input_placement.is_shard() else None
    module._tp_inner_forward = module.forward  # bound: a deep copy rebinds it to the copy
    module.forward = types.MethodType(_forward_on_local_parameters, module)


def _forward_on_local_parameters(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward :func:`replicate_module` installs: the module's own forward with its DTensor
    parameters swapped for their local tensors for the call (read at call time: FSDP may have
    swapped in its unsharded parameters); DTensor inputs run on the DTensors, output made local."""
    inner = self._tp_inner_forward
    if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
        out = inner(*args, **kwargs)
        return out.to_local() if isinstance(out, DTensor) else out
    params = self._parameters
    saved = dict(params)
    try:
        for pname, p in saved.items():
            if isinstance(p, DTensor):
                params[pname] = p.to_local(grad_placements=self._tp_grad_placements)  # type: ignore[assignment]
        return inner(*args, **kwargs)
    finally:
        params.update(saved)


def _replicate_leftovers(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate every module that still owns plain parameters (LayerNorms without SP, wpe) — except
    inside mixture-of-experts MLPs, which stay plain tensors (equal on every TP rank; expert parallelism
    slices and routes them with its own collectives)."""
    skip = {id(m) for moe in model.modules() if _is_moe(moe) for m in moe.modules()}
    for mod in model.modules():
        if id(mod) not in skip and any(not isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
            replicate_module(mod, mesh)


def check_model(model: nn.Module, tp: int) -> None:
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
        if not (isinstance(getattr(block.mlp, "c_fc", None), nn.Linear) or _is_moe(block.mlp)):
            raise UserError(f"tensor parallelism splits dense MLPs; block {i} has a {type(block.mlp).__name__}")


def _is_moe(mlp: nn.Module) -> bool:
    """A mixture-of-experts MLP (its family's ``ModelSpec.moe``): left whole on every TP rank (its experts are
    split by expert parallelism)."""
    from scaletrain.models.spec import is_moe_layer

    return is_moe_layer(mlp)


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


def apply_megatron(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                   regather: bool = True) -> nn.Module:
    """Shard a GPT-2 (``scaletrain.models.gpt2.GPT2`` or a subclass) over ``tp_mesh`` in place
    (Hugging Face's GPT-2 layout: :mod:`.hf`; both through
    :func:`scaletrain.techniques.tensor_parallel.apply_tensor_parallel`).

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
    check_model(model, t)
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
        attn._tp_size, attn._tp_rank = t, rank
        attn.forward = types.MethodType(_tp_attention_forward, attn)
        if sp:  # the residual dropouts act on this rank's s/t positions: their own masks
            for drop in (attn.resid_drop, getattr(block.mlp, "drop", None)):
                if drop is None:
                    continue
                drop._tp_rank = rank
                drop.forward = types.MethodType(_sharded_dropout_forward, drop)
        plan: dict[str, Any] = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=seq_in),
        }
        if not _is_moe(block.mlp):  # a MoE MLP runs whole on each TP rank (replicated input and output)
            plan.update({"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=seq_in)})
        if sp:
            # the norms see this rank's s/t positions: replicated weights, Partial gradients (what torch's
            # SequenceParallel style does, without DTensor's dispatch per operator)
            replicate_module(block.ln_1, tp_mesh, Shard(1))
            replicate_module(block.ln_2, tp_mesh, Shard(1))
            plan.update({
                # all-gather the sequence before the column-parallel layers (Megatron's g)
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)

    if sp and regather:
        for block in model.h:
            keep_sequence_shard_for_backward(block.attn.c_attn, tp_mesh)
            keep_sequence_shard_for_backward(block.mlp.c_fc, tp_mesh)
    head_plan: dict[str, Any] = {
        "lm_head": ColwiseParallel(input_layouts=seq_in, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        replicate_module(model.head.ln_f, tp_mesh, Shard(1))
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


def megatron_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain single-device state dict of a TP GPT-2: shards gathered, fused QKV un-permuted.

    Collective: every TP rank must call it. Loads into the unparallelised model.
    """
    info = tp_info(model)
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
