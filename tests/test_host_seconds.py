"""The trainer's host work per step (Platform.host_seconds): priced by ZeRO stage per step and per
micro-batch, measured by running the Trainer, and matching a Trainer run it was not measured on."""

from __future__ import annotations

import pytest

from scaletrain import platform as P
from scaletrain.errors import UserError
from scaletrain.plan import Plan
from scaletrain.train.trainer import Trainer

ROWS = ((0, 1e-3, 2e-4), (1, 2e-3, 3e-4), (2, 3e-3, 5e-4))


@pytest.fixture(scope="module", autouse=True)
def _one_trace():
    """mlp's trace once for every plan priced here."""
    from scaletrain.measure.estimate import trace_cache

    with trace_cache():
        yield


def _cpu(**kw) -> P.Platform:
    return P.Platform(name="t", device_mem_bytes_per_s=1e9, mem_efficiency=((0.0, 1.0),), kernel_overhead_s=0.0,
                      intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9, devices_per_node=2, **kw)


def _times(plan: Plan, plat: P.Platform, gb: int = 8, world: int = 2):
    from scaletrain import models
    from scaletrain.techniques.plan_cost import plan_costs

    mb = 0 if plan.pp > 1 else plan.micro_batch
    return [c.time_s for c in plan_costs(plan, models.get("mlp", device="meta"), world=world, global_batch=gb,
                                         seq=0, micro_batch=mb, platform=plat)]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_host_work_is_priced_per_step_and_per_micro_batch_of_the_plans_zero_stage(zero):
    plan = Plan(dp=2, zero=zero, micro_batch=1)  # 4 micro-batches per rank
    with_host, without = _times(plan, _cpu(host_seconds=ROWS))[0], _times(plan, _cpu())[0]
    _, a, c = ROWS[zero]
    assert with_host.host == pytest.approx(a + 4 * c)
    assert without.host == 0.0
    assert with_host.step_s - without.step_s == pytest.approx(a + 4 * c)
    assert with_host.to_dict()["host"] == with_host.host


def test_a_pipeline_pays_only_the_loops_per_step_part():
    """Its per-micro-batch work is the pipeline simulator's; the trainer's loop is the same code."""
    for t in _times(Plan(pp=2, micro_batch=2, microbatches=4), _cpu(host_seconds=ROWS)):
        assert t.host == pytest.approx(ROWS[0][1])


def test_presets_price_no_host_work():
    for name in P.PRESETS:
        assert P.get(name).host_seconds == ()
    assert _times(Plan(dp=2, micro_batch=1), P.get("a100-80g"))[0].host == 0.0


def test_platform_files_carry_the_rows_and_refuse_bad_ones():
    plat = _cpu(host_seconds=ROWS)
    assert P.Platform.from_dict(plat.to_dict()).host_seconds == ROWS
    for bad in ([[3, 1e-3, 0.0]], [[0, -1.0, 0.0]], [[0, 1e-3]], "x"):
        with pytest.raises(UserError, match="host_seconds"):
            P.Platform.from_dict({**plat.to_dict(), "host_seconds": bad})


def test_the_priced_host_work_matches_a_trainer_run_it_was_not_measured_on():
    """Measured at 1 and 3 micro-batches, the priced host work at 2 is the Trainer's own (main-thread CPU
    seconds of its step less the bare step's, one sample per micro-batch) within 1.5 ms + 50 %: a tiny MLP,
    whose step is mostly the trainer's own work, on a loaded 2-core machine (medians of 6 steps vary by
    ~1 ms there)."""
    from scaletrain.train import host_work as host

    tiny = {"widths": (192, 16, 16, 10)}
    rows = host.host_seconds("mlp", tiny, "fp32", world=1, trainer_cls=Trainer)
    assert [z for z, _, _ in rows] == [0]
    passes, step = host.bare_step_seconds("mlp", tiny, "fp32", 2, 0)
    measured = host.trainer_step_seconds("mlp", tiny, "fp32", 0, 2, 1, 0, trainer_cls=Trainer) - passes - step
    priced = _times(Plan(dp=1, micro_batch=1), _cpu(host_seconds=rows), gb=2, world=1)[0].host
    assert priced == pytest.approx(rows[0][1] + 2 * rows[0][2]) and priced > 0  # the loop costs time
    assert abs(priced - measured) <= 1.5e-3 + 0.5 * measured


def _rows_on(rank: int, world: int) -> tuple:
    from scaletrain.train import host_work as host

    return host.host_seconds("mlp", {"widths": (192, 16, 16, 10)}, "fp32", world=world, trainer_cls=Trainer)


@pytest.mark.slow
def test_two_processes_measure_a_row_per_zero_stage():
    """Over 2 gloo processes the Trainer runs at ZeRO 0, 1 and 2: one row each, none negative, and the
    trainer's work (DDP's and GradSync's hooks and copies, the loop) costs time."""
    from scaletrain.testing import run_distributed

    for rows in run_distributed(_rows_on, 2):
        assert [z for z, _, _ in rows] == [0, 1, 2]
        assert all(a >= 0 and c >= 0 for _, a, c in rows) and sum(a + c for _, a, c in rows) > 0
