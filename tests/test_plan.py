"""The Plan (one schema with the config), plan files, and the one compatibility table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.errors import ConfigError
from scaletrain.plan import PLAN_KEYS, Plan, load_plan_overrides
from scaletrain.techniques import compat
from scaletrain.train.config import load_config

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_plan_key_is_a_config_key_and_the_defaults_agree():
    cfg = load_config(None, [])
    assert Plan.from_config(cfg) == Plan()
    for field, key in PLAN_KEYS.items():
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)  # raises if the config has no such key


def test_plan_files_round_trip_through_the_config(tmp_path):
    plan = Plan(dp=2, zero=1, tp=2, sp=True, pp=2, schedule="interleaved", microbatches=8, precision="bf16",
                optimizer="lamb").with_(remat={"method": "optimal", "budget": "1GiB"}, offload={"optimizer": "host"})
    toml_file = tmp_path / "plan.toml"
    toml_file.write_text(plan.to_toml())
    assert Plan.from_config(load_config(None, load_plan_overrides(toml_file))) == plan
    json_file = tmp_path / "plan.json"
    json_file.write_text(json.dumps({"plan": plan.to_dict(), "step_time_s": 1.0}))
    assert Plan.from_config(load_config(None, load_plan_overrides(json_file))) == plan
    assert Plan.from_config(load_config(None, plan.overrides())) == plan


@pytest.mark.parametrize("text, suffix, needle", [
    ("[train]\nsteps = 5\n", ".toml", "'train.steps' is not a plan key"),
    ('{"dp": 2, "steps": 3}', ".json", "unknown plan field 'steps'"),
    ("[parallel]\nzero = 7\n", ".toml", "must be <= 3"),
    ("not toml = = 1", ".toml", "is not valid TOML"),
])
def test_bad_plan_files_are_one_line_errors(tmp_path, text, suffix, needle):
    f = tmp_path / f"plan{suffix}"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(None, load_plan_overrides(f))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_resolved_fills_dp_and_names_conflicts():
    assert Plan(tp=2, pp=2).resolved(8).dp == 2
    with pytest.raises(ConfigError, match="must divide the 6 process"):
        Plan(tp=4).resolved(6)
    with pytest.raises(ConfigError, match="parallel.dp=4 but 8 process"):
        Plan(dp=4, tp=4).resolved(8)


def test_every_rule_speaks_one_line():
    """Each refusal of the table fires on some plan and says what, why and what is allowed in one line."""
    fired = set()
    names, rows, notes = compat.matrix()
    for a in compat.FEATURES.values():
        for b in compat.FEATURES.values():
            plan, facts = compat._combine(a, b)
            for r in compat.violations(plan, facts):
                msg = r.message(plan, facts)
                assert "\n" not in msg and "; allowed: " in msg, msg
                fired.add(r.name)
    assert {"compression-ddp", "pp-zero2", "offload-world", "remat-pp-schedule"} <= fired


def test_readme_matrix_is_the_enforced_table():
    assert compat.matrix_markdown() in README.read_text(), "regenerate it: scaletrain compat --markdown"


def test_facts_come_from_the_model():
    from scaletrain import models

    m = models.get("gpt2-moe", device="meta", n_layer=2)
    f = compat.Facts.of(m, world=4, device="cpu", seq_len=64)
    assert f.moe and f.gpt2 and f.chain and f.n_experts == m.config.n_experts
    with pytest.raises(ConfigError, match="sequence_parallel=true on a mixture-of-experts model"):
        compat.check(Plan(tp=2, sp=True), f)
    compat.check(Plan(ep=2), f)


def test_describe_names_offload_recompute_and_the_chunk_manager():
    from scaletrain.plan import OffloadPlan

    plan = Plan(offload=OffloadPlan(optimizer="host", recompute="all"))
    assert "offload optimizer host, recompute all" in plan.describe()
    assert "offload chunks under device budget 40MiB" in Plan(
        offload=OffloadPlan(plan="chunks", device_budget="40MiB")).describe()
