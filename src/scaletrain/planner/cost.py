"""The analytic cost of a transformer plan on a platform: step time by phase and per-rank peak memory.

Units: seconds and bytes (GiB / ms only when printed). What one step costs (Narayanan et al., SC21,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"):

* **compute** per layer and micro-batch on one rank: each matmul's FLOPs / (peak × the platform's
  achieved fraction for a matmul of that size, Calculon-style, × its output's tile and wave quantization
  on the GPU's SMs, :func:`scaletrain.platform.wave_fraction`) + each memory-bound kernel's bytes /
  (HBM bandwidth × fraction for its size) — LayerNorms, bias-GELU, bias-dropout-add and, when the
  attention is materialised (Megatron 2021), softmax and attention dropout over b·a·s²/t elements.
  Backward = 2 × forward, except flash attention's core, whose backward is :data:`FLASH_BWD_RATIO` × its
  forward (it recomputes the scores). Recompute: full = +1 forward (its TP all-reduces included); selective = the
  attention core again.
* **tensor parallelism**: the bytes of the TP cost face the runtime is tested against
  (:func:`~scaletrain.techniques.tensor_parallel.cost.tp_comm_bytes_per_step`: per layer 2 all-reduces
  of b·s·h activations in the forward and 2 in the backward; under SP all-gathers + reduce-scatters and
  the backward's re-gathers, 1.5x), plus a recomputed forward's, over NVLink (TP stays inside a node):
  wire bytes / achieved bandwidth + (t − 1)α per ring step; not overlapped (as Megatron).
* **pipeline**: step = (m + (p − 1)/v)·T_mb, T_mb the slowest rank's time for one micro-batch (its
  layers, plus the embedding on the first and the logits + loss on the last) and one p2p send per
  chunk pass each way; bubble fraction (p − 1)/v / (m + (p − 1)/v) — GPipe has the same time. Each
  rank's layers are the runtime partitioner's split (:mod:`.stages`: uneven when pp does not divide l,
  the embedding and the head as units); recompute inside stages is the runtime's solver under each
  stage's budget (:mod:`.stage_remat`: each stage keeps what its layers fit, the rest run forward again).
* **context parallelism** (cp ranks, pp = 1): every per-rank cost at s/cp tokens, the attention core
  over all s keys, ring attention's K/V hops hidden behind it (:mod:`.context`); ZeRO over dp × cp.
* **HSDP** (``plan.hsdp`` = G): model states sharded over G ranks, ZeRO's collectives within them and
  the cost face's all-reduce of the shards across the dp/G groups (:func:`_dp_time`).
* **data parallelism**: bytes from ZeRO's cost face (:func:`~scaletrain.techniques.data_parallel.cost.
  comm_bytes_per_step`, gradients in the parameters' dtype: fp32 under scaletrain's autocast over fp32
  parameters), timed hierarchically (NVLink inside a node for the group's ranks there, InfiniBand across),
  α per ring step of every bucket's or (ZeRO-3) every block's collective (an all-reduce across nodes: the
  fewer of the ring's and NCCL's double binary tree's steps). ``Options`` describe other stacks: DDP after
  the flush (Megatron's local DDP), eager fp32 norms and rotary (torchtitan), a 16-bit residual stream
  (FSDP with bf16 module parameters). Overlap, stated:
  without a pipeline DDP/ZeRO-2 overlap it with the backward of the last micro-batch (ZeRO-2: every
  micro-batch's backward), all but the last bucket; ZeRO-3 (FSDP) per gather unit (the root: embedding
  and head; each layer) and pass, one unit prefetched ahead on one stream, so a unit's gathers hide only
  behind the compute of the unit before it (:func:`scaletrain.cost.prefetch_windows`); the hidden part
  still slows compute by Calculon's processor usage (0.15 over NVLink, 0.02 over InfiniBand); ZeRO-1
  and every pipeline synchronise after the flush, fully exposed.
* **optimizer step**: memory-bound, 12 + 2K bytes per (sharded) parameter: read p, g, write p, read and write
  its K bytes of states (Adam: 28).
* **offload** (ZeRO-Offload, Ren et al. ATC'21: the plan's ``offload.optimizer=host``): no optimizer step on
  the device; each micro-batch's gradients go device -> host behind the backward, then the CPU Adam update
  and the parameters' upload, exposed unless DPU overlaps them with the next step (:func:`offload_time`).
  The device keeps the parameters and one block's gradients; the host (shared by a node's ranks) the
  fp32 masters, gradients and states, and a plan fits only if both do.
* **shapes**: each matmul of the layer in forward order (:meth:`Shape.matmuls`: GPT-2's fused QKV and GELU
  MLP, or Llama's wq, wk, wv (GQA), wo and SwiGLU's w1, w3, w2); the memory-bound kernels follow it
  (SwiGLU's silu and product, rotary on q and k). Selective recompute is Megatron's (the attention core)
  or torchtitan's op-level policy (:class:`Options` ``selective``: every other matmul and every memory-bound
  kernel again in the backward).

Memory: :mod:`.memory` (model states by ZeRO stage, Korthikanti activations × in-flight micro-batches,
autocast's 16-bit weight copies held per micro-batch until its backward, the logits and loss in fp32
on the last stage, one layer's rematerialised activations during a full-recompute backward) + a stated
reserve (CUDA context, NCCL buffers, allocator fragmentation).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from dataclasses import asdict, dataclass, field
from typing import Any

from scaletrain.measure.model_states import ModelStateBytes
from scaletrain.plan import Plan
from scaletrain.planner import memory as mem
from scaletrain.planner.shape import Shape
from scaletrain.platform import GiB, Platform
from scaletrain.cost import (collective_seconds, collective_steps, exposed_seconds, optimizer_seconds,
                             prefetch_windows, roofline_seconds, zero_comm_factor)
from scaletrain.planner.context import ring_layer_times
from scaletrain.planner import stage_remat
from scaletrain.planner.stages import split as stage_split, uniform as uniform_split
from scaletrain.techniques.data_parallel import cost as zero_cost
from scaletrain.techniques.tensor_parallel.cost import tp_comm_bytes_per_step, tp_forward_bytes_per_block
from scaletrain.cost.norm import norm_seconds
from scaletrain.techniques.optim.registry import optimizer_step_bytes  # noqa: F401  (priced here, defined there)

def optim_state_bytes(name: str, hidden: int) -> float:
    """Optimizer-state bytes per fp32 parameter K, from the optimizer registry's cost face on an h x h
    weight (Adam 8, SGD 0 without momentum, 8-bit Adam ~2.004, Adafactor ~2/h factored, CAME ~4)."""
    from scaletrain.techniques.optim.registry import state_bytes_per_param

    return float(state_bytes_per_param(name.lower(), (hidden, hidden)))


NORM_FP32_BYTES = 36
"""Bytes per element of an eager fp32 RMSNorm's forward kernels on a 16-bit input (:attr:`Options.fp32_norm_rotary`)."""
ROTARY_FP32_BYTES = 20
"""Bytes per element of eager fp32 complex rotary's forward kernels on 16-bit q or k (same)."""
FLASH_BWD_RATIO = 2.5
"""Work of a fused (flash) attention's backward over its forward's: the forward runs two matmuls per
tile (S = QKᵀ, O = PV), the backward five (S again, since the s² scores are never stored, then dV = PᵀdO,
dP = dO Vᵀ, dQ = dS K, dK = dSᵀQ): 5/2 (Dao, "FlashAttention-2", 2023, §3.1.2 and its benchmarks'
FLOP count, backward = 2.5 × forward; ``torch.utils.flop_counter``'s SDPA backward counts the same five).
A materialised attention keeps P, so its backward is the usual 2 × (four matmuls)."""


