"""`scaletrain estimate` and `scaletrain profile`."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import main


pytestmark = pytest.mark.usefixtures("one_thread")


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_json(capsys) -> None:
    d = _json(capsys, ["estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--precision", "bf16",
                       "--optimizer", "sgd", "--accum", "2", "--json"])
    assert d["parameters"] == 858_880
    assert set(d["bytes"]) >= {"parameters", "gradients", "optimizer_states", "activations", "peak"}
    assert d["bytes"]["parameters"] == 4 * d["parameters"]
    assert d["bytes"]["peak"] >= sum(d["bytes"][k] for k in ("parameters", "optimizer_states"))
    assert [b["name"] for b in d["blocks"]] == ["embed", "h.0", "h.1", "h.2", "h.3", "head"]
    assert d["measured"] is False and d["accum"] == 2


def test_estimate_table_and_overrides(capsys, tmp_path) -> None:
    png = tmp_path / "est.png"
    assert main(["estimate", "--model", "gpt2-small", "--set", "n_layer=2", "--batch", "1", "--seq", "64",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for word in ("parameters", "gradients", "optimizer states", "activations", "peak", "h.1", "GiB"):
        assert word in out
    assert "h.2" not in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_unknown_names_exit_2_with_one_line(capsys) -> None:
    assert main(["estimate", "--model", "gpt9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown model 'gpt9'" in err and "\n" not in err
    assert main(["profile", "--model", "mlp", "--optimizer", "lion"]) == 2
    assert "unknown optimizer 'lion'" in capsys.readouterr().err
    assert main(["estimate", "--model", "mlp", "--set", "depth=3"]) == 2
    assert "no option 'depth'" in capsys.readouterr().err


def test_profile_json(capsys, tmp_path) -> None:
    png = tmp_path / "step.png"
    d = _json(capsys, ["profile", "--model", "mlp", "--batch", "4", "--optimizer", "adamw", "--repeats", "2",
                       "--warmup", "1", "--plot", str(png), "--json"])
    assert d["measured"] is True
    assert d["parameters"] == 629_258
    assert set(d["bytes"]) >= {"parameters", "gradients", "optimizer_states", "activations", "peak"}
    assert len(d["blocks"]) == 4 and all(b["fwd_time_s"] > 0 for b in d["blocks"])
    assert abs(d["meta"]["estimated"]["peak"] - d["bytes"]["peak"]) <= 0.05 * d["bytes"]["peak"]
    assert png.read_bytes()[:4] == b"\x89PNG"
