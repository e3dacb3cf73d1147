"""A value set for a feature that is off is one line, exit 2, nothing written — not silently ignored
(`train/preflight.py: check_unused`)."""

from __future__ import annotations

import pytest

from scaletrain.cli import main


@pytest.mark.parametrize("keys,needs", [
    (["memory.remat.budget=40MB"], "memory.remat.method=optimal"),
    (["memory.offload.disk_masters=true", "memory.offload.optimizer=host"], "memory.offload.optimizer=disk"),
    (["memory.offload.param_window=2"], "memory.offload.params=host"),
])
def test_a_key_without_its_feature_is_one_line(tmp_path, capsys, keys, needs):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", *keys]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and keys[0].split("=")[0] in err[0] and needs in err[0], err
    assert not out.exists()

