"""The cost of a whole plan, rank by rank: the one cost interface the estimator (and the planner) use.

:func:`plan_costs` composes the families' cost faces in the stack's order, on the estimated block
profile of one micro-batch (fake tensors: nothing allocated) — the same functions the runtime uses
to cut and plan, so prediction and run agree by construction where they can:

1. **pipeline stages** — the stage split is the runtime's own (:func:`.pipeline.apply.stage_bounds`),
   each stage's bytes come from :func:`.pipeline.memory.stage_memory` (weights, gradients, optimizer
   states and their step transient, one in-flight micro-batch's activation set and transients, with
   each stage's remat schedule replayed), and each pipeline rank's peak from the schedule simulator
   (:func:`.pipeline.simulate.simulate`: how many micro-batches a rank holds at once). Without a
   pipeline the model is one stage and the schedule one rank running the micro-batches in turn;
2. **tensor / sequence / context parallelism** shrink each stage's parameters to this rank's local
   counts (:func:`.tensor_parallel.cost.tp_param_elements`, per block) and its activations by the TP
   activation cost face's ratio (:func:`.tensor_parallel.cost.tp_activation_bytes`) and by cp;
3. **rematerialization** — inside (1): the stages' schedules (:func:`.remat.tree.plan_remat` /
   :func:`.pipeline.stage.stage_remat`);
4. **data parallelism** — ZeRO's cost face (:mod:`.data_parallel.cost`): optimizer states (and their
   step transient) over the shard group from stage 1, gradients from stage 2, parameters from stage 3
   (which then holds one gathered block at a time; inside pipeline stages, :func:`_shard_stages`: the
   whole stage during the step, its fp32 shards and states 1/dp);
5. **traffic** — bytes received per rank per step in the ledger's ring convention: the mesh's
   (:func:`scaletrain.techniques.cost.mesh_predictions`) or, with a pipeline, its collectives (loss,
   tied weights, the data-parallel reduction or ZeRO-1's reduce-scatter and all-gather with the same
   bucket padding as :class:`.data_parallel.zero.GradSync` or ZeRO-3's one all-gather and one fp32
   reduce-scatter of FSDP2's padded shards per step, norms, TP inside the stages).
6. **offloading** — :func:`.offload.cost.offload_bytes`: on one process the offload runtime's own predicted
   device peak; under ZeRO-Offload each rank's masters and optimizer states leave its device.

Every rank's :class:`RankCost` holds bytes by category at its peak; :func:`heaviest` names the rank
whose peak is largest (the one that decides whether the plan fits).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.adapters import adapt
from scaletrain.plan import Plan
from scaletrain.techniques.cost import StepSeconds
from scaletrain.techniques.experts import expert_param_ids


@dataclass
class RankCost:
    """One rank's predicted bytes at its peak (by category) and bytes received per step."""

    rank: str
    """Which ranks this is (pipeline rank; every TP / DP / CP rank of it is alike)."""
    peak_bytes: float
    bytes: dict[str, float] = field(default_factory=dict)
    """params, grads, optimizer (states + masters), activations (the in-flight micro-batches), transient."""
    comm_bytes: float = 0.0
    """Bytes received per optimizer step in collectives (ring convention of the ledger)."""
    time_s: StepSeconds | None = None
    """Seconds of the step by phase on the platform given to :func:`plan_costs` (None without one)."""
    host_bytes: float = 0.0
    """Host memory this rank's offloading holds (masters, optimizer states, offloaded activations)."""

    @property
    def step_time_s(self) -> float | None:
        return self.time_s.step_s if self.time_s is not None else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time_s"] = self.time_s.to_dict() if self.time_s is not None else None
        d["step_time_s"] = self.step_time_s
        return d


def heaviest(costs: list[RankCost]) -> RankCost:
    return max(costs, key=lambda c: c.peak_bytes)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten()) if out.dim() == 3 else F.cross_entropy(out, y)


def _batch(plan: Plan, global_batch: int, micro_batch: int) -> tuple[int, int]:
    """(micro-batch samples, micro-batches per step) as the trainer derives them."""
    dp = max(plan.dp, 1)
    if plan.pp > 1 and plan.microbatches:
        return global_batch // (plan.microbatches * dp), plan.microbatches
    if micro_batch:
        return micro_batch, global_batch // (micro_batch * dp)
    return global_batch // dp, 1


