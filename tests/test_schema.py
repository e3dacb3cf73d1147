"""The plan keys are declared once (scaletrain.schema) and the config, the Plan, the planner's pins and the
offload runtime's checks all follow that one declaration."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from scaletrain import schema
from scaletrain.errors import ConfigError, UserError
from scaletrain.plan import PLAN_KEYS, Plan, toml_value
from scaletrain.train.config import Config, describe, load_config


def _other_value(key: schema.Key):
    """A valid value of ``key`` other than its default."""
    if key.choices:
        return next(c for c in key.choices if c != key.default)
    if key.type is bool:
        return not key.default
    if key.type in (int, float):
        hi = key.max if key.max is not None else key.default + 2
        return key.type(min(key.default + 1, hi)) if key.default + 1 <= hi else key.type(key.min or 0)
    if key.unit == "bytes":
        return "3MiB"
    if key.unit == schema.BYTES_LIST:
        return "3MiB,4MiB"
    return "0,1" if "list" in key.help else "somewhere"


def test_every_key_is_a_config_field_and_a_plan_field_with_its_declared_default():
    rows = dict(describe())
    assert PLAN_KEYS == {k.field: k.path for k in schema.KEYS}
    assert len(schema.BY_PATH) == len(schema.KEYS) == len(schema.BY_FIELD)  # each declared once
    flat = Plan().to_flat()
    assert set(flat) == set(schema.BY_FIELD)
    cfg = Config()
    for k in schema.KEYS:
        assert flat[k.field] == k.default
        obj = cfg
        for part in k.path.split("."):
            obj = getattr(obj, part)
        assert obj == k.default and type(obj) is k.type, k.path
        assert rows[k.path].startswith(k.help), k.path  # --help from the declaration


@pytest.mark.parametrize("key", schema.KEYS, ids=lambda k: k.path)
def test_setting_one_key_moves_exactly_its_plan_field(key):
    value = _other_value(key)
    plan = Plan.from_config(load_config(None, [f"{key.path}={toml_value(value)}"])).to_flat()
    changed = {f: v for f, v in plan.items() if v != Plan().to_flat()[f]}
    assert changed == {key.field: value}


@pytest.mark.parametrize("key", [k for k in schema.KEYS if k.choices], ids=lambda k: k.path)
def test_a_value_outside_the_choices_is_one_line_naming_key_and_choices(key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key.path}=bogus"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{key.path}='bogus' is not allowed; allowed: ")
    assert msg.endswith(", ".join(map(str, key.choices)))


def test_offload_options_check_against_the_declaration():
    from scaletrain.techniques.offload import OffloadOptions

    with pytest.raises(UserError, match=r"^memory\.offload\.params='disk' is not allowed; allowed: device, host$"):
        OffloadOptions(params="disk").validate()
    with pytest.raises(UserError, match=r"^memory\.offload\.prefetch=-1 is not allowed; must be >= 0$"):
        OffloadOptions(prefetch=-1).validate()
    OffloadOptions(optimizer="disk").validate()


def test_planner_pins_and_vocabulary_follow_the_schema():
    search = importlib.import_module("scaletrain.planner.search")
    auto = importlib.import_module("scaletrain.planner.auto")
    assert set(schema.pinnable()) <= set(search.FIX_KEYS)
    assert all(search.FIX_KEYS[f] is schema.BY_FIELD[f].type for f in schema.pinnable())
    assert set(auto.PINNABLE) == set(schema.searched()) and auto.KEPT == schema.kept()
    with pytest.raises(UserError, match=r"params_dtype=int8: allowed: fp32, bf16, fp16$"):
        search.parse_fixed(["params_dtype=int8"])
    for kind, keys in schema.REMAT_KINDS.items():  # each remat kind is the plan keys it names
        flat = Plan(remat=search._remat(kind)).to_flat()
        assert {f: v for f, v in flat.items() if v != Plan().to_flat()[f]} == keys
    from scaletrain.techniques.pipeline import SCHEDULES

    assert SCHEDULES == schema.BY_FIELD["schedule"].choices


def test_the_compatibility_table_names_only_declared_config_keys():
    """Every ``section.key`` the table's messages name is a config key (a renamed key cannot linger there)."""
    import scaletrain.techniques.compat as compat

    keys = {k for k, _ in describe()}
    keys |= {k.rsplit(".", 1)[0] for k in keys}  # sections (memory.offload with ...)
    text = Path(compat.__file__).read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w.])(?:parallel|memory|train|optim|data)\.[a-z_]+(?:\.[a-z_]+)?\b", text))
    assert named and named <= keys, sorted(named - keys)
    for field_name in re.findall(r"\bp\.([a-z_]+)\b", text):  # the rules read only declared plan fields
        assert field_name in {f.name for f in dataclasses.fields(Plan)} or hasattr(Plan, field_name), field_name


def test_a_new_plan_key_is_one_declaration(monkeypatch):
    """One Key row gives the config field (documented, validated) and the Plan field: nothing else to edit."""
    demo = schema.Key("demo", "parallel.demo", 3, "a demonstration key", "ranks", min=1, planner="searched")
    monkeypatch.setattr(schema, "KEYS", (*schema.KEYS, demo))

    @dataclasses.dataclass
    @schema.config_fields("parallel")
    class Section:
        timeout_s: float = 1.0

    @dataclasses.dataclass(frozen=True)
    @schema.plan_fields()
    class PlanLike:
        pass

    f = {x.name: x for x in dataclasses.fields(Section)}["demo"]
    assert Section().demo == 3 and f.metadata["help"] == "a demonstration key" and f.metadata["unit"] == "ranks"
    assert PlanLike().demo == 3 and PlanLike(demo=5).demo == 5
    assert "demo" in schema.searched()
    with pytest.raises(ConfigError, match=r"^parallel\.demo=0 is not allowed; must be >= 1$"):
        demo.check(0)
