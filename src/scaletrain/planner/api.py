"""The planner's one entry point: ``scaletrain plan``, ``plan=auto``-free Python callers and
``scaletrain.plan(...)`` rank plans through :func:`rank`, so the CLI and the library return the same list.

:func:`plan` is the public function (exported as ``scaletrain.plan(...)``): any model the runtime
trains — a registry name, ``hf:…``, ``py:module:factory`` or an ``nn.Module`` — on a platform preset
or :class:`~scaletrain.platform.Platform`, for ``devices`` devices; it returns the ranked plans as
``scaletrain plan --json`` prints them (best first). Decoder shapes are priced on paper
(:mod:`.cost`), every other model by its fake-tensor trace (:mod:`.traced`).
"""

from __future__ import annotations

from typing import Any

from scaletrain.errors import UserError


def target(model: Any, platform: Any = None, **overrides: Any) -> Any:
    """What the planner prices: the decoder :class:`~.shape.Shape` on paper, or any other model (a name or
    an ``nn.Module``) built on the meta device and traced (:class:`.traced.Traced`). A decoder shape is
    traced too when ``platform`` carries this model's measured blocks
    (:attr:`~scaletrain.platform.Platform.measured_blocks`: ``plan=auto`` on this machine's CPU processes),
    so a model timed on the machine it will run on is priced by those times whatever its family."""
    from scaletrain.planner.shape import Shape, analytic
    from scaletrain.planner.traced import Traced

    if analytic(model):
        if platform is not None and platform.measured_blocks:
            from scaletrain.measure.block_times import model_key

            traced = Traced.of(model, **overrides)
            if any(row[0] == model_key(traced.model) for row in platform.measured_blocks):
                return traced
        return Shape.of(model, **overrides)
    return Traced.of(model, **overrides)


def rank(model: Any, overrides: dict[str, Any], platforms: list, nodes: list[int], *, gpus_per_node: int,
         global_batch: int, seq: int = 0, fix: list[str] | dict[str, Any] | None = None, precision: str = "bf16",
         optimizer: str = "adamw", **budget: Any) -> tuple[Any, int, Any]:
    """(what was priced: a Shape or a Traced model, the sequence length used, the
    :class:`~.budget.BudgetResult`); one-line UserError when nothing fits, naming the rules."""
    from scaletrain.measure import optimizers
    from scaletrain.planner import budget as bud
    from scaletrain.planner.search import parse_fixed

    fixed = parse_fixed(fix) if isinstance(fix, list) else dict(fix or {})
    shape = target(model, **overrides)
    seq = seq or shape.positions
    if shape.positions and seq > shape.positions:
        raise UserError(f"--seq {seq} exceeds the model's n_positions={shape.positions}; add --set n_positions={seq}")
    optimizers.check(optimizer)
    res = bud.plan_rentals(shape, platforms, nodes, gpus_per_node=gpus_per_node, global_batch=global_batch,
                           seq=seq, fixed=fixed, precision=precision, optimizer=optimizer, **budget)
    if not res.ranked:
        name = model if isinstance(model, str) else type(model).__name__
        where = f"{'/'.join(map(str, nodes))} x {gpus_per_node} {'/'.join(p.name for p in platforms)}"
        what = "no plan fits" if all(not r.ranked for _, _, r in res.searches) else "no plan meets the constraints"
        # the nearest misses (memory, least over first), then the rules that removed the rest of the space
        near = [r for r in res.rejected if r["kind"] == "memory"][:3]
        rules = [r for r in res.rejected if r["kind"] not in ("memory", "priced")][:2]
        why = "; ".join(([f"nearest misses: {near[0]['region']}: {near[0]['reason']}"] if near else [])
                        + [f"{r['region']}: {r['reason']}" for r in near[1:]]
                        + [f"ruled out {r['region']}: {r['reason']}" for r in rules])
        raise UserError(f"{what}: {name} on {where} with global batch {global_batch}: "
                        + (why or "no candidate plan in the searched space (check --fix)"))
    return shape, seq, res


def entry(r, best=None, objective: str = "time") -> dict:
    """One ranked plan (a :class:`~scaletrain.planner.budget.Rental`) as JSON: the issue's schema, plus
    phases and bubble, and where it runs and what the stated run costs (null when unknown)."""
    from scaletrain.planner.budget import why_lost

    c = r.cost
    # "plan" is the Plan's own JSON (flat fields, remat and offload as objects): `scaletrain train --plan`
    # reads this entry back; "summary" says the same in a few words (remat none / selective / full ...)
    d = {"plan": c.plan.to_dict(), "summary": c.to_dict()["plan"], "describe": c.plan.describe(), "fits": c.fits,
         "step_time_s": c.step_time_s, "tokens_per_s": c.tokens_per_s,
         "tflops_per_device": c.tflops_per_device, "mfu": c.mfu, "peak_bytes": c.peak_bytes["total"],
         "peak_bytes_by_category": c.peak_bytes, "device_bytes": c.device_bytes, "heaviest_rank": c.heaviest_rank,
         "bubble_fraction": c.bubble_fraction, "exposed_comm_s": c.exposed_comm_s, "phases_s": c.phases_s,
         "blocks_s": c.blocks_s, "stage_layers": list(c.stage_layers), "platform": r.platform.name,
         "nodes": r.nodes, "devices": r.devices,
         "price_per_device_hour": r.platform.price_per_device_hour or None, "train_steps": r.steps or None,
         "train_time_s": r.train_time_s, "train_cost": r.train_cost}
    if best is not None and best is not r:
        d["why_not_first"] = why_lost(best, r, objective)
    return d




def plan(model: Any, *, platform: Any = "a100-80g", devices: int = 8, gpus_per_node: int = 0, global_batch: int,
         seq: int = 0, fix: dict[str, Any] | None = None, precision: str = "bf16", optimizer: str = "adamw",
         overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The plans that fit ``model`` on ``devices`` devices of ``platform`` (a preset name or a
    :class:`~scaletrain.platform.Platform`), best first, each as ``scaletrain plan --json`` prints it
    (``plan`` the Plan's own dict, ``step_time_s`` seconds, ``peak_bytes`` bytes of the heaviest rank).
    ``gpus_per_node``: devices per node (default: all ``devices`` in one node). ``fix``: pinned
    dimensions as ``--fix`` takes them (``{"tp": 2}``). ``overrides``: the model's config (``--set``)."""
    from scaletrain import platform as platforms

    plat = platforms.get(platform) if isinstance(platform, str) else platform
    per_node = gpus_per_node or devices
    if devices < 1 or per_node < 1 or devices % per_node:
        raise UserError(f"devices={devices} must be a positive multiple of gpus_per_node={per_node}")
    if global_batch < 1:
        raise UserError(f"global_batch must be >= 1 (got {global_batch})")
    if fix:
        from scaletrain.planner.search import parse_fixed

        fix = parse_fixed([f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fix.items()])
    _, _, res = rank(model, dict(overrides or {}), [plat], [devices // per_node], gpus_per_node=per_node,
                     global_batch=global_batch, seq=seq, fix=fix, precision=precision, optimizer=optimizer)
    best = res.ranked[0]
    return [entry(r, best) for r in res.ranked]
