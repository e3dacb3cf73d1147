"""Cost faces composed for a plan, and the seconds of a step by phase (:class:`StepSeconds`).

:func:`mesh_predictions` — bytes received per rank per optimizer step and per-rank model-state
bytes of a run on a model-parallel mesh (TP / CP / EP x DP with ZeRO 0-2), from the families'
cost faces: ``tp_comm_bytes_per_step``, ``cp_comm_bytes_per_step``, ``ep_comm_bytes_per_step`` and
ZeRO's ``comm_bytes_per_step`` / ``model_state_bytes`` on the local parameter counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from scaletrain.models.spec import moe_layers
from scaletrain.techniques.mesh import has_moe


@dataclass
class StepSeconds:
    """One rank's seconds of one optimizer step, by phase: the time half of a rank's cost
    (:class:`scaletrain.techniques.plan_cost.RankCost` holds it beside the bytes), priced by
    :mod:`scaletrain.techniques.time_cost`. Every field is seconds per optimizer step;
    :attr:`step_s` is the sum of the exposed phases."""

    compute: float = 0.0
    """Forward and backward of every micro-batch on the rank's blocks (the loss included on the last stage)."""
    recompute: float = 0.0
    """Forwards replayed by rematerialization (whole blocks, or the attention core under selective recompute)."""
    comm_s: dict[str, float] = field(default_factory=dict)
    """Every collective kind's whole time (alpha-beta), hidden or not: tp, cp, ep, dp, norm, p2p."""
    comm_exposed_s: dict[str, float] = field(default_factory=dict)
    """The part of each kind the step waits for (the overlap rules of :mod:`.time_cost`)."""
    bubble: float = 0.0
    """Pipeline idle time (the schedule simulator's makespan minus this rank's busy time)."""
    copies_s: dict[str, float] = field(default_factory=dict)
    """Offload copies' whole time: h2d, d2h, disk_read, disk_write, cpu_update."""
    copies_exposed_s: dict[str, float] = field(default_factory=dict)
    """The part of each copy the step waits for."""
    optimizer: float = 0.0
    """The device optimizer step over the rank's (sharded) parameters."""
    data: float = 0.0
    """The input pipeline: the trainer fetches each micro-batch on the rank's host before its forward,
    not overlapped (``Platform.data_seconds_per_sample`` x the rank's samples; 0 where not measured)."""
    host: float = 0.0
    """The trainer's host work beyond every other phase (loop bookkeeping, clipping's Python, DDP's and
    ZeRO-1/2's bucket copies and hooks, the runtime's Python per micro-batch): ``Platform.host_seconds``'
    row for the plan's ZeRO stage, per step plus per micro-batch (0 where not measured: the presets)."""

    @property
    def step_s(self) -> float:
        """Seconds of the rank's step: compute + recompute + exposed communication + bubble + exposed
        copies + optimizer + data + host."""
        return (self.compute + self.recompute + sum(self.comm_exposed_s.values()) + self.bubble
                + sum(self.copies_exposed_s.values()) + self.optimizer + self.data + self.host)

    def to_dict(self) -> dict[str, Any]:
        return {"compute": self.compute, "recompute": self.recompute, "comm": dict(self.comm_s),
                "comm_exposed": dict(self.comm_exposed_s), "bubble": self.bubble, "copies": dict(self.copies_s),
                "copies_exposed": dict(self.copies_exposed_s), "optimizer": self.optimizer, "data": self.data,
                "host": self.host, "step": self.step_s}