def _tp_local_params(cfg: Any, t: int, n_blocks: int) -> list[float]:
    """Parameter elements one TP rank holds per Chain block of a GPT-2 (embedding, layers, head; the
    head's tied ``wte`` counted with the embedding): the per-block split of ``tp_param_elements``."""
    h, V, P = cfg.n_embd, cfg.vocab_size, cfg.n_positions
    layer = (12 * h * h + 7 * h) / t + 6 * h
    return [V * h / t + P * h] + [layer] * (n_blocks - 2) + [2 * h]


def _full_params(cfg: Any, n_blocks: int) -> list[float]:
    return _tp_local_params(cfg, 1, n_blocks)


def plan_costs(plan: Plan, model: nn.Module, *, world: int, global_batch: int, seq: int,
               micro_batch: int = 0, example: torch.Tensor | None = None, target: torch.Tensor | None = None,
               device: str = "cpu", platform: Any = None, optimizer_kw: dict[str, Any] | None = None
               ) -> list[RankCost]:
    """Every pipeline rank's predicted peak and traffic for ``plan`` on ``world`` processes (see the
    module docstring). ``model`` may live on the meta device; the compatibility table is the
    caller's. With a ``platform`` (:class:`scaletrain.platform.Platform`) each rank's ``time_s`` holds
    its step's seconds by phase (:func:`_add_times`). ``optimizer_kw``: the optimizer's settings that
    change its states (e.g. SGD's ``momentum``: one buffer per parameter, none without)."""
    from scaletrain.techniques.pipeline.memory import stage_memory
    from scaletrain.techniques.pipeline.schedules import build
    from scaletrain.techniques.pipeline.simulate import StageCosts, simulate

    plan = plan.resolved(world)
    chain, bounds, example, target, b, M = _stages(plan, model, global_batch, seq, micro_batch, example, target)
    v = plan.stages_per_rank if plan.pp > 1 else 1
    # one process runs its micro-batches forward-then-backward one at a time (accumulation): 1F1B on one
    # rank, never GPipe (which would hold every micro-batch's activations at once)
    sched_name = plan.schedule if plan.pp > 1 else "1f1b"
    remat = _remat(plan, chain, bounds, example, target)
    sched = build(sched_name, plan.pp, M, v)
    zb = None
    if sched.split_backward:  # zb1p: from I to W a micro-batch keeps its linears' inputs and output gradients
        from scaletrain.techniques.pipeline.memory import deferred_grads

        zb = deferred_grads(chain, bounds, example, precision=plan.precision)
    # ZeRO-1/2 (GradSync): a backward's gradients are standalone until their bucket launches; ZeRO-1 with
    # accumulation holds them whole (grad_bytes) in every later micro-batch, which the simulator counts
    progressive = (plan.zero == 2 or (plan.zero == 1 and M == 1)) and plan.tp == plan.cp == plan.ep == 1 and world > 1
    extras = None
    if plan.zero == 3 and plan.pp == 1 and plan.tp == plan.cp == plan.ep == 1 and not plan.hsdp and \
            plan.precision == "fp32" and remat is None and max(plan.dp, 1) > 1:
        from scaletrain.techniques.data_parallel.fsdp import block_extras

        extras = block_extras(model, list(chain.blocks), plan.fsdp_group, plan.dp, M, "cpu" if device == "cpu"
                              else device)
    mem = stage_memory(chain, bounds, example, target=target, loss_fn=_loss, optimizer=plan.optimizer,
                       precision=plan.precision, remat=remat, ep=plan.ep,
                       deferred=zb, grads_in_backward=progressive, extras=extras, **(optimizer_kw or {}))
    if zb is not None:
        mem = {**mem, "wstash_bytes": zb.wstash_bytes, "wgrad_temp_bytes": zb.wgrad_temp_bytes}
    if plan.pp > 1 and plan.zero == 3 and plan.precision in ("bf16", "fp16"):
        # FSDP2 in the stages computes with 16-bit parameters: autocast saves no 16-bit weight copies
        half = stage_memory(chain, bounds, example, target=target, loss_fn=_loss, optimizer=plan.optimizer,
                            precision=plan.precision, remat=remat, params_dtype=plan.precision, ep=plan.ep,
                            **(optimizer_kw or {}))
        for k in ("act_bytes", "fwd_temp_bytes", "bwd_temp_bytes"):
            mem[k] = half[k]
    S = len(bounds) - 1
    cfg = getattr(model, "config", None)
    from scaletrain.techniques.tensor_parallel import costed as tp_costed

    if (plan.tp > 1 or plan.cp > 1) and not tp_costed(model):  # e.g. HF Llama: trains under TP, not modelled
        raise UserError(f"the tensor/context-parallel cost faces describe the GPT-2 layout; {type(model).__name__} "
                        f"runs with parallel.tp={plan.tp} but its costs are not modelled: estimate with tp=cp=1")
    if plan.tp > 1 or plan.cp > 1:
        _shrink_model_parallel(mem, plan, cfg, bounds, b, seq)
    if plan.ep > 1:
        _shard_experts(mem, plan, bounds, chain)
    _shard_zero(mem, plan, bounds, chain, gloo=device == "cpu", accum=M, device=device,
                kept=extras[3] if extras is not None else None)
    if plan.zero >= 2 or plan.tp > 1 or plan.cp > 1 or plan.ep > 1:
        # their faces reshape the gradients and the backward's transients; the first backward's own
        # figure (gradients made during the pass) is kept for the unsharded layouts only
        mem.pop("bwd_first_temp_bytes", None)
    buckets = _bucket_views(plan) and remat is None
    sim_mem = mem
    if buckets and M > 1:  # no_sync's accumulated .grad and, in the last micro-batch's backward, DDP's buckets
        sim_mem = {**mem, "bwd_temp_bytes": [t + g for t, g in zip(mem["bwd_temp_bytes"], mem["grad_bytes"])]}
    sim = simulate(sched, StageCosts(fwd_s=[1.0] * S, bwd_s=[2.0] * S, grads_from_backward_start=buckets,
                                     **sim_mem))
    comm = _traffic(plan, model, cfg, bounds, b, seq, M, world, remat, device)
    out = []
    for r, peak in enumerate(sim.peak_memory_bytes):
        stages = [s for s in range(S) if any(sched.rank_of(s, p) == r for p in range(sched.n_pipes))]
        parts = {"params": sum(mem["weight_bytes"][s] for s in stages),
                 "grads": sum(mem["grad_bytes"][s] for s in stages),
                 "optimizer": sum(mem["state_bytes"][s] for s in stages)}
        parts["activations_and_transients"] = max(0.0, peak - sum(parts.values()))
        name = f"pipeline rank {r} (stages {stages})" if plan.pp > 1 else "every rank"
        out.append(RankCost(name, float(peak), parts, comm[r] if r < len(comm) else comm[-1]))
    if platform is not None:
        _add_times(out, plan, model, platform, chain=chain, bounds=bounds, example=example, target=target, b=b,
                   M=M, seq=seq, world=world, sched=sched, remat=remat, mem=mem, comm=comm)
    if plan.offload.plan == "chunks":  # one process (compat): the chunk manager's own cost face
        _chunks(out[0], plan, chain, example, target, M, platform)
    else:
        from scaletrain.techniques.offload.cost import offload_bytes  # 6. offloading: what leaves the device

        offload_bytes(out, plan, world=world, chain=chain, example=example, target=target, loss_fn=_loss, accum=M,
                      platform=platform)
    return out


