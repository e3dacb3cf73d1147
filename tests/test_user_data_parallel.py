"""The issue's done-when at tiny scale: prepared text with a local tokenizer, hf:llama under ZeRO-3 on two
processes, TensorBoard events; equal to one process, resumed exactly."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tensorboard")

from scaletrain.testing import run_distributed  # noqa: E402

LLAMA = ["model.name=hf:llama", "model.overrides.num_hidden_layers=1", "model.overrides.hidden_size=32",
         "model.overrides.intermediate_size=64", "model.overrides.max_position_embeddings=32",
         "train.checkpoint_every=2", "train.loggers=jsonl,tensorboard"]


def _fit(args: list[str], out: str | None = None, resume: bool = False) -> list[float]:
    import test_user_data as t
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    base = [a for a in t.BASE if not a.startswith("model.overrides.")]
    tr = Trainer(load_config(None, base + LLAMA + args), out, resume=resume, log=lambda s: None)
    try:
        return tr.fit().losses
    finally:
        tr.close()


def _ranks(rank: int, world: int, tests_dir: str, data: list[str], out: str) -> dict:
    sys.path.insert(0, tests_dir)
    zero3 = data + ["parallel.zero=3"]
    return {"straight": _fit(zero3, f"{out}/straight"), "first": _fit(zero3 + ["train.steps=2"], f"{out}/resumed"),
            "rest": _fit(zero3, f"{out}/resumed", resume=True)}


@pytest.mark.slow
def test_prepared_text_tokenizer_llama_zero3_two_processes(tmp_path):
    import test_user_data as t
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = tmp_path / "text"
    text.mkdir()
    for k in range(3):
        (text / f"part{k}.txt").write_text("\n".join(t.LINES[k::3]))
    tok = t.make_tokenizer(tmp_path / "tok")
    code, err = t.cli("data", "prepare", str(text), "--tokenizer", str(tok), "--out", str(tmp_path / "prep"))
    assert code == 0, err
    data = [f"data.name=text:{tmp_path / 'prep'}", f"data.tokenizer={tok}"]
    ref = _fit(data)
    res = run_distributed(_ranks, 2, os.path.dirname(__file__), data, str(tmp_path))
    for r in res:
        assert r["straight"] == pytest.approx(ref, rel=1e-6) and len(ref) == 4
        assert r["first"] + r["rest"] == r["straight"]  # resumed at step 2: bit for bit
    acc = EventAccumulator(str(tmp_path / "resumed" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(res[0]["straight"], rel=1e-6)