def local_param_counts(model: nn.Module, *, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """Parameter elements one rank holds, split into dense (replicated over dp x cp) and expert
    ones (over dp/ep x cp), from the cost faces: ``tp_param_elements`` / ``ep_param_elements``.
    Call on the unsharded model."""
    if tp > 1 and has_moe(model):  # attention TP-split; a MoE layer's MLP whole on every TP rank
        from scaletrain.techniques.experts import ep_param_elements, expert_param_ids
        from scaletrain.techniques.tensor_parallel import tp_param_elements

        cfg = model.config
        h, n_moe = cfg.n_embd, cfg.n_layer // cfg.moe_every
        # tp_param_elements counts a dense MLP per layer: c_fc 4h^2+4h and c_proj 4h^2 sharded, c_proj's
        # bias h replicated — the MoE layers have none of it
        dense = tp_param_elements(cfg, tp)["total"] - n_moe * ((8 * h * h + 4 * h) // tp + h)
        moe = moe_layers(model)
        experts = expert_param_ids(model)
        router = sum(q.numel() for m in moe for q in m.parameters() if id(q) not in experts)
        n = ep_param_elements(model, ep)
        if ep > 1:
            return {"dense": dense + router, "expert": n["experts"]}
        return {"dense": dense + router + n["experts"], "expert": 0}
    if tp > 1:
        from scaletrain.techniques.tensor_parallel import tp_param_elements

        return {"dense": tp_param_elements(model.config, tp)["total"], "expert": 0}
    if has_moe(model):
        from scaletrain.techniques.experts import ep_param_elements

        n = ep_param_elements(model, ep)
        return {"dense": n["other"], "expert": n["experts"]}
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            n += p.numel()
    return {"dense": n, "expert": 0}


def mesh_predictions(cfg: Any, il: Any, *, stage: int, micro_batch: int, accum: int, seq: int, counts: dict[str, int],
                     grad_clip: bool, world: int,
                     optim: tuple[str, list[tuple[int, ...]], dict[str, Any]] | None = None,
                     act_bytes: int = 4, recomputes: list[int] | None = None, kept: float = 0.0) -> dict[str, float]:
    """Bytes received per rank per optimizer step and per-rank model-state bytes (fp32), from the
    cost faces (module docstring). ``micro_batch``: samples per data-parallel rank and micro-batch.
    ``recomputes``: extra forwards of each Chain block per micro-batch (rematerialization), whose
    tensor-parallel collectives are replayed in the backward. ``kept``: ZeRO-3's parameter elements
    gathered once a micro-batch (:func:`.data_parallel.fsdp.kept_elements`)."""
    from scaletrain.techniques.data_parallel import cost as zero_mod

    kinds = {"tp": 0.0, "cp": 0.0, "ep": 0.0}  # the intra-layer bytes by collective family
    if il.tp > 1:
        from scaletrain.techniques.tensor_parallel import tp_comm_bytes_per_step
        from scaletrain.techniques.tensor_parallel.cost import tp_forward_bytes_per_block

        s_tp = seq // il.cp  # under CP each rank holds seq / cp tokens
        every = getattr(cfg, "moe_every", 0)
        moe = frozenset(i for i in range(cfg.n_layer) if every and (i + 1) % every == 0)
        kinds["tp"] += tp_comm_bytes_per_step(cfg, il.tp, micro_batch, s_tp, sequence_parallel=il.sequence_parallel,
                                        act_bytes=act_bytes, micro_batches=accum, moe_layers=len(moe))["wire_bytes"]
        if recomputes:
            fwd = tp_forward_bytes_per_block(cfg, il.tp, micro_batch, s_tp, sequence_parallel=il.sequence_parallel,
                                             act_bytes=act_bytes, moe_blocks=moe)
            kinds["tp"] += accum * sum(k * b for k, b in zip(recomputes, fwd))
    if il.cp > 1:
        from scaletrain.techniques.context_parallel import cp_comm_bytes_per_step

        # under TP the ring carries this rank's n_head / tp heads' keys and values: 1 / tp of the bytes
        kinds["cp"] += cp_comm_bytes_per_step(cfg, il.cp, micro_batch, seq, act_bytes=act_bytes,
                                        micro_batches=accum)["total"] / il.tp
    n_moe = cfg.n_layer // cfg.moe_every if hasattr(cfg, "moe_every") else 0
    if n_moe and (il.ep > 1 or il.cp > 1):
        from scaletrain.techniques.experts import ep_comm_bytes_per_step

        e = ep_comm_bytes_per_step(n_moe, micro_batch * (seq // il.cp), cfg.n_embd, cfg.n_experts, cfg.top_k,
                                   cfg.capacity_factor, il.ep, act_bytes=act_bytes)
        a2a = (il.ep - 1) / il.ep * e["all_to_all"]["payload_bytes"]
        G = il.dp * il.cp  # the load-balancing statistics are shared by all dp x cp ranks
        kinds["ep"] += accum * (a2a + 2 * (G - 1) / G * e["all_reduce"]["payload_bytes"])
    D, E = il.dp * il.cp, il.dp // il.ep * il.cp
    H = il.hsdp * il.cp if il.hsdp else 0  # HSDP: dense states sharded within dp_in (x cp), all-reduced across dp_rep
    grads = (zero_mod.comm_bytes_per_step(counts["dense"], stage, D, accum=accum, kept=kept if stage == 3 else 0.0,
                                          hsdp=H)
             + (zero_mod.comm_bytes_per_step(counts["expert"], stage, E, accum=accum) if counts["expert"] else 0.0))
    norm = 2 * (world - 1) / world * 8 if grad_clip else 0.0
    intra = kinds["tp"] + kinds["cp"] + kinds["ep"]
    out: dict[str, Any] = {"comm_bytes_by_kind": {**kinds, "dp": grads, "norm": norm},  # not a metric
           "predicted_comm_bytes": intra + grads + norm, "predicted_comm_bytes_intra_layer": intra,
           "predicted_comm_bytes_gradients": grads}
    if optim is not None:
        from scaletrain.techniques.optim import state_bytes

        name, shapes, hyper = optim
        ms_d = zero_mod.model_state_bytes(counts["dense"], stage, H or D, optim_state_bytes=0.0)
        ms_e = zero_mod.model_state_bytes(counts["expert"], stage, E, optim_state_bytes=0.0)
        opt = float(state_bytes(name, shapes, **hyper))
        out["predicted_model_state_bytes"] = ms_d.params + ms_d.grads + ms_e.params + ms_e.grads + opt
    return out


@dataclass
class MeshShape:
    """What :func:`mesh_predictions` reads of a mesh (the plan's degrees)."""

    plan: Any

    def __getattr__(self, k: str) -> Any:
        p = object.__getattribute__(self, "plan")
        return {"dp": max(p.dp, 1), "tp": p.tp, "cp": p.cp, "ep": p.ep, "sequence_parallel": p.sp,
                "hsdp": p.hsdp if p.zero and p.ep == 1 else 0}[k]