def _chunks(rank: RankCost, plan: Plan, chain: nn.Module, x: torch.Tensor, y: torch.Tensor, M: int,
            platform: Any) -> None:
    """``memory.offload.plan=chunks``: the settled placement's peak and parts, and its copies and updates
    (:func:`.offload.chunks.price`) in place of the device-resident model states."""
    from scaletrain.techniques.offload.chunks import price
    from scaletrain.techniques.remat.schedule import parse_bytes

    o = plan.offload
    c = price(chain, x, y, _loss, budget=parse_bytes(o.device_budget) if o.device_budget else None,
              chunk_bytes=None if o.chunk_bytes in ("", "auto") else parse_bytes(o.chunk_bytes), accum=M,
              platform=platform)
    rank.peak_bytes = float(c["device_peak_bytes"])
    rank.bytes = {k: float(v) for k, v in c["peak_parts"].items()}
    if rank.time_s is not None:
        t, sec = rank.time_s, c["seconds"]
        t.optimizer = sec["device_update"]
        t.copies_s = {k: sec[k] for k in ("h2d", "d2h", "cpu_update")}
        t.copies_exposed_s = dict(t.copies_s)  # the runtime waits for each copy and runs the updates in turn


def _bucket_views(plan: Plan) -> bool:
    """Whether the run wraps the model in torch DDP (:mod:`.data_parallel.ddp`: plain data parallelism)
    with ``gradient_as_bucket_view``: every ``.grad`` is a view into bucket storage the reducer keeps, so
    all of a bucket's bytes count from the backward's first gradient on, beside the activations still
    alive (measured: gpt2-tiny, 2 layers, dp=2: the peak is in the backward with every gradient byte
    present, 10.23 MB against 10.09 predicted, 9.25 without this rule). Not with recomputation: there the
    backward's bytes are the recompute's, and the measured peak came before the first gradient (the same
    model, 4 layers, periodic remat: gradients 0 at the peak, +5.9 % predicted without the rule, +16 %
    with it); the simulator holds one backward piece per stage, too coarse to place both. With accumulation
    the first micro-batches run under ``no_sync`` into standalone ``.grad`` tensors and the last one's
    backward fills the buckets beside them: the gradients twice (measured, quiet run of 2026-11-28 11:00:
    vgg-mini, hf:bert and gpt2-mini DDP at 2 and 4 micro-batches were one gradient copy under, 1.25 of
    1.26 MB, 3.44 of 3.51 MB, 14.6 of 19.7 MB at M = 2)."""
    return plan.pp == 1 and plan.zero == 0 and plan.tp == plan.cp == plan.ep == 1 and max(plan.dp, 1) > 1


