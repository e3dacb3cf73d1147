"""Measured pipeline steps versus the simulator: step time, per-rank bubble, peak memory.

For P = 2 and 4 ranks (gloo, CPU, one thread each) and every schedule, the runtime trains
GPT-2 tiny (6 layers) with AdamW on M = 8 micro-batches and records its compute events. Then:

* measured step time and per-rank bubble come from those events through
  :func:`scaletrain.techniques.pipeline.summarise` — the simulator's own definitions; the host
  time of posting a send (gloo's ``isend``: milliseconds on a loaded machine) is charged to the
  pass that produced the tensor, in the measurement and in the costs alike;
* the prediction is :func:`~scaletrain.techniques.pipeline.simulate` of the same schedule with
  the per-stage costs of the same measured step (median F, B, I, W, optimizer time; Chimera's
  gradient all-reduce: the later-arriving rank's duration, i.e. without the wait) and a link
  fitted to a ping-pong between ranks (latency + bytes / bandwidth): it tests the simulator's
  *composition* of costs into a step, not the cost estimates. The shortest measured step is
  reported (the least disturbed by other processes on a shared machine), with medians over steps;
* memory: the peak of every rank (:class:`scaletrain.measure.tracker.MemoryTracker`: weights,
  gradients, AdamW states, activations, temporaries) versus the simulator's
  ``peak_memory_bytes`` with per-stage bytes from the cost face
  :func:`scaletrain.techniques.pipeline.memory.stage_memory` (fake-tensor estimate): weights,
  gradients with their lifetime (from a stage's first backward until ``zero_grad``), AdamW's
  states and the for-loop step's transient, the activation set of an in-flight micro-batch, the
  forward and backward transients of a stage (temporaries, the received output gradient, the
  input gradient), and, replayed over the action lists, sent tensors until the runtime
  releases them and PipeDream's weight snapshots as the runtime takes them.

Run: ``python benchmarks/pipeline/measured.py [--ranks 2 4] [--steps 5]``; writes
``benchmarks/results/pipeline_measured.json`` and measured timelines
``benchmarks/results/pipeline_timeline_<schedule>_P<P>.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from itertools import cycle
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MB, RESULTS, SEQ, example_input, lm_loss, make_model, random_microbatches, write_json  # noqa: E402

from scaletrain.techniques.pipeline import SCHEDULES, Link, StageCosts, build, simulate, summarise  # noqa: E402
from scaletrain.techniques.pipeline.schedules import Action  # noqa: E402
from scaletrain.techniques.pipeline.actions import message_key  # noqa: E402
from scaletrain.testing import run_distributed  # noqa: E402

M = 8
ASYNC_WINDOWS = 5


def _pingpong(rank: int, world: int, nbytes: int, reps: int = 15) -> float:
    """One-way time (s) of an ``nbytes`` message between rank pairs (0,1), (2,3)...: median RTT / 2."""
    peer = rank ^ 1
    buf = torch.zeros(max(nbytes // 4, 1))
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        if rank % 2 == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        times.append((time.perf_counter() - t) / 2)
    return statistics.median(times)


def _worker(rank: int, world: int, schedules: list[str], steps: int) -> dict:
    from scaletrain.measure.tracker import MemoryTracker
    from scaletrain.techniques.pipeline.runtime import PipelineRuntime

    cores = os.environ.get("SCALETRAIN_BENCH_CORES")  # --cores: every rank on these CPUs
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    out: dict = {"link": {n: _pingpong(rank, world, n) for n in (1024, MB * SEQ * 128 * 4, 4 << 20)}}
    mbs = random_microbatches(M)
    for name in schedules:
        v = 2 if name == "interleaved" else 1
        model = make_model()
        rt = PipelineRuntime(model, name, M, pp=world, virtual=v, loss_fn=lm_loss, example_input=example_input(),
                             timeout_s=300)
        opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)

        def update() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        runs, comms = [], []
        if rt.asynchronous:
            rt.train(3, cycle(mbs), update)  # warm-up stream
            rt.train(ASYNC_WINDOWS, cycle(mbs), update)
            runs.append([tuple(e) for e in rt.events])
            comms.append([tuple(e) for e in rt.comm_events])
        else:
            for _ in range(2):
                rt.train_step(iter(mbs), update)
            for _ in range(steps):
                rt.train_step(iter(mbs), update)
                runs.append([tuple(e) for e in rt.events])
                comms.append([tuple(e) for e in rt.comm_events])
        with MemoryTracker(model=rt.module, optimizer=opt) as tr:
            if rt.asynchronous:
                rt.train(ASYNC_WINDOWS, cycle(mbs), update)
            else:
                rt.train_step(iter(mbs), update)
        stage_params = {f"{p}:{s}": sum(t.numel() * t.element_size() for t in dict.fromkeys(r.module.parameters()))
                        for (p, s), r in rt.replicas.items()}
        out[name] = {"runs": runs, "comms": comms, "peak_bytes": tr.peak_bytes, "peak_breakdown": tr.peak_breakdown,
                     "stage_param_bytes": stage_params, "bounds": rt.bounds,
                     "boundary_bytes": [sp.nbytes for sp in rt.specs]}
        rt.close()
    return out


def _fit_link(samples: dict[int, float]) -> Link:
    """Least-squares latency + bytes/bandwidth through the ping-pong points."""
    xs, ys = list(samples), list(samples.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return Link(bandwidth_Bps=1.0 / slope, latency_s=max(my - slope * mx, 0.0))


def _memory_costs(bounds: list[int]) -> dict[str, list[float]]:
    """Per-stage memory cost face (see the module doc); torch's AdamW runs its for-loop on CPU."""
    from scaletrain.techniques.pipeline.memory import deferred_grads, stage_memory

    model = make_model()
    zb = deferred_grads(model, bounds, example_input())  # zb1p's deferred weight gradients, as plan_costs
    mem = stage_memory(model, bounds, example_input(), target=torch.zeros(MB, SEQ, dtype=torch.long),
                       loss_fn=lm_loss, optimizer="adamw", foreach=False)
    mem_split = stage_memory(model, bounds, example_input(), target=torch.zeros(MB, SEQ, dtype=torch.long),
                             loss_fn=lm_loss, optimizer="adamw", foreach=False, deferred=zb)
    return {**mem, "split": {**mem_split, "wstash_bytes": zb.wstash_bytes, "wgrad_temp_bytes": zb.wgrad_temp_bytes}}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def _costs(sched, run: list, mem: dict[str, list[float]], boundary: list[float]) -> StageCosts:
    """Per-stage costs of one measured step: mean F, B (or I and W), median optimizer time."""
    S, P = sched.n_stages, sched.n_ranks
    dur: dict[tuple[str, int], list[float]] = {}
    for e in run:
        dur.setdefault((e[1], e[5]), []).append(e[4] - e[3])
    # the mean, not the median: a rank runs its passes back to back, so its busy time is the sum
    # of their times, which the mean preserves and the median of a right-skewed spread does not
    f = [_mean(dur.get(("F", s), [])) for s in range(S)]
    i = [_mean(dur.get(("I", s), [])) for s in range(S)]
    w = [_mean(dur.get(("W", s), [])) for s in range(S)]
    b = [_mean(dur.get(("B", s), [])) or i[s] + w[s] for s in range(S)]
    # a rank's update is recorded once per window; the simulator charges each OPT action (one per
    # local stage replica), so spread it; a stage held by two ranks (Chimera) takes the mean
    opt_cost: dict[int, list[float]] = {}
    for r in range(P):
        d = [e[4] - e[3] for e in run if e[0] == r and e[1] == "OPT"]
        local = sched.local_stages(r)
        c = _median(d) / (1 if sched.asynchronous else len(local))
        for _, s in local:
            opt_cost.setdefault(s, []).append(c)
    # Chimera's gradient all-reduce: each pair of events starts when its rank arrives and ends
    # together, so the later arrival's duration is the all-reduce itself (the earlier one waited)
    syncs: dict[tuple[int, int], list[float]] = {}
    for e in run:
        if e[1] == "GRAD_SYNC":
            syncs.setdefault((e[5], e[2]), []).append(e[4] - e[3])
    sync = [_median([min(d) for (st, _), d in syncs.items() if st == s]) for s in range(S)] if syncs else None
    return StageCosts(fwd_s=f, bwd_s=b, igrad_s=i if sched.split_backward else None, sync_s=sync,
                      opt_s=[statistics.fmean(opt_cost[s]) for s in range(S)], boundary_bytes=boundary,
                      **{k: v for k, v in (mem["split"] if sched.split_backward else mem).items()
                         if k not in ("boundary_bytes", "split")})


