"""Heterogeneous data parallelism measured: the planner's per-replica split against the even split.

Two gloo processes, one thread each, train the same MLP on a global batch of B samples; rank 1 is a
device ``--slowdown`` times slower. How it is made slower (the faithful part): after its forward and
backward, rank 1 sleeps (slowdown − 1) × the seconds that forward and backward just took, so its
compute takes slowdown × as long while its link and its optimizer step stay those of rank 0 — a slower
accelerator on the same network. Sleeping, not extra work, so the slow rank does not take CPU from the
fast one on this shared 2-core machine. Gradients: one all-reduce (sum) of the flat fp32 gradients
after the backward, each rank's loss weighted by its share of the global batch
(:func:`scaletrain.techniques.data_parallel.uneven.loss_weight`, not averaged), then SGD.

Plan, as Metis/HetPipe do: each rank profiles itself (a line through the medians of its forward + backward
seconds at B/4 and B/2 samples: seconds per sample and fixed seconds; the slope floored at 5 % of the mean
rate against a noisy pair), the tail (all-reduce + step of the rank that reaches it last, which waits for
no one) is timed, and
:func:`scaletrain.planner.hetero.min_max_split` splits B. Predicted step of a split = the slowest rank's
line + the tail; predicted margin = even / planned. Measured: repeats interleave the two splits
(even, planned, even, planned, ...), ``--steps`` timed steps each (barrier to barrier on rank 0), medians.
The split is planned once, from the first profile; each repeat first re-profiles the ranks (the same
two sizes, never the uneven split measured) and that repeat's predicted margin uses its profile (the shared machine's
load moves its speed by up to 2x in minutes); the reported margins are the medians over repeats.
Writes ``benchmarks/results/planner_hetero_dp.json`` (the machine's load before and after is recorded).

    PYTHONPATH=src python benchmarks/planner/hetero_dp.py              # ~2 minutes on the shared 2-core machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "pipeline"))
from common import machine, write_json  # noqa: E402

from scaletrain.planner.hetero import even_split, min_max_split, slowest  # noqa: E402
from scaletrain.techniques.data_parallel.uneven import loss_weight, rank_slice  # noqa: E402
from scaletrain.testing import run_distributed  # noqa: E402


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _worker(rank: int, world: int, a: dict) -> dict:
    model = _model(a["width"], a["depth"])
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    B = a["batch"]
    x, y = torch.randn(B, a["width"], generator=g), torch.randint(0, 10, (B,), generator=g)
    slow = a["slowdown"] if rank == world - 1 else 1.0

    def step(split: list[int]) -> tuple[float, float, float]:
        """(wall seconds barrier to barrier, this rank's compute seconds incl. slowdown, tail seconds)."""
        dist.barrier()
        t0 = time.perf_counter()
        part = rank_slice(split, rank)
        loss = torch.nn.functional.cross_entropy(model(x[part]), y[part]) * loss_weight(split, rank, averaged=False)
        loss.backward()
        c = time.perf_counter() - t0
        if slow > 1:
            time.sleep((slow - 1) * c)
        t1 = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=False)
        tail = time.perf_counter() - t1
        dist.barrier()
        return time.perf_counter() - t0, t1 - t0, tail

    def profile(n_steps: int) -> tuple[list[float], list[float], float]:
        """Every rank's line (seconds per sample, fixed seconds) through the medians of its forward + backward
        seconds at B/4 and B/2 samples (``n_steps`` each, interleaved), and the tail (all-reduce + step of the
        rank that reaches it last, which waits for no one)."""
        lo, hi = [], []
        for _ in range(n_steps):
            lo.append(step([B // 4] * world))
            hi.append(step([B // 2] * world))
        c_lo, c_hi = statistics.median(c for _, c, _ in lo), statistics.median(c for _, c, _ in hi)
        unit = max((c_hi - c_lo) / (B // 2 - B // 4), 0.05 * c_hi / (B // 2))  # a floor against noise
        mine = (unit, max(c_hi - unit * (B // 2), 0.0), statistics.median(t for *_, t in lo + hi))
        got = [None] * world
        dist.all_gather_object(got, mine)
        return [g[0] for g in got], [g[1] for g in got], min(g[2] for g in got)

    for _ in range(2):
        step(even_split(B, world))
    unit, fix, tail_s = profile(a["profile_steps"])
    even, planned = even_split(B, world), min_max_split(B, unit, fix)
    pred = {"even": slowest(even, unit, fix) + tail_s, "planned": slowest(planned, unit, fix) + tail_s}
    # measure: interleaved repeats; each repeat first re-profiles the ranks (this shared machine's load moves
    # its speed by up to 2x within minutes), and that repeat's prediction of both splits uses that profile
    times: dict[str, list[float]] = {"even": [], "planned": []}
    margins: list[tuple[float, float]] = []
    comp: dict[str, list[float]] = {"even": [], "planned": [], "predicted_even": [], "predicted_planned": []}
    for _ in range(a["repeats"]):
        u, f, t = profile(a["steps"])  # this repeat's own profile, never the splits it predicts
        step(even)  # one untimed step after switching
        ev_s = [step(even) for _ in range(a["steps"])]
        step(planned)
        pl_s = [step(planned) for _ in range(a["steps"])]
        ev, pl = [x[0] for x in ev_s], [x[0] for x in pl_s]
        comp["even"].append(statistics.median(x[1] for x in ev_s))
        comp["planned"].append(statistics.median(x[1] for x in pl_s))
        comp["predicted_even"].append(even[rank] * u[rank] + f[rank])
        comp["predicted_planned"].append(planned[rank] * u[rank] + f[rank])
        p_even, p_plan = slowest(even, u, f) + t, slowest(planned, u, f) + t
        times["even"] += ev
        times["planned"] += pl
        margins.append((p_even / p_plan, statistics.median(ev) / statistics.median(pl)))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {k: statistics.median(v) for k, v in comp.items()})
    return {"compute_s_per_rank": per_rank, "rank": rank, "slowdown": slow, "per_sample_s": unit, "fixed_s": fix, "tail_s": tail_s,
            "even": even, "planned": planned, "predicted_step_s": pred, "times": times, "margins": margins}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slowdown", type=float, default=3.0, help="rank 1's compute time over rank 0's")
    ap.add_argument("--batch", type=int, default=512, help="global batch, samples")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per repeat and split")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=7)
    ap.add_argument("--out", default="planner_hetero_dp.json")
    a = vars(ap.parse_args())
    before = machine()
    t0 = time.time()
    res = run_distributed(_worker, 2, a, timeout_s=900)[0]
    measured = {k: statistics.median(v) for k, v in res["times"].items()}
    pred = res["predicted_step_s"]
    pm = statistics.median(p for p, _ in res["margins"])  # per repeat: predicted from its own re-profile
    mm = statistics.median(m for _, m in res["margins"])
    out = {"args": a, "machine_before": before, "seconds": time.time() - t0,
           "slowdown_method": "rank 1 sleeps (slowdown - 1) x its measured forward+backward seconds each step",
           "profile": {k: res[k] for k in ("per_sample_s", "fixed_s", "tail_s")},
           "even": res["even"], "planned": res["planned"], "predicted_step_s": pred, "measured_step_s": measured,
           "predicted_margin": pm, "measured_margin": mm, "margin_error": mm / pm - 1,
           "within_15pct": abs(mm / pm - 1) <= 0.15, "compute_s_per_rank_median": res["compute_s_per_rank"], "margins_predicted_measured_per_repeat": res["margins"],
           "predicted_margin_from_first_profile": pred["even"] / pred["planned"], "step_times_s": res["times"]}
    path = write_json(a["out"], out)
    print(f"split even {res['even']} vs planned {res['planned']}: predicted {pred['even'] * 1e3:.1f} / "
          f"{pred['planned'] * 1e3:.1f} ms (margin {pm:.2f}x), measured {measured['even'] * 1e3:.1f} / "
          f"{measured['planned'] * 1e3:.1f} ms (margin {mm:.2f}x, {mm / pm - 1:+.1%}); wrote {path}")


if __name__ == "__main__":
    main()
