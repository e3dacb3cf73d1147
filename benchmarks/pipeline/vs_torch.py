"""Our pipeline runtime versus ``torch.distributed.pipelining`` on the same model and split.

For P = 2 and 4 ranks (gloo, CPU, one thread each), GPT-2 tiny (6 layers), M = 8
micro-batches of 4 × 128 tokens, AdamW: our ``gpipe`` / ``1f1b`` / ``interleaved`` (v = 2) against
PyTorch's ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` on the same stage
modules (the Chain's blocks, equal split). A timed step is forward + backward of the M
micro-batches and the optimizer step, between barriers; its time is the slowest rank's. The two
runtimes alternate in rounds (order swapped every round) so that a shared machine's changing
load hits both alike. Reported:
median step time of each and the ratio ours / PyTorch's, plus the first step's loss of both
(same initial weights and data, so they agree to float rounding). PyTorch's schedules do not
all-reduce GPT-2's tied embedding between the first and last stage (ours does; 128 KiB here).

Run: ``python benchmarks/pipeline/vs_torch.py [--ranks 2 4] [--steps 6]``; writes
``benchmarks/results/pipeline_vs_torch.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MB, SEQ, example_input, lm_loss, make_model, random_microbatches, write_json  # noqa: E402

from scaletrain.chain import to_chain  # noqa: E402
from scaletrain.techniques.pipeline.partition import equal_bounds  # noqa: E402
from scaletrain.testing import run_distributed  # noqa: E402

M = 8
PAIRS = (("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1), ("interleaved", "ScheduleInterleaved1F1B", 2))


def _timed(fn, steps: int) -> tuple[list[float], float]:
    """Run ``fn`` (one training step, returns a loss or None) ``steps`` times; per-step time is
    the slowest rank's (all-reduce MAX); returns the times and the first step's loss."""
    times, first = [], None
    for k in range(steps):
        dist.barrier()
        t = time.perf_counter()
        loss = fn()
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
        if k == 0:
            first = loss
    return times, first


def _ours(name: str, v: int, P: int, mbs):
    """A step function for our runtime (forward, backward, optimizer; returns the loss)."""
    from scaletrain.techniques.pipeline.runtime import PipelineRuntime

    model = make_model()
    rt = PipelineRuntime(model, name, M, pp=P, virtual=v, loss_fn=lm_loss, example_input=example_input(),
                         record_events=False)
    opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)

    def step():
        loss = rt.train_step(iter(mbs))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _theirs(cls_name: str, v: int, P: int, rank: int, mbs):
    """The same step with torch.distributed.pipelining's schedule on the same stage modules."""
    from torch.distributed import pipelining

    chain = to_chain(make_model())
    S = P * v
    bounds = equal_bounds(len(chain), S)
    local = [s for s in range(S) if s % P == rank]
    stages = [pipelining.PipelineStage(nn.Sequential(*chain.blocks[bounds[s]:bounds[s + 1]]), s, S,
                                       torch.device("cpu")) for s in local]
    cls = getattr(pipelining, cls_name)
    sched = cls(stages if v > 1 else stages[0], n_microbatches=M, loss_fn=lm_loss)
    params = list(dict.fromkeys(p for st in stages for p in st.submod.parameters()))
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.cat([a for a, _ in mbs])
    y = torch.cat([b for _, b in mbs])
    first, last = 0 in local, S - 1 in local

    def step():
        losses: list = []
        if first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack([t.detach() for t in losses]).mean()) if losses else None

    return step


def _worker(rank: int, world: int, steps: int, rounds: int) -> dict:
    """Per pair: one warm-up step each, then ``rounds`` rounds of ``steps`` timed steps, the two
    runtimes alternating (and swapping order every round) so load changes hit both alike."""
    mbs = random_microbatches(M)
    out = {}
    for ours, theirs, v in PAIRS:
        fns = {"ours": _ours(ours, v, world, mbs), "theirs": _theirs(theirs, v, world, rank, mbs)}
        first_loss = {k: _timed(f, 1)[1] for k, f in fns.items()}
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for r in range(rounds):
            for k in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
                times[k] += _timed(fns[k], steps)[0]
        out[ours] = {"ours_s": times["ours"], "theirs_s": times["theirs"], "loss_ours": first_loss["ours"],
                     "loss_theirs": first_loss["theirs"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of ours / PyTorch's")
    args = ap.parse_args()
    out: dict = {"model": "gpt2-tiny n_layer=6", "micro_batch": MB, "seq": SEQ, "microbatches": M,
                 "command": "python benchmarks/pipeline/vs_torch.py " + " ".join(sys.argv[1:]), "results": {}}
    for P in args.ranks:
        per_rank = run_distributed(_worker, P, args.steps, args.rounds, timeout_s=1800)
        res = {}
        for ours, theirs, v in PAIRS:
            r = per_rank[0][ours]
            loss_theirs = next((x[ours]["loss_theirs"] for x in per_rank if x[ours]["loss_theirs"] is not None), None)
            a, b = statistics.median(r["ours_s"]), statistics.median(r["theirs_s"])
            res[ours] = {"torch_schedule": theirs, "virtual": v, "ours_step_s": a, "torch_step_s": b,
                         "ratio_ours_over_torch": a / b, "ours_steps_s": r["ours_s"], "torch_steps_s": r["theirs_s"],
                         "first_loss_ours": r["loss_ours"], "first_loss_torch": loss_theirs}
            print(f"P={P} {ours:12s} ours {a * 1e3:8.1f} ms  {theirs:24s} {b * 1e3:8.1f} ms  ratio {a / b:.3f}  "
                  f"loss {r['loss_ours']:.5f} / {loss_theirs:.5f}", flush=True)
        out["results"][str(P)] = res
    print("wrote", write_json("pipeline_vs_torch.json", out))


if __name__ == "__main__":
    main()