def _charge_sends(run: list, comm: list) -> list:
    """Charge the host time of posting a send (gloo copies/queues it: milliseconds under load) to
    the pass that produced the tensor, which the send follows in the list. The simulator's link
    has no sender-side cost, so measured and simulated passes both include it."""
    out = [list(e) for e in run]
    by_rank: dict[int, list[list]] = {}
    for e in out:
        by_rank.setdefault(e[0], []).append(e)
    for c in comm:
        if not c[1].startswith("SEND"):
            continue
        prev = [e for e in by_rank.get(c[0], []) if e[1] in ("F", "B", "I") and e[4] <= c[3] + 1e-9]
        if prev:
            p = max(prev, key=lambda e: e[4])
            p[4] = max(p[4], c[4])
    return [tuple(e) for e in out]


def _pass_times(run: list) -> dict[tuple, float]:
    """Each measured compute pass's own duration, keyed as :func:`simulate`'s ``durations``
    (the optimizer is left to the per-stage cost: a rank records one update per window)."""
    return {(e[0], e[1], e[6], e[5], e[2]): e[4] - e[3] for e in run if e[1] in ("F", "B", "I", "W")}


def _delivery(comm: list, boundary: list[float], link: Link) -> dict:
    """Per message: from the later of (send posted, receiver waiting) to the receive's end, i.e. the
    delivery time the link model predicts as ``latency + bytes / bandwidth``; median and 90th
    percentile over the step's messages, and the link model's figure for a boundary tensor."""
    def key(c) -> tuple:  # the simulator's send/receive matching, on a (rank, kind, mb, start, end, stage, pipe) event
        return message_key(Action(c[1], c[5], c[2], pipe=c[6]))

    sent = {key(c): c[4] for c in comm if c[1] in ("SEND_F", "SEND_B")}
    d = sorted(c[4] - max(c[3], sent[key(c)]) for c in comm if c[1] in ("RECV_F", "RECV_B") and key(c) in sent)
    if not d:
        return {}
    return {"n_messages": len(d), "median_s": _median(d), "mean_s": _mean(d), "p90_s": d[int(0.9 * (len(d) - 1))],
            "link_model_s": link.time(max(boundary))}


