"""Plan any model the runtime trains: the search over plans priced by the traced cost model.

The analytic planner (:mod:`.cost`, :mod:`.search`) prices decoder shapes on paper; every other model
— VGG, ResNet, an MLP, a mixture of experts, ``hf:gpt2`` / ``hf:bert`` / ``hf:llama`` configs, a
``py:module:factory`` model or an ``nn.Module`` — is priced here by the cost model ``scaletrain
estimate`` uses: the model is built on the meta device (nothing allocated), cut into its Chain of
blocks and traced with fake tensors (:func:`scaletrain.techniques.plan_cost.plan_costs`: each
rank's peak bytes by category, its traffic, and with a platform its step's seconds by phase on the
roofline, α–β collectives and the pipeline simulator of :mod:`scaletrain.techniques.time_cost`).

The space: tp (divisors of a node's devices) × cp (where pinned, ``--fix cp=N``: a model the runtime's ring
attention cannot run is the compatibility table's one line) × pp (divisors of the world, at most one stage per
block; the runtime's cost-balanced split, or equal block counts with ``--fix pp_split=equal``) × ep (MoE models:
divisors of dp and of the experts) × dp × ZeRO 0–3 (0–1 with a pipeline; ZeRO-3's grouping ``parallel.fsdp_group``:
fastest first until one fits, or pinned with ``--fix fsdp_group=…``) × HSDP (ZeRO within one node's dp ranks
when the job spans nodes, or the pinned group) × remat none / selective (attention models) / full ×
sequence parallelism × schedule (1F1B, interleaved, ZB-1P; GPipe — 1F1B's time with more micro-batches
alive — and Chimera — two copies of the weights — when pinned; each priced by the pipeline simulator) ×
micro-batch × offload (none; ``optimizer``: ZeRO-Offload, the fp32 masters, gradients and optimizer
states on the host and the update on the CPU — one process, or ZeRO-1/2 without a pipeline, compat rule
``offload-world``; with full recompute on one process as the offload runtime's ``recompute=all``;
``activations``: every block's saved tensors on the host as well; ``weights``: the parameters streamed
block by block as well, the last two on one process — :func:`.search._offload`). Recomputation only adds
time, so a heavier remat is priced only where the lighter one does not fit; offloading too: the whole space
is searched again with each offload (ranked together) only where no plan fits without it (or when pinned,
``--fix offload=…``); a pipeline that does not fit without it runs the runtime's solver in every stage, each
under its own stage's budget fitted to its rank's slack (:func:`.stage_remat.fit_traced`). What the model cannot
run is pruned by the compatibility table (:mod:`scaletrain.techniques.compat`) with the rule's name;
a plan the cost model cannot price is rejected with the reason it gave. Units: seconds, bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from torch import nn

from scaletrain.errors import UserError
from scaletrain.plan import Plan, RematPlan
from scaletrain.schema import REMAT_KINDS
from scaletrain.planner import stage_remat
from scaletrain.planner.cost import Options, PlanCost
from scaletrain.planner.stages import PIPELINE_REMAT
from scaletrain.platform import Platform
from scaletrain.techniques import compat

MAX_MICRO_BATCH = 64
"""Largest micro-batch searched (each is one fake-tensor trace of the model)."""
REMATS = tuple(REMAT_KINDS)


@dataclass
class Traced:
    """A model as the traced planner sees it: the module (on the meta device) and what the search asks of it."""

    name: str
    model: nn.Module
    blocks: int
    """Blocks of its Chain (embedding and head count as blocks): the most pipeline stages."""
    n_params: int
    positions: int = 0
    """Longest sequence the model takes (0: no limit known, or not a sequence model)."""

    @property
    def layers(self) -> int:
        return self.blocks

    def params(self) -> int:
        return self.n_params

    @classmethod
    def of(cls, model: str | nn.Module, **overrides: Any) -> "Traced":
        """Build ``model`` (a registry name, ``hf:…``, ``py:module:factory`` with config ``overrides``) on
        the meta device, or take an ``nn.Module`` as it is; one-line UserError when it cannot be cut into blocks."""
        from scaletrain.chain import to_chain
        from scaletrain.measure.estimate import resolve_model

        name, module = resolve_model(model, **overrides)
        try:
            blocks = len(to_chain(module))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the one line names what the planner needs
            raise UserError(f"scaletrain plan: {name} cannot be cut into a Chain of blocks, which the traced cost "
                            f"model needs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        cfg = getattr(module, "config", None)
        pos = int(getattr(cfg, "n_positions", 0) or getattr(cfg, "max_position_embeddings", 0) or 0)
        return cls(name=name, model=module, blocks=blocks, n_params=sum(p.numel() for p in module.parameters()),
                   positions=pos)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _remat(kind: str) -> RematPlan:
    return RematPlan.of_kind(kind)


def price(target: Traced, plan: Plan, plat: Platform, *, global_batch: int, seq: int, device: str = "cuda",
          options: Options | None = None) -> PlanCost:
    """One plan (dp resolved, micro_batch set) priced by the traced cost model, as the planner's
    :class:`~.cost.PlanCost` (the heaviest rank's peak, the slowest rank's step by phase)."""
    return summary(target, plan, plat, rank_costs(target, plan, plat, global_batch=global_batch, seq=seq,
                                                  device=device), global_batch=global_batch, seq=seq, options=options)


def rank_costs(target: Traced, plan: Plan, plat: Platform, *, global_batch: int, seq: int,
               device: str = "cuda") -> list[Any]:
    """Every pipeline rank's :class:`~scaletrain.techniques.plan_cost.RankCost` of ``plan`` (timed on ``plat``)."""
    from scaletrain.techniques.plan_cost import plan_costs

    mb = 0 if plan.pp > 1 else plan.micro_batch
    return plan_costs(plan, target.model, world=plan.world(), global_batch=global_batch, seq=seq, micro_batch=mb,
                      device=device, platform=plat)


