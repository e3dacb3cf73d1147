"""scaletrain against the fastest peer, engines interleaved in the same processes: one table.

Per workload (gpt2-mini, vgg-mini; 2 CPU processes, gloo, 1 thread each, fp32, AdamW, clipping 1.0),
every engine is built once in the same two processes from the same seed (same weights) and trained on
the same batches, and the engines take turns: round r runs ``--turn`` steps of each engine, the order
rotated by r places, so a shared machine's load hits every engine alike (round 0 is the warm-up and is
not timed). Each step is timed the same way for every engine: a barrier, then the step (forward,
backward, gradient collectives, clipping, update, zero grad), then the *slowest rank's* seconds (every
rank's times are gathered at the end). Peak: scaletrain's memory tracker (the tracker ``compare`` and
``train.measure_memory`` use) over one extra step of each engine on each rank, heaviest rank.

Engines: scaletrain ``zero=3`` with ``parallel.fsdp_group=auto`` (grouping chosen by cost) and
``=block`` (one group per block); torch ``fully_shard`` per block and as one group (the root only);
scaletrain ``zero=2`` (and DeepSpeed ZeRO-2 / ZeRO-3 when ``deepspeed`` imports, ``DS_ACCELERATOR=cpu``);
scaletrain ``zero=0`` (DDP) and torch DDP; on gpt2-mini also scaletrain ``tp=2`` and torch's own tensor
parallelism (``parallelize_module`` with Colwise/RowwiseParallel as its tutorial shows it, :func:`_torch_tp`),
both running the whole batch on each rank. The table row of a technique compares scaletrain's engine with
the fastest peer of that technique: ratio = scaletrain median / best peer median (below 1: faster), and
with the fastest peer whose peak is at most scaletrain's (``ratio_at_most_its_peak``); beside it the ratio of
the minima and ``paired_ratio``, the median over rounds of the two engines' same-round times (on a machine
whose load swings between rounds, the medians of two engines can differ by 30 % from one run to the next;
the paired ratio and the minima do not).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/run.py   # -> benchmarks/results/speed.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

RESULTS = Path(__file__).resolve().parents[1] / "results"
WORKLOADS = {"gpt2-mini": dict(batch=8, seq=128), "vgg-mini": dict(batch=32, seq=None)}
"""The compare study's settings (global batch [samples], sequence length [tokens])."""
ROWS = {  # technique -> (scaletrain engine, its peers)
    "ZeRO-3": ("st-zero3-auto", ("fully_shard-block", "fully_shard-one", "deepspeed-zero3")),
    "ZeRO-3 per block": ("st-zero3-block", ("fully_shard-block", "fully_shard-one", "deepspeed-zero3")),
    "ZeRO-3 one group": ("st-zero3-one", ("fully_shard-block", "fully_shard-one", "deepspeed-zero3")),
    "ZeRO-2": ("st-zero2", ("deepspeed-zero2",)),
    "DDP": ("st-ddp", ("torch-ddp",)),
    "TP=2": ("st-tp", ("torch-tp",)),
    "TP=2, step logged": ("st-tp-logged", ("torch-tp",)),
}
TP_ENGINES = ("st-tp", "st-tp-logged", "torch-tp")
"""Tensor-parallel engines (language models only): both ranks run the whole batch, the blocks split."""
OPT = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)


