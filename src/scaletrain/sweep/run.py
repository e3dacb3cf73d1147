"""Run a sweep: every run's trainer in a thread, their shards on the hub's devices.

Order: validate every run's config (one line, exit 2, before anything is written or started) ->
start the devices -> build each run's :class:`~scaletrain.train.trainer.Trainer` in turn (each
seeds and initialises its model exactly as its solo run would, then its RNG stream is taken as
the model's own) -> profile the shard tasks and predict the sweep (:mod:`.simulate`) -> train
all runs at once -> write ``sweep.json`` (measured next to predicted) and the timelines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from scaletrain.errors import ConfigError, UserError
from scaletrain.sweep import predict
from scaletrain.sweep import shards as sharding
from scaletrain.sweep.hub import Hub
from scaletrain.sweep.policy import HOST_KIND, POLICIES, Policy
from scaletrain.sweep.simulate import plot_timelines, simulate, utilisation
from scaletrain.sweep.options import SweepOptions
from scaletrain.sweep.runtime import SpilledRuntime
from scaletrain.train.config import Config


@dataclass
class Run:
    """One run of a sweep: its name (its directory under the sweep's), config and overrides."""

    name: str
    cfg: Config
    overrides: dict[str, Any] = field(default_factory=dict)


def check_run(run: Run) -> None:
    """Refuse, before anything starts, what a sweep cannot train: the compatibility table's ``sweep-*``
    rules on the run's plan (the model's own facts are checked again once it is built)."""
    from dataclasses import replace

    from scaletrain.plan import Plan
    from scaletrain.techniques import compat

    if run.cfg.plan == "auto":
        raise ConfigError(f"run {run.name}: plan=auto does not apply to a sweep; the sweep plans its shards")
    device = "cuda" if run.cfg.train.device == "cuda" else "cpu"
    try:
        compat.check(Plan.from_config(run.cfg), replace(compat.Facts(), sweep=True, device=device))
    except ConfigError as e:
        raise ConfigError(f"run {run.name}: {e}") from None


def _factory(hub: Hub, index: int, run: Run, budget: int | None, shards: int,
             keep: dict[int, Any]) -> Callable[..., SpilledRuntime]:
    def build(plan: Any, model: torch.nn.Module, ctx: Any, facts: Any) -> SpilledRuntime:
        from scaletrain.models.adapters import adapt
        from scaletrain.techniques.offload.probe import probe_chain

        from dataclasses import replace

        from scaletrain.techniques import compat

        try:
            compat.check(plan, replace(facts, sweep=True))
        except ConfigError as e:
            raise ConfigError(f"run {run.name}: {e}") from None
        chain = adapt(model).chain()
        x, y = ctx.example_batch()
        costs = probe_chain(chain, x, y, ctx.loss_fn, ctx.autocast)
        bounds = sharding.partition(costs, budget, shards)
        keep[index] = {"costs": costs, "bounds": bounds}
        rt = SpilledRuntime(model, hub, index, bounds, run.cfg, costs)
        ctx.forward_backward = lambda *a: (_ for _ in ()).throw(RuntimeError("spilled shards run their own passes"))
        return rt

    return build


@dataclass
class SweepResult:
    runs: list[dict[str, Any]]
    makespan_s: float
    timeline: list[Any]
    summary: dict[str, Any]


def _budget(runs: list[Run], opts: SweepOptions) -> int | None:
    """One budget for all devices: the option, else the runs' memory.device_budget (all equal)."""
    if not opts.device_budget:
        found = {r.cfg.memory.device_budget for r in runs}
        if len(found) > 1:
            raise ConfigError(f"the runs give different memory.device_budget values ({', '.join(sorted(found))}); the "
                              f"devices have one budget: set it once (--device-budget)")
    return opts.budget_bytes(runs[0].cfg)


def run_sweep(runs: list[Run], opts: SweepOptions, out: Path, *, log: Callable[[str], None] = print,
              resume: bool = False, predict_only: bool = False) -> SweepResult:
    """Train ``runs`` together (see the module docstring); returns per-run results and the timeline."""
    from scaletrain.train import rundir
    from scaletrain.train.trainer import Trainer

    if len({r.name for r in runs}) != len(runs):
        raise ConfigError("two runs of the sweep have the same name; name them apart")
    for r in runs:
        check_run(r)
        if not predict_only:
            rundir.check_target(out / r.name, resume).release()  # a check only: each run's Trainer holds its lock
    budget = _budget(runs, opts)
    cores = opts.cores or (os.cpu_count() or 1)
    threads = opts.threads or max(1, cores // opts.devices)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the coordinator's host steps hold one core each
    hub = Hub(opts.devices, cores, budget, opts.policy, len(runs), threads=threads, track=opts.track_memory)
    trainers: list[Any] = []
    facts: dict[int, Any] = {}
    try:
        for i, r in enumerate(runs):
            tr = Trainer(r.cfg, None if predict_only else out / r.name, resume=resume,
                         log=lambda s, n=r.name: log(f"[{n}] {s}"),
                         runtime=_factory(hub, i, r, budget, opts.shards, facts))
            tr.parallel.capture_rng()
            trainers.append(tr)
        bounds = [facts[i]["bounds"] for i in range(len(runs))]
        durs, spread = predict.durations(hub, trainers, bounds, opts.repeats)
        progs = [predict.program_of(tr, len(bounds[i])) for i, tr in enumerate(trainers)]
        candidates = {p: simulate(progs, durs, opts.devices, cores, p)
                      for p in (POLICIES if opts.policy == "auto" else (opts.policy,))}
        policy = min(candidates, key=lambda p: (candidates[p].makespan_s, POLICIES.index(p)))
        pred = candidates[policy]
        hub.policy = Policy(policy, len(runs), opts.devices)
        if opts.policy == "auto":
            log("sweep: predicted makespan per policy: " + ", ".join(
                f"{p} {c.makespan_s:.1f} s" for p, c in sorted(candidates.items(), key=lambda x: x[1].makespan_s))
                + f"; running {policy}")
        for m, (p, d) in enumerate(zip(progs, durs)):
            hub.remaining[m] = p.total(d)
            hub.predict[m] = {**d.tasks, (HOST_KIND, 0): d.host}
        log(f"sweep: {len(runs)} runs on {opts.devices} devices ({policy}), shards "
            f"{', '.join(str(len(b)) for b in bounds)}; predicted makespan {pred.makespan_s:.1f} s, "
            f"device utilisation {', '.join(f'{u:.0%}' for u in pred.utilisation)}")
        costs = [facts[i]["costs"] for i in range(len(runs))]
        summary = _prediction(runs, opts, cores, threads, budget, bounds, costs, durs, progs, pred)
        summary.update(policy=policy, predicted_makespan_by_policy={p: c.makespan_s for p, c in candidates.items()},
                       profile_spread=spread, load_average_at_profile=list(os.getloadavg()))
        if spread > 0.2:
            log(f"sweep: warning: shard task times varied by {spread:.0%} while profiled (other load on the "
                f"machine?); the prediction is as uncertain")
        if predict_only:
            return SweepResult([], 0.0, [], summary)
        results, makespan, t0 = _train_all(runs, trainers, out, hub)
        stats = hub.broadcast({"op": "stats"})
        spans = list(hub.timeline)
        summary.update(_measured(spans, stats, opts, makespan, t0, len(runs)))
        summary["makespan_error"] = (pred.makespan_s - makespan) / makespan if makespan else 0.0
        summary["load_average_at_end"] = list(os.getloadavg())
        out.mkdir(parents=True, exist_ok=True)
        plot_timelines([(f"predicted ({policy}): {pred.makespan_s:.1f} s", pred.timeline, opts.devices),
                        (f"measured: {makespan:.1f} s", spans, opts.devices)], [r.name for r in runs],
                       str(out / "timeline.png"))
        return SweepResult(results, makespan, spans, summary)
    finally:
        for tr in trainers:
            tr.close()
        hub.close()
        torch.set_num_threads(old_threads)


def _train_all(runs: list[Run], trainers: list[Any], out: Path, hub: Hub) -> tuple[list[dict[str, Any]], float, float]:
    """Every trainer's ``fit`` in its own thread; (results, makespan seconds, start on the monotonic clock)."""
    results: list[dict[str, Any]] = [{} for _ in runs]
    errors: list[BaseException | None] = [None] * len(runs)

    def train(i: int) -> None:
        try:
            res = trainers[i].fit()
            results[i] = {"name": runs[i].name, "overrides": runs[i].overrides, "status": "ok", "steps": res.steps,
                          "final_loss": res.final_loss, "val_loss": res.val_loss, "losses": res.losses,
                          "out_dir": str(out / runs[i].name)}
        except BaseException as e:  # noqa: BLE001 - reported per run below
            errors[i] = e
        finally:
            hub.finish(i)

    t0 = time.monotonic()
    threads = [threading.Thread(target=train, args=(i,), name=f"run-{runs[i].name}") for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    makespan = time.monotonic() - t0
    for i, e in enumerate(errors):  # a run that failed on its input (diverged, ...) does not stop the others
        if isinstance(e, UserError):
            results[i] = {"name": runs[i].name, "overrides": runs[i].overrides, "status": "failed",
                          "error": str(e).splitlines()[0], "out_dir": str(out / runs[i].name)}
        elif e is not None:  # a bug: its traceback
            raise e
    return results, makespan, t0


def _prediction(runs, opts, cores, threads, budget, bounds, costs, durs, progs, pred) -> dict[str, Any]:
    want = {"h2d": 0, "d2h": 0}
    for i in range(len(runs)):
        tb = sharding.task_bytes(costs[i], bounds[i])
        for kind, shard in progs[i].tasks():
            for d in want:
                want[d] += tb.get((kind, shard), {}).get(d, 0)
    peaks = [max(sharding.shard_cost(costs[i], a, b, b == len(costs[i])).peak_bytes for a, b in bounds[i])
             for i in range(len(runs))]
    return {
        "devices": opts.devices, "cores": cores, "threads_per_device": threads,
        "predicted_makespan_s": pred.makespan_s, "predicted_utilisation": pred.utilisation,
        "predicted_finish_s": pred.finish_s, "budget_bytes": budget, "predicted_shard_peak_bytes": max(peaks),
        "predicted_bytes_moved": want, "shards": {runs[i].name: bounds[i] for i in range(len(runs))},
        "task_seconds": {runs[i].name: {f"{k}{s_}": v for (k, s_), v in durs[i].tasks.items()}
                         for i in range(len(runs))},
        "host_step_s": [d.host for d in durs], "checkpoint_s": [d.checkpoint for d in durs],
        "latency_s": durs[0].latency if durs else 0.0,
    }


def _measured(spans, stats, opts, makespan: float, t0: float, n: int) -> dict[str, Any]:
    _, used = utilisation(spans, opts.devices)
    moved = {d: sum(v for st in stats for key, v in st["transfers"].items() if key.startswith(d + "/"))
             for d in ("h2d", "d2h")}
    return {
        "makespan_s": makespan, "utilisation": used,
        "finish_s": [max((sp.end for sp in spans if sp.model == m), default=t0) - t0 for m in range(n)],
        "device_peak_bytes": [st["phase_max"] for st in stats], "bytes_moved": moved,
        "timeline": [[sp.model, sp.kind, sp.shard, sp.device, round(sp.start - t0, 6), round(sp.end - t0, 6)]
                     for sp in sorted(spans, key=lambda sp: sp.start)],
    }


def write_summary(path: Path, result: SweepResult) -> None:
    path.write_text(json.dumps({**result.summary, "runs": result.runs}, indent=1) + "\n")
