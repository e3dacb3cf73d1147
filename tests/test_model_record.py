"""A model passed from Python is recorded so that the run can be exported and resumed
(`train/model_record.py`): transformers models by family and config, anything else by class with a
one-line refusal naming how to resume it from Python."""

from __future__ import annotations

import contextlib
import io
import json
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from scaletrain.cli import main  # noqa: E402
from scaletrain.train import checkpoint as ckpt  # noqa: E402
from scaletrain.train.config import load_config  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402

KEYS = ["train.global_batch=4", "data.seq_len=16", "train.eval_batches=1", "train.progress=off", "train.eval_every=0"]


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64))


def _bert() -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _fit(model: nn.Module, run: Path, *extra: str, resume: bool = False) -> nn.Module:
    torch.manual_seed(0)
    tr = Trainer(load_config(None, KEYS + list(extra)), run, model=model, resume=resume, log=lambda s: None)
    try:
        tr.fit()
    finally:
        tr.close()
    return model


def _recorded(run: Path) -> dict:
    return tomllib.loads((run / "config.toml").read_text())


@pytest.mark.parametrize("build,family", [(_gpt2, "hf:gpt2"), (_llama, "hf:llama"), (_bert, "hf:bert")])
def test_python_hf_model_is_recorded_and_exports(tmp_path, build, family):
    """An HF object passed to Trainer is recorded as its family + config; `export --to hf` loads with
    from_pretrained, names the architecture and holds the trained weights."""
    run, out = tmp_path / "run", tmp_path / "hf"
    torch.manual_seed(0)
    model = _fit(build(), run, "train.steps=1")
    rec = _recorded(run)["model"]
    assert rec["name"] == family, rec
    assert main(["checkpoint", "export", str(run), "--to", "hf", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    theirs = getattr(transformers, type(model).__name__).from_pretrained(out)
    mine = model.state_dict()
    for k, v in theirs.state_dict().items():
        assert torch.equal(v, mine[k]), k


def test_python_hf_model_resumes_from_the_command_line(tmp_path):
    """`scaletrain train --out RUN --resume` rebuilds the recorded model and continues exactly: the
    resumed last step equals the uninterrupted run's."""
    run = tmp_path / "run"
    torch.manual_seed(0)
    model = _fit(_gpt2(), run, "train.steps=3", "train.checkpoint_every=2", "train.checkpoint_format=consolidated")
    final = {k: v.clone() for k, v in model.state_dict().items()}
    last = ckpt.latest(run / "checkpoints")
    assert ckpt.load(last)["step"] == 3
    last.unlink()  # as if the run had stopped after step 2's checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--out", str(run), "--resume"]) == 0
    resumed = ckpt.load(ckpt.latest(run / "checkpoints"))
    assert resumed["step"] == 3
    for k, v in resumed["model"].items():
        assert torch.equal(v, final[k]), k


class Net(nn.Module):
    """A model only Python can build (its width is not recorded anywhere)."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(192, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_plain_module_is_recorded_by_class_and_refused_in_one_line(tmp_path, capsys):
    """A plain module: config.toml names its class; the CLI's --resume and --to hf are one line each
    naming what works; from Python, passing the model, the run resumes."""
    run = tmp_path / "run"
    torch.manual_seed(0)
    _fit(Net(16), run, "train.steps=1", "data.image_size=8")
    rec = _recorded(run)
    assert rec["model"]["name"] == f"python:{__name__}:Net" and rec["data"]["name"] == "digits"
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model=Net(...), resume=True" in err[0], err
    assert main(["checkpoint", "export", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--to safetensors" in err[0], err
    cfg_path = str(run / "config.toml")
    tr = Trainer(load_config(cfg_path, ["train.steps=2"]), run, model=Net(16), resume=True, log=lambda s: None)
    try:
        assert tr.fit().steps == 2
    finally:
        tr.close()


def _exported(tmp_path: Path) -> Path:
    run, out = tmp_path / "run", tmp_path / "hf"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--out", str(run), "model.name=hf:gpt2", "model.overrides.n_layer=1",
                     "model.overrides.n_embd=32", "model.overrides.n_head=2", "train.steps=1", *KEYS]) == 0
        assert main(["checkpoint", "export", str(run), "--to", "hf", "--out", str(out)]) == 0
    return out


def test_export_of_a_run_is_an_hf_dir(tmp_path):
    """An export names its architecture, so `model.name=hf:DIR` builds it again (the exported weights)."""
    out = _exported(tmp_path)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    from scaletrain import models

    again, theirs = models.get(f"hf:{out}"), transformers.GPT2LMHeadModel.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), theirs.state_dict().values()))


def test_estimate_takes_an_export(tmp_path):
    """`scaletrain estimate --model hf:DIR` takes scaletrain's own HF export."""
    out = _exported(tmp_path)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["estimate", "--model", f"hf:{out}", "--batch", "2", "--seq", "16", "--json"]) == 0
    n = sum(p.numel() for p in transformers.GPT2LMHeadModel.from_pretrained(out).parameters())
    assert json.loads(buf.getvalue())["parameters"] == n
