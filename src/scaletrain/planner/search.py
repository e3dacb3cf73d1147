"""The pruned search over plans: every dp × tp × pp × schedule × virtual stages × micro-batch × ZeRO ×
remat (none / selective / full) × sequence parallelism the runtime can run, priced by :mod:`.cost`.

Pruning, cheapest first, each rejected region kept with its reason:

1. **divisibility** — tp divides the GPUs of a node (TP stays on NVLink) and the heads and vocabulary
   (the compatibility table's rule), pp divides the layers, dp·tp·pp = world, dp divides the global
   batch and dp·b divides it too (micro-batch b: every divisor, no fixed cap);
2. **memory lower bound** — a (tp, pp) pair whose model states alone, sharded as far as any ZeRO
   stage the runtime allows there, exceed the device is dropped before any time is priced;
3. **the compatibility table** (:mod:`scaletrain.techniques.compat`) — what the runtime refuses;
4. **memory** — a priced plan whose heaviest rank does not fit is kept only as "out of memory by …".

Plans that fit are ranked by predicted step time. ``fixed`` pins any dimension (``tp=8``, ``zero=1``,
``remat=full``, ``schedule=interleaved``, ``virtual=2``, ``micro_batch=4``, ``sp=true``, ``dp``, ``pp``,
``offload=optimizer``).

**Offload** (ZeRO-Offload: the optimizer on the host) trades step time for device memory, so it is
searched only when no plan fits without it (a second pass, said in ``notes``) or when pinned. Its plans
keep the offload runtime's own keys: full recompute is ``memory.offload.recompute=all``; selective
recompute does not combine with it (compat rule offload-remat).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from scaletrain import schema
from scaletrain.errors import UserError
from scaletrain.plan import OffloadPlan, Plan, RematPlan
from scaletrain.planner import memory as mem
from scaletrain.planner.cost import Options, PlanCost, optim_state_bytes, plan_cost, remat_kind
from scaletrain.planner.shape import Shape
from scaletrain.platform import Platform
from scaletrain.techniques import compat
from scaletrain.techniques.data_parallel import cost as zero_cost

FIX_KEYS = {**{k: schema.BY_FIELD[k].type for k in schema.pinnable()}, "remat": str, "offload": str, "attention": str}
"""What ``--fix KEY=VALUE`` may pin, and the type of its value: the plan keys the schema marks searched or
pinned, and the planner's own words (remat kind, offload, attention pricing)."""
REMATS = tuple(schema.REMAT_KINDS)
SCHEDULES = ("1f1b", "interleaved", "gpipe")
TRACED_SCHEDULES = ("zb1p", "chimera")
"""Synchronous schedules only the traced planner prices (the pipeline simulator runs them); the analytic
planner's closed forms are 1F1B's, GPipe's and the interleaved schedule's."""
OFFLOADS = ("none", "optimizer")
"""none, or optimizer: ZeRO-Offload (fp32 masters, gradients and Adam states on the host, the update on
the CPU); searched only when nothing fits without it, or when pinned with ``--fix offload=optimizer``."""


@dataclass
class SearchResult:
    """Ranked plans that fit (best first), the priced ones that do not, and the rejected regions."""

    ranked: list[PlanCost]
    out_of_memory: list[PlanCost]
    rejected: list[dict[str, Any]]
    """Regions ruled out, each ``{"region", "kind", "reason"}`` (kind: divisibility, batch, memory, compat)."""
    evaluated: int
    seconds: float
    world: int
    notes: list[str] = field(default_factory=list)