@dataclass(frozen=True)
class Options:
    """How the priced system runs, where it is not in the plan."""

    attention: str = "flash"
    """flash (SDPA fused attention: no s² tensor in memory or traffic; scaletrain on GPUs) or
    materialized (Megatron-LM 2021: fused scale-mask-softmax then dropout over b·a·s²)."""
    p2p_scatter: bool = False
    """Megatron's scatter/gather (SC21 §4.1): each TP rank sends 1/t of a stage boundary."""
    reserve_bytes: float = 2 * GiB
    """Per device, never planned: CUDA context (~0.5 GiB), NCCL buffers, allocator fragmentation."""
    stage_split: str = "runtime"
    """How layers are split over pipeline ranks: runtime (scaletrain's partitioner over the embedding, the
    l layers and the head as units, ``parallel.balance``: :mod:`.stages`) or uniform (l/pp layers per rank,
    the embedding and the head beside them: Megatron-LM's split, for pricing its published runs)."""
    selective: str = "attention"
    """What selective recompute recomputes: attention (Megatron, Korthikanti et al. 2022: the attention
    core; nothing to redo under flash attention) or op (torchtitan's op-level policy: keep every other
    matmul's output and the attention output, recompute the rest of the layer in the backward)."""
    dp_overlap: bool = True
    """Whether DDP's gradient buckets overlap the backward. False: the whole all-reduce runs after the
    forward-backward, exposed — Megatron-LM 2021's ``--DDP-impl local`` (NVIDIA/Megatron-LM
    ``megatron/training.py`` ``train_step`` calls ``allreduce_gradients()`` after ``forward_backward_func``,
    under its ``backward-params-all-reduce`` timer)."""
    fp32_norm_rotary: bool = False
    """Norms and rotary as Meta's Llama reference code runs them, which torchtitan keeps (at 9dec370,
    the commit of its Dec 2024 benchmark: ``norm_type = "rmsnorm"`` and ``compile = false`` in
    ``train_configs/llama3_8b.toml``; ``torchtitan/models/norms.py`` RMSNorm ``self._norm(x.float()).type_as(x)
    * self.weight``; ``apply_rotary_emb``: ``view_as_complex(xq.float() ...)`` times ``freqs_cis``, then
    ``type_as``): unfused eager kernels in fp32. Bytes per element of each forward kernel, counted from that
    code: the norm 36 (cast 2 + 4, ``pow`` 4 + 4, ``mean`` 4, scale 4 + 4, cast back 4 + 2, weight 2 + 2)
    instead of a fused norm's 2 + 2; rotary 20 (cast 2 + 4, complex multiply 4 + 4, cast back 4 + 2)
    instead of 2 + 2. The backward stays 2 x the forward (module docstring)."""
    loss_bytes_per_logit: float = 0.0
    """Bytes the loss's memory-bound kernels move per logit of one micro-batch, forward and backward together.
    0 = scaletrain's runtime: the 16-bit logits cast to fp32 and the loss and its gradient over them,
    2·(e + 8). Megatron-LM 2021 counted from its code: 52 (``benchmarks/planner/megatron_table1.py``)."""
    optimizer_bytes_per_param: float = 0.0
    """Bytes the optimizer step moves per (sharded) parameter, where the priced stack runs its own kernels.
    0 = scaletrain's runtime: :func:`~scaletrain.techniques.optim.registry.optimizer_step_bytes` (torch's
    foreach AdamW and gradient clipping, 92 for Adam). Megatron-LM 2021 counted from its code: 60
    (``benchmarks/planner/megatron_table1.py``)."""
    norm_kernel: str = "torch"
    """The kernel that runs each LayerNorm / RMSNorm on a GPU platform (``device_type`` cuda), priced at
    its measured fractions of HBM bandwidth, backward as its own kernels (:mod:`scaletrain.cost.norm`):
    torch (``torch.nn.functional.layer_norm``: scaletrain's runtime, MPT's low-precision LayerNorm), apex
    (apex's ``fused_layer_norm_cuda``, Megatron-LM 2021's MixedFusedLayerNorm) or roofline (streaming
    bytes at the size table's fraction, backward 2 x; what CPU platforms always use). Ignored under
    :attr:`fp32_norm_rotary`, which prices the norm as its unfused eager kernels."""
    autocast_residual_fp32: bool = True
    """Under autocast over fp32 parameters (scaletrain's runtime: precision bf16/fp16 with params_dtype
    fp32) the embedding's output, and so the residual stream, is fp32. PyTorch's autocast op reference
    (``torch.amp`` docs, "CUDA Ops that can autocast to float32": ``layer_norm``; to lower precision:
    ``linear``, ``addmm``) then gives, per element of the stream: each LayerNorm reads and writes 4 bytes,
    each matmul that reads a norm's output first casts it (read 4, write 2; autocast caches only the
    weights' casts, so GPT-2's fused QKV and fc cast twice per layer, Llama's wq, wk, wv, w1, w3 five
    times), and each residual add reads 4 + 2 and writes 4. Measured on one H200 (gpt2-medium, JSON
    ``planner_gpu_h200_profile.json``: 15.4 ms of casts and copies per step). False: a 16-bit stream
    (FSDP with ``param_dtype`` bf16 and no fp32 module parameters: torchtitan's FSDP2, Composer's FSDP
    ``DEFAULT`` and ``PURE``)."""


