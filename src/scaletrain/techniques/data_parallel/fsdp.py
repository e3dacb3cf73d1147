"""ZeRO stage 3 with torch's FSDP2 ``fully_shard``, on any data-parallel mesh: :class:`FSDPSync`.

Groups of consecutive Chain blocks whose parameters no other block uses (``parallel.fsdp_group``:
one group per block, up to a size, or ``auto``: the size :func:`.cost.fsdp_group_limit` prices
fastest — fewer groups pay fewer collectives' latency, larger ones hold more unsharded bytes and
expose more of their first gather; the runtime and the planner fit it to the rank's memory first,
:mod:`.grouping`), then the root — what runs the
forward (the model, or its blocks under nested checkpoints) — which takes shared ones such as
GPT-2's tied embedding. Parameters are sharded DTensors, all-gathered before a block runs and freed
after it, in forward and again in backward (``reshard_after_forward=True``: ZeRO-3's 3 Psi of traffic) —
except the units whose backward runs first, the root and the last group (torchtitan's choice; fully_shard's
default for the root): freed after forward they would be gathered again at once, so they stay whole from
their forward into their backward, one all-gather a micro-batch (:func:`kept_elements`; without TP/EP,
where the cost faces count it), and a single group is the root's own unit (one set of hooks, as one-group
``fully_shard``: the per-module hooks of a grouped unit cost ~5 % of a small step on gloo); gradients
are reduce-scattered per block; the next block's all-gather is prefetched explicitly in both
directions. With a 2-D data-parallel mesh (replicate x shard) this is HSDP. Applied *after* tensor
parallelism (torchtitan's 2-D: ``parallelize_module`` on the TP mesh, then ``fully_shard`` on the
data-parallel mesh of the same device mesh), every parameter becomes a DTensor over both dims.

The runtime (:class:`~scaletrain.techniques.spmd.MeshRuntime`) sees the same face as
:class:`~.zero.GradSync`: the optimizer updates *proxies* — plain tensors sharing storage with each
parameter's local shard — so every scaletrain optimizer runs unchanged; the norm counts each element
once (a shard replicated over TP counts 1/tp, over HSDP replicas 1/replicas); state dicts go through
DTensor (``full_tensor`` / ``distribute_tensor``), so checkpoints are the single-process layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from scaletrain.measure.comm import ledger_owned


def block_groups(blocks: list[nn.Module], setting: str, dp: int, accum: int, device_type: str) -> list[list[nn.Module]]:
    """``blocks`` (:func:`shardable_blocks`) merged into consecutive FSDP groups as ``parallel.fsdp_group``
    says (:func:`.cost.fsdp_group_limit`; the bytes are the parameters' storage bytes)."""
    from scaletrain.techniques.data_parallel.cost import fsdp_group_limit, fsdp_groups

    sizes = [float(sum(p.numel() * p.element_size() for p in b.parameters())) for b in blocks]
    limit = fsdp_group_limit(setting, sizes, dp, accum, device_type)
    return [[blocks[i] for i in g] for g in fsdp_groups(sizes, limit)]


def gather_units(model: nn.Module, blocks: list[nn.Module], setting: str, dp: int, accum: int,
                 device_type: str) -> list[float]:
    """Bytes of each unit FSDP gathers at once among ``blocks`` (a Chain's, or a stage's): a group of
    shardable blocks (:func:`block_groups`, as the runtime forms them) or a block left to the root
    (shared parameters). The ZeRO-3 cost faces count them (collectives) and take the largest (peak)."""
    shardable = {id(b) for b in shardable_blocks(model)}
    units = [float(sum(p.numel() * p.element_size() for p in b.parameters())) for b in blocks
             if id(b) not in shardable]
    mine = [b for b in blocks if id(b) in shardable]
    units += [float(sum(p.numel() * p.element_size() for b in g for p in b.parameters()))
              for g in block_groups(mine, setting, dp, accum, device_type)]
    return units


def block_extras(model: nn.Module, blocks: list[nn.Module], setting: str, dp: int, accum: int,
                 device_type: str) -> tuple[list[float], list[float], float, float] | None:
    """ZeRO-3 with several groups, block by block (fp32; gloo's measured layout): bytes FSDP2 holds beyond
    the shards while each Chain block runs forward and backward, and (``kept``) the root's unsharded
    parameters, gathered at its forward and held to the end of the backward. Returns (forward extras,
    backward extras, the loss's extra, kept), or None with one group (the root's own unit).

    Forward of a block in unit u: the unit whole and unit u + 1's all-gather buffer (prefetch). Backward:
    the unit whole, unit u - 1's all-gather buffer (prefetch), unit u + 1's reduce-scatter input (FSDP2
    holds it until the next reduce-scatter), the root's unsharded gradients (made in the head's backward),
    and with one micro-batch the gradient shards of the units after u (made in this backward). The root's
    own blocks: the last unit, kept from its forward into its backward, and its prefetch at the head;
    unit 0's held reduce-scatter input and every shard at the embedding. Measured: gpt2-mini, per-block
    groups, 2 processes: in block 5's backward the tracker holds block 5, two unit-sized buffers and one
    shard beside the activations."""
    groups = block_groups(shardable_blocks(model), setting, dp, accum, device_type)
    if len(groups) < 2:
        return None
    nbytes = [float(sum(p.numel() * p.element_size() for b in g for p in b.parameters())) for g in groups]
    unit_of = {id(b): u for u, g in enumerate(groups) for b in g}
    grouped = {id(p) for g in groups for b in g for p in b.parameters()}
    kept = float(sum(p.numel() * p.element_size() for p in {id(q): q for q in model.parameters()}.values()
                     if id(p) not in grouped))
    last = len(groups) - 1
    shards = [x / dp if accum == 1 else 0.0 for x in nbytes]
    fwd, bwd, seen = [], [], False
    for b in blocks:
        u = unit_of.get(id(b), unit_of.get(id(getattr(b, "layer", b))))
        if u is not None:
            seen = True
            fwd.append(nbytes[u] + (nbytes[u + 1] if u < last else 0.0))
            bwd.append(nbytes[u] + (nbytes[u - 1] if u > 0 else 0.0) + (nbytes[u + 1] if u < last else 0.0)
                       + kept + sum(shards[u + 1:]))
        elif not seen:  # a root block before the units (embedding): the end of the backward
            fwd.append(nbytes[0])
            bwd.append(nbytes[0] + kept + sum(shards))
        else:  # a root block after them (head): the last unit kept, the one before it prefetched
            fwd.append(nbytes[last])
            bwd.append(nbytes[last] + nbytes[last - 1])
    return fwd, bwd, nbytes[last], kept


def kept_elements(model: nn.Module, setting: str, dp: int, accum: int, device_type: str, padded: bool = False) -> int:
    """Parameter elements ZeRO-3 gathers once a micro-batch instead of twice (not resharded after
    forward): the root's (every parameter outside the shardable groups) and the last group's. The
    traffic faces subtract them from the forward's all-gather. ``padded``: as FSDP2 moves them, each
    tensor's dim 0 padded to a multiple of ``dp`` (what its collectives carry)."""
    from scaletrain.techniques.data_parallel.sharded import shard_rows

    groups = block_groups(shardable_blocks(model), setting, dp, accum, device_type)
    resharded = {id(p) for g in groups[:-1] for b in g for p in b.parameters()}

    def size(p: torch.Tensor) -> int:
        rows = p.shape[0] if p.ndim else 1
        return dp * shard_rows(rows, dp, 0)[0] * (p.numel() // max(rows, 1)) if padded else p.numel()

    return sum(size(p) for p in {id(q): q for q in model.parameters()}.values()
               if p.requires_grad and id(p) not in resharded)


def plan_kept_elements(model: nn.Module, plan: Any, accum: int, device_type: str, padded: bool = False) -> int:
    """:func:`kept_elements` of ``plan`` (a :class:`~scaletrain.plan.Plan`) as the runtime shards it:
    ZeRO-3 outside pipelines, without TP or EP (the runtime keeps the last units only there); else 0."""
    if plan.zero != 3 or plan.pp > 1 or plan.tp > 1 or plan.ep > 1:
        return 0
    return kept_elements(model, plan.fsdp_group, max(plan.dp, 1) * plan.cp, accum, device_type, padded)


def gathered_peak_bytes(model: nn.Module, blocks: list[nn.Module], setting: str, dp: int, accum: int,
                        device_type: str, keep_last: bool = False) -> float:
    """Unsharded bytes ZeRO-3 adds at its backward peak among ``blocks``: the largest unit whole and the
    one before it prefetched (2 G), and the gradients of the block backward is in before the group's
    reduce-scatter (B, and gloo's full copy of that input: 2 B on CPU). Per-block groups give the
    calibrated 4 B (3 B on NCCL); a merged group's earlier gradients appear as its blocks' activations
    are freed, so they do not add to the peak at its first block. ``keep_last`` (the runtime keeps the
    last group, ZeRO-3 without TP/EP) with a single group: the root holds every parameter as one unit,
    gathered once and kept, so the backward's peak has them all unsharded beside all their unsharded
    gradients (2 x the unit); the one reduce-scatter, and gloo's copy, come after the activations are
    freed (measured: gpt2-tiny 2 layers on 2 processes, 8.95 MiB tracked, 9.0 priced)."""
    units = gather_units(model, blocks, setting, dp, accum, device_type)
    if keep_last and len(block_groups(shardable_blocks(model), setting, dp, accum, device_type)) == 1:
        return 2 * sum(units)
    block = max((float(sum(p.numel() * p.element_size() for p in b.parameters())) for b in blocks), default=0.0)
    return 2 * max(units, default=0.0) + (2 if device_type == "cpu" else 1) * block


def shardable_blocks(model: nn.Module) -> list[nn.Module]:
    """Chain blocks that own parameters no other block uses (each becomes one FSDP group)."""
    from scaletrain.chain import to_chain

    try:
        blocks = list(to_chain(model).blocks)
    except Exception:  # noqa: BLE001 - no chain: the root alone is one group
        return []
    # glue a chain adds around a model's layer (HF layers returning tuples, Llama's rotary embedding) is not
    # called by the model's own forward: shard the layer inside it, whose hooks fire on either path
    # (other glue, e.g. a head made of the final norm and the LM head, is left to the root's group)
    in_model = {id(m) for m in model.modules()}
    unwrapped = (getattr(b, "layer", b) if id(b) not in in_model else b for b in blocks)
    blocks = [b2 for b2 in unwrapped if id(b2) in in_model]
    users: dict[int, int] = {}
    for b in blocks:
        for p in b.parameters():
            users[id(p)] = users.get(id(p), 0) + 1
    return [b for b in blocks if any(True for _ in b.parameters())
            and all(users[id(p)] == 1 for p in b.parameters()) and b is not model]


@dataclass
class FSDPEntry:
    """One parameter (a DTensor after ``fully_shard``) and the optimizer's proxy of its local shard."""

    name: str
    param: nn.Parameter
    replicas: int
    proxy: nn.Parameter

    @property
    def local(self) -> torch.Tensor:
        with torch.no_grad():
            return self.param.to_local()  # type: ignore[attr-defined]

    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.local.shape)


class FSDPSync:
    """FSDP2 over ``dp_mesh`` (1-D: ZeRO-3; 2-D replicate x shard: HSDP) of ``model``, rooted at ``root``.

    ``tp_replicas(p)``: how many TP ranks hold the same values as this rank's TP-local tensor of ``p``
    (1 without TP), for the global norm.
    """

    stage = 3

    def __init__(self, model: nn.Module, root: nn.Module, dp_mesh: Any, *, param_dtype: torch.dtype | None = None,
                 tp_replicas: Any = None, prefetch: bool = True, reshard_root: bool = True,
                 group: str = "auto", accum: int = 1, keep_last: bool = True) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.model, self.root, self.param_dtype = model, root, param_dtype
        # ZeRO's mixed precision: compute and communicate in the half dtype, shards stay fp32.
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        self.groups = block_groups(shardable_blocks(model), group, dp_mesh.size(), accum, device_type)
        # by name: fully_shard registers new (DTensor) parameters in place of the module's
        reps = {n: (tp_replicas(p) if tp_replicas is not None else 1) for n, p in model.named_parameters()}
        self.blocks: list[nn.Module] = []
        """The FSDP units in forward order: each group's first block (a group's hooks live on all its
        modules; prefetching the unit means prefetching its first block's state, shared by the group)."""
        self.kept = kept_elements(model, group, dp_mesh.size(), accum, device_type) if keep_last else 0
        """Parameter elements gathered once a micro-batch (the root's and the last group's)."""
        # one group kept whole from forward into backward is the root's own unit: the root takes its
        # parameters (one set of hooks on the root, not one on each of the group's modules)
        units = [] if keep_last and len(self.groups) == 1 else self.groups
        for i, g in enumerate(units):
            last = keep_last and i == len(units) - 1  # its backward runs first: keep it from forward
            fully_shard(g if len(g) > 1 else g[0], mesh=dp_mesh, reshard_after_forward=not last, mp_policy=mp)
            self.blocks.append(g[0])
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard_root and not keep_last, mp_policy=mp)
        if prefetch:
            for i, b in enumerate(self.blocks):
                if i + 1 < len(self.blocks):
                    b.set_modules_to_forward_prefetch([self.blocks[i + 1]])  # type: ignore[operator]
                if i > 0:
                    b.set_modules_to_backward_prefetch([self.blocks[i - 1]])  # type: ignore[operator]
        self.replicate = dp_mesh.size(0) if dp_mesh.ndim == 2 else 1
        """HSDP: the replicas each shard lives on."""
        self.entries: list[FSDPEntry] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.entries.append(FSDPEntry(name, p, reps[name] * self.replicate, nn.Parameter(_local(p))))

    # -------------------------------------------------------------- the step (FSDP's hooks reduce)
    def begin_micro_batch(self, last: bool) -> None:
        """Every micro-batch's gradients are reduce-scattered as backward produces them (FSDP2);
        the reduced shards accumulate across micro-batches."""

    def end_micro_batch(self, last: bool) -> None:
        pass

    def expect_accumulations(self, counts: dict[int, int]) -> None:
        pass

    def prepare_step(self) -> None:
        for e in self.entries:
            local = _shard_of(e.param)
            if local.data_ptr() != e.proxy.data_ptr():  # FSDP re-padded its shard: follow it
                e.proxy.data = local
            g = e.param.grad
            e.proxy.grad = _shard_of(g) if g is not None else torch.zeros_like(e.proxy)

    @torch.no_grad()
    def square_norm(self) -> torch.Tensor:
        """This rank's share of the squared global norm (fp64; sum it over every rank): one ``_foreach_norm``
        per (replicas, dtype) — fp32 for 16-bit gradients, as :func:`.zero.squared_norm` reduces — not 5
        operators a parameter (~380 a step on gpt2-mini, what one-group ``fully_shard``'s clip does not pay)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.entries[0].proxy.device if self.entries else "cpu")
        by: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for e in self.entries:
            g = e.proxy.grad
            if g is not None and g.numel():
                by.setdefault((e.replicas, g.dtype), []).append(g)
        for (replicas, dtype), grads in by.items():
            half = dtype in (torch.float16, torch.bfloat16)
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32 if half else None)
            sq += torch.stack(norms).double().square().sum() / replicas
        return sq

    def scale_grads(self, coef: float) -> None:
        grads = [e.proxy.grad for e in self.entries if e.proxy.grad is not None]
        if grads and coef < 1.0:
            torch._foreach_mul_(grads, coef)

    def after_step(self) -> None:
        pass  # the proxies are the shards: FSDP gathers them at the next forward

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for e in self.entries:
            e.proxy.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return []

    def proxies_for(self, module_params: Iterable[nn.Parameter]) -> dict[int, nn.Parameter]:
        wanted = {id(p) for p in module_params}
        return {id(e.param): e.proxy for e in self.entries if id(e.param) in wanted}

    def close(self) -> None:
        pass

    # -------------------------------------------------------------- state (DTensor does the gathering)
    def full_value(self, e: FSDPEntry) -> torch.Tensor:
        """The parameter's whole (global) value; collective."""
        with ledger_owned():
            return e.param.full_tensor().detach()  # type: ignore[attr-defined]

    def load_value(self, e: FSDPEntry, full: torch.Tensor) -> None:
        with torch.no_grad():
            e.local.copy_(_distribute(e.param, full))

    def state_full(self, e: FSDPEntry, v: torch.Tensor) -> torch.Tensor:
        """A proxy's state tensor (local-shard-shaped) as the whole parameter's; collective."""
        p = e.param
        d = DTensor.from_local(v.to(e.proxy.device), p.device_mesh, p.placements, run_check=False,  # type: ignore[attr-defined]
                               shape=p.shape, stride=p.stride())
        with ledger_owned():
            return d.full_tensor()

    def state_local(self, e: FSDPEntry, full: torch.Tensor) -> torch.Tensor:
        return _distribute(e.param, full).clone()


# gathering a 2-D (FSDP x TP) parameter for a checkpoint takes two all-gathers; torch warns each time
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _shard_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (no ``to_local`` view and autograd node: ~2 operators a parameter a
    step); a plain tensor as it is."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def _local(p: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return p.to_local().detach()  # type: ignore[attr-defined]


def _distribute(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` in ``p``'s DTensor layout."""
    return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()  # type: ignore[attr-defined]
