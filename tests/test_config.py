"""Config schema: TOML + dotted overrides, documented fields, one-line errors with exit code 2."""

import subprocess
import sys

import pytest

from scaletrain.errors import ConfigError
from scaletrain.train.config import describe, load_config, to_toml


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nprecision = "bf16"\n[optim]\nname = "sgd"\n')
    cfg = load_config(f, ["train.steps=9", "optim.lr=3e-4", "model.overrides.n_layer=2", "memory.remat.method=optimal"])
    assert cfg.train.steps == 9 and cfg.train.precision == "bf16" and cfg.optim.name == "sgd"
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.model.overrides == {"n_layer": 2}
    assert cfg.memory.remat.method == "optimal"


def test_round_trip_toml(tmp_path):
    cfg = load_config(None, ["train.global_batch=32", "data.seq_len=64"])
    f = tmp_path / "out.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg


def test_required_keys_exist():
    keys = {k for k, _ in describe()}
    for k in ("model.name", "data.name", "train.steps", "train.global_batch", "train.micro_batch",
              "train.precision", "train.eval_every", "optim.name", "optim.lr"):
        assert k in keys
    for k, h in describe():
        assert h.strip() and "default" in h, k


@pytest.mark.parametrize("override,needle", [
    ("train.stepz=1", "unknown key 'train.stepz'; allowed in [train]: steps"),
    ("train.precision=fp8", "train.precision='fp8' is not allowed; allowed: fp32, bf16, fp16"),
    ("train.steps=abc", "train.steps='abc' is not allowed; expected an integer"),
    ("optim.lr=-1", "optim.lr=-1.0 is not allowed; must be >= 0.0"),
    ("bogus.x=1", "unknown key 'bogus'"),
    ("steps=3", "must name a section and a key"),
    ("optim.name=adamx", "allowed: adamw"),
])
def test_bad_values(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize("args,needle", [
    (["train", "train.stepz=3"], "unknown key 'train.stepz'"),
    (["train", "optim.name=nope"], "optim.name='nope' is not allowed"),
    (["train", "model.name=gpt5"], "unknown model 'gpt5'"),
    (["train", "train.global_batch=10", "train.micro_batch=4"], "allowed micro_batch: 1, 2, 5, 10"),
    (["train", "--resume", "--out", "nothing-here"], "no checkpoint"),
])
def test_cli_errors_are_one_line_exit_2(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", *args], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "nothing-here").exists()  # nothing written by a failed command
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_help_lists_every_key():
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for k, _ in describe():
        assert k in r.stdout


def test_every_size_is_read_whether_or_not_its_feature_is_on():
    """`memory.remat.budget=lots` with no remat method used to pass silently (issue 18, item 5)."""
    for key in ("memory.remat.budget=lots", "memory.device_budget=3 apples", "memory.offload.disk_chunk_bytes=4q"):
        with pytest.raises(ConfigError, match="is not allowed; cannot read budget"):
            load_config(None, [key])
    assert load_config(None, ["memory.remat.budget=12MiB"]).memory.remat.budget == "12MiB"
