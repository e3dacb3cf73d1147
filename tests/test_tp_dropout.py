"""Dropout under tensor parallelism (Megatron's model-parallel RNG, :mod:`scaletrain.techniques.tensor_parallel.rng`):
replicated activations are identical across the TP group, sharded regions draw their own masks,
runs are bit-reproducible, and a dropout run at tp=2 trains like one process does."""

from __future__ import annotations

import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from scaletrain.testing import run_distributed, start_method
from scaletrain.train.config import load_config

SMALL = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=4",
         "model.overrides.dropout=0.1", "data.seq_len=64", "train.global_batch=8", "train.eval_every=0",
         "train.eval_batches=1", "train.log_every=50", "train.progress=off", "optim.warmup_steps=10"]


def test_sharded_region_forks_per_rank_and_replays():
    from scaletrain.techniques.tensor_parallel.rng import sharded_region

    torch.manual_seed(0)
    state = torch.get_rng_state()
    with sharded_region(0):
        a = torch.rand(8)
    after = torch.rand(1)
    torch.set_rng_state(state)
    with sharded_region(1):
        b = torch.rand(8)
    assert torch.equal(torch.rand(1), after)  # the default stream advanced alike on both "ranks"
    torch.set_rng_state(state)
    with sharded_region(0):
        assert torch.equal(torch.rand(8), a)  # a recomputation from the same state replays the mask
    assert not torch.equal(a, b)
    before = torch.get_rng_state()
    with sharded_region(0, active=False):  # no dropout: nothing drawn
        pass
    assert torch.equal(torch.get_rng_state(), before)


def _replicated_both(rank: int, world: int) -> dict[bool, list]:
    """Without and with sequence parallelism, in one start of the processes."""
    return {sp: _replicated(rank, world, sp) for sp in (False, True)}


def _replicated(rank: int, world: int, sp: bool) -> list:
    import torch.distributed as dist

    from scaletrain import models
    from scaletrain.techniques.mesh import apply_model_parallel, build_mesh
    from scaletrain.techniques.tensor_parallel.rng import replica_seed

    torch.manual_seed(0)
    m = models.get("gpt2-tiny", n_layer=2, n_embd=64, n_head=4, dropout=0.2)
    mp = build_mesh(world=world, tp=world, sequence_parallel=sp)
    apply_model_parallel(m, mp)
    torch.manual_seed(replica_seed(0, rank, world))
    outs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda mod, i, o: outs.append(o.detach().clone())) for b in m.h]
    x = torch.randint(0, 256, (2, 16))
    m.train()
    m(x)
    for h in hooks:
        h.remove()
    same = []
    for o in outs:  # gather every rank's block output
        parts = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(parts, o.contiguous())
        same.append(all(torch.equal(parts[0], p) for p in parts[1:]))
    return same


@pytest.mark.slow
def test_replicated_activations_agree_across_the_tp_group():
    for same in run_distributed(_replicated_both, 2):
        assert all(same[False]), same  # without SP the block outputs are replicated: identical masks
        assert not any(same[True]), same  # with SP each rank holds other positions (and draws its own masks)


def _train(rank: int, world: int, extra: list[str]) -> tuple[list[float], list[float]]:
    """The run, then the same run again cut to its warm-up (``REPLAY`` steps, whose learning rates do
    not depend on the run's length): the replay must repeat the first ``REPLAY`` losses bit for bit,
    which proves the dropout masks reproducible for a tenth of the steps of a second full run."""
    from scaletrain.train.trainer import Trainer

    runs = []
    for more in ([], [f"train.steps={REPLAY}"]):
        t = Trainer(load_config(None, SMALL + extra + more), None, log=lambda s: None)
        runs.append(t.fit().losses)
        t.close()
    return runs[0], runs[1]


REPLAY = 10  # = optim.warmup_steps in SMALL


def _one_process_tail(seed: int) -> float:
    """The mean of the last 50 of 200 one-process losses with dropout seed ``1000 + seed`` (one thread)."""
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    t = Trainer(load_config(None, SMALL + ["train.steps=200"]), None, log=lambda s: None)
    torch.manual_seed(1000 + seed)
    tail = statistics.mean(t.fit().losses[-50:])
    t.close()
    return tail


@pytest.mark.slow
def test_tp2_dropout_trains_like_one_process_and_reproduces():
    """200 steps of gpt2-tiny (2 x 64) with dropout 0.1: the tp=2 curve (mean of its last 50 losses)
    lies within the run-to-run spread of one process over dropout seeds (mean ± 3 sd, 4 seeds); a
    second tp=2 run repeats the first one's losses bit for bit (over the warm-up's 10 steps)."""
    steps = ["train.steps=200"]
    # one process, same init and data; only the dropout stream differs — two seeds at a time, one thread
    # each (on 2 cores ~1.5x faster than one process after another with two threads: tests/test_optim_convergence.py)
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context(start_method())) as ex:
        tails = list(ex.map(_one_process_tail, range(4)))
    first, replay = run_distributed(_train, 2, steps + ["parallel.tp=2"])[0]
    assert len(first) == 200 and replay == first[:REPLAY]  # bit-reproducible
    tp_tail = statistics.mean(first[-50:])
    mu, sd = statistics.mean(tails), statistics.stdev(tails)
    assert abs(tp_tail - mu) <= 3 * sd + 1e-3, (tp_tail, tails)
