"""The ``torch-tp`` peer of ``scaletrain compare``, and scaletrain's TP against it: same step, no more dispatch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.compare import matrix, runner
from scaletrain.testing import run_distributed


def test_torch_tp_cells_run_where_scaletrains_tp_runs() -> None:
    def why(model: str, devices: int) -> str:
        got = runner.blocked(matrix.build((model,), ("torch-tp",), (devices,))[0])
        return got[1] if got else ""

    assert why("gpt2-mini", 2) == "" and "torch-tp" in matrix.FULL["strategies"]
    assert "GPT-2-style language model" in why("vgg-mini", 2)
    assert "one-process run" in why("gpt2-mini", 1)
    assert matrix.STRATEGIES["torch-tp"].like == "tp"


class _DTensorOps(TorchDispatchMode):
    """Counts the operators that get a DTensor argument (each one a trip through DTensor's dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        self.n += any(isinstance(a, DTensor) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
        return func(*args, **(kwargs or {}))


def _steps(rank: int, world: int) -> dict:
    """One step of gpt2-tiny three ways on every rank: one process, torch's TP peer (``tp_engine``: clipped,
    AdamW), scaletrain's TP (loss and backward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from scaletrain import models
    from scaletrain.compare.peer_engine import _optimizer
    from scaletrain.compare.tp_peer import loss_context, tp_engine
    from scaletrain.techniques.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
    from scaletrain.techniques.tensor_parallel import loss_context as st_loss_context
    from scaletrain.train.config import load_config

    cfg = load_config(None, ["model.name=gpt2-tiny", f"parallel.tp={world}", "optim.grad_clip=0.05",
                             "optim.warmup_steps=0"])
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 32))
    y = torch.randint(0, 256, (2, 32))
    out: dict = {}
    torch.manual_seed(0)
    ref = models.get("gpt2-tiny")
    opt, _ = _optimizer(cfg, ref)
    loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss.backward()
    out["ref"] = (float(loss.detach()), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
    opt.step()
    out["ref_after"] = float(torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten()))

    torch.manual_seed(0)
    engine = tp_engine(models.get("gpt2-tiny"), cfg, torch.device("cpu"))
    with loss_context("torch-tp"):
        with _DTensorOps() as ops:
            loss = torch.nn.functional.cross_entropy(engine.forward(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
        out["peer"] = (float(loss.full_tensor()), engine.step())
        out["peer_after"] = float(torch.nn.functional.cross_entropy(engine.forward(x).flatten(0, 1),
                                                                    y.flatten()).full_tensor())
    out["peer_ops"] = ops.n
    out["peer_plain"] = sum(not isinstance(p, DTensor) for p in engine.model.parameters())

    torch.manual_seed(0)
    model = apply_tensor_parallel(models.get("gpt2-tiny"), init_device_mesh("cpu", (world,)))
    with st_loss_context(model), _DTensorOps() as ops:
        loss = vocab_parallel_cross_entropy(model(x), y)
        loss.backward()
    out["st"] = float(loss.full_tensor())
    out["st_ops"] = ops.n
    dist.barrier()
    return out


@pytest.mark.slow
def test_torch_tp_peer_steps_like_one_process_and_scaletrain_dispatches_no_more() -> None:
    r = run_distributed(_steps, 2)[0]
    assert r["peer"] == pytest.approx(r["ref"], rel=1e-5)  # loss and the clipped global norm (each element once)
    assert r["peer_after"] == pytest.approx(r["ref_after"], rel=1e-5)  # AdamW over split groups: the same update
    assert r["st"] == pytest.approx(r["ref"][0], rel=1e-5)
    # norms and position embeddings compute on plain tensors: DTensor's dispatch where torch's TP has it, and
    # once a step for each of those parameters (its gradient accumulated as a DTensor)
    assert 0 < r["st_ops"] <= r["peer_ops"] + r["peer_plain"], (r["st_ops"], r["peer_ops"], r["peer_plain"])
