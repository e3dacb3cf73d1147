"""`scaletrain checkpoint export RUN --to hf`: a directory that transformers' `from_pretrained`
loads and that computes what the trained model computes — for the reference GPT-2 (renamed,
Linear -> Conv1D transposed, tied head) and for an `hf:` model (its own names)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain import models
from scaletrain.cli import main
from scaletrain.train import checkpoint as ckpt

transformers = pytest.importorskip("transformers")
TINY = ["data.seq_len=32", "train.steps=2", "train.global_batch=4", "train.progress=off", "train.eval_batches=1"]


def _train_and_export(tmp_path: Path, *keys: str) -> tuple[dict, Path]:
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--out", str(run), *TINY, *keys]) == 0
    assert main(["checkpoint", "export", str(run), "--to", "hf", "--out", str(out)]) == 0
    return ckpt.load(ckpt.latest(run / "checkpoints")), out


def test_reference_gpt2_exports_to_a_gpt2lmheadmodel(tmp_path):
    over = dict(n_layer=2, n_embd=32, n_head=2)
    state, out = _train_and_export(tmp_path, *(f"model.overrides.{k}={v}" for k, v in over.items()))
    ours = models.get("gpt2-tiny", **over)
    ours.load_state_dict(state["model"])
    theirs = transformers.GPT2LMHeadModel.from_pretrained(out)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours.eval()(x), theirs.eval()(x).logits, atol=1e-5, rtol=0)
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()  # tied again


def test_hf_model_exports_under_its_own_names(tmp_path):
    keys = ["model.name=hf:llama", "model.overrides.num_hidden_layers=1", "model.overrides.hidden_size=32",
            "model.overrides.intermediate_size=64", "model.overrides.num_attention_heads=2",
            "model.overrides.num_key_value_heads=2"]
    state, out = _train_and_export(tmp_path, *keys)
    theirs = transformers.LlamaForCausalLM.from_pretrained(out)
    for k, v in theirs.state_dict().items():
        assert torch.equal(v, state["model"][k]), k


def test_a_model_without_a_hugging_face_layout_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "model.name=mlp", "train.steps=1", "train.progress=off"]) == 0
    assert main(["checkpoint", "export", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no Hugging Face layout" in err[0] and "--to safetensors" in err[0]
