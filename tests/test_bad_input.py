"""The bad inputs of issue #27, each one line on stderr naming it, exit code 2, nothing written."""

from __future__ import annotations

import pytest

from scaletrain.cli import main

PLATFORMS = {"str": '{"name": "x", "flops_fp32": "fast"}', "zero": '{"name": "x", "flops_bf16": 0}',
             "neg": '{"name": "x", "device_memory_bytes": -5}', "nan": '{"name": "x", "h2d_bytes_per_s": NaN}'}
CASES = [
    (["estimate", "--model", "gpt2-tiny", "--platform", "p_str.json"], "flops_fp32"),
    (["estimate", "--model", "gpt2-tiny", "--platform", "p_zero.json"], "flops_bf16"),
    (["estimate", "--model", "gpt2-tiny", "--platform", "p_neg.json"], "device_memory_bytes"),
    (["plan", "--model", "gpt2-small", "--global-batch", "8", "--platform", "p_nan.json"], "h2d_bytes_per_s"),
    (["plan", "--model", "gpt2-small", "--global-batch", "8", "--out", "adir"], "directory"),
    (["plan", "--model", "gpt2-small", "--global-batch", "8", "--nodes", "1-10000000"], "--nodes"),
    (["sweep", "--runs", "adir"], "adir"),
    (["pipeline", "--profile", "bin.json"], "UTF-8"),
    (["pipeline", "--ranks", "100000", "--microbatches", "100000"], "--ranks"),
    (["pipeline", "--ranks", "1000", "--microbatches", "1000"], "passes"),
    (["estimate", "--model", "gpt2-tiny", "--flops-per-s", "-1"], "--flops-per-s"),
    (["estimate", "--model", "gpt2-tiny", "--flops-per-s", "nan"], "--flops-per-s"),
    (["compat", "--nproc", "0"], "--nproc"),
    (["estimate", "--model", "gpt2-tiny", "--set", "n_layer=-1"], "n_layer"),
    (["train", "train.steps=99999999999999999999"], "train.steps"),
    (["train", "--nproc-per-node", "1000"], "--nproc-per-node"),
    (["train", "memory.offload.optimizer=disk", "memory.offload.disk_dir=afile", "model.name=mlp", "train.steps=1"],
     "disk_dir"),
    (["estimate", "--bogus"], "--help"),
]


@pytest.mark.parametrize("argv,names", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(argv, names, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for k, v in PLATFORMS.items():
        (tmp_path / f"p_{k}.json").write_text(v)
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    before = set(tmp_path.rglob("*"))
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and names in err[0] and ": error: " in err[0], err
    assert set(tmp_path.rglob("*")) == before
