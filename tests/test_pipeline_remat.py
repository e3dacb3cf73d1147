"""Rematerialization inside pipeline stages (``memory.remat.method`` with ``parallel.pp > 1``).

* runtime, gloo, 2 processes: 1F1B with a periodic schedule per stage recomputes (more forwards
  than blocks), trains to the same losses and parameters as without, and holds less at its peak
  (:class:`~scaletrain.measure.tracker.MemoryTracker`), as the memory model predicts (within
  10 %, with and without remat);
* trainer, gloo, 2 processes: ``parallel.pp=2 parallel.schedule=1f1b memory.remat.method=periodic``, and
  ``memory.remat.method=optimal`` with ``memory.remat.stage_budgets`` (one budget per stage: the tight stage
  alone recomputes), give one process's losses; zb1p and the asynchronous schedules with remat are one-line
  ConfigErrors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.errors import ConfigError
from scaletrain.testing import run_distributed
from scaletrain.train.config import load_config

M, MB, SEQ = 4, 2, 32
KW = dict(n_layer=6, n_embd=32, n_head=2, n_positions=SEQ)  # 8 blocks: 4 per stage, so √4 = 2 segments



def check_config(cfg, microbatches, offload=False):
    """The compatibility table on ``cfg`` with a meta model (world = pp x tp x cp x max(dp, ep))."""
    from scaletrain import models
    from scaletrain.techniques import compat

    if offload:
        cfg.memory.offload.optimizer = "host"
    p = cfg.parallel
    world = p.pp * p.tp * p.cp * max(p.dp, p.ep, 1)
    model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
    compat.check_config(cfg, model, world=world, microbatches=microbatches)

def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _runtime_worker(rank: int, world: int) -> dict:
    from scaletrain.measure.tracker import MemoryTracker
    from scaletrain.techniques.pipeline.runtime import PipelineRuntime

    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 256, (MB, SEQ), generator=g), torch.randint(0, 256, (MB, SEQ), generator=g))
           for _ in range(M)]
    out: dict = {}
    for method in ("none", "periodic"):
        torch.manual_seed(0)
        model = models.get("gpt2-tiny", **KW)
        rt = PipelineRuntime(model, "1f1b", M, pp=world, loss_fn=_loss, example_input=mbs[0][0], timeout_s=120,
                             record_events=False, remat=method, example_target=mbs[0][1])
        opt = torch.optim.SGD(rt.parameters(), lr=0.5)

        def update() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        losses = rt.train(2, iter(mbs * 2), update)
        with MemoryTracker(model=rt.module, optimizer=opt) as tr:
            losses += rt.train(1, iter(mbs), update)
        rt.sync_full_model()
        out[method] = {"losses": losses, "peak": tr.peak_bytes,
                       "params": {k: v.clone() for k, v in model.state_dict().items()},
                       "forwards": {s: sch.n_forwards for s, sch in rt.remat_schedules.items()},
                       "blocks": {s: rt.bounds[s + 1] - rt.bounds[s] for s in rt.remat_schedules},
                       "bounds": rt.bounds, "schedules": dict(rt.remat_schedules)}
        rt.close()
    return out


@pytest.mark.slow  # > 20 s: kept out of make test-fast
def test_runtime_remat_same_training_less_memory():
    from scaletrain.techniques.pipeline import build, simulate, StageCosts
    from scaletrain.techniques.pipeline.memory import stage_memory

    results = run_distributed(_runtime_worker, 2, timeout_s=180)
    for rank, res in enumerate(results):
        plain, remat = res["none"], res["periodic"]
        assert remat["forwards"] and all(remat["forwards"][s] > remat["blocks"][s] for s in remat["forwards"]), remat
        assert remat["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0), rank
        for k, v in plain["params"].items():
            torch.testing.assert_close(remat["params"][k], v, rtol=1e-6, atol=1e-7)
        assert remat["peak"] < 0.9 * plain["peak"], (rank, remat["peak"], plain["peak"])
    # the memory model predicts both: the remat stages' kept bytes and transients replayed from
    # their schedules (SGD without momentum: no optimizer state)
    torch.manual_seed(0)
    model = models.get("gpt2-tiny", **KW)
    x = torch.zeros(MB, SEQ, dtype=torch.long)
    for method in ("none", "periodic"):
        schedules = {s: sch for r in results for s, sch in r[method]["schedules"].items()}
        mem = stage_memory(model, results[0][method]["bounds"], x, target=x, loss_fn=_loss, optimizer="sgd",
                           foreach=False, remat=[schedules[s] for s in range(2)] if schedules else None)
        pred = simulate(build("1f1b", 2, M), StageCosts(fwd_s=[1.0] * 2, bwd_s=[2.0] * 2, **mem)).peak_memory_bytes
        for rank, res in enumerate(results):
            assert res[method]["peak"] == pytest.approx(pred[rank], rel=0.10), (method, rank, pred)


# --------------------------------------------------------------------------- the trainer
TRAIN = ["model.overrides.n_layer=6", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
         "data.name=synthetic-text", "train.global_batch=8", "train.eval_batches=1", "train.log_every=1",
         "optim.warmup_steps=1", "train.steps=3", "train.eval_every=0", "train.progress=off",
         "optim.name=sgd", "optim.lr=0.5"]


def _quiet(s: str) -> None:
    pass


def _stage_budgets() -> tuple[str, list[int]]:
    """memory.remat.stage_budgets for TRAIN's two stages: stage 0 halfway between its solver's least budget
    and its peak without recompute (it recomputes), stage 1 above its peak (it keeps everything)."""
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import stage_graphs_of
    from scaletrain.techniques.remat import min_budget

    model = models.get("gpt2-tiny", device="meta", n_layer=6, n_embd=32, n_head=2, n_positions=16)
    g0, g1 = stage_graphs_of(Plan(pp=2, microbatches=M, schedule="1f1b"), model, world=2, global_batch=8, seq=16)
    budgets = [(min_budget(g0, "optimal") + min_budget(g0, "none")) // 2, 2 * min_budget(g1, "none")]
    return ",".join(map(str, budgets)), [len(g0), len(g1)]


def _trainer_worker(rank: int, world: int, stage_budgets: str) -> list:
    from scaletrain.train.trainer import Trainer

    out = []
    for remat in (["memory.remat.method=periodic"],
                  ["memory.remat.method=optimal", f"memory.remat.stage_budgets={stage_budgets}"]):
        cfg = load_config(None, TRAIN + ["parallel.pp=2", "parallel.schedule=1f1b", f"parallel.microbatches={M}",
                                         *remat])
        t = Trainer(cfg, None, log=_quiet)
        res = t.fit()
        out.append((res.losses, {s: sch.n_forwards for s, sch in t.parallel.runtime.remat_schedules.items()}))
        t.close()
    return out


@pytest.mark.slow  # > 20 s: kept out of make test-fast
def test_trainer_pp2_1f1b_remat_equals_one_process():
    """One budget (periodic: √n segments in every stage) and one budget per stage (stage 0 tight, stage 1
    above its peak): one process's losses without remat; each stage recomputes what its own budget asks."""
    from scaletrain.train.trainer import Trainer

    budgets, blocks = _stage_budgets()
    t = Trainer(load_config(None, TRAIN + [f"train.micro_batch={8 // M}"]), None, log=_quiet)
    one = t.fit().losses
    t.close()
    per_stage: dict[int, int] = {}
    for (losses, forwards), (staged, fw) in run_distributed(_trainer_worker, 2, budgets, timeout_s=180):
        assert forwards and all(n > 4 for n in forwards.values()), forwards  # 4 blocks per stage, recomputed
        assert losses == pytest.approx(one, rel=1e-5)
        assert staged == pytest.approx(one, rel=1e-5)
        per_stage.update(fw)
    assert per_stage[0] > blocks[0] and per_stage[1] == blocks[1], (per_stage, blocks)  # stage 0 alone recomputes


