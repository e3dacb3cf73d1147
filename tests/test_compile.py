"""train.compile: torch.compile per Chain block, as a plan key, refused where unverified, priced or said not to be."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scaletrain.plan import Plan, load_plan_overrides
from scaletrain.platform import Platform
from scaletrain.techniques import compat
from scaletrain.techniques import compile as comp
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

# the smallest run that compiles every kind of block: embedding, one transformer block, head
TINY = ["model.name=gpt2-tiny", "model.overrides.n_layer=1", "data.name=synthetic-text", "data.seq_len=32",
        "train.global_batch=2", "train.steps=3", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
        "train.progress=off", "train.checkpoint_format=none"]


# inductor compiles 3 blocks (forward + backward): 78 s with an empty cache on 2 busy cores, 13 s warm
@pytest.mark.slow
def test_compiled_gpt2_trains_and_equals_eager():
    eager = Trainer(load_config(None, TINY), None, log=lambda s: None)
    e = eager.fit().losses
    logs: list[str] = []
    t = Trainer(load_config(None, TINY + ["train.compile=true"]), None, log=logs.append)
    c = t.fit().losses
    from scaletrain.chain import to_chain

    assert all(b._compiled_call_impl is not None for b in to_chain(t.model).blocks)  # every block compiled
    assert any("3 Chain blocks compiled" in s for s in logs)
    assert t.model.state_dict().keys() == eager.model.state_dict().keys()  # in place: checkpoints unchanged
    # inductor fuses and reorders fp32 reductions (layer norm, softmax, matmul epilogues): equal up to float
    # rounding, ~1e-7 relative measured; 1e-5 leaves room for other CPUs' vector widths, and training diverging
    # (a wrong gradient, a missed update) moves the third loss by > 1e-3
    assert c == pytest.approx(e, rel=1e-5)
    assert len(c) == 3


def test_plan_key_round_trips_and_auto_keeps_cpu_eager(tmp_path):
    cfg = load_config(None, ["train.compile=true"])
    assert Plan.from_config(cfg).compile == "true" and "compiled" in Plan.from_config(cfg).describe()
    f = tmp_path / "plan.toml"
    f.write_text("[train]\ncompile = true\n")  # a TOML boolean is the string choice
    assert Plan.from_config(load_config(None, load_plan_overrides(f))).compile == "true"
    assert Plan(compile="auto").overrides() == ['train.compile="auto"']
    assert not comp.resolve("auto", "cpu") and comp.resolve("auto", "cuda") and comp.resolve("true", "cpu")
    assert not comp.resolve("false", "cuda")


def test_cost_multiplies_by_the_measured_factor_or_says_not_priced():
    plan = Plan(compile="true")
    assert comp.compute_factor(plan, 0.8) == 0.8 and comp.compute_factor(Plan(), 0.8) == 1.0
    assert comp.compute_factor(plan, 0.0) == 1.0
    assert "not priced" in comp.priced_note(plan, 0.0)
    assert "x 0.80" in comp.priced_note(plan, 0.8) and comp.priced_note(Plan(), 0.8) == ""
    assert Platform.from_dict({**Platform("x").to_dict(), "compile_factor": 0.7}).compile_factor == 0.7


@pytest.mark.parametrize("keys,rule", [
    ({"pp": 2}, "compile-pp"), ({"offload": {"optimizer": "host"}}, "compile-offload"),
    ({"remat": {"method": "dtr", "budget": "1MiB"}}, "compile-remat-ops"), ({"tp": 2}, "compile-parallel"),
    ({"activation_compression": True}, "compile-compress"),
    ({"remat": {"selective": "attention"}}, "compile-selective"),
])
def test_refused_where_unverified(keys, rule):
    plan = Plan(compile="true").with_(**keys)
    facts = compat.Facts(world=plan.world())
    assert rule in [r.name for r in compat.violations(plan, facts)]
    assert rule not in [r.name for r in compat.violations(plan.with_(compile="false"), facts)]
    assert rule not in [r.name for r in compat.violations(plan.with_(compile="auto"), facts)]  # auto: eager on cpu


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", *TINY, "train.compile=true",
                        "memory.remat.method=dtr", "memory.remat.budget=1MiB", "--out", "run"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "train.compile=true" in r.stderr and "allowed" in r.stderr
    assert not (tmp_path / "run").exists()


def test_plan_cost_multiplies_compute_by_the_platform_factor():
    from scaletrain import models
    from scaletrain.platform import get
    from scaletrain.techniques.plan_cost import plan_costs

    model = models.get("gpt2-tiny", device="meta", n_layer=1)
    plat = get("h100").with_(compile_factor=0.5)

    def compute(plan: Plan) -> float:
        c = plan_costs(plan, model, world=1, global_batch=2, seq=32, micro_batch=2, device="cuda", platform=plat)
        return c[0].to_dict()["time_s"]["compute"]

    eager, compiled = compute(Plan(dp=1)), compute(Plan(dp=1, compile="true"))
    assert eager > 0 and compiled == pytest.approx(0.5 * eager, rel=1e-9)
    assert compute(Plan(dp=1, compile="auto")) == pytest.approx(compiled, rel=1e-9)  # auto compiles on cuda