@dataclass
class PlanCost:
    """A plan's predicted cost. Times in seconds, memory in bytes, throughput per second."""

    plan: Plan
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    """Achieved TFLOP/s per device counting recomputation (Narayanan et al. eq. (3) accounting)."""
    mfu: float
    """Model FLOPs (no recompute: 72·B·s·l·h²(…)) per second / (devices × peak)."""
    peak_bytes: dict[str, float]
    """The heaviest rank's bytes at its peak by category, and ``total``."""
    device_bytes: float
    fits: bool
    bubble_fraction: float
    exposed_comm_s: float
    phases_s: dict[str, float] = field(default_factory=dict)
    """compute, recompute, tp_comm, pipeline_bubble, p2p, dp_comm (exposed), optimizer."""
    blocks_s: dict[str, float] = field(default_factory=dict)
    """One micro-batch on one rank, per block and pass: layer_fwd, layer_bwd, layer_recompute, layer_cp_comm,
    stage_recompute (the slowest rank's layers run again under a pipeline remat budget, all of them),
    layer_tp_comm, layer_weight_traffic (each per layer), embedding, head (logits + loss, fwd + bwd)."""
    heaviest_rank: str = "first"
    stage_layers: tuple[int, ...] = ()
    """Layers on each pipeline rank (the runtime's split, :mod:`.stages`); rank 0 has the embedding, the
    last the head."""
    slowest_rank: int = 0
    """The pipeline rank whose micro-batch sets the pace (every slot of the schedule is priced at its time)."""
    rank_peaks: list[dict[str, float]] = field(default_factory=list)
    """Each priced rank's ``rank``, ``live`` micro-batches, ``activations`` and ``total`` bytes (the heaviest is
    ``peak_bytes``): what a pipeline's per-stage remat budgets are fitted to (:mod:`.stage_remat`)."""
    stage_kept: tuple[int, ...] = ()
    """Pipeline remat by a solver under per-stage budgets: layers per rank that keep their activations."""
    host_bytes: float = 0.0
    """Host memory the plan needs on one node (offloaded optimizer: masters, gradients, states of every
    rank there); fits only if it is within the platform's host memory too."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["plan"] = plan_summary(self.plan)
        return d


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The plan fields ``scaletrain plan --json`` shows (the issue's schema) plus the rest that matter."""
    full = plan.remat.blocks == "all" or plan.offload.recompute == "all"  # offload's own recompute key
    remat = "full" if full else ("selective" if plan.remat.selective != "none" else
                                 plan.remat.method)  # a solver's name (pipelines: planner/stage_remat.py) or none
    return {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep, "zero": plan.zero,
            "micro_batch": plan.micro_batch, "schedule": plan.schedule if plan.pp > 1 else "none",
            "virtual": max(plan.virtual, 1), "microbatches": plan.microbatches, "sp": plan.sp, "remat": remat,
            "offload": offload_kind(plan), "precision": plan.precision,
            "optimizer": plan.optimizer}


def remat_kind(plan: Plan) -> str:
    return plan_summary(plan)["remat"]


def offload_kind(plan: Plan) -> str:
    """none; optimizer (ZeRO-Offload: fp32 masters, gradients and Adam on the host, with or without the
    offload runtime's block recompute and DPU) — what the planner prices; or other (not priced)."""
    o = plan.offload
    if not o.active:
        return "none"
    if o.optimizer == "host" and o.params == "device" and o.activations == "none" and o.recompute in ("none", "all"):
        return "optimizer"
    return "other"


def _mm(plat: Platform, precision: str, m: float, n: float, k: float, batch: float = 1.0) -> float:
    """Seconds of a (batched) [m, k] x [k, n] matmul on the one roofline (:func:`scaletrain.cost.roofline_seconds`):
    2mnk FLOPs, both operands read and the output written; its m × n output (× batch) tiled on the SMs."""
    e = 4 if precision == "fp32" else 2
    return roofline_seconds(plat, 2 * m * n * k * batch, e * (m * k + k * n + m * n) * batch, precision=precision,
                            unaligned=any(float(d) % 8 for d in (m, n, k)), output=(m, n, batch))