@pytest.mark.parametrize("schedule", ["zb1p", "pipedream", "pipedream-2bw"])
def test_remat_with_split_or_async_schedules_is_a_config_error(schedule):
    cfg = load_config(None, TRAIN + ["parallel.pp=2", f"parallel.schedule={schedule}", f"parallel.microbatches={M}",
                                     "memory.remat.method=periodic"])
    with pytest.raises(ConfigError, match="allowed: parallel.schedule=gpipe, 1f1b") as e:
        check_config(cfg, M)
    assert "\n" not in str(e.value)


def test_stage_budgets_are_checked_in_one_line():
    cfg = load_config(None, TRAIN + ["parallel.pp=2", f"parallel.microbatches={M}", "memory.remat.method=optimal",
                                     "memory.remat.stage_budgets=1MiB,2MiB,3MiB"])
    with pytest.raises(ConfigError, match="stage_budgets has 3 entries.*allowed: 2 comma-separated sizes"):
        check_config(cfg, M)
    cfg = load_config(None, TRAIN + ["memory.remat.method=optimal", "memory.remat.stage_budgets=1MiB,2MiB"])
    with pytest.raises(ConfigError, match="parallel.pp > 1"):
        check_config(cfg, 1)
    with pytest.raises(ConfigError, match="stage_budgets.*entry 1"):
        load_config(None, TRAIN + ["memory.remat.stage_budgets=1MiB,,2MiB"])
