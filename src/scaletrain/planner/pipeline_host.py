"""The pipeline runtime's own host costs on this machine, measured with its own code (issue #25).

A pipeline step on a CPU is longer than its stages' blocks and its bubble: every action of a rank's list
runs Python (:mod:`scaletrain.techniques.pipeline.runtime`: the action loop, the micro-batch
bookkeeping, the loss weighting, the input gradient handed to the send), and gloo moves a message's bytes
only once the receive is posted, through the *sender's* progress thread — which, with one process per
core, waits for the core its own compute holds. Measured here, 2 processes on 2 cores: a receive whose
sender computes took 2 to 10 ms under load, one whose sender waits 0.2 to 0.5 ms (the collectives'
α). Three figures, each by running the runtime's code; nothing is fitted to a step time:

* ``p2p_recv_s`` — the receive itself: one rank posts a 4-byte ``isend`` and computes (square matmuls
  for :data:`SENDER_BUSY_S`), its peer computes 1 ms, then receives; the seconds of that receive. Every
  pair of ranks measures both ways at once; the median sample.
* ``pipeline_action_s`` — the real :class:`~scaletrain.techniques.pipeline.runtime.PipelineRuntime`
  (1F1B, pp = the world, :data:`MICROBATCHES` micro-batches) over stages of one 8 × 8 linear layer,
  its events recorded: the median over steps of (the rank's F and B events' seconds − the same stage's
  forward and backward timed alone, one call per sample as the events time one pass each, times M) / 2M
  — what the runtime adds around each pass (measured here: 0.08–0.2 ms per action).
* ``p2p_send_s`` — the same run's send events (posting an ``isend``), median.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

MICROBATCHES = 4
"""Micro-batches of the measured pipeline step."""
SENDER_BUSY_S = 0.03
"""Seconds the sender computes after posting its send in the receive measurement."""


def _busy(seconds: float, a: torch.Tensor) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a


def recv_seconds(world: int, repeats: int = 7) -> float:
    """Median seconds of a receive while its sender computes (module docstring); 0 with one process."""
    if world <= 1 or not dist.is_initialized():
        return 0.0
    rank = dist.get_rank()
    peer = rank ^ 1
    if peer >= world:  # the odd rank out of an odd world: no partner
        peer = -1
    a, msg = torch.randn(128, 128), torch.zeros(1)
    samples = []
    for i in range(2 * repeats):
        dist.barrier()
        if peer < 0:
            continue
        sender = (i + rank) % 2 == 0  # each rank of the pair in turn; its peer the other role
        if sender:
            work = dist.isend(msg, peer, tag=i + 1)
            _busy(SENDER_BUSY_S, a)
            work.wait()
        else:
            _busy(0.001, a)
            t0 = time.perf_counter()
            dist.irecv(msg, peer, tag=i + 1).wait()
            samples.append(time.perf_counter() - t0)
    dist.barrier()
    return statistics.median(samples) if samples else 0.0


def _alone_seconds(stage: nn.Module, last: bool, loss_fn, width: int) -> float:
    """Forward and backward of one stage's blocks (and the loss on the last), without the runtime."""
    x = torch.randn(1, width)
    y = torch.zeros(1, width)

    def step() -> None:
        xi = x.clone().requires_grad_(True)
        out = stage(xi)
        (loss_fn(out, y) if last else out).backward(None if last else torch.ones_like(out))

    step()
    samples = []
    for _ in range(4 * MICROBATCHES * 5):  # one call per sample, as the runtime's events time one pass each
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def action_seconds(world: int, repeats: int = 5, width: int = 8) -> tuple[float, float]:
    """(host seconds per compute action, per posted send) of the pipeline runtime on this rank
    (module docstring); (0, 0) with one process."""
    if world <= 1 or not dist.is_initialized():
        return 0.0, 0.0
    from scaletrain.techniques.pipeline.runtime import PipelineRuntime, split_microbatches

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out - y).pow(2).mean()

    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Linear(width, width) for _ in range(world)])
    M = MICROBATCHES
    rt = PipelineRuntime(chain, "1f1b", M, pp=world, dp=1, loss_fn=loss_fn, example_input=torch.zeros(1, width),
                         record_events=True, timeout_s=60.0)
    try:
        mbs = split_microbatches(torch.randn(M, width), torch.zeros(M, width), M)
        opt = torch.optim.SGD(rt.parameters(), lr=0.0)

        def update() -> None:
            opt.step()
            opt.zero_grad()

        per_pass, sends = [], []
        for i in range(2 + repeats):
            rt.train_step(mbs, update)
            if i >= 2:
                per_pass.append(sum(e.end_s - e.start_s for e in rt.events if e.kind in ("F", "B")))
                sends += [e.end_s - e.start_s for e in rt.comm_events if e.kind.startswith("SEND")]
        rank = rt.pp_rank
        stage = chain[rank:rank + 1]
        alone = _alone_seconds(stage, rank == world - 1, loss_fn, width)
        dist.barrier()
    finally:
        rt.close()
    action = max((statistics.median(per_pass) - M * alone) / (2 * M), 0.0)
    return action, statistics.median(sends) if sends else 0.0


def host_costs(world: int) -> dict[str, float]:
    """The three :class:`~scaletrain.platform.Platform` fields, measured by every rank at once."""
    action, send = action_seconds(world)
    return {"pipeline_action_s": action, "p2p_send_s": send, "p2p_recv_s": recv_seconds(world)}
