"""Pipelines whose stages do almost nothing: measured step against the schedule simulator with and without
the pipeline runtime's host terms (issue #25). Run under torchrun with 2 processes:

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/pipeline/host_negligible.py

Each stage is one 8 × 8 linear layer (the last with a squared-error loss), so a step is the runtime's own
work: its actions' Python, gloo's sends and receives, the waits between the ranks. "before": the simulator
with the stages' passes timed alone and the link's α–β (transfers beside the compute, as on NCCL);
"after": plus ``pipeline_action_s`` per pass, ``p2p_send_s`` per send and gloo's blocking receive
(:class:`scaletrain.techniques.pipeline.simulate.Link`), all measured first by
:func:`scaletrain.planner.pipeline_host.host_costs`. Rank 0 prints one line per schedule.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.planner.local import collective_rates
from scaletrain.planner.pipeline_host import _alone_seconds, host_costs
from scaletrain.techniques.pipeline.runtime import PipelineRuntime, split_microbatches
from scaletrain.techniques.pipeline.simulate import Link, StageCosts, simulate

WIDTH = 8
CASES = (("1f1b", 4, 1), ("1f1b", 8, 1), ("gpipe", 4, 1), ("interleaved", 4, 2), ("zb1p", 4, 1), ("zb1p", 8, 1))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    beta, alpha = collective_rates(2)
    host = host_costs(2)
    for schedule, M, v in CASES:
        torch.manual_seed(0)
        chain = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(2 * v)])
        rt = PipelineRuntime(chain, schedule, M, pp=2, dp=1, virtual=v, loss_fn=loss_fn,
                             example_input=torch.zeros(1, WIDTH), record_events=False)
        opt = torch.optim.SGD(rt.parameters(), lr=0.0)
        mbs = split_microbatches(torch.randn(M, WIDTH), torch.zeros(M, WIDTH), M)

        def update() -> None:
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            rt.train_step(mbs, update)
        times = []
        for _ in range(15):
            dist.barrier()
            t0 = time.perf_counter()
            rt.train_step(mbs, update)
            times.append(time.perf_counter() - t0)
        sched = rt.schedule_for(1)
        S = sched.n_stages
        alone = [_alone_seconds(chain[i:i + 1], i == S - 1, loss_fn, WIDTH) for i in range(S)]
        every: list = [None, None]
        dist.all_gather_object(every, (alone, statistics.median(times)))
        if rank == 0:
            passes = [max(a, b) for a, b in zip(every[0][0], every[1][0])]
            measured = max(every[0][1], every[1][1])
            f, b = [x / 3 for x in passes], [2 * x / 3 for x in passes]  # backward ≈ 2 forwards
            nbytes = [WIDTH * 4.0] * S
            before = simulate(sched, StageCosts(fwd_s=f, bwd_s=b, boundary_bytes=nbytes), Link(beta, alpha))
            a, pieces = host["pipeline_action_s"], 3 if sched.split_backward else 2
            costs = StageCosts(fwd_s=[x + a for x in f], bwd_s=[x + (pieces - 1) * a for x in b],
                               igrad_s=[x / 2 + a for x in b] if sched.split_backward else None, boundary_bytes=nbytes)
            after = simulate(sched, costs, Link(beta, alpha, blocking=True, busy_latency_s=host["p2p_recv_s"],
                                                send_s=host["p2p_send_s"]))
            print(f"{schedule} M={M} v={v}: measured {measured * 1e3:.2f} ms; simulated before "
                  f"{before.makespan_s * 1e3:.2f} ({(before.makespan_s / measured - 1) * 100:+.0f} %), after "
                  f"{after.makespan_s * 1e3:.2f} ({(after.makespan_s / measured - 1) * 100:+.0f} %) [action "
                  f"{a * 1e6:.0f} us, send {host['p2p_send_s'] * 1e6:.0f} us, recv {host['p2p_recv_s'] * 1e6:.0f} us, "
                  f"alpha {alpha * 1e6:.0f} us, 1-min load {os.getloadavg()[0]:.1f}]", flush=True)
        rt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