def _insitu_link(comm: list, boundary: list[float], link: Link) -> Link:
    """The ping-pong link with its latency raised so that a boundary tensor's delivery takes the
    step's *mean* measured delivery: the ping-pong runs on idle ranks, while in the pipeline a
    message may land when its receiver is descheduled (more ranks than cores) — a tail of
    milliseconds that the mean carries and the median does not."""
    d = _delivery(comm, boundary, link)
    if not d:
        return link
    return Link(link.bandwidth_Bps, max(link.latency_s, d["mean_s"] - max(boundary) / link.bandwidth_Bps))


def _comm_time(comm: list, P: int, prefix: str) -> list[float]:
    return [sum(c[4] - c[3] for c in comm if c[0] == r and c[1].startswith(prefix)) for r in range(P)]


def analyse(P: int, name: str, rec: dict, link: Link) -> dict:
    """Measured versus simulated, step by step: each measured step is simulated with its own
    per-stage costs; the least-disturbed step (shortest) is reported, with the median over steps."""
    v = 2 if name == "interleaved" else 1
    sched = build(name, P, M, v, steps=ASYNC_WINDOWS if name in ("pipedream", "pipedream-2bw") else None)
    mem = _memory_costs(rec["bounds"])
    boundary = [float(x) for x in rec["boundary_bytes"][1:]]
    steps = []
    for run, comm in zip(rec["runs"], rec["comms"]):
        run = _charge_sends(run, comm)
        costs = _costs(sched, run, mem, boundary)
        steps.append((summarise(sched, run, costs), simulate(sched, costs, link), costs,
                      simulate(sched, costs, link, durations=_pass_times(run)),
                      simulate(sched, costs, _insitu_link(comm, boundary, link))))
    best = min(range(len(steps)), key=lambda k: steps[k][0].step_time_s)
    meas, sim, costs, replay, insitu = steps[best]
    idle = [meas.step_time_s * meas.bubble_per_rank[r] for r in range(P)]
    peaks = rec["peak_bytes"]
    diff = [abs(a - c) for a, c in zip(meas.bubble_per_rank, sim.bubble_per_rank)]
    return {
        "measured": {"step_time_s": meas.step_time_s, "bubble_per_rank": meas.bubble_per_rank,
                     "bubble_fraction": meas.bubble_fraction, "peak_memory_bytes": peaks,
                     "peak_breakdown": rec["peak_breakdown"], "peak_inflight": meas.peak_inflight,
                     "idle_s_per_rank": idle,
                     "recv_s_per_rank": _comm_time(rec["comms"][best], P, "RECV"),
                     "send_post_s_per_rank": _comm_time(rec["comms"][best], P, "SEND"),
                     "delivery": _delivery(rec["comms"][best], boundary, link)},
        "simulated": {"step_time_s": sim.step_time_s, "bubble_per_rank": sim.bubble_per_rank,
                      "bubble_fraction": sim.bubble_fraction, "peak_memory_bytes": sim.peak_memory_bytes,
                      "peak_inflight": sim.peak_inflight},
        "ratio_step_time": meas.step_time_s / sim.step_time_s,
        "insitu_link": {"step_time_s": insitu.step_time_s, "ratio_step_time": meas.step_time_s / insitu.step_time_s},
        "replayed": {"step_time_s": replay.step_time_s, "bubble_per_rank": replay.bubble_per_rank,
                     "ratio_step_time": meas.step_time_s / replay.step_time_s},
        "bubble_abs_diff_per_rank": diff,
        "ratio_peak_memory": [m / s for m, s in zip(peaks, sim.peak_memory_bytes)],
        "median_over_steps": {
            "ratio_step_time": _median([m.step_time_s / s.step_time_s for m, s, *_ in steps]),
            "ratio_step_time_replayed": _median([m.step_time_s / rp.step_time_s for m, _, _, rp, _ in steps]),
            "bubble_fraction_measured": _median([m.bubble_fraction for m, *_ in steps]),
            "bubble_fraction_simulated": _median([s.bubble_fraction for _, s, *_ in steps]),
        },
        "within_10pct": {"step_time": abs(meas.step_time_s / sim.step_time_s - 1) <= 0.1,
                         "bubble_per_rank": [d <= 0.1 for d in diff],
                         "peak_memory_per_rank": [abs(m / s - 1) <= 0.1 for m, s in zip(peaks, sim.peak_memory_bytes)]},
        "stage_costs": {"fwd_s": costs.fwd_s, "bwd_s": costs.bwd_s, "igrad_s": costs.igrad_s, "opt_s": costs.opt_s,
                        "memory": mem},
        "n_steps_measured": len(steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5, help="measured steps per synchronous schedule")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--cores", default="", help="pin every rank to these CPUs (e.g. 0): ranks share cores, "
                    "to see what oversubscription does to the wait times; output pipeline_measured_cores<C>.json")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", default="", help="result file name under benchmarks/results/ (default "
                    "pipeline_measured.json, or pipeline_measured_cores<C>.json with --cores)")
    args = ap.parse_args()
    if args.cores:
        os.environ["SCALETRAIN_BENCH_CORES"] = args.cores
    from scaletrain.techniques.pipeline.timeline import draw

    out: dict = {"model": "gpt2-tiny n_layer=6", "micro_batch": MB, "seq": SEQ, "microbatches": M,
                 "command": "python benchmarks/pipeline/measured.py " + " ".join(sys.argv[1:]), "results": {}}
    for P in args.ranks:
        t = time.time()
        per_rank = run_distributed(_worker, P, args.schedules, args.steps, timeout_s=1800)
        link_pts = {int(n): statistics.median(r["link"][n] for r in per_rank) for n in per_rank[0]["link"]}
        link = _fit_link(link_pts)
        res = {"link": {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps, "points": link_pts},
               "wall_s": None}
        for name in args.schedules:
            rec = {k: per_rank[0][name][k] for k in ("stage_param_bytes", "bounds", "boundary_bytes")}
            rec["runs"] = [sorted(e for r in per_rank for e in r[name]["runs"][k])
                           for k in range(len(per_rank[0][name]["runs"]))]
            rec["comms"] = [sorted(e for r in per_rank for e in r[name]["comms"][k])
                            for k in range(len(per_rank[0][name]["runs"]))]
            rec["peak_bytes"] = [r[name]["peak_bytes"] for r in per_rank]
            rec["peak_breakdown"] = [r[name]["peak_breakdown"] for r in per_rank]
            rec["stage_param_bytes"] = {k: v for r in per_rank for k, v in r[name]["stage_param_bytes"].items()}
            res[name] = analyse(P, name, rec, link)
            runs = rec["runs"]
            pick = min(range(len(runs)), key=lambda k: max(e[4] for e in runs[k]))  # the reported step
            png = RESULTS / f"pipeline_timeline_{name}_P{P}.png"
            if not args.no_plots:
                draw(runs[pick], png, n_ranks=P, title=f"{name} P={P} M={M} measured (gloo, CPU): bubble "
                     f"{res[name]['measured']['bubble_fraction']:.3f}, "
                     f"simulated {res[name]['simulated']['bubble_fraction']:.3f}")
            m, s = res[name]["measured"], res[name]["simulated"]
            print(f"P={P} {name:14s} step {m['step_time_s'] * 1e3:7.1f} ms (sim {s['step_time_s'] * 1e3:7.1f}, "
                  f"x{res[name]['ratio_step_time']:.3f}; replayed x{res[name]['replayed']['ratio_step_time']:.3f}; "
                  f"in-situ link x{res[name]['insitu_link']['ratio_step_time']:.3f})  "
                  f"delivery ms {m['delivery'].get('median_s', 0) * 1e3:.2f}/{m['delivery'].get('p90_s', 0) * 1e3:.2f} "
                  f"(link {m['delivery'].get('link_model_s', 0) * 1e3:.2f})  bubble {m['bubble_fraction']:.3f} (sim "
                  f"{s['bubble_fraction']:.3f})  peak MiB " + " ".join(
                      f"{a / 2**20:.1f}/{b / 2**20:.1f}"
                      for a, b in zip(m["peak_memory_bytes"], s["peak_memory_bytes"])),
                  flush=True)
        res["wall_s"] = time.time() - t
        out["results"][str(P)] = res
    out["cores"] = args.cores or "all"
    name = args.out or (f"pipeline_measured_cores{args.cores.replace(',', '-')}.json" if args.cores
                        else "pipeline_measured.json")
    print("wrote", write_json(name, out))


if __name__ == "__main__":
    main()