def summary(target: Traced, plan: Plan, plat: Platform, costs: list[Any], *, global_batch: int, seq: int,
            options: Options | None = None) -> PlanCost:
    """The ranks' costs as the planner's :class:`~.cost.PlanCost` (the heaviest rank's peak, the slowest
    rank's step by phase, every rank's total in ``rank_peaks``)."""
    from scaletrain.techniques.plan_cost import heaviest

    opts = options or Options()
    world = plan.world()
    top = heaviest(costs)
    slow = max(costs, key=lambda c: c.step_time_s or 0.0)
    t = slow.time_s
    assert t is not None  # plan_costs with a platform times every rank
    step = t.step_s
    if not step > 0:
        raise UserError(f"the traced cost model priced {target.name} under {plan.describe()} at {step} s; "
                        f"a plan must cost time")
    exposed = sum(t.comm_exposed_s.values())
    phases = {"compute": t.compute, "recompute": t.recompute, "pipeline_bubble": t.bubble,
              **{f"{k}_comm": v for k, v in t.comm_exposed_s.items()},
              "optimizer": t.optimizer, "offload": sum(t.copies_exposed_s.values()), "data": t.data,
              "host": t.host}
    flops = _flops(target, plan, global_batch, seq)
    peak = {k: float(v) for k, v in top.bytes.items()}
    peak["total"] = float(top.peak_bytes)
    busy = step - t.bubble
    # offloading: the ranks of one node share its host memory (the analytic search's rule)
    host = max(c.host_bytes for c in costs) * min(world, plat.devices_per_node)
    return PlanCost(plan=plan, step_time_s=step, tokens_per_s=global_batch * max(seq, 1) / step,
                    tflops_per_device=flops / step / world / 1e12, mfu=flops / step / world / plat.flops(plan.precision),
                    peak_bytes=peak, device_bytes=float(plat.device_memory_bytes),
                    fits=top.peak_bytes + opts.reserve_bytes <= plat.device_memory_bytes
                    and host <= plat.host_memory_bytes, host_bytes=host,
                    bubble_fraction=t.bubble / step if busy < step else 0.0, exposed_comm_s=exposed, phases_s=phases,
                    heaviest_rank=top.rank, blocks_s={},
                    rank_peaks=[{"rank": r, "total": float(c.peak_bytes)} for r, c in enumerate(costs)])


