"""Checkpoint files are data, never paths (issue 27, deliverable 1).

A hostile or broken ``manifest.json`` (piece files by absolute path, ``..``, a symlink out of the
checkpoint, a bad dtype/shape/nbytes/step/world, no ``files``...) is a damaged checkpoint: nothing
outside the checkpoint is read, ``checkpoint info`` says DAMAGED, ``export`` refuses it in one line
(exit 2, nothing written) as it refuses a rank file failing its CRC32, and a resume skips it for the
older checkpoint. ``checkpoint import`` checks tensor names and aliases alike.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import sharded_checkpoint as sharded
from scaletrain.train.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model.overrides.n_layer=1", "model.overrides.n_embd=32", "model.overrides.n_head=2", "data.seq_len=16",
        "data.name=synthetic-text", "train.global_batch=4", "train.eval_every=0", "train.eval_batches=1",
        "train.log_every=1", "optim.warmup_steps=1", "train.progress=off", "train.checkpoint_format=sharded",
        "train.checkpoint_every=2", "train.steps=4"]
SECRET = b"SECRET-BYTES-" * 64  # 832 bytes outside the run: must never reach a model


def _train(out: Path, *extra: str, resume: bool = False) -> list[str]:
    from scaletrain.train.trainer import Trainer

    logs: list[str] = []
    t = Trainer(load_config(None, TINY + list(extra)), out, resume=resume, log=logs.append)
    try:
        t.fit()
    finally:
        t.close()
    return logs


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hard") / "run"
    _train(out)
    return out


def _one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scaletrain: error:") and "Traceback" not in err, err
    return err


def _edit(ck: Path, fn) -> None:
    m = json.loads((ck / "manifest.json").read_text())
    fn(m)
    (ck / "manifest.json").write_text(json.dumps(m))


def _first_piece(m: dict) -> dict:
    return m["tensors"]["model/embed.wte.weight"]["pieces"][0]


def _redirect(m: dict, name: str) -> None:
    """A consistent attack: ``name`` listed with the secret's true size and CRC32, and one small tensor
    (a layer norm's 32 floats) read from its first 128 bytes."""
    import zlib

    m["files"][name] = {"bytes": len(SECRET), "crc32": zlib.crc32(SECRET)}
    m["tensors"]["model/h.0.ln_1.weight"]["pieces"] = [
        {"file": name, "offset": [0], "size": [32], "byte": 0, "nbytes": 128, "dtype": "float32"}]
    m["world"] = len(m["files"])  # one file per rank, as the format has it


HOSTILE = {
    "absolute file": lambda m, secret: _redirect(m, str(secret)),
    "dot-dot file": lambda m, secret: _redirect(m, "../../../secret.bin"),
    "bad dtype": lambda m, s: m["tensors"]["model/embed.wte.weight"].update(dtype="complex128"),
    "huge shape": lambda m, s: m["tensors"]["model/embed.wte.weight"].update(shape=[10**12, 32]),
    "wrong nbytes": lambda m, s: _first_piece(m).update(nbytes=_first_piece(m)["nbytes"] + 4),
    "piece past its file": lambda m, s: _first_piece(m).update(byte=10**9),
    "offset outside shape": lambda m, s: _first_piece(m).update(offset=[5000, 0]),
    "step not an int": lambda m, s: m.update(step="4"),
    "step of another dir": lambda m, s: m.update(step=7),
    "world zero": lambda m, s: m.update(world=0),
    "world huge": lambda m, s: m.update(world=10**9),
    "no files": lambda m, s: m.pop("files"),
    "tensor key a path":
        lambda m, s: m["tensors"].update({"model/../../x": m["tensors"].pop("model/embed.wte.weight")}),
    "alias a path": lambda m, s: m.update(aliases={"/etc/passwd": "embed.wte.weight"}),
    "no tensors": lambda m, s: m.update(tensors=[]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_manifest_is_damaged_never_read(run, tmp_path, capsys, case):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "secret.bin").write_bytes(SECRET)  # what '../' would reach from inside the checkpoint's dir tree
    ck = copy / "checkpoints" / "step_00000004"
    _edit(ck, lambda m: HOSTILE[case](m, secret))
    why = sharded.problem(ck)
    assert why is not None and "\n" not in why
    assert case not in ("absolute file", "dot-dot file") or "never paths" in why, why
    assert main(["checkpoint", "info", str(ck)]) == 2
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "integrity: ok" not in out
    target = tmp_path / "model.safetensors"
    assert "damaged" in _one_line(capsys, ["checkpoint", "export", str(ck), "--out", str(target)])
    assert not target.exists() and not list(tmp_path.glob("model.safetensors*"))
    with pytest.raises(Exception) as e:  # a library caller gets a one-line UserError, not a crash
        sharded.Reader(ck).state(lazy=False)
    assert type(e.value).__name__ in ("BadManifest", "UserError")


def test_symlinked_piece_file_and_manifest_are_not_followed(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ck = copy / "checkpoints" / "step_00000004"
    rank = ck / "rank_00000.bin"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(rank.read_bytes())  # the same size and CRC: only the link gives it away
    rank.unlink()
    rank.symlink_to(outside)
    assert "not a plain file" in sharded.problem(ck)
    assert "damaged" in _one_line(capsys, ["checkpoint", "export", str(ck), "--out", str(tmp_path / "m.st")])
    rank.unlink()
    shutil.copy(outside, rank)
    man = ck / "manifest.json"
    (tmp_path / "m.json").write_bytes(man.read_bytes())
    man.unlink()
    man.symlink_to(tmp_path / "m.json")
    assert "not a plain file" in sharded.problem(ck)


def test_export_refuses_a_rank_file_failing_its_crc(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    f = copy / "checkpoints" / "step_00000004" / "rank_00000.bin"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    target = tmp_path / "model.safetensors"
    err = _one_line(capsys, ["checkpoint", "export", str(copy), "--out", str(target)])
    assert "CRC32" in err and "not exported" in err
    assert not target.exists()
    assert main(["checkpoint", "info", str(copy)]) == 2 and "DAMAGED" in capsys.readouterr().out


def test_resume_skips_a_hostile_manifest_for_the_older_checkpoint(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "secret.bin").write_bytes(SECRET)
    _edit(copy / "checkpoints" / "step_00000004", lambda m: _redirect(m, "../../secret.bin"))
    logs = _train(copy, "train.steps=5", resume=True)
    warn = [s for s in logs if s.startswith("warning: skipping damaged checkpoint")]
    assert len(warn) == 1 and "step_00000004" in warn[0] and "rank file name" in warn[0]
    assert any("resumed from" in s and "step_00000002" in s for s in logs)
    assert ckpt.load(ckpt.latest(copy / "checkpoints"))["step"] == 5


def test_import_checks_names_and_aliases_like_a_manifest(tmp_path, capsys):
    from safetensors.torch import save_file

    for i, (tensors, meta, words) in enumerate([
        ({"../../evil": torch.ones(2)}, None, "component"),
        ({"/abs/w": torch.ones(2)}, None, "path"),
        ({"w": torch.ones(2)}, {"scaletrain_aliases": json.dumps({"../x": "w"})}, "component"),
        ({"w": torch.ones(2)}, {"scaletrain_aliases": json.dumps({"v": "nope"})}, "not a tensor"),
    ]):
        src = tmp_path / f"f{i}.safetensors"
        save_file(tensors, str(src), metadata=meta)
        out = tmp_path / f"imported{i}"
        assert words in _one_line(capsys, ["checkpoint", "import", str(src), "--out", str(out)])
        assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == [f"f{i}.safetensors" for i in range(4)]