def _stages(plan: Plan, model: nn.Module, global_batch: int, seq: int, micro_batch: int = 0,
            example: torch.Tensor | None = None, target: torch.Tensor | None = None) -> tuple:
    """(chain, the runtime's stage bounds, one micro-batch's example input and target, micro-batch samples,
    micro-batches per step) of ``plan`` (dp resolved) as the runtime cuts them."""
    from scaletrain.chain import to_chain
    from scaletrain.techniques.pipeline.apply import stage_bounds

    chain = to_chain(model)
    b, M = _batch(plan, global_batch, micro_batch)
    if b < 1 or M < 1:
        raise UserError(f"global batch {global_batch} does not split over dp={plan.dp} and the micro-batches")
    adapter = adapt(model)  # task and example input of any model (reference, Hugging Face, own)
    lm = adapter.task == "lm"
    if example is None:
        example = adapter.input_spec(b, seq if lm else None)
    if target is None:
        target = torch.zeros(example.shape if lm else (b,), dtype=torch.long, device="meta")
    bounds = (stage_bounds(model, example, pp=plan.pp, schedule=plan.schedule, microbatches=M,
                           virtual=plan.stages_per_rank, loss_fn=_loss, balance=plan.balance)
              if plan.pp > 1 else [0, len(chain)])
    return chain, bounds, example, target, b, M


def stage_graphs_of(plan: Plan, model: nn.Module, *, world: int, global_batch: int, seq: int,
                    micro_batch: int = 0) -> list[Any]:
    """The rematerialization cost graph of each of ``plan``'s pipeline stages as the runtime's solvers see
    them (:func:`.pipeline.stage.stage_graphs`): what a per-stage budget bounds."""
    from scaletrain.techniques.pipeline.stage import stage_graphs

    chain, bounds, x, y, _, _ = _stages(plan.resolved(world), model, global_batch, seq, micro_batch)
    return stage_graphs(chain, bounds, x, target=y, loss_fn=_loss, precision=plan.precision)


def _add_times(costs: list[RankCost], plan: Plan, model: nn.Module, platform: Any, **kw: Any) -> None:
    """Each rank's seconds by phase (:func:`scaletrain.techniques.time_cost.rank_seconds`) on the same
    stages, schedule, remat and traffic as its bytes."""
    from scaletrain.techniques.time_cost import rank_seconds

    times = rank_seconds(plan, model, platform, loss_fn=_loss, parts=[c.bytes for c in costs], **kw)
    for c, t in zip(costs, times):
        c.time_s = t


def _remat(plan: Plan, chain: nn.Module, bounds: list[int], x: torch.Tensor, y: torch.Tensor) -> list | None:
    r = plan.remat
    if r.method == "none" and r.blocks == "none":
        return None
    if len(bounds) > 2:
        from scaletrain.techniques.pipeline.stage import remat_budgets, stage_remat

        return stage_remat(chain, bounds, x, r.method, remat_budgets(r), target=y, loss_fn=_loss,
                           precision=plan.precision)
    from scaletrain.techniques.remat.tree import Segment, plan_remat, tree_ops

    choice = plan_remat(chain, r, x, y, _loss, plan.precision)
    if choice.schedule is not None:
        return [choice.schedule]
    if choice.tree is None or not any(isinstance(it, Segment) for it in choice.tree):
        return None
    # explicit blocks (memory.remat.blocks): their schedule on the fake-tensor graph, as the solvers' are
    from scaletrain.techniques.remat.fromtrace import estimate_graph
    from scaletrain.techniques.remat.simulate import make_schedule

    graph, _ = estimate_graph(chain, x, target=y, loss_fn=_loss, precision=plan.precision)
    return [make_schedule("blocks", graph, tree_ops(choice.tree), None)]


