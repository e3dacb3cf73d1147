"""``scaletrain remat``: rematerialization schedules of a model for a memory budget.

Plans each method on the model's estimated Profile (fake tensors, nothing allocated) and prints
its predicted activation peak and time; ``--measure`` also runs one real step per method on
this machine (CPU) and reports the measured peak (memory tracker), step time (median, min, max of
interleaved rounds on pinned threads: :func:`~scaletrain.techniques.remat.measure_run.time_interleaved`) and
whether the gradients equal plain autograd's bitwise. ``--intra-block K`` instead plans inside
block K of the model's chain (an ILP over its aten ops, run by selective activation checkpointing:
:mod:`scaletrain.techniques.remat.intrablock`) and reports its saved bytes and recompute cost.
"""

from __future__ import annotations

import argparse
import json

from scaletrain.argtypes import count, positive_float, positive_int

NAME = "remat"
HELP = "rematerialization schedules for a memory budget: predicted (and measured) peak and time"
DESCRIPTION = __doc__ + """
The budget covers activations: the batch, stored activations, tensors saved for backward,
activation gradients and temporaries — not parameters, their gradients or optimizer state.

examples:
  scaletrain remat --model gpt2-tiny --batch 4 --seq 64 --budget 8MiB
  scaletrain remat --model resnet-mini --batch 8 --budget 20MiB --methods optimal periodic --measure --json
  scaletrain remat --model gpt2-tiny --batch 2 --seq 16 --intra-block 1 --budget 512KiB --measure --show-ops

With --intra-block the budget is what block K may keep for backward beyond its input.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaletrain.schema import BY_FIELD  # the methods without importing torch (the parser of every command is
    # built for any command)

    METHODS = BY_FIELD["remat.method"].choices

    p.add_argument("--model", required=True, help="model: a reference name, hf:<family>, hf:/path/to/dir or "
                                                   "py:module:factory (see `scaletrain models`)")
    p.add_argument("--batch", type=positive_int(), default=1, help="micro-batch size (default 1)")
    p.add_argument("--seq", type=positive_int(), default=None, help="sequence length for language models")
    p.add_argument("--budget", required=True, help="activation memory budget: bytes or a size like 1.5GiB, 512MiB")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, metavar="METHOD",
                   help=f"methods to plan (default: all of {', '.join(METHODS)})")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="autocast precision")
    p.add_argument("--time-limit", type=positive_float(86400.0), default=20.0,
                   help="ilp solver time limit, seconds (default 20)")
    p.add_argument("--measure", action="store_true", help="run each schedule once for real and measure it")
    p.add_argument("--repeats", type=positive_int(1000), default=5,
                   help="timed rounds with --measure: every method once a round, in rotated order, after one "
                        "untimed warm-up round (median, min and max reported)")
    p.add_argument("--threads", type=count(1024), default=1,
                   help="torch CPU threads while measuring (default 1: steady timings on a shared machine; "
                        "0 = torch's default)")
    p.add_argument("--show-ops", action="store_true", help="print each schedule's operations")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per method")
    p.add_argument("--intra-block", type=int, default=None, metavar="K",
                   help="plan inside block K of the model's chain instead (-1 = last; --budget: bytes the block "
                        "may keep for backward beyond its input); --json then prints one object")


def run(args: argparse.Namespace) -> int:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.errors import UserError
    from scaletrain.measure.step import autocast, loss_for, make_batch
    from scaletrain.techniques import remat
    from scaletrain.techniques.remat.fromtrace import estimate_graph
    from scaletrain.techniques.remat.executor import run_schedule
    from scaletrain.techniques.remat.measure_run import measure_autograd, measure_schedule, same_grads, time_interleaved

    models.check_name(args.model)  # a reference model, hf:... or py:...; else one line listing them
    if args.batch < 1:
        raise UserError(f"--batch must be ≥ 1, got {args.batch}")
    if args.repeats < 1 or args.threads < 0:
        raise UserError(f"--repeats must be ≥ 1 and --threads ≥ 0, got {args.repeats} and {args.threads}")
    if args.budget.strip().startswith("-"):
        raise UserError(f"--budget must be ≥ 0 bytes, got {args.budget!r}: give bytes or a size like 512KiB")
    budget = remat.parse_bytes(args.budget)
    if budget is None:
        raise UserError("--budget is empty: give bytes or a size like 1.5GiB")
    if args.intra_block is not None:
        return _intra_block(args, budget)
    meta_model = models.get(args.model, device="meta")
    meta_chain = to_chain(meta_model)
    with FakeTensorMode():
        x_fake, y_fake = make_batch(meta_chain, args.batch, args.seq)
    graph, profile = estimate_graph(meta_chain, x_fake, target=y_fake, precision=args.precision, name=args.model)
    lowest = remat.min_budget(graph, "optimal")
    if budget < lowest:
        raise UserError(f"budget {remat.fmt_bytes(budget)} is below the minimum feasible {remat.fmt_bytes(lowest)} "
                        f"for {args.model} (batch {args.batch}{f', seq {args.seq}' if args.seq else ''})")
    rows = []
    for method in args.methods:
        row = {"method": method, "budget_bytes": budget, "predicted_peak_bytes": None, "predicted_time_s": None,
               "measured_peak_bytes": None, "step_time_s": None, "grads_match": None}
        try:
            opts = {"time_limit": args.time_limit} if method == "ilp" else {}
            s = remat.solve(graph, budget, method, **opts)
        except UserError as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        row.update(predicted_peak_bytes=s.predicted_peak_bytes, predicted_time_s=s.predicted_time_s,
                   forwards=s.n_forwards, blocks=len(graph), ops=str(s))
        row["_schedule"] = s
        rows.append(row)
    if args.measure:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads or threads)
        torch.manual_seed(0)
        model = models.get(args.model)
        chain = to_chain(model)
        x, y = make_batch(chain, args.batch, args.seq)
        loss_fn = loss_for(model)
        # peaks and gradients first (one run each under the tracker, which also warms every method up) ...
        with autocast(args.precision, "cpu"):
            ref = measure_autograd(model, chain, x, y, loss_fn, repeats=1)
        steps = {"autograd": lambda: loss_fn(chain(x), y).backward()}
        for row in rows:
            if "_schedule" not in row:
                continue
            with autocast(args.precision, "cpu"):
                m = measure_schedule(model, chain, row["_schedule"], x, y, loss_fn, repeats=1)
            row.update(measured_peak_bytes=m["measured_peak_bytes"], grads_match=same_grads(m["grads"], ref["grads"]))
            steps[row["method"]] = (lambda s: lambda: run_schedule(chain, s, x, loss_fn, y))(row["_schedule"])
        rows.append({"method": "autograd", "budget_bytes": budget, "predicted_peak_bytes": None,
                     "predicted_time_s": None, "measured_peak_bytes": ref["measured_peak_bytes"],
                     "grads_match": True, "note": "plain loss.backward(), the reference"})
        # ... then the times, every method in every round (time_interleaved), not one method after another
        with autocast(args.precision, "cpu"):
            spread = time_interleaved(model, steps, rounds=args.repeats)
        torch.set_num_threads(threads)  # (a caller in the same process keeps its own)
        for row in rows:
            if row["method"] in spread:
                s = spread[row["method"]]
                row.update(step_time_s=s["median"], step_time_min_s=s["min"], step_time_max_s=s["max"])
    for row in rows:
        row.pop("_schedule", None)
    if args.json:
        print(json.dumps(rows))
        return 0
    _print_table(args, profile, graph, budget, lowest, rows)
    return 0


def _print_table(args, profile, graph, budget, lowest, rows) -> None:
    from scaletrain.techniques.remat import baseline_time, min_budget

    mib = lambda b: "-" if b is None else f"{b / 2**20:.2f}"
    ms = lambda s: "-" if s is None else f"{s * 1e3:.2f}"
    none_peak = min_budget(graph, "none")
    base = baseline_time(graph)
    print(f"{args.model}: {len(graph)} blocks, batch {args.batch}"
          f"{f', seq {args.seq}' if args.seq else ''}, {args.precision}; budget {mib(budget)} MiB "
          f"(minimum feasible {mib(lowest)} MiB, no remat {mib(none_peak)} MiB; estimated profile)")
    head = f"{'method':<10} {'pred peak MiB':>13} {'pred time':>10} {'fwds':>5}"
    if args.measure:
        head += f" {'meas peak MiB':>13} {'step ms':>9} {'min-max ms':>15} {'grads':>6}"
    print(head)
    for r in rows:
        if r.get("error"):  # the table speaks MiB; the solver's message (bytes and GiB) stays in --json
            try:
                need = none_peak if r["method"] == "none" else min_budget(graph, r["method"])
            except Exception:  # noqa: BLE001 - no minimum for this method: show the solver's own words
                print(f"{r['method']:<10} infeasible: {r['error']}")
                continue
            print(f"{r['method']:<10} infeasible: needs {mib(need)} MiB"
                  f"{' without rematerialization' if r['method'] == 'none' else ''}, over the budget of "
                  f"{mib(budget)} MiB")
            continue
        pt = "-" if r["predicted_time_s"] is None else f"{r['predicted_time_s'] / base:.3f}x"
        line = f"{r['method']:<10} {mib(r['predicted_peak_bytes']):>13} {pt:>10} {r.get('forwards', '-'):>5}"
        if args.measure:
            gm = "-" if r["grads_match"] is None else ("equal" if r["grads_match"] else "DIFF")
            rng = f"{ms(r.get('step_time_min_s'))}-{ms(r.get('step_time_max_s'))}" if r.get("step_time_min_s") else "-"
            line += f" {mib(r['measured_peak_bytes']):>13} {ms(r['step_time_s']):>9} {rng:>15} {gm:>6}"
        print(line)
        if args.show_ops and r.get("ops"):
            print(f"    {r['ops']}")
    print("pred time: predicted step time relative to no rematerialization (times estimated from FLOPs)")
    if args.measure:
        print(f"step ms: median of {args.repeats} interleaved rounds (every method once a round, order rotated, "
              f"after a warm-up round) with {args.threads or 'torch default'} thread(s); min-max of those rounds")


def _intra_block(args: argparse.Namespace, budget: int) -> int:
    """``--intra-block K``: plan block K's SAC policy under ``budget``; with --measure, run it."""
    import torch

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.errors import UserError
    from scaletrain.measure.step import autocast, make_batch
    from scaletrain.measure.tracker import MemoryTracker
    from scaletrain.techniques.remat.intrablock import apply_block_plan, plan_block, remove_block_plan, trace_block
    from scaletrain.techniques.remat.measure_run import EXCLUDED, same_grads

    torch.manual_seed(0)
    model = models.get(args.model)
    chain = to_chain(model)
    n, k = len(chain), args.intra_block
    if not -n <= k < n:
        raise UserError(f"--intra-block {k} is out of range: {args.model} has {n} blocks "
                        f"({', '.join(chain.names)}), allowed 0..{n - 1} or -{n}..-1 from the end")
    k %= n
    block = chain.blocks[k]
    x, _ = make_batch(chain, args.batch, args.seq)
    with torch.no_grad(), autocast(args.precision, "cpu"):
        x = chain.run(x, 0, k)  # the block's input: the blocks before it applied to a batch
    with autocast(args.precision, "cpu"):
        ops = trace_block(block, x)
    plan = plan_block(block, x, budget, time_limit=args.time_limit, ops=ops)
    cand = [o for o in ops if o.candidate]
    row = {"model": args.model, "block": k, "block_name": chain.names[k], "blocks": n, "batch": args.batch,
           "seq": args.seq, "precision": args.precision, "budget_bytes": budget, "traced_ops": len(ops),
           "candidate_ops": len(cand), "full_saved_bytes": sum(o.out_bytes for o in cand),
           "predicted_saved_bytes": plan.predicted_saved_bytes, "kept_op_count": len(plan.kept),
           "no_checkpoint": plan.no_checkpoint,
           "predicted_recompute_s": float(plan.predicted_recompute_time_s),
           "predicted_recompute_flops": plan.predicted_recompute_flops,
           "measured_saved_bytes": None, "measured_plain_saved_bytes": None, "grads_equal": None}
    if args.show_ops:
        row["kept_ops"] = [f"{o.key[0]}#{o.key[1]}" for o in ops if o.key in plan.kept]

    def fwd(xx):
        torch.manual_seed(1)  # same dropout masks in every run (checkpoint restores them on replay)
        with autocast(args.precision, "cpu"):
            return block(xx)

    def grads():
        block.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(x.is_floating_point())
        (fwd(xx).float() ** 2).sum().backward()
        return [p.grad for p in block.parameters()] + ([xx.grad] if x.is_floating_point() else [])

    def saved():
        with MemoryTracker(model=block, track_saved=False) as tr:
            y = fwd(x.detach().requires_grad_(x.is_floating_point()))
            _keep, y = y.grad_fn, None  # drop the output, keep the graph: what survives is kept for backward
            return sum(r.nbytes for r in tr.records if r.died is None and r.origin != "pre-existing"
                       and r.category not in EXCLUDED)

    if args.measure:
        ref, row["measured_plain_saved_bytes"] = grads(), saved()
        apply_block_plan(block, plan)
        try:
            row["measured_saved_bytes"], row["grads_equal"] = saved(), same_grads(grads(), ref)
        finally:
            remove_block_plan(block)
    if args.json:
        print(json.dumps(row))
        return 0
    unit = lambda v: next((f"{v / 2**e:.4g} {u}" for e, u in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if v >= 2**e),
                          f"{v} B")
    b = lambda v: "-" if v is None else f"{v} B ({unit(v)})" if v >= 1024 else f"{v} B"
    print(f"{args.model} block {k} ({chain.names[k]}) of {n}, batch {args.batch}"
          f"{f', seq {args.seq}' if args.seq else ''}, {args.precision}: intra-block plan, budget {b(budget)}")
    kept = "plain autograd fits the budget: no checkpoint" if plan.no_checkpoint else f"{len(plan.kept)} kept"
    lines = [("traced ops", len(ops)), ("candidate ops", f"{len(cand)} ({kept})"),
             ("saved, keep all", b(row["full_saved_bytes"])), ("predicted saved", b(plan.predicted_saved_bytes)),
             ("predicted recompute", f"{plan.predicted_recompute_time_s:.4g} s "
                                     f"({plan.predicted_recompute_flops} FLOPs; cost model)")]
    if args.measure:
        lines += [("measured saved", b(row["measured_saved_bytes"])),
                  ("measured, no remat", b(row["measured_plain_saved_bytes"])),
                  ("grads equal", str(row["grads_equal"]).lower())]
    for name, v in lines:
        print(f"  {name:<20} {v}")
    if args.show_ops:
        print(f"  kept ops: {', '.join(row['kept_ops']) or '(none)'}")
    return 0