def parse_fixed(items: list[str]) -> dict[str, Any]:
    """``["tp=8", "sp=true"]`` -> ``{"tp": 8, "sp": True}`` (UserError in one line otherwise)."""
    out: dict[str, Any] = {}
    for it in items:
        k, sep, v = it.partition("=")
        k = k.strip()
        if not sep or k not in FIX_KEYS:
            raise UserError(f"--fix expects KEY=VALUE with KEY in {', '.join(FIX_KEYS)}; got {it!r}")
        typ = FIX_KEYS[k]
        if typ is bool:
            if v.lower() not in ("true", "false", "1", "0"):
                raise UserError(f"--fix {k}={v}: expected true or false")
            out[k] = v.lower() in ("true", "1")
        elif typ is int:
            try:
                out[k] = int(v)
            except ValueError:
                raise UserError(f"--fix {k}={v}: expected an integer") from None
            if out[k] < (0 if k == "zero" else 1):
                raise UserError(f"--fix {k}={v}: must be >= {0 if k == 'zero' else 1}")
        else:
            allowed = {"remat": REMATS, "schedule": SCHEDULES + TRACED_SCHEDULES, "offload": OFFLOADS,
                       "attention": ("flash", "materialized")}.get(k) or schema.BY_FIELD[k].choices
            if v not in allowed:
                raise UserError(f"--fix {k}={v}: allowed: {', '.join(allowed)}")
            out[k] = v
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _remat(kind: str) -> RematPlan:
    return RematPlan.of_kind(kind)


def _states_lower_bound(shape: Shape, tp: int, pp: int, dp: int, zero_max: int, k: float, storage: str,
                        offload: str = "none") -> float:
    """Bytes of model states on the heaviest stage, sharded as far as ZeRO ``zero_max`` goes (with the
    optimizer on the host: the parameters alone)."""
    n = max(mem.rank_params(shape, tp=tp, pp=pp, first=True, last=pp == 1),
            mem.rank_params(shape, tp=tp, pp=pp, first=pp == 1, last=True))
    ms = zero_cost.model_state_bytes(n, zero_max, dp, precision=storage, optim_state_bytes=k)
    return ms.params if offload != "none" else ms.total