_FLOPS: dict[tuple[int, int, str], float] = {}


def _flops(target: Traced, plan: Plan, global_batch: int, seq: int) -> float:
    """Model FLOPs of one step (forward and backward of every sample, no recompute): the traced
    operators' FLOPs of one sample times the global batch."""
    key = (id(target.model), seq, plan.precision)
    if key not in _FLOPS:
        import torch

        from scaletrain.chain import to_chain
        from scaletrain.measure.census import census
        from scaletrain.models.adapters import adapt
        from scaletrain.techniques.plan_cost import _loss

        a = adapt(target.model)
        lm = a.task == "lm"
        x = a.input_spec(1, seq if lm else None)
        y = torch.zeros(x.shape if lm else (1,), dtype=torch.long, device="meta")
        ops = census(to_chain(target.model), x, y, _loss, plan.precision)
        _FLOPS[key] = float(sum(o.flops for b in ops for o in (*b.fwd, *b.bwd)))
    return _FLOPS[key] * global_batch


def search(target: Traced, plat: Platform, *, nodes: int, gpus_per_node: int, global_batch: int, seq: int,
           fixed: dict[str, Any] | None = None, precision: str = "bf16", optimizer: str = "adamw",
           options: Options | None = None, device: str = "cuda", params_dtype: str = "fp32") -> Any:
    """Every plan the model can run on ``nodes × gpus_per_node`` devices, priced and ranked (module
    docstring); returns a :class:`~.search.SearchResult` like the analytic search."""
    from scaletrain.planner.search import TRACED_OFFLOADS, SearchResult, _merge, _offload, _remat_rank
    from scaletrain.techniques.plan_cost import stage_graphs_of

    t0 = time.perf_counter()
    fx = dict(fixed or {})
    opts = options or Options()
    world = nodes * gpus_per_node
    plat = plat.with_(devices_per_node=gpus_per_node)
    base = compat.Facts.of(target.model, world=world, device=device, seq_len=seq)
    attention = base.gpt2 or base.hf
    rejected: list[dict[str, Any]] = []
    ranked: list[PlanCost] = []
    oom: dict[tuple, PlanCost] = {}
    count = [0]

    if "attention" in fx:
        raise UserError(f"--fix attention={fx['attention']}: a traced model is priced with the attention kernels it "
                        f"runs; attention= applies to decoder shapes priced on paper")
    if fx.get("cp", 1) > 1:  # a model the runtime's context parallelism cannot run: the table's one line
        bad = compat.violations(Plan(cp=fx["cp"]), base)
        if bad:
            raise UserError(f"--fix cp={fx['cp']}: compat rule {bad[0].name}: {bad[0].message(Plan(cp=fx['cp']), base)}")
    balance = fx.pop("pp_split", "profile")
    params_dtype = fx.pop("params_dtype", params_dtype)

    def reject(region: str, kind: str, reason: str, key: str = "") -> None:
        rejected.append({"region": region, "kind": kind, "reason": reason, "key": key or reason})

    def check(plan: Plan, region: str, m: int) -> bool:
        facts = compat.Facts(**{**base.__dict__, "microbatches": m})
        bad = compat.violations(plan, facts)
        if bad:
            reject(region, "compat", f"{bad[0].name}: {bad[0].message(plan, facts)}", key=f"{region} {bad[0].name}")
        return not bad

    def _groups(tp: int, cp: int, pp: int, dp: int, region: str) -> list[int]:
        """HSDP shard groups searched (ZeRO within groups of G dp ranks, replicated across them; 0: over all):
        one node's dp ranks when the job spans nodes (the runtime's hybrid sharding keeps its all-gathers
        inside a node), or the pinned one."""
        per_node = max(gpus_per_node // (tp * cp * pp), 1)
        groups = [0] + ([per_node] if nodes > 1 and 1 < per_node < dp and dp % per_node == 0 else [])
        if "hsdp" in fx:
            groups = [fx["hsdp"]] if fx["hsdp"] == 0 or (1 < fx["hsdp"] < dp and dp % fx["hsdp"] == 0) else []
            if not groups:
                reject(region, "divisibility", f"hsdp={fx['hsdp']} must be a divisor of dp={dp} below it (0: none)")
        if any(groups) and not check(Plan(tp=tp, cp=cp, pp=pp, dp=dp, zero=1, hsdp=max(groups)), f"{region} hsdp", 1):
            groups = [g for g in groups if g == 0]
        return groups

    offload = [str(fx.get("offload", "none"))]  # the pass being searched: none, then optimizer if nothing fits

    def _region(tp: int, cp: int, pp: int, dp: int, ep: int, region: str) -> None:
        off = offload[0]
        region += " offload" if off != "none" else ""
        groups = _groups(tp, cp, pp, dp, region)
        per_rank = global_batch // dp
        for b in _divisors(per_rank):
            if b > MAX_MICRO_BATCH or fx.get("micro_batch", b) != b:
                continue
            m = per_rank // b
            scheds: list[tuple[str, int]] = [("1f1b", 1)]
            if pp > 1:  # GPipe: 1F1B's time with more micro-batches alive; Chimera: two pipelines' weights
                scheds += [("interleaved", 2), ("zb1p", 1)] + [(k, 1) for k in ("gpipe", "chimera")
                                                                if fx.get("schedule") == k]
            for sched, v in scheds:
                if (pp == 1 and "schedule" in fx) or fx.get("schedule", sched) != sched:
                    continue
                if fx.get("virtual", v) != v and not (v == 1 and fx.get("virtual") in (0, 1)):
                    continue
                for zero, hsdp in [(z, g) for z in ((0,) if dp == 1 else (0, 1, 2, 3) if pp == 1 else (0, 1))
                                   for g in groups if z >= 1 or g == 0]:  # ZeRO shards over dp (or HSDP groups)
                    if fx.get("zero", zero) != zero:
                        continue
                    for sp in ((False, True) if tp > 1 else (False,)):
                        if fx.get("sp", sp) != sp:
                            continue
                        # recomputation only adds time: the next remat is priced only when the lighter one
                        # does not fit (or when pinned); ZeRO-3's grouping likewise, fastest first
                        fitted = False
                        for remat in REMATS:
                            if fitted:
                                break
                            if fx.get("remat", remat) != remat or (remat == "selective" and not attention):
                                continue
                            if off != "none" and remat == "selective":
                                continue  # the offload runtime recomputes whole blocks only (compat offload-remat)
                            if off == "activations" and remat != "none":
                                continue  # a block's saved tensors go to the host or are recomputed, not both
                            if pp > 1 and remat != "none":
                                reject(f"{region} remat={remat}", "runtime", PIPELINE_REMAT, key=f"{region} pp-remat")
                                continue
                            for group in _fsdp_groups(zero, pp, hsdp or dp * cp, m):
                                plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, zero=zero, hsdp=hsdp,
                                            balance=balance, micro_batch=b, fsdp_group=group,
                                            microbatches=m if pp > 1 else 0, schedule=sched if pp > 1 else "1f1b",
                                            virtual=v if v > 1 else 0,
                                            remat=_remat(remat) if off == "none" else RematPlan(),
                                            offload=_offload(off, remat), precision=precision,
                                            params_dtype=params_dtype, optimizer=optimizer)
                                if _priced(plan, region, m, f"{region} {sched if pp > 1 else ''} b={b}"):
                                    fitted = True
                                    break

    def _fsdp_groups(zero: int, pp: int, shard: int, accum: int) -> list[str]:
        """``parallel.fsdp_group`` values searched: the pinned one, or — ZeRO-3 without a pipeline — every
        distinct grouping, fastest first by its collectives' count and exposure (:func:`.grouping.group_settings`;
        the first that fits ends the search); else ``auto`` (no grouping to choose)."""
        if "fsdp_group" in fx:
            return [fx["fsdp_group"]]
        if zero != 3 or pp > 1:
            return ["auto"]
        from scaletrain.techniques.data_parallel.grouping import group_settings

        return group_settings(target.model, shard, accum, device)

    def _cost(plan: Plan, region: str, where: str, solve: bool = False) -> PlanCost | None:
        """``plan`` priced (with ``solve``: its pipeline stages' remat budgets fitted first), or None — a
        rejected region naming why the cost model cannot price it."""
        try:
            costs = rank_costs(target, plan, plat, global_batch=global_batch, seq=seq, device=device)
            if solve:  # the runtime's pipeline remat: each stage's solver under its own stage's slack
                graphs = stage_graphs_of(plan, target.model, world=world, global_batch=global_batch, seq=seq)
                plan, costs = stage_remat.fit_traced(plan, costs, graphs, plat.device_memory_bytes - opts.reserve_bytes,
                                                     lambda p: rank_costs(target, p, plat, global_batch=global_batch,
                                                                          seq=seq, device=device))
            return summary(target, plan, plat, costs, global_batch=global_batch, seq=seq, options=opts)
        except Exception as e:  # noqa: BLE001 - a plan the cost model cannot price is a named rejected region
            why = str(e).splitlines()[0] if str(e) else ""
            why = why if isinstance(e, UserError) else f"{type(e).__name__}: {why}"
            reject(where.replace("  ", " "), "unpriced", f"the cost model cannot price {plan.describe()}: {why}",
                   key=f"{region} {plan.schedule} {why[:60]}")
            return None

    def _keep(c: PlanCost) -> bool:
        count[0] += 1
        if c.fits:
            ranked.append(c)
            return True
        key = (c.plan.tp, c.plan.cp, c.plan.pp, c.plan.dp, c.plan.ep, c.plan.offload.active)
        if key not in oom or c.peak_bytes["total"] < oom[key].peak_bytes["total"]:
            oom[key] = c
        return False

    def _priced(plan: Plan, region: str, m: int, where: str) -> bool:
        """Price one plan; True when it fits (no heavier remat needed). A pipeline that does not fit without
        recompute is priced again with the runtime's solver per stage (:func:`.stage_remat.fit_traced`)."""
        if not check(plan, region, m):
            return False
        c = _cost(plan, region, where)
        if c is None or _keep(c) or plan.pp == 1 or plan.remat.active or plan.offload.active or "remat" in fx:
            return c is not None and c.fits
        probe = plan.with_(remat=RematPlan(method=stage_remat.METHOD, budget="1"))  # what the table reads
        if not check(probe, f"{region} remat={stage_remat.METHOD}", m):
            return False
        solved = _cost(plan, region, f"{where} remat={stage_remat.METHOD}", solve=True)
        return solved is not None and _keep(solved)

    from scaletrain.measure.estimate import trace_cache

    notes = [f"{target.name} priced by its fake-tensor trace (the estimate's cost model)"]
    with trace_cache():
        _scan(target, world, gpus_per_node, global_batch, fx, base, check, reject, _region)
        if not ranked and oom and "offload" not in fx:  # memory was what ruled plans out: offloading helps
            notes.append("no plan fits on the device: searched again with the optimizer on the host (ZeRO-Offload), "
                         "with the activations too, and with the weights streamed too, ranked together; "
                         "--fix offload=none forbids it")
            for off in ("optimizer",) + TRACED_OFFLOADS:  # each its own recompute choice; the ranking picks
                offload[0] = off
                _scan(target, world, gpus_per_node, global_batch, fx, base, check, reject, _region)
    # equal times go to the simpler plan: less sharding, less recompute, less offloaded, then the lighter one
    ranked.sort(key=lambda c: (round(c.step_time_s, 9), c.plan.zero, _remat_rank(c.plan), _offload_rank(c.plan),
                               c.plan.sp, c.plan.hsdp, c.peak_bytes["total"]))
    for (tp, cp, pp, dp, ep, off), c in sorted(oom.items()):
        if not any(r.plan.tp == tp and r.plan.cp == cp and r.plan.pp == pp and r.plan.ep == ep for r in ranked):
            over = c.peak_bytes["total"] + opts.reserve_bytes - c.device_bytes
            reject(f"tp={tp}" + (f" cp={cp}" if cp > 1 else "") + f" pp={pp} dp={dp}" + (f" ep={ep}" if ep > 1 else "")
                   + (" offload" if off else ""),
                   "memory", f"every plan is out of memory; the smallest by {_gib(over) if over > 0 else ''}"
                   f"{_gib(c.host_bytes - plat.host_memory_bytes) + ' of host memory' if over <= 0 else ''} "
                   f"({c.plan.describe()}, micro-batch {c.plan.micro_batch})")
    return SearchResult(ranked=ranked, out_of_memory=list(oom.values()), rejected=_merge(rejected),
                        evaluated=count[0], seconds=time.perf_counter() - t0, world=world, notes=notes)


