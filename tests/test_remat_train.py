"""`scaletrain train memory.remat.method=... memory.remat.budget=...`: within the budget, same losses.

The budget covers what a schedule's predicted peak covers (activations, temporaries, the batch
and the loss: everything but parameters, gradients, optimizer states and buffers); it is measured
here with the tracker around the trainer's own forward/backward of a real training step.
"""

import pytest
import torch

from scaletrain.measure.tracker import MemoryTracker
from scaletrain.techniques.remat.measure_run import activation_peak
from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

SMALL = ["model.overrides.n_layer=6", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=64",
         "train.global_batch=8", "train.steps=3", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
         "optim.warmup_steps=1", "train.progress=off"]
DROPOUT = ["model.overrides.dropout=0.1"]  # one process only: ranks draw their own dropout masks


def _fit_tracked(extra):
    """Train; the last micro-batch's forward/backward runs under the tracker. (losses, peak, params)."""
    t = Trainer(load_config(None, SMALL + extra), None, log=lambda s: None)
    inner, peaks = t.forward_backward, []

    def tracked(x, y, weight):
        if t.step < t.cfg.train.steps - 1:
            return inner(x, y, weight)
        with MemoryTracker(model=t.model, track_saved=False) as tr:
            loss = inner(x, y, weight)
        peaks.append(activation_peak(tr, exclude=list(t.model.buffers())))
        return loss

    t.forward_backward = tracked
    losses = t.fit().losses
    params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    t.close()
    return losses, max(peaks), params


@pytest.mark.slow  # > 20 s: kept out of make test-fast
@pytest.mark.parametrize("method", ["optimal", "revolve", "periodic"])
def test_trainer_stays_within_budget_with_unchanged_losses(method):
    base_losses, base_peak, base_params = _fit_tracked(DROPOUT)
    budget = int(base_peak * 0.6)
    losses, peak, params = _fit_tracked(DROPOUT + [f"memory.remat.method={method}", f"memory.remat.budget={budget}"])
    assert peak <= budget < base_peak, (peak, budget, base_peak)
    assert losses == base_losses  # bitwise: same kernels, dropout replayed
    assert torch.equal(params, base_params)


def _dp_remat(rank, world, runs):
    out = []
    for extra in runs:
        t = Trainer(load_config(None, SMALL + extra), None, log=lambda s: None)
        r = t.fit()
        full = t.parallel.model_state_dict()
        flat = torch.cat([v.detach().float().reshape(-1) for k, v in sorted(full.items())])
        t.close()
        out.append((r.losses, flat))
    return out


@pytest.mark.slow
def test_remat_composes_with_every_zero_stage():
    """Data parallelism (DDP, ZeRO-1/2, FSDP2) x remat as nested checkpoints: the losses and final
    parameters of one process without remat (rel 1e-5) — the wrappers see every forward."""
    ref = Trainer(load_config(None, SMALL), None, log=lambda s: None)
    ref_losses = ref.fit().losses
    ref_flat = torch.cat([v.detach().float().reshape(-1) for k, v in sorted(ref.model.state_dict().items())])
    ref.close()
    runs = [[f"parallel.zero={stage}", f"memory.remat.method={m}", "memory.remat.budget=2MiB"]
            for stage, m in ((0, "optimal"), (1, "optimal"), (2, "periodic"), (3, "optimal"), (3, "periodic"))]
    res = run_distributed(_dp_remat, 2, runs)
    for rank_out in res:
        for extra, (losses, flat) in zip(runs, rank_out):
            assert losses == pytest.approx(ref_losses, rel=1e-5), extra
            assert float((flat - ref_flat).norm() / ref_flat.norm()) < 1e-5, extra