def search(shape: Shape, plat: Platform, *, nodes: int, gpus_per_node: int, global_batch: int, seq: int,
           fixed: dict[str, Any] | None = None, precision: str = "bf16", optimizer: str = "adamw",
           options: Options | None = None, device: str = "cuda", params_dtype: str = "fp32") -> SearchResult:
    """Every runnable plan for ``nodes × gpus_per_node`` devices, priced and ranked (module docstring).
    ``device``: what the compatibility table is asked about (cuda; cpu for ``plan=auto`` here).
    ``params_dtype``: the stored parameters' type (fp32 under autocast, scaletrain's default; bf16 to
    price a system that keeps 16-bit parameters with fp32 masters, as DeepSpeed does)."""
    t0 = time.perf_counter()
    fx = dict(fixed or {})
    if fx.get("cp", 1) != 1:
        raise UserError(f"--fix cp={fx['cp']}: the planner does not search context parallelism yet (run it with "
                        f"parallel.cp={fx['cp']} and plan=manual; `scaletrain estimate` prices it)")
    if fx.get("schedule") in TRACED_SCHEDULES:
        raise UserError(f"--fix schedule={fx['schedule']}: the analytic planner prices {', '.join(SCHEDULES)} only; "
                        f"`scaletrain estimate --plan` prices {fx['schedule']} for a decoder by its trace")
    if fx.get("ep", 1) != 1:
        raise UserError(f"--fix ep={fx['ep']}: a dense decoder shape has no experts to shard (ep is searched for "
                        f"mixture-of-experts models such as gpt2-moe)")
    opts = options or Options()
    # pinned, not searched: the stored parameters' type and how attention is priced (flash or materialized)
    params_dtype = fx.pop("params_dtype", params_dtype)
    if "attention" in fx:
        opts = dataclasses.replace(opts, attention=fx.pop("attention"))
    world = nodes * gpus_per_node
    plat = plat.with_(devices_per_node=gpus_per_node)
    k = optim_state_bytes(optimizer, shape.hidden)
    rejected: list[dict[str, Any]] = []
    ranked: list[PlanCost] = []
    oom: dict[tuple, PlanCost] = {}
    count = [0]
    facts_base = dict(world=world, device=device, gpt2=True, n_head=shape.heads, vocab_size=shape.vocab,
                      n_blocks=shape.layers + 2, seq_len=seq, dropout=shape.dropout)

    def reject(region: str, kind: str, reason: str, key: str = "") -> None:
        rejected.append({"region": region, "kind": kind, "reason": reason, "key": key or reason})

    def scan(offload: str) -> None:
        storage = "fp32" if params_dtype == "fp32" else "mixed"
        for tp in _divisors(gpus_per_node):
            if "tp" in fx and tp != fx["tp"]:
                continue
            if shape.heads % tp or shape.vocab % tp or (shape.kv_heads or shape.heads) % tp:
                reject(f"tp={tp}", "divisibility", f"tp must divide n_head={shape.heads}, the key/value heads "
                       f"({shape.kv_heads or shape.heads}) and vocab_size={shape.vocab}")
                continue
            for pp in _divisors(world // tp):
                if ("pp" in fx and pp != fx["pp"]) or not shape.layers % pp:
                    continue
                reject(f"tp={tp} pp={pp}", "divisibility", f"pp={pp} does not divide the {shape.layers} layers: the "
                       f"analytic planner gives every stage l/pp layers (uneven splits are not searched yet)")
            for pp in _divisors(shape.layers):
                if "pp" in fx and pp != fx["pp"]:
                    continue
                region = f"tp={tp} pp={pp}"
                if world % (tp * pp):
                    if pp <= world:
                        reject(region, "divisibility", f"tp x pp = {tp * pp} does not divide the {world} devices")
                    continue
                dp = world // (tp * pp)
                if "dp" in fx and dp != fx["dp"]:
                    continue
                region += f" dp={dp}" + (" offload" if offload != "none" else "")
                if global_batch % dp:
                    reject(region, "batch", f"dp={dp} does not divide the global batch {global_batch}")
                    continue
                zeros = [z for z in ((0, 1) if pp > 1 else (0, 1, 2, 3)) if fx.get("zero", z) == z]
                if not zeros:
                    reject(region, "compat", f"zero={fx['zero']} is not searched with pipelines (zero=2: compat "
                           f"rule pp-zero2; zero=3 runs, but the planner does not search it yet)")
                    continue
                floor = _states_lower_bound(shape, tp, pp, dp, max(zeros), k, storage, offload) + opts.reserve_bytes
                if floor > plat.device_memory_bytes:
                    reject(region, "memory", f"out of memory by at least {(floor - plat.device_memory_bytes) / 2**30:.1f}"
                           f" GiB: model states alone with ZeRO-{max(zeros)}"
                           + (" and the optimizer on the host" if offload != "none" else "")
                           + f" are {floor / 2**30:.1f} GiB (reserve included) on "
                           f"{plat.device_memory_bytes / 2**30:.0f} GiB")
                    continue
                _scan_region(tp, pp, dp, region, zeros, offload)

    def _scan_region(tp: int, pp: int, dp: int, region: str, zeros: list[int], offload: str) -> None:
        per_rank = global_batch // dp
        for b in _divisors(per_rank):
            if "micro_batch" in fx and b != fx["micro_batch"]:
                continue
            m = per_rank // b
            scheds: list[tuple[str, int]] = [("1f1b", 1)]
            if pp > 1:
                scheds.append(("gpipe", 1))
                scheds += [("interleaved", v) for v in _divisors(shape.layers // pp) if v > 1 and v <= 8]
            for sched, v in scheds:
                if "schedule" in fx and (pp == 1 or sched != fx["schedule"]):
                    continue  # a pinned schedule asks for a pipeline
                if "virtual" in fx and v != fx["virtual"]:
                    continue
                for zero in zeros:
                    for remat in REMATS:
                        if "remat" in fx and remat != fx["remat"]:
                            continue
                        if offload != "none" and remat == "selective":
                            continue  # the offload runtime recomputes whole blocks only (compat offload-remat)
                        for sp in ((False, True) if tp > 1 else (False,)):
                            if "sp" in fx and sp != fx["sp"]:
                                continue
                            plan = Plan(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, micro_batch=b,
                                        microbatches=m if pp > 1 else 0,
                                        schedule=sched if pp > 1 else "1f1b", virtual=v if v > 1 else 0,
                                        remat=_remat(remat) if offload == "none" else RematPlan(),
                                        offload=_offload(offload, remat), precision=precision,
                                        params_dtype=params_dtype, optimizer=optimizer)
                            facts = compat.Facts(microbatches=m, **facts_base)
                            bad = compat.violations(plan, facts)
                            if bad:
                                reject(f"{region} {sched} v={v} b={b}", "compat", bad[0].message(plan, facts),
                                       key=f"{region} {bad[0].name}")
                                continue
                            c = plan_cost(shape, plan, plat, global_batch=global_batch, seq=seq, options=opts)
                            count[0] += 1
                            if c.fits:
                                ranked.append(c)
                            else:
                                key = (tp, pp, dp, offload)
                                if key not in oom or c.peak_bytes["total"] < oom[key].peak_bytes["total"]:
                                    oom[key] = c

    notes: list[str] = []
    scan(fx.get("offload", "none"))
    if not ranked and "offload" not in fx:
        notes.append("no plan fits with the optimizer on the device: searched again with it on the host "
                     "(ZeRO-Offload; --fix offload=none forbids it)")
        scan("optimizer")
    # by predicted time; equal times (to a microsecond) go to the simpler plan, then the lighter one
    ranked.sort(key=lambda c: (round(c.step_time_s, 6), c.plan.zero, REMATS.index(_remat_name(c.plan)),
                               c.plan.sp, c.peak_bytes["total"]))
    for (tp, pp, dp, offload), c in sorted(oom.items()):
        if not any(r.plan.tp == tp and r.plan.pp == pp for r in ranked):
            over = c.peak_bytes["total"] + opts.reserve_bytes - c.device_bytes
            where = (f"{over / 2**30:.1f} GiB" if over > 0 else
                     f"{(c.host_bytes - plat.host_memory_bytes) / 2**30:.1f} GiB of host memory")
            reject(f"tp={tp} pp={pp} dp={dp}" + (" offload" if offload != "none" else ""), "memory",
                   f"every plan is out of memory; the smallest by {where} ({c.plan.describe()})")
    return SearchResult(ranked=ranked, out_of_memory=list(oom.values()), rejected=_merge(rejected),
                        evaluated=count[0], seconds=time.perf_counter() - t0, world=world, notes=notes)


def _offload(kind: str, remat: str) -> OffloadPlan:
    """The plan's offload keys: none, or the optimizer on the host (ZeRO-Offload), whose runtime does
    full recompute itself (``memory.offload.recompute=all``)."""
    if kind == "none":
        return OffloadPlan()
    return OffloadPlan(optimizer="host", recompute="all" if remat == "full" else "none")


def _remat_name(plan: Plan) -> str:
    return remat_kind(plan)


def _merge(rejected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (kind, key) — a compat rule within one (tp, pp, dp) region, else the reason — with
    the first instance's words and how many candidates it stands for."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rejected:
        key = (r["kind"], r.pop("key"))
        if key in out:
            out[key]["count"] += 1
        else:
            out[key] = {**r, "count": 1}
    order = {"memory": 0, "batch": 1, "divisibility": 2, "compat": 3}
    return sorted(out.values(), key=lambda r: order.get(r["kind"], 4))


def why_lost(best: PlanCost, other: PlanCost) -> str:
    """One line: how much slower ``other`` is than ``best`` and the phase that costs it most."""
    pct = (other.step_time_s / best.step_time_s - 1) * 100
    if pct < 0.05:
        return ("same predicted step time; ranked after the simpler plan (fewer ZeRO stages, less recompute, "
                "no SP), then the lighter one")
    diff = {k: other.phases_s.get(k, 0.0) - best.phases_s.get(k, 0.0) for k in best.phases_s}
    worst = max(diff, key=lambda k: diff[k])
    return f"+{pct:.1f}% step time, mostly {worst.replace('_', ' ')} (+{diff[worst] * 1e3:.0f} ms)"