def _gib(n: float) -> str:
    """Bytes in words: GiB from a quarter GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def _scan(target: Traced, world: int, gpus_per_node: int, global_batch: int, fx: dict[str, Any], base: Any,
          check: Any, reject: Any, region_fn: Any) -> None:
    """tp x cp x pp x dp x ep regions, pruned by divisibility, batch and the compatibility table (cp only where
    pinned: the trace prices it, the runtime's ring attention runs GPT-2-style models only)."""
    cp = fx.get("cp", 1)
    for tp in _divisors(gpus_per_node):
        if fx.get("tp", tp) != tp or world % (tp * cp):
            continue
        if (tp > 1 or cp > 1) and not check(Plan(tp=tp, cp=cp), f"tp={tp}" + (f" cp={cp}" if cp > 1 else ""), 0):
            continue
        for pp in _divisors(world // (tp * cp)):
            if fx.get("pp", pp) != pp:
                continue
            if pp > target.blocks:
                reject(f"pp={pp}", "divisibility", f"pp={pp} exceeds the model's {target.blocks} blocks (one stage "
                       f"holds at least one block)")
                continue
            dp = world // (tp * cp * pp)
            if fx.get("dp", dp) != dp:
                continue
            region = f"tp={tp}" + (f" cp={cp}" if cp > 1 else "") + f" pp={pp} dp={dp}"
            if cp > 1 and pp > 1 and not check(Plan(tp=tp, cp=cp, pp=pp), region, 0):
                continue
            if global_batch % dp:
                reject(region, "batch", f"dp={dp} does not divide the global batch {global_batch}")
                continue
            eps = [e for e in _divisors(dp) if e == 1 or (base.moe and base.n_experts % e == 0)]
            for ep in eps:
                if fx.get("ep", ep) != ep:
                    continue
                region_fn(tp, cp, pp, dp, ep, region + (f" ep={ep}" if ep > 1 else ""))


def _offload_rank(plan: Plan) -> int:
    """Less offloaded first: nothing, the optimizer, the activations too, the weights too."""
    o = plan.offload
    return 3 if o.params == "host" else 2 if o.activations != "none" else 1 if o.active else 0