def _engine(name: str, model: nn.Module, loss_fn, micro: int, world: int, seq: int | None, rank: int):
    """One step function (x, y) -> loss of engine ``name`` over ``model``, and what the tracker counts."""
    if name.startswith("st-"):  # scaletrain's runtime stack, as `scaletrain train` builds it
        from scaletrain.plan import Plan
        from scaletrain.techniques.compat import Facts
        from scaletrain.techniques.runtime import RunContext
        from scaletrain.techniques.stack import build_runtime

        zero = {"st-ddp": 0, "st-zero2": 2, "st-tp": 0, "st-tp-logged": 0}.get(name, 3)
        tp = world if name.startswith("st-tp") else 1
        logged = name.endswith("-logged")  # every step a logging step: TP's collectives counted op by op
        # steps / log_every: the trainer's steady step, which counts no traffic op by op (its logging steps
        # run the TP collectives' counter, a dispatch mode over every operator: engine st-tp-logged)
        ctx = RunContext(device=torch.device("cpu"), rank=rank, world=world, dp_world=world // tp,
                         micro_batch=micro * tp, seq_len=seq, loss_fn=loss_fn, task="lm" if seq else "classify",
                         steps=1 if logged else 10**9, log_every=1 if logged else 10**9)
        group = {"st-zero3-block": "block", "st-zero3-one": "1GiB"}.get(name, "auto")
        plan = Plan(zero=zero, fsdp_group=group, tp=tp).resolved(world)
        strat = build_runtime(plan, model, ctx, Facts.of(model, world=world, device="cpu", seq_len=seq))
        opt = strat.build_optimizer(lambda m: torch.optim.AdamW(m.parameters(), **OPT))
        ctx.forward_backward = lambda x, y, w: strat.loss_and_backward(ctx, x, y, w)

        def step(x, y):
            loss = strat.run_micro_batches(ctx, iter([(x, y)]))
            strat.prepare_step(opt)
            strat.clip_grad_norm(opt, 1.0)
            opt.step()
            strat.after_step()
            strat.zero_grad(opt)
            return loss
        return step, model, opt, []
    if name.startswith("deepspeed"):
        import deepspeed

        elems = 25 * 2**20 // 4
        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
               "train_batch_size": micro * world, "gradient_clipping": 1.0, "steps_per_print": 10**9,
               "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": int(name[-1]), "overlap_comm": True, "contiguous_gradients": True,
                                     "reduce_bucket_size": elems, "allgather_bucket_size": elems,
                                     "stage3_prefetch_bucket_size": elems}}
        opt = torch.optim.AdamW(model.parameters(), **OPT)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)

        def step(x, y):
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            return float(loss)
        extra = [p.ds_tensor for p in engine.module.parameters() if getattr(p, "ds_tensor", None) is not None]
        return step, engine.module, opt, extra
    if name == "torch-tp":
        return _torch_tp(model, loss_fn, world)
    if name.startswith("torch-ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        fwd: nn.Module = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
        if name == "torch-ddp-hook":  # the Python all-reduce hook scaletrain's DDP routes through its ledger
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            fwd.register_comm_hook(None, default_hooks.allreduce_hook)
    else:  # fully_shard as its docs show it: per block then the root, or the root alone (one group)
        from torch.distributed.fsdp import fully_shard

        from scaletrain.techniques.data_parallel.fsdp import shardable_blocks

        if name == "fully_shard-block":
            for b in shardable_blocks(model):
                fully_shard(b)
        fwd = fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **OPT)

    def step(x, y):
        loss = loss_fn(fwd(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return step, model, opt, []


def _torch_tp(model: nn.Module, loss_fn, world: int):
    """torch's own tensor parallelism as its tutorial shows it: the ``torch-tp`` peer of ``scaletrain compare``
    (:mod:`scaletrain.compare.tp_peer`: Colwise/RowwiseParallel over this rank's heads, vocabulary-parallel
    embedding and head with ``loss_parallel``, norms plain modules), AdamW with one kind of tensor a group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from scaletrain.compare.tp_peer import clip_mixed, split_groups, torch_tp_split

    torch_tp_split(model, init_device_mesh("cpu", (world,)))
    params = list(model.parameters())
    opt = split_groups(torch.optim.AdamW(params, **OPT))

    def step(x, y):
        with loss_parallel():
            loss = loss_fn(model(x), y)
            loss.backward()
        clip_mixed(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.full_tensor()) if hasattr(loss, "full_tensor") else float(loss)
    return step, model, opt, []


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: wall seconds (what a user waits), or this rank's CPU seconds (all its threads: compute, gloo's
copies and reductions, Python), which a loaded machine inflates far less than wall time, since time spent
waiting for a core or for the other rank is not counted: on a shared machine it compares the work engines do."""


def _worker(rank: int, world: int, workload: str, engines: list[str], rounds: int, turn: int,
            clock: str = "wall") -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.comm import DTensorMemoryTracker
    from scaletrain.measure.step import loss_for, make_batch

    w = WORKLOADS[workload]
    micro = w["batch"] // world
    if not w["seq"]:  # tensor parallelism: the language model only
        engines = [n for n in engines if n not in TP_ENGINES]
    built = {}
    for name in engines:
        torch.manual_seed(0)
        model = models.get(workload)
        built[name] = _engine(name, model, loss_for(model), micro, world, w["seq"], rank)
    torch.manual_seed(1 + rank)
    chain = to_chain(models.get(workload))
    x, y = make_batch(chain, micro, w["seq"])  # this rank's batch, the same for every engine
    torch.manual_seed(1)
    tp_batch = make_batch(chain, micro * world, w["seq"]) if w["seq"] else None  # TP: every rank the whole
    batch = {n: tp_batch if n in TP_ENGINES else (x, y) for n in engines}
    times: dict[str, list[float]] = {n: [] for n in engines}
    tick = CLOCKS[clock]
    for r in range(rounds + 1):
        for i in range(len(engines)):
            name = engines[(i + r) % len(engines)]
            for _ in range(turn):
                dist.barrier()
                t0 = tick()
                built[name][0](*batch[name])
                if r:  # round 0: warm-up
                    times[name].append(tick() - t0)
    peaks = {}
    for name in engines:
        step, model, opt, extra = built[name]
        with DTensorMemoryTracker(model=model, optimizer=opt, track_saved=True) as tr:
            tr.register(extra, "parameters") if extra else None
            step(*batch[name])
        peaks[name] = int(tr.peak_bytes)
    return {"times": times, "peaks": peaks, "engines": engines}


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (after one warm-up round)")
    p.add_argument("--turn", type=int, default=2, help="steps an engine runs per round")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--out", default=str(RESULTS / "speed.json"))
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="step seconds: wall, or each rank's "
                   "CPU seconds (robust to other processes' load; see CLOCKS)")
    p.add_argument("--engines", default="", help="comma-separated subset (also torch-ddp-hook: torch DDP with "
                   "the Python all-reduce comm hook); default: all")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from scaletrain.testing import run_distributed

    has_ds = importlib.util.find_spec("deepspeed") is not None
    engines = ["st-zero3-auto", "st-zero3-block", "st-zero3-one", "fully_shard-block", "fully_shard-one", "st-zero2",
               "st-ddp", "torch-ddp", "st-tp", "torch-tp"] + (["deepspeed-zero2", "deepspeed-zero3"] if has_ds else [])
    if args.engines:
        engines = args.engines.split(",")
    load_before = os.getloadavg()
    out_rows, raw = [], {}
    for wl in args.workloads.split(","):
        t0 = time.time()
        res = run_distributed(_worker, args.world, wl, engines, args.rounds, args.turn, args.clock,
                              timeout_s=1800)
        slowest = {n: [max(r["times"][n][i] for r in res) for i in range(len(res[0]["times"][n]))]
                   for n in res[0]["engines"]}
        stats = {n: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                     "peak_bytes": max(r["peaks"][n] for r in res)} for n, t in slowest.items()}
        rounds = {n: [sum(t[k:k + args.turn]) for k in range(0, len(t), args.turn)] for n, t in slowest.items()}
        raw[wl] = {"engines": stats, "wall_s": time.time() - t0, "slowest_rank_step_s": slowest}
        for tech, (mine, peers) in ROWS.items():
            if mine not in stats:  # --engines left it out
                continue
            there = [q for q in peers if q in stats]
            if not there:
                out_rows.append({"workload": wl, "technique": tech, "scaletrain": mine, "best_peer": None,
                                 "note": "no peer installed"})
                continue
            best = min(there, key=lambda q: stats[q]["median_s"])
            fits = [q for q in there if stats[q]["peak_bytes"] <= stats[mine]["peak_bytes"] * 1.001]
            at_peak = min(fits, key=lambda q: stats[q]["median_s"]) if fits else None
            out_rows.append({"best_peer_at_most_its_peak": at_peak,
                             "ratio_at_most_its_peak":
                                 stats[mine]["median_s"] / stats[at_peak]["median_s"] if at_peak else None,
                             "workload": wl, "technique": tech, "scaletrain": mine, "best_peer": best,
                             "scaletrain_median_s": stats[mine]["median_s"],
                             "peer_median_s": stats[best]["median_s"],
                             "ratio": stats[mine]["median_s"] / stats[best]["median_s"],
                             "ratio_of_mins": stats[mine]["min_s"] / stats[best]["min_s"],
                             # the same round's steps of both engines ran seconds apart: robust to load drift
                             "paired_ratio": statistics.median(a / b for a, b in zip(rounds[mine], rounds[best])),
                             "scaletrain_peak_bytes": stats[mine]["peak_bytes"],
                             "peer_peak_bytes": stats[best]["peak_bytes"]})
    out = {"benchmark": "speed", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                       "note": "shared machine (other agents' jobs running): compare ratios, not absolute times"},
           "versions": {"torch": torch.__version__, "deepspeed": _version("deepspeed"),
                        "python": sys.version.split()[0]},
           "setup": {**vars(args), "engines": engines, "backend": "gloo", "threads_per_rank": 1, "dtype": "fp32",
                     "timing": "barrier, step, slowest rank; engines interleaved in rotated rounds, round 0 warm-up"},
           "workloads": raw, "table": out_rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"load average before/after: {load_before} / {os.getloadavg()}")
    print(f"{'workload':10s} {'technique':17s} {'scaletrain':>15s} {'best peer':>18s} {'ratio':>6s} "
          f"{'peak MiB st/peer':>17s}"
          f"  {'best peer at <= peak':>20s} {'ratio':>6s} {'mins':>5s} {'paired':>6s}")
    for r in out_rows:
        if r.get("best_peer") is None:
            print(f"{r['workload']:10s} {r['technique']:17s} {r['scaletrain']:>15s} {'-':>18s} {'-':>6s}  (no peer)")
            continue
        print(f"{r['workload']:10s} {r['technique']:17s} {r['scaletrain']:>15s} {r['best_peer']:>18s} "
              f"{r['ratio']:6.2f} {r['scaletrain_peak_bytes'] / 2**20:8.2f}/{r['peer_peak_bytes'] / 2**20:.2f}  "
              f"{r['best_peer_at_most_its_peak'] or '-':>20s} "
              f"{r['ratio_at_most_its_peak'] if r['ratio_at_most_its_peak'] is not None else float('nan'):6.2f} "
              f"{r['ratio_of_mins']:5.2f} {r['paired_ratio']:6.2f}")
    for wl, d in raw.items():
        print(wl + ": " + ", ".join(f"{n} {s['median_s'] * 1e3:.0f} [{s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f}] ms"
                                   for n, s in d["engines"].items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