def layer_times(shape: Shape, plat: Platform, *, seq: int, b: int, tp: int, sp: bool, precision: str,
                opts: Options, autocast: bool = False) -> dict[str, float]:
    """Seconds of one layer on one TP rank for one micro-batch: ``fwd``, ``bwd``, ``attn_core`` (the
    part selective recompute repeats), ``tp_fwd`` / ``tp_bwd`` (the TP collectives of each pass) and
    ``tp_stage`` (once per micro-batch and stage: embedding, loss, SP's replicated gradients). ``autocast``:
    a 16-bit precision over fp32 parameters with an fp32 residual stream (:attr:`Options.autocast_residual_fp32`)."""
    s, h, a, t, f = seq, shape.hidden, shape.heads, tp, shape.ffn_width
    e = 4 if precision == "fp32" else 2
    sbh = s * b * h
    bs = b * s
    # the layer's matmuls on [b·s, ·] in forward order (GPT-2: QKV, projection, fc1, fc2; Llama: wq, wk,
    # wv, wo, w1, w3, w2), column-parallel ones split on their output, row-parallel on their input;
    # QK^T and AV batched over b·a/t heads of width h/a (GQA shares K and V: the same FLOPs)
    mms = [_mm(plat, precision, bs, o / t, i) if kind == "col" else _mm(plat, precision, bs, o, i / t)
           for _, o, i, kind in shape.matmuls()]
    fwd_mm = sum(mms)
    heads = b * a / t
    attn = (_mm(plat, precision, s, s, h / a, heads) + _mm(plat, precision, s, h / a, s, heads))
    rep = t if sp else 1  # what TP replicates, SP splits
    drop = 1 if shape.dropout > 0 else 0
    # LayerNorm x2 (read + write), bias-GELU on f (read + write), bias-dropout-add x2 (2 reads, 1 write, mask)
    r = 4 if autocast else e  # bytes per element of the residual stream
    # the norms by their kernel on a GPU (scaletrain.cost.norm: measured fractions, backward its own kernels)
    kernel = opts.norm_kernel if plat.device_type == "cuda" and not opts.fp32_norm_rotary else "roofline"
    norm_f, norm_b = norm_seconds(plat, kernel, sbh / rep, r)
    norm = NORM_FP32_BYTES * sbh / rep if opts.fp32_norm_rotary else 0.0
    elementwise = [norm, norm, 2 * s * b * f * e / t,
                   (2 * r + e + drop) * sbh / rep, (2 * r + e + drop) * sbh / rep]
    if autocast:  # each matmul reading a norm's fp32 output casts it to 16 bits first (read 4, write 2)
        elementwise += [6 * sbh / rep] * sum(1 for *_, kind in shape.matmuls() if kind == "col")
    if shape.gated:  # SwiGLU: silu(w1 x) (read f, write f) then the product with w3 x (read 2f, write f)
        elementwise[2:3] = [2 * s * b * f * e / t, 3 * s * b * f * e / t]
    if shape.rotary:  # rotary on q and k: read and write each
        elementwise.append((ROTARY_FP32_BYTES if opts.fp32_norm_rotary else 2 * e) * s * b * (h + shape.kv_width) / t)
    ew = sum(plat.memory_bound_seconds(x) for x in elementwise)
    if not opts.fp32_norm_rotary:
        ew += 2 * norm_f
    if opts.attention == "materialized":
        n2 = b * a * s * s / t
        attn += plat.memory_bound_seconds(2 * e * n2) + (plat.memory_bound_seconds((2 * e + 1) * n2) if drop else 0.0)
    fwd = fwd_mm + attn + ew
    tp = tp_wire_bytes(shape, t, b, s, sp, e)
    bw, alpha = plat.intra_node_bytes_per_s * plat.intra_node_efficiency, plat.intra_node_latency_s
    # latency: per layer 4 ring collectives' worth of (t-1) steps each way, 6 backward with SP's regathers
    tp_fwd = collective_seconds(tp["fwd"], 4 * (t - 1), bw, alpha) if t > 1 else 0.0
    tp_bwd = collective_seconds(tp["bwd"], (6 if sp else 4) * (t - 1), bw, alpha) if t > 1 else 0.0
    # torchtitan's op-level selective recompute redoes every other matmul (the 2nd, 4th, ...) and every
    # memory-bound kernel of the layer; the attention and the other matmuls' outputs are kept
    op_recompute = sum(mms[1::2]) + ew
    # flash attention's backward recomputes the scores: FLASH_BWD_RATIO x its forward, not 2 x
    bwd = 2 * fwd + ((FLASH_BWD_RATIO - 2) * attn if opts.attention == "flash" else 0.0)
    if not opts.fp32_norm_rotary:  # the norms' backward kernels, not 2 x their forward
        bwd += 2 * (norm_b - 2 * norm_f)
    return {"fwd": fwd, "bwd": bwd, "attn_core": attn, "op_recompute": op_recompute, "tp_fwd": tp_fwd,
            "tp_bwd": tp_bwd, "tp_stage": tp["stage"] / bw if t > 1 else 0.0}


def tp_wire_bytes(shape: Shape, t: int, b: int, s: int, sp: bool, elem: int) -> dict[str, float]:
    """Bytes one TP rank puts on the wire per micro-batch — ``fwd`` / ``bwd`` of one layer and ``stage``
    (embedding, loss, SP's replicated-gradient all-reduce), from the TP cost face the runtime is tested
    against (:func:`~scaletrain.techniques.tensor_parallel.cost.tp_comm_bytes_per_step`: with SP the
    backward re-gathers the inputs it needs, 1.5x the forward's bytes)."""
    def cfg(l: int) -> SimpleNamespace:
        return SimpleNamespace(n_embd=shape.hidden, n_layer=l, n_positions=shape.position_rows)

    if t == 1:
        return {"fwd": 0.0, "bwd": 0.0, "stage": 0.0}
    w1, w2 = (tp_comm_bytes_per_step(cfg(n), t, b, s, sequence_parallel=sp, act_bytes=elem)["wire_bytes"]
              for n in (1, 2))
    fwd = tp_forward_bytes_per_block(cfg(1), t, b, s, sequence_parallel=sp, act_bytes=elem)[1]
    return {"fwd": fwd, "bwd": (w2 - w1) - fwd, "stage": w1 - (w2 - w1)}