def _shrink_model_parallel(mem: dict, plan: Plan, cfg: Any, bounds: list[int], b: int, seq: int) -> None:
    """TP: each stage's parameters to this rank's local elements, activations by the TP cost face's
    ratio; CP: activations of seq / cp tokens."""
    from scaletrain.techniques.tensor_parallel.cost import tp_activation_bytes

    n = bounds[-1]
    t = plan.tp
    local, full = _tp_local_params(cfg, t, n), _full_params(cfg, n)
    s_loc = seq // plan.cp
    act = tp_activation_bytes(cfg, t, b, s_loc, sequence_parallel=plan.sp)["total"] / \
        tp_activation_bytes(cfg, 1, b, seq)["total"]
    for s in range(len(bounds) - 1):
        blocks = range(bounds[s], bounds[s + 1])
        w = sum(local[i] for i in blocks) / sum(full[i] for i in blocks)
        if s == len(bounds) - 2 and bounds[s] > 0:  # the last stage also holds the tied wte
            w = (sum(local[i] for i in blocks) + local[0] - cfg.n_positions * cfg.n_embd) / \
                (sum(full[i] for i in blocks) + full[0] - cfg.n_positions * cfg.n_embd)
        for k in ("weight_bytes", "grad_bytes", "state_bytes", "opt_temp_bytes"):
            mem[k][s] *= w
        for k in ("act_bytes", "fwd_temp_bytes", "bwd_temp_bytes"):
            mem[k][s] *= act
        if plan.sp or plan.cp > 1:
            mem["boundary_bytes"][s] /= (plan.tp if plan.sp else 1) * plan.cp


def _shard_zero(mem: dict, plan: Plan, bounds: list[int], chain: nn.Module, gloo: bool, accum: int = 1,
                device: str = "cpu", kept: float | None = None) -> None:
    """ZeRO over the data-parallel ranks (ZeRO's cost face; rows split as torch.chunk, so ~1/N).

    ``gloo``: the CPU backend reduce-scatters by all-reducing a full copy of the input and keeping this
    rank's chunk (the tracker sees a bucket-sized buffer, born inside the collective, split at its wait),
    so every bucket in flight costs its input once more until it is drained; NCCL reduces in place."""
    N = plan.hsdp or max(plan.dp, 1) * (plan.cp if plan.pp == 1 else 1)
    single = plan.pp == plan.tp == plan.cp == plan.ep == 1  # with N = 1: one process, no GradSync at all
    if plan.zero == 0 or (N == 1 and (plan.zero == 3 or single)):
        return
    # ZeRO-1/2 on one data-parallel rank (pp=2 or tp=2 on 2 processes) still runs GradSync's buckets: the
    # reduce-scatter input and output of every bucket are made (the output copied from the input: no
    # collective, so no gloo copy) before the step — the (N + 1) / N = 2 stage weights below
    if plan.zero == 3 and plan.pp > 1:
        _shard_stages(mem, plan, bounds, chain, N, gloo)
        return
    for s in range(len(bounds) - 1):
        mem["state_bytes"][s] /= N
        # the step's transient: the optimizer's over the owned rows, or — ZeRO-1/2 — every bucket's
        # reduce-scatter input (N padded shards) and output, then every bucket's all-gather output and input,
        # all in flight at once: (N + 1) / N of the stage's parameter bytes, and gloo's copy of the input
        w = mem["weight_bytes"][s]
        mem["opt_temp_bytes"][s] = max(mem["opt_temp_bytes"][s] / N,
                                       (N + 1) / N * w + (w if gloo and N > 1 else 0.0)
                                       if plan.zero in (1, 2) else 0.0)
        if plan.zero >= 2:
            mem["grad_bytes"][s] /= N
        if plan.zero == 3:  # FSDP2 in backward: groups of blocks gathered whole (parallel.fsdp_group), unsharded
            # gradients before their reduce-scatter (fsdp.gathered_peak_bytes)
            from scaletrain.techniques.data_parallel.fsdp import gathered_peak_bytes

            if kept is not None:  # priced block by block (fsdp.block_extras): the root's unsharded parameters
                mem["weight_bytes"][s] = mem["weight_bytes"][s] / N + kept
                continue
            mem["weight_bytes"][s] = mem["weight_bytes"][s] / N + gathered_peak_bytes(
                chain, list(chain.blocks[bounds[s]:bounds[s + 1]]), plan.fsdp_group, N, accum,
                "cpu" if gloo else device,
                keep_last=plan.pp == 1 and plan.tp == 1 and plan.ep == 1)  # as fsdp.plan_kept_elements


