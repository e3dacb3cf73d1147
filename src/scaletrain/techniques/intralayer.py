"""Compose the intra-layer techniques with data parallelism on one DeviceMesh — the trainer's entry.

Mesh dims, outermost first: ``("dp_rep", "ep", "cp", "tp")`` with ``dp = dp_rep · ep``. TP is
innermost so that its ranks are neighbours (the fastest links: Megatron's placement); EP splits the
data-parallel ranks (each EP rank has its own tokens); CP ranks share a batch and split its
sequence. World = dp · cp · tp.

Who averages what (each rank's loss is the mean over its own tokens, all ranks hold equally many):

- replicated parameters (everything but experts; TP shards included — a TP shard is replicated
  over dp × cp): mean over the ``dp × cp`` group;
- expert parameters: each already sums its EP group's tokens' contributions, so sum over the ranks
  holding the same experts (``dp_rep × cp``) and divide by ``dp · cp``.

:meth:`IntraLayer.reduce_gradients` does both with one flat all-reduce per group (the ZeRO-0 path);
a ZeRO / DDP strategy can instead use :attr:`IntraLayer.grad_group` and
:func:`scaletrain.techniques.experts.expert_params`, working on ``p.to_local()`` of DTensor
parameters. Not composed here: TP with CP or EP (both replace the attention / MLP forward that TP
also replaces) — a UserError says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from scaletrain.errors import ConfigError, UserError

MESH_DIMS = ("dp_rep", "ep", "cp", "tp")


@dataclass
class IntraLayer:
    """What :func:`setup_intralayer` built: the mesh, the groups and the per-step helpers."""

    mesh: DeviceMesh
    dp: int
    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    dp_rank: int
    """This rank's index among the data-parallel ranks: the data loader's ``rank``."""
    dp_group: dist.ProcessGroup
    grad_group: dist.ProcessGroup
    """dp × cp: the group replicated parameters' gradients are averaged over."""
    expert_grad_group: dist.ProcessGroup
    """dp_rep × cp: the ranks holding the same experts."""

    # -------------------------------------------------------------- per micro-batch
    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a data-parallel batch: under CP its tokens in the balanced layout."""
        if self.cp == 1:
            return x, y
        from scaletrain.techniques.context_parallel import shard_sequence

        r = self.mesh["cp"].get_local_rank()
        return shard_sequence(x, r, self.cp), shard_sequence(y, r, self.cp)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Wrap the loss's forward and backward (``loss_parallel`` under TP)."""
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss(self, model: nn.Module, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy (vocabulary-parallel under TP) plus the model's MoE auxiliary
        loss when it has one. Call inside :meth:`loss_context`."""
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        aux = getattr(model, "aux_loss", None)
        if callable(aux):
            loss = loss + aux()
        return loss

    def reduce_gradients(self, model: nn.Module) -> None:
        """Data-parallel reduction of all gradients (see the module docstring)."""
        from scaletrain.techniques.experts import expert_params

        D = dist.get_world_size(self.grad_group)
        experts = {id(p) for p in expert_params(model)}
        dense, sparse = [], []
        for p in model.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            (sparse if id(p) in experts else dense).append(g)
        for grads, group in ((dense, self.grad_group), (sparse, self.expert_grad_group)):
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            flat /= D
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip the global L2 gradient norm (after :meth:`reduce_gradients`); return it.

        Under TP the parameters are DTensors and ``clip_grad_norm_`` sums their shards' squares
        over the TP group itself. Under EP each rank holds other experts: their squared norms are
        summed over the EP group, so every rank clips by the same factor (a rank-local norm would
        let the replicated parameters drift apart).
        """
        params = [p for p in model.parameters() if p.grad is not None]
        if self.tp > 1:
            return float(nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
        from scaletrain.techniques.experts import expert_params

        experts = {id(p) for p in expert_params(model)}
        dense_sq = sum((p.grad.double().pow(2).sum() for p in params if id(p) not in experts), torch.zeros((),
                                                                                                  dtype=torch.float64))
        expert_sq = sum((p.grad.double().pow(2).sum() for p in params if id(p) in experts),
                        torch.zeros((), dtype=torch.float64))
        if self.ep > 1:
            dist.all_reduce(expert_sq, group=self.mesh["ep"].get_group())
        norm = float((dense_sq + expert_sq).sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

    def mean(self, value: float | torch.Tensor) -> float:
        """Average a logged scalar (e.g. the loss) over dp × cp."""
        if isinstance(value, DTensor):
            value = value.full_tensor()
        t = torch.as_tensor(float(value), dtype=torch.float64)
        dist.all_reduce(t, group=self.grad_group)
        return float(t) / dist.get_world_size(self.grad_group)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Single-device state dict (collective over the whole mesh)."""
        if self.tp > 1:
            from scaletrain.techniques.tensor_parallel import full_state_dict

            return full_state_dict(model)
        if self.ep > 1 or self.cp > 1:
            from scaletrain.techniques.experts import gather_expert_state

            return gather_expert_state(model, self.mesh["ep"])
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def setup_intralayer(model: nn.Module, *, tp: int = 1, cp: int = 1, ep: int = 1, sequence_parallel: bool = False,
                     world: int | None = None, device_type: str = "cpu") -> IntraLayer:
    """Build the (dp_rep, ep, cp, tp) mesh over the initialised process group and apply TP (+SP),
    CP and EP to ``model`` in place. Every rank must pass the same initial weights."""
    world = world or dist.get_world_size()
    for name, v in (("tp", tp), ("cp", cp), ("ep", ep)):
        if v < 1:
            raise UserError(f"parallel.{name}={v} is not allowed; must be >= 1")
    if world % (tp * cp):
        raise UserError(f"parallel.tp={tp} x parallel.cp={cp} must divide the {world} processes")
    dp = world // (tp * cp)
    if dp % ep:
        raise UserError(f"parallel.ep={ep} must divide the data-parallel size {dp} (= {world} processes / (tp x cp))")
    if tp > 1 and (cp > 1 or ep > 1):
        raise UserError("parallel.tp > 1 cannot be combined with parallel.cp or parallel.ep yet; allowed: tp with dp, "
                        "or cp and/or ep with dp")
    if sequence_parallel and tp == 1:
        raise UserError("parallel.sequence_parallel needs parallel.tp > 1")
    mesh = init_device_mesh(device_type, (dp // ep, ep, cp, tp), mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["dp_rep", "ep"]._flatten("dp")
    grad_mesh = mesh["dp_rep", "ep", "cp"]._flatten("dp_cp")
    expert_mesh = mesh["dp_rep", "cp"]._flatten("edp_cp")
    if tp > 1:
        from scaletrain.techniques.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
    if cp > 1:
        from scaletrain.techniques.context_parallel import apply_context_parallel

        apply_context_parallel(model, mesh["cp"])
    if ep > 1 or (cp > 1 and _has_moe(model)):
        from scaletrain.techniques.experts import apply_expert_parallel

        # load-balancing statistics over all dp x cp ranks: the global batch's auxiliary loss
        apply_expert_parallel(model, mesh["ep"], aux_group=grad_mesh.get_group())
    return IntraLayer(mesh, dp, tp, cp, ep, sequence_parallel, dp_mesh.get_local_rank(), dp_mesh.get_group(),
                      grad_mesh.get_group(), expert_mesh.get_group())


def _has_moe(model: nn.Module) -> bool:
    from scaletrain.models.moe import MoEFeedForward

    return any(isinstance(m, MoEFeedForward) for m in model.modules())


def describe(il: IntraLayer) -> str:
    parts = [f"dp={il.dp}"]
    parts += [f"{k}={v}" for k, v in (("tp", il.tp), ("cp", il.cp), ("ep", il.ep)) if v > 1]
    if il.sequence_parallel:
        parts.append("sequence parallel")
    return "mesh " + " x ".join(parts)


# --------------------------------------------------------------------------- configuration


def check_config(cfg: Any, model: nn.Module, world: int) -> None:
    """Every conflict of ``parallel.tp/sequence_parallel/cp/ep`` with the rest of the config, as
    one-line ConfigErrors naming the key and what is allowed (before any group is built)."""
    p = cfg.parallel
    tp, cp, ep = p.tp, p.cp, p.ep
    if p.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1; allowed with tp=1: false")
    if tp > 1 and (cp > 1 or ep > 1):
        raise ConfigError(f"parallel.tp={tp} cannot be combined with parallel.cp={cp} / parallel.ep={ep} yet; "
                          f"allowed: tp with dp, or cp and/or ep with dp")
    if p.zero not in (0, 1, 2):
        raise ConfigError(f"parallel.zero={p.zero} is not supported with parallel.tp/cp/ep; allowed: 0, 1, 2")
    if p.hsdp or p.compression != "none":
        raise ConfigError(f"parallel.hsdp={p.hsdp} / parallel.compression={p.compression} are not supported with "
                          f"parallel.tp/cp/ep; allowed: hsdp=0, compression=none")
    if cfg.train.precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision={cfg.train.precision} is not supported with parallel.tp/cp/ep (the fp16 "
                          f"loss scaler is not sharding-aware); allowed: fp32, bf16")
    mem = cfg.memory
    if mem.remat.method != "none" or mem.activation_compression:
        raise ConfigError(f"memory.remat.method={mem.remat.method} / memory.activation_compression="
                          f"{str(mem.activation_compression).lower()} are not supported with parallel.tp/cp/ep yet; "
                          f"allowed: none / false")
    from scaletrain.train.config import OffloadConfig

    if mem.offload != OffloadConfig() or mem.device_budget:
        raise ConfigError("memory.offload / memory.device_budget are not supported with parallel.tp/cp/ep yet; "
                          "allowed: the defaults")
    if getattr(model, "task", "lm") != "lm" or not hasattr(model, "config") or not hasattr(model, "h"):
        raise ConfigError(f"parallel.tp/cp/ep need a GPT-2-style language model (e.g. model.name=gpt2-tiny or "
                          f"gpt2-moe); got {type(model).__name__}")
    moe = _has_moe(model)
    if ep > 1 and not moe:
        raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model (model.name=gpt2-moe); "
                          f"{type(model).__name__} has no experts")
    if tp > 1 and moe:
        raise ConfigError(f"parallel.tp={tp} splits dense MLPs; {type(model).__name__} has mixture-of-experts "
                          f"layers: use parallel.ep instead")
    c = model.config
    if tp > 1 and getattr(c, "dropout", 0.0) > 0:
        # every rank seeds its own RNG (trainer: seed + rank), so dropout masks would differ inside
        # a TP group and the activations DTensor treats as Replicate would silently diverge
        raise ConfigError(f"parallel.tp={tp} with model dropout={c.dropout} is not supported yet (each rank draws "
                          f"its own dropout masks, so a TP group's replicated activations would differ); allowed: "
                          f"model.overrides.dropout=0")
    if tp > 1:
        for key, v in (("n_head", c.n_head), ("vocab_size", c.vocab_size)):
            if v % tp:
                raise ConfigError(f"parallel.tp={tp} must divide the model's {key}={v}; allowed tp: "
                                  f"{', '.join(str(d) for d in range(1, v + 1) if v % d == 0 and d <= world)}")
    if cp > 1:
        seq = cfg.data.seq_len
        if seq % (2 * cp):
            raise ConfigError(f"parallel.cp={cp} needs data.seq_len={seq} to be a multiple of 2 x cp = {2 * cp} "
                              f"(the balanced causal layout cuts it into 2 x cp chunks)")
        if getattr(c, "dropout", 0.0) > 0:
            raise ConfigError(f"parallel.cp={cp} (ring attention) does not implement dropout; model dropout="
                              f"{c.dropout}, allowed: 0 (model.overrides.dropout=0)")
    dp = world // (tp * cp)
    if dp % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the data-parallel size {dp} (= {world} processes / "
                          f"(tp={tp} x cp={cp}))")
    if moe and ep > 1:
        n_exp = c.n_experts
        if n_exp % ep:
            raise ConfigError(f"parallel.ep={ep} must divide the number of experts ({n_exp}, "
                              f"model.overrides.n_experts)")


# --------------------------------------------------------------------------- cost face


def local_param_counts(model: nn.Module, *, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """Parameter elements one rank holds, split into dense (replicated over dp x cp) and expert
    ones (over dp/ep x cp), from the cost faces: ``tp_param_elements`` / ``ep_param_elements``.
    Call on the unsharded model."""
    if tp > 1:
        from scaletrain.techniques.tensor_parallel import tp_param_elements

        return {"dense": tp_param_elements(model.config, tp)["total"], "expert": 0}
    if _has_moe(model):
        from scaletrain.techniques.experts import ep_param_elements

        n = ep_param_elements(model, ep)
        return {"dense": n["other"], "expert": n["experts"]}
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            n += p.numel()
    return {"dense": n, "expert": 0}


def predict(cfg: Any, il: Any, *, stage: int, micro_batch: int, accum: int, seq: int, counts: dict[str, int],
            grad_clip: bool, world: int, optim: tuple[str, list[tuple[int, ...]], dict[str, Any]] | None = None,
            act_bytes: int = 4) -> dict[str, float]:
    """Bytes received per rank per optimizer step and per-rank model-state bytes (fp32), from the
    cost faces (module docstring). ``micro_batch``: samples per data-parallel rank and micro-batch."""
    from scaletrain.techniques.data_parallel import cost as zero_mod

    intra = 0.0
    if il.tp > 1:
        from scaletrain.techniques.tensor_parallel import tp_comm_bytes_per_step

        intra += tp_comm_bytes_per_step(cfg, il.tp, micro_batch, seq, sequence_parallel=il.sequence_parallel,
                                        act_bytes=act_bytes, micro_batches=accum)["wire_bytes"]
    if il.cp > 1:
        from scaletrain.techniques.context_parallel import cp_comm_bytes_per_step

        intra += cp_comm_bytes_per_step(cfg, il.cp, micro_batch, seq, act_bytes=act_bytes,
                                        micro_batches=accum)["total"]
    n_moe = cfg.n_layer // cfg.moe_every if hasattr(cfg, "moe_every") else 0
    if n_moe and (il.ep > 1 or il.cp > 1):
        from scaletrain.techniques.experts import ep_comm_bytes_per_step

        e = ep_comm_bytes_per_step(n_moe, micro_batch * (seq // il.cp), cfg.n_embd, cfg.n_experts, cfg.top_k,
                                   cfg.capacity_factor, il.ep, act_bytes=act_bytes)
        a2a = (il.ep - 1) / il.ep * e["all_to_all"]["payload_bytes"]
        G = il.dp * il.cp  # the load-balancing statistics are shared by all dp x cp ranks
        intra += accum * (a2a + 2 * (G - 1) / G * e["all_reduce"]["payload_bytes"])
    D, E = il.dp * il.cp, il.dp // il.ep * il.cp
    grads = (zero_mod.comm_bytes_per_step(counts["dense"], stage, D, accum=accum)
             + (zero_mod.comm_bytes_per_step(counts["expert"], stage, E, accum=accum) if counts["expert"] else 0.0))
    norm = 2 * (world - 1) / world * 8 if grad_clip else 0.0
    out = {"predicted_comm_bytes": intra + grads + norm, "predicted_comm_bytes_intra_layer": intra,
           "predicted_comm_bytes_gradients": grads}
    if optim is not None:
        from scaletrain.techniques.optim import state_bytes

        name, shapes, hyper = optim
        ms_d = zero_mod.model_state_bytes(counts["dense"], stage, D, optim_state_bytes=0.0)
        ms_e = zero_mod.model_state_bytes(counts["expert"], stage, E, optim_state_bytes=0.0)
        opt = float(state_bytes(name, shapes, **hyper))
        out["predicted_model_state_bytes"] = ms_d.params + ms_d.grads + ms_e.params + ms_e.grads + opt
    return out
