"""Seconds of a plan's training step, rank by rank, from the block profile on a Platform.

The time half of the one cost interface: :func:`scaletrain.techniques.plan_cost.plan_costs` with a
``platform`` fills each rank's :class:`~scaletrain.techniques.cost.StepSeconds`. It works for any
model the estimator cuts into a Chain (not only GPT-2 shapes: :mod:`scaletrain.planner.cost` prices
GPT shapes on paper). Units: seconds, bytes, FLOPs.

* **compute** — every operator of every block (:func:`scaletrain.measure.census.census`, fake
  tensors, one micro-batch) on a roofline: an operator with FLOPs costs
  ``max(FLOPs / (peak × matmul_fraction(FLOPs)) + kernel_overhead, bytes / (HBM × mem_fraction(bytes))
  + kernel_overhead)`` (:func:`scaletrain.cost.roofline_seconds`, the planner's too, with the bytes the operator really moves), any other
  ``bytes / (HBM × mem_fraction(bytes)) + kernel_overhead`` (``Platform.memory_bound_seconds``, as the planner prices it). Peak is
  the platform's bf16 figure for an operator writing 16 bits, its fp32 one otherwise. Under tensor
  parallelism every operator with FLOPs (Megatron splits all of a layer's matmuls, the attention
  heads and the vocabulary) does 1/t of the work, memory-bound ones 1/t under sequence parallelism
  and all of it without (LayerNorm, residual adds: replicated); under context parallelism everything
  is 1/cp (each rank's s/cp queries). The per-kernel overhead is paid once per kernel regardless.
* **recompute** — each block's forward once more per extra forward the remat plan gives it
  (:func:`.remat.tree.recompute_counts` of the stages' schedules or of ``remat.blocks``); selective
  recompute replays the attention kernel of every layer.
* **communication** — the bytes the cost faces count (the traffic of :func:`plan_costs`, to the byte)
  by collective kind, each at α–β: ``bytes received / (link × efficiency) + ring steps × α``. Ring
  steps: 2(n − 1) per all-reduce, n − 1 per all-gather, reduce-scatter or all-to-all. Placement:
  tp innermost, then cp, dp, pp outermost; a group whose ranks span more than ``devices_per_node``
  uses the inter-node link, else NVLink.
* **overlap** (what the runtime overlaps, stated): tp / cp / ep collectives run inside the layer's
  forward and backward and are waited for (Megatron); the norm and loss all-reduces likewise; without
  a pipeline DDP's bucket all-reduces run during the last micro-batch's backward (``no_sync`` before),
  ZeRO-2's reduce-scatters during every micro-batch's backward — hidden up to that window, the last
  bucket always exposed; ZeRO-3's gathers and reduce-scatters per FSDP group, one group prefetched
  ahead on one stream (:func:`scaletrain.cost.prefetch_windows`; each group's collectives by its bytes,
  the micro-batch's forward and backward, recompute included, spread evenly over the groups); ZeRO-1 and every pipeline reduce after the flush: exposed. On a platform whose
  copies do not run beside compute (``copy_overlaps_compute=False``: the CPU pool, where gloo's
  threads take the same cores) nothing is hidden.
* **pipeline** — the schedule simulator (:func:`.pipeline.simulate.simulate`) with each stage's
  forward / backward (recompute and intra-layer collectives included) for one micro-batch, each pass
  plus the runtime's host time per action (``Platform.pipeline_action_s``, counted in compute); bubble
  of a rank = makespan without p2p cost − its busy time; the p2p sends (stage boundary bytes on the pp
  link) are exposed by the makespan they add — on a platform with a measured blocking receive
  (``Platform.p2p_recv_s``: gloo on a CPU) every receive runs on the receiver's clock after both sides
  posted, and every send costs ``p2p_send_s``. Without a pipeline the same simulator runs one rank's
  micro-batches in turn (no bubble).
* **offload copies** — optimizer on the host: the rank's gradients down and parameters up per step at
  the platform's d2h / h2d rates, the update at ``cpu_adam_params_per_s`` (replacing the device
  step), all exposed (with ``dpu`` the update hides behind the next step's compute); on disk also
  the states read and written at the disk rates. Activation offload: each micro-batch's activation
  set down and back up; streamed weights: the stage's parameters up for every forward and backward;
  both hidden behind compute where copies overlap it.
* **host** — the trainer's own host work per step that no term above prices (the loop's bookkeeping,
  clipping's Python, DDP's and ZeRO-1/2's bucket hooks and flat-buffer copies, the runtime's Python per
  micro-batch), measured by running the Trainer (``Platform.host_seconds``; :func:`host_time`); 0 on
  the presets.
* **optimizer** — memory-bound, the planner's bytes per updated parameter
  (:func:`scaletrain.techniques.optim.registry.optimizer_step_bytes`: torch's foreach AdamW kernels and clipping)
  at HBM bandwidth (``Platform.memory_bound_seconds``, one fixed cost per kernel).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from scaletrain.cost import (collective_seconds, collective_steps, exposed_seconds, optimizer_seconds, prefetch_windows,
                            roofline_seconds, zero_comm_factor)
from scaletrain.errors import UserError
from scaletrain.measure.census import BlockOps, Op
from scaletrain.platform import Platform
from scaletrain.techniques.cost import StepSeconds

def op_seconds(op: Op, plat: Platform, *, work_split: float = 1.0, mem_split: float = 1.0) -> float:
    """Seconds of one operator on ``plat`` on the one roofline (:func:`scaletrain.cost.roofline_seconds`);
    ``work_split`` divides an operator with FLOPs (its FLOPs and bytes), ``mem_split`` a memory-bound one.
    A GEMM passes its output shape (tile and wave quantization on the platform's SMs) and alignment, as the
    planner's matmuls do; under a split its output's columns are divided (Megatron's column-parallel
    matmuls and attention heads; a row-parallel one, whose output is whole, is priced the same way)."""
    if op.flops > 0:
        output = op.output and (op.output[0], op.output[1] / work_split, op.output[2])
        return roofline_seconds(plat, op.flops / work_split, op.nbytes / work_split,
                                precision="bf16" if op.half else "fp32", unaligned=op.unaligned, output=output)
    return plat.memory_bound_seconds(op.nbytes / mem_split)


def block_seconds(ops: list[BlockOps], plat: Platform, *, tp: int = 1, sp: bool = False,
                  cp: int = 1) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of each entry of a census (the loss last) on one rank."""
    w, m = float(tp * cp), float(cp * (tp if sp else 1))
    fwd = [sum(op_seconds(o, plat, work_split=w, mem_split=m) for o in b.fwd) for b in ops]
    bwd = [sum(op_seconds(o, plat, work_split=w, mem_split=m) for o in b.bwd) for b in ops]
    return fwd, bwd


def attention_seconds(ops: BlockOps, plat: Platform, *, tp: int = 1, cp: int = 1) -> float:
    """Forward seconds of a block's attention kernels (what selective recompute replays)."""
    return sum(op_seconds(o, plat, work_split=float(tp * cp)) for o in ops.fwd if "scaled_dot_product" in o.name)


def _measured(plat: Platform, model: nn.Module, chain: Any, plan: Any, ops: list[BlockOps], fwd: list[float],
              bwd: list[float], *, seq: int, b: int) -> tuple[list[float], list[float], bool] | None:
    """The blocks' seconds measured on this machine (:attr:`Platform.measured_blocks`, the measured source of
    the per-block table) when it has this model, else None (the roofline's stand); the flag says whether
    they were measured in the plan's tensor-parallel layout, in-layer collectives included (then no TP
    collective time is added). Without such rows, under tp / cp each block keeps the roofline's ratio of
    its split time to its whole time."""
    if not plat.measured_blocks:
        return None
    from scaletrain.measure.block_times import lookup, model_key, tp_key

    key = model_key(model, chain)
    if plan.tp > 1 and plan.cp == 1:
        got = lookup(plat.measured_blocks, tp_key(key, plan.tp, plan.sp), plan.precision, seq, b)
        if got is not None and len(got[0]) == len(fwd):
            return got[0], got[1], True
    got = lookup(plat.measured_blocks, key, plan.precision, seq, b)
    if got is None or len(got[0]) != len(fwd):
        return None
    mf, mb = got
    if plan.tp * plan.cp > 1:
        wf, wb = block_seconds(ops, plat)
        mf = [m * (s / w if w > 0 else 1.0) for m, s, w in zip(mf, fwd, wf)]
        mb = [m * (s / w if w > 0 else 1.0) for m, s, w in zip(mb, bwd, wb)]
    return mf, mb, False


def recompute_counts(plan: Any, bounds: list[int], remat: list | None) -> list[int]:
    """Extra forwards of each block per micro-batch under the plan's remat (stages' schedules, or
    ``remat.blocks`` checkpointed whole)."""
    from scaletrain.techniques.remat.schedule import FORWARD_KINDS
    from scaletrain.techniques.remat.tree import blocks_tree, recompute_counts as counts_of, tree_of

    n = bounds[-1]
    out = [0] * n
    if remat:
        for s, sched in enumerate(remat):
            k = bounds[s + 1] - bounds[s]
            try:  # nested checkpoints, as the runtime applies them
                c = counts_of(tree_of(sched), max(k, sched.n_nodes))[:k]
            except UserError:  # a schedule only the executor runs: its forwards beyond the first, per block
                c = [max(sum(1 for o in sched.ops if o.kind in FORWARD_KINDS and o.index == i) - 1, 0)
                     for i in range(k)]
            out[bounds[s]:bounds[s + 1]] = c
    elif plan.remat.blocks != "none":
        out = counts_of(blocks_tree(n, plan.remat.blocks), n)
    elif plan.offload.recompute != "none":  # the offload runtime's own checkpointed blocks
        out = counts_of(blocks_tree(n, plan.offload.recompute), n)
    return out


def tp_ring_steps(bounds: list[int], stage: int, rec: list[int], t: int, sp: bool) -> float:
    """Ring steps of one micro-batch's TP collectives on a stage of the GPT-2 layout (as the TP cost face
    counts them): the embedding's all-reduce in the forward, 2 per layer in the forward and 2 in the
    backward, the head's in the backward and the vocabulary-parallel loss's 3; a recomputed forward
    replays its forward ones. 2(t - 1) steps each; under SP each is a reduce-scatter + all-gather pair
    (the same steps) and the backward re-gathers add half as many again."""
    n = bounds[-1]
    steps = 0
    for i in range(bounds[stage], bounds[stage + 1]):
        fwd = 1 if i == 0 else (0 if i == n - 1 else 2)
        steps += fwd * (1 + rec[i]) + (0 if i == 0 else 2 if i < n - 1 else 4)
    return steps * 2 * (t - 1) * (1.5 if sp else 1.0)


def link(plat: Platform, stride: int, n: int) -> tuple[float, float]:
    """(achieved bytes/s, α) of a group of ``n`` ranks ``stride`` apart (placement in the module doc)."""
    if stride * n > max(plat.devices_per_node, 1):
        return plat.inter_node_bytes_per_s * plat.inter_node_efficiency, plat.inter_node_latency_s
    return plat.intra_node_bytes_per_s * plat.intra_node_efficiency, plat.intra_node_latency_s


def _comm(plan: Any, model: nn.Module, cfg: Any, plat: Platform, *, b: int, seq: int, M: int, world: int,
          total: float, bounds: list[int], rank: int, remat: list | None, rank_param_bytes: float,
          n_blocks: int, tp_steps: float) -> dict[str, float]:
    """Seconds of each collective kind on one pipeline rank (its bytes from the cost faces)."""
    t, cp, dp, pp = plan.tp, plan.cp, max(plan.dp, 1), plan.pp
    if world == 1:
        return {}
    if pp == 1 and plan.zero == 0 and t == cp == plan.ep == 1:
        kinds = {"dp": total}
    elif pp == 1:
        from scaletrain.techniques.cost import MeshShape, local_param_counts, mesh_predictions
        from scaletrain.techniques.data_parallel.fsdp import plan_kept_elements

        kinds = mesh_predictions(cfg, MeshShape(plan), stage=plan.zero, micro_batch=b, accum=M, seq=seq,
                                 counts=local_param_counts(model, tp=t, ep=plan.ep), grad_clip=True, world=world,
                                 kept=plan_kept_elements(model, plan, M, plat.device_type))["comm_bytes_by_kind"]
    else:  # the pipeline rank's TP bytes from the stage cost face; the rest (gradients, tied, loss, norms) is dp
        from scaletrain.techniques.pipeline.schedules import build
        from scaletrain.techniques.pipeline.tensor_parallel import rank_tp_bytes

        sched = build(plan.schedule, pp, M, plan.virtual or (2 if plan.schedule == "interleaved" else 1))
        kinds = {"tp": rank_tp_bytes(plan, cfg, bounds, b, seq, sched, rank, remat) if t > 1 else 0.0}
        kinds["dp"] = max(total - kinds["tp"], 0.0)
    out: dict[str, float] = {}
    D = dp * cp
    if kinds.get("tp"):
        out["tp"] = collective_seconds(kinds["tp"], tp_steps, *link(plat, 1, t))
    if kinds.get("cp"):  # ring attention: cp - 1 exchanges per layer in the forward, twice that in the backward
        out["cp"] = collective_seconds(kinds["cp"], 3 * cfg.n_layer * (cp - 1) * M, *link(plat, t, cp))
    if kinds.get("ep"):  # two all-to-alls per MoE layer each way
        n_moe = cfg.n_layer // cfg.moe_every
        out["ep"] = collective_seconds(kinds["ep"], 4 * n_moe * (plan.ep - 1) * M, *link(plat, t * cp, plan.ep))
    if kinds.get("dp"):
        buckets = max(1, math.ceil(rank_param_bytes / (plan.bucket_mb * 2**20)))
        halves = {0: 2 * buckets, 1: 2 * buckets, 2: (M + 1) * buckets, 3: 3 * n_blocks * M}[plan.zero]
        G = D if pp == 1 else dp
        stride = t * (cp if pp == 1 else 1)
        # latency as NCCL counts it (scaletrain.cost.collective_steps): DDP's all-reduce per bucket (two halves)
        intra, inter = collective_steps(G, max(1, plat.devices_per_node // stride), all_reduce=plan.zero == 0)
        issued = halves // 2 if plan.zero == 0 else halves
        out["dp"] = (collective_seconds(kinds["dp"], 0, link(plat, stride, G)[0], 0.0)
                     + issued * (intra * plat.intra_node_latency_s + inter * plat.inter_node_latency_s)) \
            * zero_comm_factor(plat, plan.zero, M)
        if plan.zero == 3:  # FSDP2's own work per collective (copy-in/out, hooks), measured where known
            out["dp"] += halves * plat.fsdp_collective_overhead_s
    if kinds.get("norm"):
        out["norm"] = collective_seconds(kinds["norm"], 2 * (world - 1), *link(plat, 1, world))
    return out


def rank_seconds(plan: Any, model: nn.Module, plat: Platform, *, chain: Any, bounds: list[int], example: Any,
                 target: Any, loss_fn: Any, b: int, M: int, seq: int, world: int, sched: Any, remat: list | None,
                 mem: dict, comm: list[float], parts: list[dict[str, float]]) -> list[StepSeconds]:
    """Each pipeline rank's :class:`StepSeconds` (module docstring). ``sched``, ``bounds``, ``remat``,
    ``mem`` (the stages' bytes), ``comm`` (bytes received per rank) and ``parts`` (each rank's params /
    grads / optimizer bytes) are :func:`.plan_cost.plan_costs`' own, so time and bytes describe one plan."""
    from scaletrain.measure.census import census
    from scaletrain.techniques.compile import compute_factor
    from scaletrain.techniques.pipeline.actions import SEND_B, SEND_F
    from scaletrain.techniques.pipeline.simulate import Link, StageCosts, simulate

    ops = census(chain, example, target, loss_fn, plan.precision)
    fwd, bwd = block_seconds(ops, plat, tp=plan.tp, sp=plan.sp, cp=plan.cp)
    measured = _measured(plat, model, chain, plan, ops, fwd, bwd, seq=seq, b=b)
    tp_inside = False  # the TP collectives' time is inside blocks measured in the plan's layout
    if measured is not None:
        fwd, bwd, tp_inside = measured
    k = compute_factor(plan, plat.compile_factor, plat.device_type)  # train.compile: the measured compiled/eager factor (1 when not measured)
    fwd, bwd = [x * k for x in fwd], [x * k for x in bwd]
    rec = recompute_counts(plan, bounds, remat)
    attn = [attention_seconds(o, plat, tp=plan.tp, cp=plan.cp) for o in ops]
    selective = plan.remat.selective != "none"
    n, S, P = bounds[-1], len(bounds) - 1, sched.n_ranks
    cfg = getattr(model, "config", None)
    stage_f, stage_b, stage_r = [], [], []
    for s in range(S):
        blocks = range(bounds[s], bounds[s + 1])
        last = s == S - 1
        stage_f.append(sum(fwd[i] for i in blocks) + (fwd[-1] if last else 0.0))
        stage_b.append(sum(bwd[i] for i in blocks) + (bwd[-1] if last else 0.0))
        stage_r.append(sum(rec[i] * fwd[i] for i in blocks)
                       + (sum(attn[i] for i in blocks if 0 < i < n - 1) if selective else 0.0))
    stages_of = [[s for s in range(S) if any(sched.rank_of(s, p) == r for p in range(sched.n_pipes))]
                 for r in range(P)]
    passes = [{s: sum(1 for a in sched.actions[r] if a.kind == "F" and a.stage == s) for s in stages_of[r]}
              for r in range(P)]
    n_blocks = [sum(bounds[s + 1] - bounds[s] for s in stages_of[r]) for r in range(P)]
    units: list[float] = [1.0] * n_blocks[0]
    kept: list[bool] = [False] * n_blocks[0]
    if plan.zero == 3 and plan.pp == 1:  # ZeRO-3's collectives: one set per FSDP group (parallel.fsdp_group)
        from scaletrain.techniques.data_parallel.fsdp import gather_units, shardable_blocks

        units = gather_units(chain, list(chain.blocks), plan.fsdp_group, plan.hsdp or max(plan.dp, 1) * plan.cp,
                             M, plat.device_type) or [1.0]
        n_blocks = [len(units)]
        # the root's units (listed first) and the last group stay gathered into the backward without TP/EP
        n_root = sum(1 for b in chain.blocks if id(b) not in {id(x) for x in shardable_blocks(chain)})
        keep = plan.tp == 1 and plan.ep == 1
        kept = [keep and (i < n_root or i == len(units) - 1) for i in range(len(units))]
    comm_s = [_comm(plan, model, cfg, plat, b=b, seq=seq, M=M, world=world, total=comm[min(r, len(comm) - 1)],
                    bounds=bounds, rank=r, remat=remat, rank_param_bytes=parts[r]["params"], n_blocks=n_blocks[r],
                    tp_steps=sum(passes[r][s] * tp_ring_steps(bounds, s, rec, plan.tp, plan.sp) for s in stages_of[r]))
              for r in range(P)]
    if tp_inside:
        for c in comm_s:
            c.pop("tp", None)
    # the collectives inside the layers run in the passes: each stage pass carries its share, half each way
    inner = [sum(c.get(k, 0.0) for k in ("tp", "cp", "ep")) for c in comm_s]
    share = [inner[r] / max(sum(passes[r].values()), 1) for r in range(P)]
    # the pipeline runtime's host time per action (F, B; I and W when split), in every pass it runs
    act = plat.pipeline_action_s if plan.pp > 1 else 0.0
    pieces = 3 if sched.split_backward else 2  # actions per micro-batch and stage
    f_s, b_s = [0.0] * S, [0.0] * S
    ig_s: list[float] | None = [0.0] * S if sched.split_backward else None
    for r in range(P):
        for s in stages_of[r]:
            f_s[s] = stage_f[s] + share[r] / 2 + act
            b_s[s] = stage_b[s] + stage_r[s] + share[r] / 2 + (pieces - 1) * act
            if ig_s is not None:  # the simulator's default split (half each), each piece with its own action
                ig_s[s] = (b_s[s] - 2 * act) / 2 + act
    bare = simulate(sched, StageCosts(fwd_s=f_s, bwd_s=b_s, igrad_s=ig_s))
    p2p_total = [0.0] * P
    makespan = bare.makespan_s
    if plan.pp > 1:
        bw, alpha = link(plat, plan.tp * plan.cp * max(plan.dp, 1), plan.pp)
        # a measured blocking receive (gloo on a CPU): the transfer runs on the receiver's clock
        lk = Link(bandwidth_Bps=bw if bw > 0 else math.inf, latency_s=alpha, blocking=plat.p2p_recv_s > 0,
                  busy_latency_s=plat.p2p_recv_s, send_s=plat.p2p_send_s)
        if bw <= 0:
            raise UserError("the platform has no link bandwidth for the pipeline's sends; give a preset or a "
                            "platform file with intra_node_bytes_per_s / inter_node_bytes_per_s")
        makespan = simulate(sched, StageCosts(fwd_s=f_s, bwd_s=b_s, igrad_s=ig_s,
                                              boundary_bytes=mem["boundary_bytes"]), link=lk).makespan_s
        for r in range(P):
            for a in sched.actions[r]:
                if a.kind in (SEND_F, SEND_B):  # a forward send carries its stage's output, a backward one
                    s = a.stage if a.kind == SEND_F else a.stage - 1  # the gradient of the previous stage's
                    p2p_total[r] += lk.time(mem["boundary_bytes"][s]) + (lk.send_s if lk.blocking else 0.0)
    out = []
    for r in range(P):
        mine = stages_of[r]
        t = StepSeconds()
        t.compute = sum(passes[r][s] * (stage_f[s] + stage_b[s] + pieces * act) for s in mine)
        t.recompute = sum(passes[r][s] * stage_r[s] for s in mine)
        t.bubble = max(bare.makespan_s - bare.busy_s[r], 0.0)
        t.comm_s = dict(comm_s[r])
        window = {0: sum(stage_b[s] for s in mine), 2: M * sum(stage_b[s] for s in mine)}.get(plan.zero, 0.0) \
            if plan.pp == 1 else 0.0
        t.comm_exposed_s = {k: _exposed(k, v, plat, plan, window, parts[r]["params"], M, units,
                                        sum(f_s[s] for s in mine), sum(b_s[s] for s in mine), kept)
                            for k, v in comm_s[r].items()}
        if plan.pp > 1:
            t.comm_s["p2p"] = p2p_total[r]
            t.comm_exposed_s["p2p"] = makespan - bare.makespan_s
        opt_params = parts[r]["params"] / (_shards(plan) if plan.zero in (1, 2) else 1)
        t.optimizer = _optimizer_seconds(plat, plan, opt_params, parts[r]["optimizer"])
        t.data = b * M * plat.data_seconds_per_sample  # every rank iterates the loader for its micro-batches
        t.host = host_time(plat, plan, sum(passes[r].values()) if plan.pp > 1 else M)
        _offload(t, plan, plat, mem=mem, stages=mine, M=M, params=opt_params, states=parts[r]["optimizer"])
        out.append(t)
    return out


def host_time(plat: Platform, plan: Any, micro_batches: int) -> float:
    """The trainer's host work of one step (``Platform.host_seconds``, measured): the row of the plan's ZeRO
    stage, per step plus per micro-batch. Without a pipeline, ZeRO 0-2 as measured. A pipeline or ZeRO-3:
    only stage 0's per-step part (the loop's bookkeeping, clipping, the scheduler: the same trainer code),
    because their per-micro-batch and per-collective work is priced where it runs (the pipeline simulator's
    per-action time; FSDP2's ``fsdp_collective_overhead_s``). ``micro_batches``: this rank's forward passes."""
    rows = {z: (a, c) for z, a, c in plat.host_seconds}
    if not rows:
        return 0.0
    if plan.pp == 1 and plan.zero in rows:
        a, c = rows[plan.zero]
        return a + c * micro_batches
    return rows.get(0, (0.0, 0.0))[0]


def _shards(plan: Any) -> int:
    """Ranks one ZeRO shard group spans (as :func:`.plan_cost._shard_zero`)."""
    return plan.hsdp or max(plan.dp, 1) * (plan.cp if plan.pp == 1 else 1)


def _exposed(kind: str, seconds: float, plat: Platform, plan: Any, window: float, param_bytes: float, M: int,
             units: list[float], fwd: float, bwd: float, kept: list[bool] | None = None) -> float:
    """Seconds of a collective kind the step waits for (the overlap rules of the module docstring).
    ZeRO-3: ``units`` the bytes of each gather unit (its collectives per micro-batch share the kind's
    seconds by bytes: gather, reduce-scatter, and the backward's gather unless ``kept``), ``fwd`` /
    ``bwd`` one micro-batch's compute, spread evenly over the units."""
    if kind != "dp" or not plat.copy_overlaps_compute or plan.pp > 1 or plan.zero == 1:
        return seconds
    if plan.zero == 3:
        n, kept = len(units), kept or [False] * len(units)
        moved = sum(u * (2 if k else 3) for u, k in zip(units, kept)) or 1.0  # bytes behind ``seconds``
        one = [seconds / M * u / moved for u in units]
        again = [0.0 if k else o for o, k in zip(one, kept)]
        return M * exposed_seconds(*prefetch_windows(one, one, [fwd / n] * n, [bwd / n] * n, again))
    buckets = max(1, math.ceil(param_bytes / (plan.bucket_mb * 2**20)))
    issued = {0: buckets, 2: (M + 1) * buckets}[plan.zero]
    last = min(seconds / issued, seconds)  # the last starts when the backward ends
    return exposed_seconds([seconds, last], [window, 0.0])


def _optimizer_seconds(plat: Platform, plan: Any, params: float, states: float) -> float:
    """The device optimizer step over ``params`` bytes of parameters holding ``states`` bytes of states
    (masters included): the planner's bytes per parameter, memory-bound."""
    from scaletrain.techniques.optim.registry import optimizer_step_bytes

    n = params / (4 if plan.params_dtype == "fp32" else 2)  # parameters updated
    return optimizer_seconds(plat, n * optimizer_step_bytes(plan.optimizer, states / n if n else 0.0)) if n else 0.0


def _offload(t: StepSeconds, plan: Any, plat: Platform, *, mem: dict, stages: list[int], M: int, params: float,
             states: float) -> None:
    """Host and disk copies of the plan's offloading into ``t`` (module docstring)."""
    o = plan.offload
    copies: dict[str, float] = {}
    hideable: dict[str, float] = {}
    if o.optimizer in ("host", "disk"):
        copies["d2h"] = plat.d2h_time(params)  # each rank its own shard: fp32 gradients down, parameters up
        copies["h2d"] = plat.h2d_time(params)
        copies["cpu_update"] = params / 4 / plat.cpu_adam_params_per_s
        t.optimizer = 0.0  # the update runs on the host
        if o.optimizer == "disk":
            copies["disk_read"] = states / plat.disk_read_bytes_per_s
            copies["disk_write"] = states / plat.disk_write_bytes_per_s
        if o.dpu:
            hideable["cpu_update"] = copies["cpu_update"]
    if o.activations != "none":
        act = M * sum(mem["act_bytes"][s] for s in stages)
        copies["d2h"] = copies.get("d2h", 0.0) + plat.d2h_time(act)
        copies["h2d"] = copies.get("h2d", 0.0) + plat.h2d_time(act)
        if plat.copy_overlaps_compute:
            hideable["d2h"], hideable["h2d"] = plat.d2h_time(act), plat.h2d_time(act)
    if o.params == "host":
        w = 2 * M * sum(mem["weight_bytes"][s] for s in stages)
        copies["h2d"] = copies.get("h2d", 0.0) + plat.h2d_time(w)
        if plat.copy_overlaps_compute:
            hideable["h2d"] = hideable.get("h2d", 0.0) + plat.h2d_time(w)
    budget = t.compute + t.recompute  # what the hideable copies can run beside
    exposed = {}
    for k, v in copies.items():
        h = min(hideable.get(k, 0.0), budget)
        budget -= h
        exposed[k] = v - h
    t.copies_s, t.copies_exposed_s = copies, exposed