def _shard_experts(mem: dict, plan: Plan, bounds: list[int], chain: nn.Module) -> None:
    """Expert parallelism (:mod:`.experts`, :mod:`.pipeline.experts`): each rank keeps 1/ep of every
    expert tensor, so a stage's weights lose (1 - 1/ep) of its experts' share — and so do its gradients
    below ZeRO-2 and its optimizer states and step transient without ZeRO (ZeRO then shards the experts
    over the dp/ep ranks holding the same ones: 1/dp of them, as :func:`_shard_zero` divides).
    Activations stay: the all-to-all moves the same E·cap rows."""
    experts = expert_param_ids(chain)
    for s in range(len(bounds) - 1):
        ps = _stage_params(chain, bounds, s)
        total = sum(p.numel() for p in ps)  # a tied embedding is among the head block's parameters
        e = sum(p.numel() for p in ps if id(p) in experts)
        keep = 1.0 - (e / total) * (1.0 - 1.0 / plan.ep) if total else 1.0
        keys = ["weight_bytes"] + (["grad_bytes"] if plan.zero < 2 else []) + \
            (["state_bytes", "opt_temp_bytes"] if plan.zero == 0 else [])
        for k in keys:
            mem[k][s] *= keep
        if plan.precision in ("bf16", "fp16"):  # autocast's 16-bit copies of the expert weights, saved for the
            # backward of their batched matmuls, are of this rank's experts only
            w = sum(p.numel() for p in ps if id(p) in experts and p.dim() == 3)
            mem["act_bytes"][s] -= 2.0 * w * (1.0 - 1.0 / plan.ep)


