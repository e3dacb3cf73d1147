"""The pruned search over plans: every dp × tp (+SP) × cp × pp (uneven, cost-balanced splits) × schedule ×
virtual stages × micro-batch × ZeRO 0–3 × HSDP × remat (none / selective / full) the runtime can run,
priced by :mod:`.cost`.

Pruning, cheapest first, each rejected region kept with its reason (compat rules by name):

1. **divisibility** — tp divides the GPUs of a node (TP stays on NVLink) and the heads and vocabulary
   (the compatibility table's rule), dp·tp·cp·pp = world, pp ≤ l + 2 blocks (any pp: the runtime's
   partitioner splits the embedding, the l layers and the head unevenly, :mod:`.stages`), cp by the
   table's cp-seq / cp-dropout / pp-cp rules, HSDP's group G a divisor of dp (data parallelism,
   also beside tp: compat hsdp-mp), pp × ZeRO-2 (compat pp-zero2), dp divides the global batch
   and dp·b divides it too (micro-batch b: every divisor, no fixed cap);
2. **memory lower bound** — a (tp, pp) pair whose model states alone, sharded as far as any ZeRO
   stage the runtime allows there, exceed the device is dropped before any time is priced;
3. **the compatibility table** (:mod:`scaletrain.techniques.compat`) — what the runtime refuses;
4. **memory** — a priced plan whose heaviest rank does not fit is kept only as "out of memory by …".

Plans that fit are ranked by predicted step time. ``fixed`` pins any dimension (``tp=8``, ``zero=1``,
``remat=full``, ``schedule=interleaved``, ``virtual=2``, ``micro_batch=4``, ``sp=true``, ``dp``, ``pp``,
``cp=16``, ``hsdp=8``, ``pp_split=equal``, ``offload=optimizer``). The compatibility table is asked once
per distinct verdict (memoised on what its rules read), the stage split once per region.

**Remat in pipelines** is what the pipeline runtime runs: a solver's schedule per stage under its own budget
(``memory.remat.method=optimal``, ``memory.remat.stage_budgets``), fitted to each stage's memory slack and priced
per stage (:mod:`.stage_remat`) where nothing fits without recompute; full and selective recompute with
pp > 1 are a rejected region of kind ``runtime`` (the pipeline runtime does not apply those keys).
Activation and weight offload are named regions too (compat offload-world / offload-pp beyond one device).

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
from scaletrain.planner import stage_remat
from scaletrain.planner.cost import Options, PlanCost, optim_state_bytes, plan_cost, remat_kind
from scaletrain.planner.shape import Shape
from scaletrain.planner.stages import BALANCES, PIPELINE_REMAT
from scaletrain.platform import Platform
from scaletrain.techniques import compat
from scaletrain.techniques.data_parallel import cost as zero_cost

FIX_KEYS = {**{k: schema.BY_FIELD[k].type for k in schema.pinnable()}, "remat": str, "offload": str, "attention": str,
            "pp_split": str}
"""What ``--fix KEY=VALUE`` may pin, and the type of its value: the plan keys the schema marks searched or
pinned, and the planner's own words (remat kind, offload, attention pricing, ``pp_split``: the plan's
``parallel.balance``, profile or equal; ``hsdp``: ``parallel.hsdp``, 0 for none)."""
REMATS = tuple(schema.REMAT_KINDS)
SCHEDULES = ("1f1b", "interleaved", "gpipe")
TRACED_SCHEDULES = ("zb1p", "chimera")
"""Synchronous schedules only the traced planner prices (the pipeline simulator runs them); the analytic
planner's closed forms are 1F1B's, GPipe's and the interleaved schedule's."""
OFFLOADS = ("none", "optimizer")
TRACED_OFFLOADS = ("activations", "weights")
"""Offload searched for traced models only (priced by their trace's offload cost face, not on paper):
``activations`` — the optimizer and every block's saved tensors on the host; ``weights`` — the
parameters streamed block by block as well (L2L / ZeRO-Infinity)."""
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
            if out[k] < (0 if k in ("zero", "hsdp") else 1):
                raise UserError(f"--fix {k}={v}: must be >= {0 if k in ('zero', 'hsdp') else 1}")
        elif k == "fsdp_group":  # auto, block or a byte limit: read as the runtime reads it
            try:
                zero_cost.fsdp_group_limit(v, [], 1, 1, "cpu")
            except Exception as e:  # noqa: BLE001 - ConfigError naming what is allowed
                raise UserError(f"--fix {e}") from None
            out[k] = v
        else:
            allowed = {"remat": REMATS, "schedule": SCHEDULES + TRACED_SCHEDULES, "offload": OFFLOADS + TRACED_OFFLOADS,
                       "attention": ("flash", "materialized"), "pp_split": BALANCES}.get(k) or schema.BY_FIELD[k].choices
            if v not in allowed:
                raise UserError(f"--fix {k}={v}: allowed: {', '.join(allowed)}")
            out[k] = v
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _remat(kind: str) -> RematPlan:
    return RematPlan.of_kind(kind)


def _states_lower_bound(shape: Shape, tp: int, pp: int, shard: int, zero_max: int, k: float, storage: str,
                        offload: str = "none") -> float:
    """Bytes of model states on the lightest-possible heaviest stage (l/pp layers, the embedding or the
    head beside them), sharded over ``shard`` ranks as far as ZeRO ``zero_max`` goes (with the optimizer
    on the host: the parameters alone). Uneven splits only add layers to some rank, so this bounds them."""
    n = max(mem.rank_params(shape, tp=tp, pp=pp, first=True, last=pp == 1),
            mem.rank_params(shape, tp=tp, pp=pp, first=pp == 1, last=True))
    ms = zero_cost.model_state_bytes(n, zero_max, shard, precision=storage, optim_state_bytes=k)
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
    if fx.get("schedule") in TRACED_SCHEDULES:
        raise UserError(f"--fix schedule={fx['schedule']}: the analytic planner prices {', '.join(SCHEDULES)} only; "
                        f"`scaletrain estimate --plan` prices {fx['schedule']} for a decoder by its trace")
    if fx.get("offload") in TRACED_OFFLOADS:
        raise UserError(f"--fix offload={fx['offload']}: the analytic planner prices {', '.join(OFFLOADS)} only; "
                        f"a traced model (any model but a named decoder shape) is searched with it")
    if fx.get("ep", 1) != 1:
        raise UserError(f"--fix ep={fx['ep']}: a dense decoder shape has no experts to shard (ep is searched for "
                        f"mixture-of-experts models such as gpt2-moe)")
    opts = options or Options()
    # pinned, not searched: the stored parameters' type and how attention is priced (flash or materialized)
    params_dtype = fx.pop("params_dtype", params_dtype)
    if "attention" in fx:
        opts = dataclasses.replace(opts, attention=fx.pop("attention"))
    balance = fx.pop("pp_split", "profile")
    fsdp_group = fx.pop("fsdp_group", "auto")  # decoder shapes on paper do not price the grouping: kept as pinned
    world = nodes * gpus_per_node
    plat = plat.with_(devices_per_node=gpus_per_node)
    k = optim_state_bytes(optimizer, shape.hidden)
    rejected: list[dict[str, Any]] = []
    ranked: list[PlanCost] = []
    oom: dict[tuple, PlanCost] = {}
    count = [0]
    facts_base = dict(world=world, device=device, gpt2=True, n_head=shape.heads, vocab_size=shape.vocab,
                      n_blocks=shape.layers + 2, seq_len=seq, dropout=shape.dropout)
    verdicts: dict[tuple, list] = {}

    def reject(region: str, kind: str, reason: str, key: str = "", over: float = 0.0) -> None:
        rejected.append({"region": region, "kind": kind, "reason": reason, "key": key or reason, "over": over})

    def refused(plan: Plan, m: int) -> list:
        """The compatibility table's verdict, memoised on all it reads of a searched plan (its degrees,
        schedule, remat and offload; the micro-batch count only as m mod pp for interleaved and m mod 2
        for Chimera: pp-interleaved, pp-chimera)."""
        key = (plan.dp, plan.tp, plan.pp, plan.cp, plan.sp, plan.zero, plan.hsdp, plan.schedule, plan.virtual,
               plan.remat, plan.offload, m % plan.pp if plan.schedule == "interleaved" else 0,
               m % 2 if plan.schedule == "chimera" else 0)
        if key not in verdicts:
            verdicts[key] = compat.violations(plan, compat.Facts(microbatches=m, **facts_base))
        return verdicts[key]

    def rule(plan: Plan, region: str, m: int = 1, where: str = "") -> bool:
        """Name the first compat rule ``plan`` breaks as a rejected region (one entry per rule and mesh
        region ``where``, with a count); True when it runs."""
        bad = refused(plan, m)
        if bad:
            facts = compat.Facts(microbatches=m, **facts_base)
            reject(region, "compat", f"compat rule {bad[0].name}: {bad[0].message(plan, facts)}",
                   key=f"{where or region} {bad[0].name}")
        return not bad

    def scan(offload: str) -> None:
        storage = "fp32" if params_dtype == "fp32" else "mixed"
        for tp in _divisors(gpus_per_node):
            if "tp" in fx and tp != fx["tp"]:
                continue
            if shape.heads % tp or shape.vocab % tp or (shape.kv_heads or shape.heads) % tp:
                reject(f"tp={tp}", "divisibility", f"tp must divide n_head={shape.heads}, the key/value heads "
                       f"({shape.kv_heads or shape.heads}) and vocab_size={shape.vocab}")
                continue
            for cp in _divisors(world // tp):
                if fx.get("cp", cp) != cp:
                    continue
                if cp > 1 and not rule(Plan(tp=tp, cp=cp), f"tp={tp} cp={cp}"):
                    continue  # seq % 2cp, dropout: whole cp value refused
                for pp in _divisors(world // (tp * cp)):
                    if "pp" in fx and pp != fx["pp"]:
                        continue
                    region = f"tp={tp} cp={cp} pp={pp}" if cp > 1 else f"tp={tp} pp={pp}"
                    if pp > shape.layers + 2:
                        reject(region, "compat", f"compat rule pp-blocks: pp={pp} stages for {shape.layers + 2} "
                               f"blocks (the layers, the embedding and the head)", key="pp-blocks")
                        continue
                    if opts.stage_split == "uniform" and shape.layers % pp:
                        reject(region, "divisibility", f"pp={pp} does not divide the {shape.layers} layers (a "
                               f"uniform split was asked for: Options.stage_split)", key="uniform")
                        continue
                    if pp > 1 and cp > 1:
                        rule(Plan(tp=tp, cp=cp, pp=pp), f"tp={tp} cp>1 pp>1")
                        continue
                    dp = world // (tp * cp * pp)
                    if "dp" in fx and dp != fx["dp"]:
                        continue
                    region += f" dp={dp}" + (" offload" if offload != "none" else "")
                    if global_batch % dp:
                        reject(region, "batch", f"dp={dp} does not divide the global batch {global_batch}")
                        continue
                    _scan_mesh(tp, cp, pp, dp, region, offload, storage)

    def _scan_mesh(tp: int, cp: int, pp: int, dp: int, region: str, offload: str, storage: str) -> None:
        zeros = [z for z in ((0, 1, 3) if pp > 1 else (0, 1, 2, 3)) if fx.get("zero", z) == z]
        if dp * cp == 1 and "zero" not in fx:
            zeros = [0]  # ZeRO shards over the data-parallel ranks: with one there is nothing to shard
        if pp > 1 and 2 == fx.get("zero"):
            rule(Plan(tp=tp, pp=pp, zero=2), region)
        if pp > 1 and 3 in zeros and not rule(Plan(tp=tp, pp=pp, zero=3), f"{region} zero=3"):
            zeros.remove(3)  # pp x ZeRO-3 where the table refuses it (e.g. a MoE with ep)
        # HSDP: ZeRO within groups of G of the dp ranks, replicated across them (plain data parallelism only)
        groups = [0] + [g for g in _divisors(dp) if 1 < g < dp]
        if "hsdp" in fx:
            groups = [fx["hsdp"]] if fx["hsdp"] in groups else []
            if not groups:
                reject(region, "divisibility", f"hsdp={fx['hsdp']} must be a divisor of dp={dp} below it (0: none)")
        if len(groups) > 1 and not rule(Plan(tp=tp, cp=cp, pp=pp, zero=1, hsdp=groups[1]), f"{region} hsdp"):
            groups = [0]
        for hsdp in groups:
            zs = [z for z in zeros if z >= 1] if hsdp else zeros
            if not zs:
                continue
            where = region + (f" hsdp={hsdp}" if hsdp else "")
            floor = (_states_lower_bound(shape, tp, pp, (hsdp or dp) * cp, max(zs), k, storage, offload)
                     + opts.reserve_bytes)
            if floor > plat.device_memory_bytes:
                over = floor - plat.device_memory_bytes
                reject(where, "memory", f"out of memory by at least {over / 2**30:.1f}"
                       f" GiB: model states alone with ZeRO-{max(zs)}"
                       + (" and the optimizer on the host" if offload != "none" else "")
                       + f" are {floor / 2**30:.1f} GiB (reserve included) on "
                       f"{plat.device_memory_bytes / 2**30:.0f} GiB", over=over)
                continue
            _scan_region(tp, cp, pp, dp, hsdp, where, zs, offload)

    def layer_bytes(b: int, tp: int, sp: bool, remat: str) -> float:
        return mem.layer_activation_bytes(shape, seq, b, tp=tp, sp=sp, remat=remat, elem=2 if precision != "fp32"
                                          else 4, flash=opts.attention == "flash")

    def price(plan: Plan, key: tuple) -> PlanCost:
        c = plan_cost(shape, plan, plat, global_batch=global_batch, seq=seq, options=opts)
        count[0] += 1
        if c.fits:
            ranked.append(c)
        elif key not in oom or c.peak_bytes["total"] < oom[key].peak_bytes["total"]:
            oom[key] = c
        return c

    def _scan_region(tp: int, cp: int, pp: int, dp: int, hsdp: int, region: str, zeros: list[int],
                     offload: str) -> None:
        per_rank = global_batch // dp
        for b in _divisors(per_rank):
            if "micro_batch" in fx and b != fx["micro_batch"]:
                continue
            m = per_rank // b
            scheds: list[tuple[str, int]] = [("1f1b", 1)]
            if pp > 1:
                scheds.append(("gpipe", 1))
                scheds += [("interleaved", v) for v in range(2, 9) if (shape.layers + 2) >= pp * v]
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
                        if pp > 1 and remat != "none":
                            reject(f"{region} remat={remat}", "runtime", PIPELINE_REMAT, key=f"{region} pp-remat")
                            continue
                        for sp in ((False, True) if tp > 1 and cp == 1 else (False,)):
                            if "sp" in fx and sp != fx["sp"]:
                                continue
                            plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, sp=sp, zero=zero, hsdp=hsdp, micro_batch=b,
                                        microbatches=m if pp > 1 else 0,
                                        schedule=sched if pp > 1 else "1f1b", virtual=v if v > 1 else 0,
                                        balance=balance, fsdp_group=fsdp_group,
                                        remat=_remat(remat) if offload == "none" else RematPlan(),
                                        offload=_offload(offload, remat), precision=precision,
                                        params_dtype=params_dtype, optimizer=optimizer)
                            if not rule(plan, f"{region} {sched} v={v} b={b}", m, where=region):
                                continue
                            c = price(plan, (tp, cp, pp, dp, hsdp, offload))
                            if not c.fits and pp > 1 and remat == "none" and offload == "none" and "remat" not in fx:
                                # the runtime's pipeline remat: a solver per stage under the budget the
                                # stages' slack leaves (planner/stage_remat.py); only where nothing fits without
                                budgets = stage_remat.fit_budgets(c.rank_peaks, plat.device_memory_bytes
                                                                  - opts.reserve_bytes, layer_bytes(b, tp, sp, "none"),
                                                                  layer_bytes(b, tp, sp, "full"), c.stage_layers,
                                                                  [mem.inflight(sched, pp, m, v, rank=k)
                                                                   for k in range(pp)])
                                solved = stage_remat.with_budgets(plan, budgets, layer_bytes(b, 1, False, "none")
                                                                  / layer_bytes(b, tp, sp, "none"))
                                if rule(solved, f"{region} {sched} v={v} b={b} remat={stage_remat.METHOD}", m,
                                        where=region):
                                    price(solved, (tp, cp, pp, dp, hsdp, offload))

    notes: list[str] = []
    scan(fx.get("offload", "none"))
    if not ranked and "offload" not in fx:
        notes.append("no plan fits with the optimizer on the device: searched again with it on the host "
                     "(ZeRO-Offload; --fix offload=none forbids it)")
        scan("optimizer")
    _offload_regions(reject, world, compat, facts_base)
    # by predicted time; equal times (to a microsecond) go to the simpler plan, then the lighter one
    ranked.sort(key=lambda c: (round(c.step_time_s, 6), c.plan.zero, _remat_rank(c.plan),
                               c.plan.sp, c.plan.cp, c.plan.hsdp, c.peak_bytes["total"]))
    for (tp, cp, pp, dp, hsdp, offload), c in sorted(oom.items()):
        if not any(r.plan.tp == tp and r.plan.pp == pp and r.plan.cp == cp for r in ranked):
            over = c.peak_bytes["total"] + opts.reserve_bytes - c.device_bytes
            where = (f"{over / 2**30:.1f} GiB" if over > 0 else
                     f"{(c.host_bytes - plat.host_memory_bytes) / 2**30:.1f} GiB of host memory")
            reject(f"tp={tp}" + (f" cp={cp}" if cp > 1 else "") + f" pp={pp} dp={dp}"
                   + (f" hsdp={hsdp}" if hsdp else "") + (" offload" if offload != "none" else ""), "memory",
                   f"every plan is out of memory; the smallest by {where} ({c.plan.describe()})",
                   over=max(over, 0.0))
    return SearchResult(ranked=ranked, out_of_memory=list(oom.values()), rejected=_merge(rejected),
                        evaluated=count[0], seconds=time.perf_counter() - t0, world=world, notes=notes)


def _offload_regions(reject: Any, world: int, compat: Any, facts_base: dict[str, Any]) -> None:
    """Activation and weight offload: the regions the runtime refuses at this size, each naming its compat
    rule; where it runs (one device) they are not priced on paper, said so (``scaletrain estimate`` prices them)."""
    for what, off in (("activations", OffloadPlan(activations="all")), ("weights", OffloadPlan(params="host"))):
        plan = Plan(dp=world, offload=off)
        bad = compat.violations(plan, compat.Facts(microbatches=1, **facts_base))
        if bad:
            facts = compat.Facts(microbatches=1, **facts_base)
            reject(f"offload {what}", "compat", f"compat rule {bad[0].name}: {bad[0].message(plan, facts)}")
        else:
            reject(f"offload {what}", "priced", f"offload of {what} is not priced on paper (the analytic planner "
                   f"prices the optimizer's, ZeRO-Offload); `scaletrain estimate` prices it")


def _offload(kind: str, remat: str) -> OffloadPlan:
    """The plan's offload keys: none, or the optimizer on the host (ZeRO-Offload), whose runtime does
    full recompute itself (``memory.offload.recompute=all``)."""
    if kind == "none":
        return OffloadPlan()
    recompute = "all" if remat == "full" else "none"
    if kind == "activations":  # saved tensors of every block on the host too (none recomputed)
        return OffloadPlan(optimizer="host", activations="all")
    if kind == "weights":  # and the parameters streamed block by block
        return OffloadPlan(optimizer="host", activations="all" if recompute == "none" else "none",
                           recompute=recompute, params="host")
    return OffloadPlan(optimizer="host", recompute=recompute)


def _remat_rank(plan: Plan) -> int:
    """Less recompute first: none, selective, full, then a pipeline's solver schedule."""
    name = remat_kind(plan)
    return REMATS.index(name) if name in REMATS else len(REMATS)


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
    # memory first, nearest miss first (bytes over the device): what "no plan fits" names
    order = {"memory": 0, "batch": 1, "divisibility": 2, "compat": 3, "runtime": 4}
    return sorted(out.values(), key=lambda r: (order.get(r["kind"], 4), r.get("over", 0.0)))


def why_lost(best: PlanCost, other: PlanCost) -> str:
    """One line: how much slower ``other`` is than ``best`` and the phase that costs it most."""
    pct = (other.step_time_s / best.step_time_s - 1) * 100
    if pct < 0.05:
        return ("same predicted step time; ranked after the simpler plan (fewer ZeRO stages, less recompute, "
                "no SP), then the lighter one")
    diff = {k: other.phases_s.get(k, 0.0) - best.phases_s.get(k, 0.0) for k in best.phases_s}
    worst = max(diff, key=lambda k: diff[k])
    return f"+{pct:.1f}% step time, mostly {worst.replace('_', ' ')} (+{diff[worst] * 1e3:.0f} ms)"