def plan_cost(shape: Shape, plan: Plan, plat: Platform, *, global_batch: int, seq: int,
              options: Options | None = None) -> PlanCost:
    """Price ``plan`` (resolved: dp set, micro_batch set, microbatches = m) for ``global_batch``
    sequences of ``seq`` tokens per step (module docstring). Divisibility is the caller's (search)."""
    opts = options or Options()
    dp, tp, pp, v = max(plan.dp, 1), plan.tp, plan.pp, max(plan.virtual, 1) if plan.schedule == "interleaved" else 1
    b, cp = plan.micro_batch, max(plan.cp, 1)
    m = global_batch // (dp * b)
    world = dp * tp * pp * cp
    e = 4 if plan.precision == "fp32" else 2
    remat = remat_kind(plan)
    autocast = plan.precision != "fp32" and plan.params_dtype == "fp32" and opts.autocast_residual_fp32
    full_seq, seq = seq, seq // cp  # a CP rank's tokens (ring attention: planner/context.py)
    lt = ring_layer_times(layer_times(shape, plat, seq=seq, b=b, tp=tp, sp=plan.sp, precision=plan.precision,
                                      opts=opts, autocast=autocast),
                          shape, plat, seq=full_seq, b=b, tp=tp, cp=cp, elem=e)
    selective = lt["attn_core"] if opts.selective == "attention" else lt["op_recompute"]
    recompute = (lt["fwd"] + lt["tp_fwd"] + lt["cp_fwd"] if remat == "full"
                 else (selective if remat == "selective" else 0.0))
    tp_layer, cp_layer = lt["tp_fwd"] + lt["tp_bwd"], lt["cp_fwd"] + lt["cp_bwd"]
    layer = lt["fwd"] + lt["bwd"] + recompute + tp_layer + cp_layer
    # per micro-batch and parameter, memory-bound: the 16-bit weight gradient written, read back and
    # accumulated into the fp32 gradient (2 + 2 + 4 + 4 bytes), and with fp32 parameters under autocast
    # the 16-bit copy of each weight made by every forward (read 4, write 2; recomputed forwards too)
    forwards = 2 if remat == "full" else 1
    casts = 6 * forwards if plan.precision != "fp32" and plan.params_dtype == "fp32" else 0
    weight_traffic = plat.memory_bound_seconds((12 + casts) * shape.layer_params() / tp)
    layer += weight_traffic
    # the logits (tied head, vocabulary-parallel) and the loss in fp32 on the last stage
    sbV = seq * b * shape.vocab / tp
    loss = (plat.memory_bound_seconds(sbV * opts.loss_bytes_per_logit) if opts.loss_bytes_per_logit
            else 2 * plat.memory_bound_seconds(sbV * (e + 8)))
    head = 3 * _mm(plat, plan.precision, seq * b, shape.vocab / tp, shape.hidden) + loss
    embed = 3 * plat.memory_bound_seconds(seq * b * shape.hidden * e * 2) + lt["tp_stage"]
    # each rank's layers by the runtime's split (parallel.balance; uneven when pp does not divide l)
    split = (stage_split(shape.layers, pp, v, embed_layers=embed / (lt["fwd"] + lt["bwd"]),
                         head_layers=head / (lt["fwd"] + lt["bwd"]), balance=plan.balance)
             if opts.stage_split == "runtime" else uniform_split(shape.layers, pp))
    # pipeline remat by a solver under each stage's budget (planner/stage_remat.py): each keeps what fits
    kept, rc = _stage_kept(shape, plan, split.layers, seq=seq, elem=e, flash=opts.attention == "flash"), [0.0] * pp
    if kept is not None:
        rc = [(n - r) * (lt["fwd"] + lt["tp_fwd"] + lt["cp_fwd"]) for n, r in zip(split.layers, kept)]
    rank_mb = [n * layer + (embed if k == 0 else 0.0) + (head if k == pp - 1 else 0.0) + rc[k]
               for k, n in enumerate(split.layers)]
    slow = max(range(pp), key=lambda k: rank_mb[k])
    t_mb, L = rank_mb[slow], split.layers[slow]
    # p2p: one send per chunk pass each way, blocking (Megatron), across nodes once a stage fills one
    p2p_msg = 0.0
    if pp > 1:
        nbytes = seq * b * shape.hidden * e / (tp if (opts.p2p_scatter or plan.sp) else 1)
        inter = tp * dp >= plat.devices_per_node
        bw = (plat.inter_node_bytes_per_s * plat.inter_node_efficiency if inter
              else plat.intra_node_bytes_per_s * plat.intra_node_efficiency)
        p2p_msg = collective_seconds(nbytes, 1, bw, plat.inter_node_latency_s if inter else plat.intra_node_latency_s)
    per_mb = t_mb + 2 * v * p2p_msg
    slots = m + (pp - 1) / v if pp > 1 else m
    pipeline = slots * per_mb
    bubble = ((pp - 1) / v) / slots if pp > 1 else 0.0
    # data parallelism (ZeRO's bytes, timed hierarchically) and its overlap
    n_rank = max(mem.rank_params(shape, tp=tp, pp=pp, first=f, last=la, layers=n)
                 for f, la, n in {(k == 0, k == pp - 1, n) for k, n in enumerate(split.layers)})
    # gradients travel in the parameters' dtype (DDP and ZeRO-1/2 reduce param.grad), ZeRO-3 in the compute one
    grad_e = e if plan.zero == 3 else (4 if plan.params_dtype == "fp32" else 2)
    # CP ranks share the parameters: ZeRO's group is dp x cp (the runtime's dense mesh, cp inside dp, tp
    # innermost); HSDP shards within plan.hsdp of its ranks
    dp_time, dp_intra = _dp_time(plat, n_rank, plan.zero, dp * cp, tp, m, grad_e,
                                 blocks=int(L) + 2, bucket_bytes=plan.bucket_mb * 1e6, hsdp=plan.hsdp)
    # on a platform whose collectives do not run beside compute (the CPU pool: gloo's threads take the
    # same cores) nothing is hidden, as the traced cost model prices it (time_cost._exposed)
    if pp == 1 and plan.zero != 1 and plat.copy_overlaps_compute and (opts.dp_overlap or plan.zero == 3):
        window = {0: L * lt["bwd"], 2: m * L * lt["bwd"], 3: 0.0}[plan.zero]
        last_bucket = _dp_time(plat, plan.bucket_mb * 1e6 / grad_e, 0, dp * cp, tp, 1, grad_e,
                               bucket_bytes=plan.bucket_mb * 1e6)[0]
        # an overlapped collective still slows the compute it hides behind: NCCL's kernels take SMs and
        # HBM bandwidth — Calculon's "processor_usage": 0.15 of the device while NVLink traffic runs, 0.02
        # while InfiniBand's does (calculon-ai/calculon systems/a100_80e.json)
        share = dp_intra / dp_time if dp_time else 0.0
        slowdown = 0.15 * share + 0.02 * (1 - share)
        if plan.zero == 3:  # per gather unit and pass: FSDP prefetches one unit ahead (prefetch_windows)
            root = n_rank - L * shape.layer_params() / tp
            one = [_dp_time(plat, n, 3, dp * cp, tp, 1, e, blocks=1, hsdp=plan.hsdp)[0] / 3
                   for n in (root, shape.layer_params() / tp)]
            fwd = lt["fwd"] + lt["tp_fwd"]
            units = [one[0]] + [one[1]] * int(L)
            # without TP/EP the runtime keeps the root and the last layer gathered into the backward
            again = [0.0] + [one[1]] * (int(L) - 1) + [0.0] if plan.tp == 1 and plan.ep == 1 else units
            comm, win = prefetch_windows(units, units, [(embed + head) / 3] + [fwd] * int(L),
                                         [2 * (embed + head) / 3] + [layer - fwd] * int(L), again)
            dp_exposed = m * exposed_seconds(comm, win, slowdown)
        else:  # buckets: the backward's window, then the last bucket issued when it ends
            dp_exposed = exposed_seconds([dp_time, min(last_bucket, dp_time)], [window, 0.0], slowdown)
    else:
        dp_exposed = dp_time
    k = optim_state_bytes(plan.optimizer, shape.hidden)
    opt_params = n_rank / ((plan.hsdp or dp) * cp if plan.zero >= 1 else 1)
    offloaded = offload_kind(plan) == "optimizer"
    # the update's bytes per (sharded) parameter (optimizer_step_bytes) — on the device unless offloaded
    step_bytes = opts.optimizer_bytes_per_param or optimizer_step_bytes(plan.optimizer, k)
    optimizer = 0.0 if offloaded else optimizer_seconds(plat, opt_params * step_bytes)
    host = offload_time(shape, plan, plat, n_rank=n_rank, opt_params=opt_params, m=m, tp=tp,
                        backward_s=L * lt["bwd"], compute_s=pipeline) if offloaded else {"s": 0.0, "host_bytes": 0.0}
    step = pipeline + dp_exposed + optimizer + host["s"]
    tokens = global_batch * full_seq
    hw_flops = shape.flops_per_iteration(global_batch, full_seq, recompute=remat == "full")
    model_flops = shape.flops_per_iteration(global_batch, full_seq, recompute=False)
    if kept is not None:  # the share of the layers the stages run forward again
        again = shape.flops_per_iteration(global_batch, full_seq, recompute=True) - model_flops
        hw_flops = model_flops + again * (shape.layers - sum(kept)) / shape.layers
    # phases add up to the step: the m micro-batch slots of the slowest rank split by kind, then the rest
    slots_compute = m * (t_mb - L * (recompute + tp_layer + cp_layer) - rc[slow])
    phases = {"compute": slots_compute, "recompute": m * (L * recompute + rc[slow]),
              "tp_comm": m * L * tp_layer, "cp_comm": m * L * cp_layer,
              "pipeline_bubble": (pp - 1) / v * per_mb if pp > 1 else 0.0,
              "p2p": m * 2 * v * p2p_msg, "dp_comm": dp_exposed, "optimizer": optimizer, "offload": host["s"]}
    peak, which, ranks = _peak(shape, plan, plat, seq=seq, m=m, v=v, e=e, remat=remat, k=k, opts=opts,
                               offloaded=offloaded, layers=split.layers, kept=kept)
    host_bytes = host["host_bytes"] * min(world, plat.devices_per_node)  # the ranks of one node share its host
    return PlanCost(plan=plan, step_time_s=step, tokens_per_s=tokens / step,
                    tflops_per_device=hw_flops / step / world / 1e12,
                    mfu=model_flops / step / world / plat.flops(plan.precision),
                    peak_bytes=peak, device_bytes=float(plat.device_memory_bytes),
                    fits=peak["total"] + opts.reserve_bytes <= plat.device_memory_bytes
                    and host_bytes <= plat.host_memory_bytes, host_bytes=host_bytes,
                    bubble_fraction=bubble,
                    exposed_comm_s=phases["tp_comm"] + phases["cp_comm"] + phases["p2p"] + dp_exposed,
                    phases_s=phases, heaviest_rank=which, stage_layers=split.layers, slowest_rank=slow,
                    rank_peaks=ranks, stage_kept=kept or (),
                    blocks_s={"layer_fwd": lt["fwd"], "layer_bwd": lt["bwd"], "layer_recompute": recompute,
                              "stage_recompute": rc[slow], "layer_tp_comm": tp_layer, "layer_cp_comm": cp_layer,
                              "layer_weight_traffic": weight_traffic,
                              "embedding": embed, "head": head},
                    notes=(["offload keys other than optimizer=host (with recompute none or all, DPU) are not priced"]
                           if offload_kind(plan) == "other" else [])
                    + ([f"uneven stage split {split.describe()} layers (the runtime's partitioner)"]
                       if not split.even else []))