def _padded_shard_elements(params: list, N: int, shape: Callable[[Any], tuple] | None = None) -> int:
    """Elements of one rank's FSDP2 shards of ``params`` (dim 0 padded to a multiple of N). ``shape(p)``: the
    tensor FSDP shards (the TP-local shape under tensor parallelism; default the whole ``p.shape``)."""
    total = 0
    for p in params:
        shp = tuple(shape(p) if shape is not None else p.shape)
        rows = shp[0] if shp else 1
        total += -(-rows // N) * (math.prod(shp) // max(rows, 1))
    return total


def _tp_shape(chain: nn.Module, t: int) -> Callable[[Any], tuple]:
    """``p`` -> its TP-local shape (:func:`_tp_local_shape`) for the parameters of ``chain``."""
    names = {id(p): n for n, p in chain.named_parameters()}
    return lambda p: _tp_local_shape(names.get(id(p), ""), tuple(p.shape), t)


def _stage_params(chain: nn.Module, bounds: list[int], s: int) -> list:
    return list({id(p): p for b in chain.blocks[bounds[s]:bounds[s + 1]] for p in b.parameters()}.values())


def _shard_stages(mem: dict, plan: Plan, bounds: list[int], chain: nn.Module, N: int, gloo: bool) -> None:
    """ZeRO-3 inside pipeline stages (:mod:`.pipeline.fsdp`, torchtitan's PP + FSDP): the fp32 shards and
    optimizer states are 1/N; during the step each stage is gathered whole (compute dtype: 2 bytes under
    bf16/fp16) and keeps its whole fp32 gradient, as ZeRO-1; at the update the reduce-scatter's fp32 input
    takes the whole gradient's place (FSDP2 copies it in and drops the gradient; gloo all-reduces a second
    copy) and its 1/N output lives beside it."""
    half = plan.precision in ("bf16", "fp16")
    for s in range(len(bounds) - 1):
        w = mem["weight_bytes"][s]  # fp32, the whole stage
        shard = 4.0 * _padded_shard_elements(_stage_params(chain, bounds, s), N, _tp_shape(chain, plan.tp))
        mem["state_bytes"][s] /= N
        mem["weight_bytes"][s] = shard + (w / 2 if half else w)
        mem["grad_bytes"][s] = w
        mem["opt_temp_bytes"][s] = max(mem["opt_temp_bytes"][s] / N + shard - w, (w if gloo else 0.0) + shard)


def _traffic(plan: Plan, model: nn.Module, cfg: Any, bounds: list[int], b: int, seq: int, M: int,
             world: int, remat: list | None, device: str = "cpu") -> list[float]:
    """Bytes received per step per pipeline rank (the ledger's collectives)."""
    if plan.pp == 1:
        if world == 1:
            return [0.0]
        from scaletrain.techniques.cost import MeshShape, local_param_counts, mesh_predictions

        counts = local_param_counts(model, tp=plan.tp, ep=plan.ep)
        padded = plan.zero > 0 and plan.tp == plan.cp == 1 and not counts["expert"] and not plan.hsdp
        if padded:  # ZeRO-1/2's buckets and ZeRO-3's FSDP2 shards both pad dim 0 to a multiple of dp
            counts = {"dense": _zero_padded_elements(model, plan.dp), "expert": 0}
        if plan.zero == 0 and plan.tp == plan.cp == plan.ep == 1:  # torch DDP: one all-reduce of the gradients
            from scaletrain.techniques.data_parallel.cost import comm_bytes_per_step

            # every gradient, a MoE's experts included (ep = 1: they are replicated like the rest); DDP's
            # replicas clip alike: no norm all-reduce
            return [comm_bytes_per_step(counts["dense"] + counts["expert"], 0, world)]
        mp = MeshShape(plan)
        recomputes = None
        if remat:  # the recomputed forwards' TP collectives are replayed in the backward, as the runtime predicts
            from scaletrain.techniques.remat.tree import recompute_counts, tree_of

            recomputes = recompute_counts(tree_of(remat[0]), bounds[-1] - bounds[0])
        from scaletrain.techniques.data_parallel.fsdp import plan_kept_elements

        kept = plan_kept_elements(model, plan, M, device, padded=padded)
        return [mesh_predictions(cfg, mp, stage=plan.zero, micro_batch=b, accum=M, seq=seq, counts=counts,
                                 grad_clip=True, world=world, recomputes=recomputes, kept=kept)["predicted_comm_bytes"]]
    return [_pipeline_traffic(plan, model, cfg, bounds, b, seq, M, r, remat) for r in range(plan.pp)]


def _zero_padded_elements(model: nn.Module, dp: int) -> int:
    """Elements ZeRO-1/2's reduce-scatter and all-gather move per rank group: :class:`.data_parallel.zero.GradSync`
    shards every tensor by rows (``shard_rows``) and pads it to ``dp`` whole chunks, so a tensor with a row
    count not divisible by ``dp`` (an odd vocabulary: hf:bert's embedding and decoder bias) carries its
    padding rows on the wire (hf:bert, dp=2: 129 elements, 258 bytes per collective). FSDP2 (ZeRO-3) pads its
    shards the same way: hf:bert's two odd tensors are the root's, gathered once and reduce-scattered once a
    micro-batch, 516 bytes a step at dp=2."""
    from scaletrain.techniques.data_parallel.sharded import shard_rows

    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        rows = p.shape[0] if p.ndim else 1
        n += dp * shard_rows(rows, dp, 0)[0] * (p.numel() // max(rows, 1))
    return n


def _tp_local_shape(name: str, shape: tuple[int, ...], t: int) -> tuple[int, ...]:
    """This TP rank's shape of a GPT-2 parameter (Megatron: column-parallel QKV / MLP-in and the
    vocabulary-parallel embedding split their rows, row-parallel projections their columns)."""
    if t == 1 or not shape:
        return shape
    if name.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias", "wte.weight", "lm_head.weight")):
        return (shape[0] // t, *shape[1:])
    if name.endswith("c_proj.weight"):
        return (shape[0], shape[1] // t)
    return shape


def _pipeline_traffic(plan: Plan, model: nn.Module, cfg: Any, bounds: list[int], b: int, seq: int, M: int,
                      rank: int, remat: list | None = None) -> float:
    """One pipeline rank's collectives per step — the terms
    :meth:`.pipeline.strategy.PipelineStrategy.predicted_collectives` counts on the running layout:
    the loss all-reduce, the tied embedding's sum over its holders, the data-parallel all-reduce (or
    ZeRO-1's reduce-scatter + all-gather of the padded buckets, or ZeRO-3's one all-gather + one fp32
    reduce-scatter of the padded FSDP2 shards) and the norm all-reduces, and the TP
    collectives of the rank's stages (:func:`.pipeline.tensor_parallel.stage_tp_bytes`)."""
    from scaletrain.chain import to_chain
    from scaletrain.techniques.pipeline.schedules import build

    from scaletrain.techniques.data_parallel.sharded import shard_rows

    chain = to_chain(model)
    v = (plan.virtual or (2 if plan.schedule == "interleaved" else 1))
    sched = build(plan.schedule, plan.pp, M, v)
    S = len(bounds) - 1
    names = {id(p): n for n, p in model.named_parameters()}
    holders: dict[int, set[int]] = {}
    for st in range(S):
        for blk in chain.blocks[bounds[st]:bounds[st + 1]]:
            for p in blk.parameters():
                holders.setdefault(id(p), set()).update(sched.rank_of(st, q) for q in range(sched.n_pipes))
    mine = [p for p in model.parameters() if rank in holders.get(id(p), ())]  # the runtime's order
    t, dp = plan.tp, max(plan.dp, 1)

    def ring_ar(n: int, x: float) -> float:
        return 2 * (n - 1) / n * x if n > 1 else 0.0

    def nbytes(ps: list) -> float:
        if plan.zero == 3:  # the tied gradient is summed over its holders as this rank's FSDP2 shard (dp rank 0's)
            shp = [_tp_local_shape(names[id(p)], tuple(p.shape), t) for p in ps]
            return float(sum(math.prod(shard_rows(x[0], dp, 0)[2:] + x[1:]) * 4 for x in shp))
        return float(sum(math.prod(_tp_local_shape(names[id(p)], tuple(p.shape), t)) * 4 for p in ps))

    total = ring_ar(plan.pp * dp, 8.0)  # the window's mean loss (float64)
    shared = [p for p in mine if len(holders[id(p)]) > 1]
    if shared:  # (Chimera's replicas: an expert tensor is this rank's 1/ep slice of it)
        sliced = [p for p in shared if id(p) in expert_param_ids(chain)] if plan.ep > 1 else []
        total += ring_ar(len(holders[id(shared[0])]), nbytes(shared) - (1 - 1 / plan.ep) * nbytes(sliced))
    if plan.zero == 3:  # FSDP2 in the stages: one all-gather (compute dtype) and one fp32 reduce-scatter per step
        pb = 2 if plan.precision in ("bf16", "fp16") else 4
        total += (dp - 1) * _padded_shard_elements(mine, dp, _tp_shape(model, t)) * (pb + 4)
    elif plan.zero == 1:
        from scaletrain.techniques.data_parallel.zero import bucket_segments

        ep = max(plan.ep, 1)
        experts = expert_param_ids(chain) if ep > 1 else set()
        for group, n in (([p for p in mine if id(p) not in experts], dp), ([p for p in mine if id(p) in experts],
                                                                           dp // ep)):
            shapes = []  # an expert tensor is this rank's 1/ep of it, sharded over the n ranks holding the same
            for p in group:
                shp = _tp_local_shape(names[id(p)], tuple(p.shape), t)
                if id(p) in experts:
                    shp = (shp[0] // ep, *shp[1:])
                rows = shp[0] if shp else 1
                shapes.append((rows, math.prod(shp) // max(rows, 1), 4))
            segs = bucket_segments(shapes, n, plan.bucket_mb * 2**20)
            total += 2 * (n - 1) / n * sum(n * seg * 4 for seg in segs) if n > 1 else 0.0
    else:
        ep = max(plan.ep, 1)
        experts = [p for p in mine if id(p) in expert_param_ids(chain)] if ep > 1 else []
        total += ring_ar(dp, nbytes([p for p in mine if not any(p is q for q in experts)]))
        total += ring_ar(dp // ep, nbytes(experts) / ep)  # EP: this rank's 1/ep, summed over the same experts
        total += ring_ar(plan.pp, 8.0) + (ring_ar(t, 8.0) if t > 1 else 0.0) + (ring_ar(ep, 8.0) if experts else 0.0)
    if plan.precision == "fp16":  # the loss scaler's found-inf all-reduce (one fp32) over the world
        total += ring_ar(plan.pp * dp * t, 4.0)
    if plan.ep > 1:  # the all-to-alls of this rank's MoE layers
        from scaletrain.techniques.pipeline.experts import moe_layers_per_block, rank_ep_bytes

        total += rank_ep_bytes(cfg, sched, bounds, moe_layers_per_block(chain.blocks), rank, b, seq, plan.ep,
                               plan.precision, remat)
    if t > 1:
        from scaletrain.techniques.pipeline.tensor_parallel import rank_tp_bytes

        total += rank_tp_bytes(plan, cfg, bounds, b, seq, sched, rank, remat)
    return total