def _dp_time(plat: Platform, n_params: float, zero: int, dp: int, tp: int, m: int, elem: int, *,
             blocks: int = 1, bucket_bytes: float = 25e6, hsdp: int = 0) -> tuple[float, float]:
    """Seconds of one step's data-parallel collectives for ``n_params`` on this rank: ZeRO's bytes
    (ring convention over dp; ``elem`` bytes per value: DDP's and ZeRO-1/2's gradients in the parameters'
    dtype, the 16-bit gathers and reductions of FSDP2's mixed-precision policy for ZeRO-3), timed as
    hierarchical rings — the group's k ranks inside a node over NVLink, then dp/k nodes over each rank's
    own InfiniBand NIC (tp innermost, dp next) — plus α per latency step of every collective issued, as
    NCCL's tuning model counts them (:func:`scaletrain.cost.collective_steps`: DDP's all-reduces NCCL's
    tree; ZeRO's reduce-scatters and all-gathers rings, a step per rank, nodes − 1 of them across): DDP and
    ZeRO-1/2 one per ``bucket_bytes`` bucket (ZeRO-2's reduce-scatters per micro-batch), ZeRO-3 (FSDP2)
    two all-gathers and a reduce-scatter per block and micro-batch. ``hsdp`` G: ZeRO within groups of G
    consecutive dp ranks, then the cost face's all-reduces of the G-th shards across the dp/G groups
    (ranks tp·G apart). Returns (seconds, of which NVLink)."""
    if dp <= 1:
        return 0.0, 0.0
    if 0 < hsdp < dp:
        shard, shard_intra = _dp_time(plat, n_params, zero, hsdp, tp, m, elem, blocks=blocks,
                                      bucket_bytes=bucket_bytes)
        rep = (zero_cost.comm_bytes_per_step(n_params, zero, dp, grad_bytes=elem, param_bytes=elem, accum=m,
                                             hsdp=hsdp)
               - zero_cost.comm_bytes_per_step(n_params, zero, hsdp, grad_bytes=elem, param_bytes=elem, accum=m))
        one = _dp_time(plat, n_params / hsdp, 0, dp // hsdp, tp * hsdp, 1, elem, bucket_bytes=bucket_bytes)
        times = rep / zero_cost.comm_bytes_per_step(n_params / hsdp, 0, dp // hsdp, grad_bytes=elem)
        return shard + times * one[0], shard_intra + times * one[1]
    received = zero_cost.comm_bytes_per_step(n_params, zero, dp, grad_bytes=elem, param_bytes=elem, accum=m)
    S = float(elem) * n_params
    k = max(1, min(dp, plat.devices_per_node // min(tp, plat.devices_per_node)))
    nodes = dp // k
    bi, bo = plat.intra_node_bytes_per_s * plat.intra_node_efficiency, plat.inter_node_bytes_per_s * plat.inter_node_efficiency
    scale = received / (2 * (dp - 1) / dp * S)
    buckets = max(1, math.ceil(S / bucket_bytes))
    # (reduce-scatters + all-gathers) issued per step; an all-reduce is one of each
    halves = {0: 2 * buckets, 1: 2 * buckets, 2: (m + 1) * buckets, 3: 3 * m * blocks}[zero]
    # ring bytes of the all-reduce-equivalent inside the node (k ranks) and across (dp/k), scaled to ZeRO's
    factor = zero_comm_factor(plat, zero, m)  # the backend's reduce-scatters / all-gathers against the ring
    # latency steps as NCCL counts them (collective_steps): DDP's all-reduces NCCL's tree, 2(k − 1) NVLink
    # steps and 2⌈log2 nodes⌉ across; ZeRO's reduce-scatters and all-gathers rings through every rank,
    # dp − nodes NVLink steps and nodes − 1 across
    issued = buckets if zero == 0 else halves
    step_intra, step_inter = collective_steps(dp, k, all_reduce=zero == 0)
    intra = collective_seconds(2 * (k - 1) / k * S * scale, issued * step_intra, bi, plat.intra_node_latency_s) * factor
    if zero == 3:  # FSDP2's own work per collective (copy-in/out, hooks), measured where known (local)
        intra += halves * plat.fsdp_collective_overhead_s
    inter = collective_seconds(2 * (nodes - 1) / nodes * S / k * scale, issued * step_inter, bo,
                               plat.inter_node_latency_s) * factor if nodes > 1 else 0.0
    return intra + inter, intra


def offload_time(shape: Shape, plan: Plan, plat: Platform, *, n_rank: float, opt_params: float, m: int, tp: int,
                 backward_s: float, compute_s: float) -> dict[str, float]:
    """Seconds a step spends on ZeRO-Offload's host side beyond the device's work, and the host bytes of
    one rank (Ren et al., ATC'21, §4–5; bytes and update time from the offload runtime's cost face,
    :func:`~scaletrain.techniques.offload.optimizer.predict_optimizer`).

    * every micro-batch, each gradient goes device -> host as the backward produces it (its shard's
      ``opt_params`` after ZeRO's reduce-scatter with dp ranks): overlapped with the backward on a copy
      engine, except what the backward outlasts and the last block's gradients (the embedding's or a
      layer's), copied after it ends;
    * once a step, the CPU Adam update of ``opt_params`` (``Platform.cpu_adam_params_per_s``), then the
      updated parameters host -> device; both wait for the backward, unless the plan asks for DPU (one
      step stale: they overlap the next step's ``compute_s``).
    """
    from scaletrain.techniques.offload.optimizer import predict_optimizer

    ep = 4 if plan.params_dtype == "fp32" else 2
    oc = predict_optimizer([int(opt_params)], plat.cpu_adam_params_per_s, resident_params=True,
                           dpu=plan.offload.dpu, element_size=ep)
    d2h = oc.d2h_bytes_per_microbatch / plat.d2h_bytes_per_s
    if plat.copy_overlaps_compute:
        tail = ep * max(shape.layer_params(), shape.vocab * shape.hidden) / tp * opt_params / n_rank
        d2h = max(0.0, d2h - backward_s) + tail / plat.d2h_bytes_per_s
    update = oc.update_time_s + oc.h2d_bytes_per_step / plat.h2d_bytes_per_s
    if plan.offload.dpu:
        update = max(0.0, update - compute_s)
    return {"s": m * d2h + update, "host_bytes": float(oc.host_bytes), "d2h_s": d2h,
            "update_s": oc.update_time_s, "h2d_s": oc.h2d_bytes_per_step / plat.h2d_bytes_per_s}


def _stage_kept(shape: Shape, plan: Plan, layers: tuple[int, ...], *, seq: int, elem: int,
                flash: bool) -> tuple[int, ...] | None:
    """Layers per rank that keep their activations under the plan's pipeline remat budgets (None without):
    each rank's budget back in this TP rank's bytes, then :func:`.stage_remat.kept_layers` per stage."""
    budgets = stage_remat.rank_budgets(plan)
    if budgets is None:
        return None
    full, inp, whole = (mem.layer_activation_bytes(shape, seq, plan.micro_batch, tp=t, sp=sp, remat=r, elem=elem,
                                                   flash=flash)
                        for t, sp, r in ((plan.tp, plan.sp, "none"), (plan.tp, plan.sp, "full"), (1, False, "none")))
    # the last stage's budget also holds its logits (the solver's graph ends with the head and the loss)
    logits = mem.logits_bytes(shape, seq, plan.micro_batch, tp=plan.tp, elem=elem)
    return tuple(stage_remat.kept_layers(n, budgets[k] * full / whole
                                         - (logits if k == len(layers) - 1 else 0.0), full, inp)
                 for k, n in enumerate(layers))


def _peak(shape: Shape, plan: Plan, plat: Platform, *, seq: int, m: int, v: int, e: int, remat: str, k: float,
          opts: Options, offloaded: bool = False, layers: tuple[int, ...] = (), kept: tuple[int, ...] | None = None
          ) -> tuple[dict[str, float], str, list[dict[str, float]]]:
    """The heaviest pipeline rank's bytes by category, which it is, and every priced rank's totals: the first,
    the last, and under an uneven split (``layers`` per rank) the earliest rank of each other layer count
    (most in flight; with ``kept``, layers per rank keeping their activations under pipeline remat budgets, of each
    other pair of layer and kept counts)."""
    tp, pp, dp, b = plan.tp, plan.pp, max(plan.dp, 1), plan.micro_batch
    flash = opts.attention == "flash"
    storage = "fp32" if plan.params_dtype == "fp32" else "mixed"
    best: tuple[dict[str, float], str] | None = None
    every: list[dict[str, float]] = []
    layers = layers or (shape.layers // pp,) * pp
    # under per-stage remat budgets a rank is also set by the layers it keeps: of the ranks alike, the earliest
    cases: list = list(zip(layers, kept)) if kept is not None else list(layers)
    ranks = [0] + sorted({cases.index(n) for n in set(cases)} - {0, pp - 1}) + ([pp - 1] if pp > 1 else [])
    for r in ranks:
        which, first, last = ("first" if r == 0 else "last" if r == pp - 1 else f"stage {r}"), r == 0, r == pp - 1
        n = mem.rank_params(shape, tp=tp, pp=pp, first=first, last=last, layers=layers[r])
        ms = zero_cost.model_state_bytes(n, plan.zero, (plan.hsdp or dp) * max(plan.cp, 1), precision=storage,
                                         optim_state_bytes=k)
        if offloaded:  # ZeRO-Offload: parameters stay; gradients leave block by block; no states here
            block_grads = max(shape.layer_params() / tp, shape.vocab * shape.hidden / tp if first else 0)
            ms = ModelStateBytes(ms.params, ms.params / n * block_grads, 0.0)
        live = mem.inflight(plan.schedule, pp, m, v, rank=r)
        L = layers[r]
        act = live * L * mem.layer_activation_bytes(shape, seq, b, tp=tp, sp=plan.sp, remat=remat, elem=e,
                                                    flash=flash, selective=opts.selective)
        again = 0.0  # one checkpointed layer's activations rematerialised during its backward
        if kept is not None:
            full, inp = (mem.layer_activation_bytes(shape, seq, b, tp=tp, sp=plan.sp, remat=x, elem=e, flash=flash)
                         for x in ("none", "full"))
            act = live * (kept[r] * full + (L - kept[r]) * inp)
            again = full if kept[r] < L else 0.0
        casts = 0.0
        if plan.precision != "fp32" and plan.params_dtype == "fp32" and plan.zero != 3:  # autocast's, per forward
            casts = 2 * n * (1 if remat == "full" else live)
        transient = 0.0
        if plan.zero == 3:  # FSDP2: this block and the prefetched one gathered (16-bit), one block's gradients
            outer = (shape.vocab / tp * (1 if shape.tied else 2) + shape.position_rows) * shape.hidden
            block = max(shape.layer_params() / tp, outer if first else 0)  # FSDP's root: embedding (+ head)
            transient += 3 * e * block
        if remat == "full" or (remat == "selective" and opts.selective == "op"):  # one layer rematerialised
            transient += mem.layer_activation_bytes(shape, seq, b, tp=tp, sp=plan.sp, remat="none", elem=e,
                                                   flash=flash)
        transient += again
        if last:  # logits (16-bit), their fp32 copy and its gradient
            transient = max(transient, mem.logits_bytes(shape, seq, b, tp=tp, elem=e)
                            + (transient if plan.zero == 3 else 0))
        d = {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer, "weight_casts": casts,
             "activations": act, "transient": transient}
        d["total"] = sum(d.values())
        every.append({"rank": r, "live": live, "activations": act, "remat_transient": again, "total": d["total"],
                      "layers": L, "graph_extra": mem.logits_bytes(shape, seq, b, tp=tp, elem=e) if last else 0.0})
        if best is None or d["total"] > best[0]["total"]:
            best = (d, which)
    assert best is not None
    return best[0], best[1], every
