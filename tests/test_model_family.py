"""A model family is one registration: a toy family defined here, registered with one
``register(ModelSpec(...))``, is cut into blocks, priced by the planner and trained — no other file edited."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import scaletrain
from scaletrain import models
from scaletrain.chain import to_chain
from scaletrain.errors import UserError
from scaletrain.models.spec import ModelEntry, ModelSpec, ShardingPlan, register, spec_named, spec_of, unregister
from scaletrain.testing import run_distributed


class ToyLayer(nn.Module):
    """A residual MLP layer: x + fc2(gelu(fc1(x)))."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class ToyNet(nn.Module):
    """An image classifier the library has never seen: no chain_blocks(), blocks only through its spec."""

    task = "classify"

    def __init__(self, width: int = 16, depth: int = 3, num_classes: int = 10, image_size: int = 8,
                 channels: int = 3):
        super().__init__()
        self.num_classes, self.image_size, self.channels = num_classes, image_size, channels
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size ** 2, width))
        self.layers = nn.ModuleList(ToyLayer(width) for _ in range(depth))
        self.out = nn.Linear(width, num_classes)

    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        return torch.zeros(batch, self.channels, self.image_size, self.image_size, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def toy_blocks(m: ToyNet) -> list[tuple[str, nn.Module]]:
    return [("stem", m.stem), *[(f"layers.{i}", b) for i, b in enumerate(m.layers)], ("out", m.out)]


@pytest.fixture
def toy():
    spec = register(ModelSpec(
        name="toy", classes=(ToyNet,), blocks=toy_blocks,
        models={"toy-tiny": ModelEntry(ToyNet, dict(width=16, depth=3), "residual MLP (test)", "digits")}))
    try:
        yield spec
    finally:
        unregister("toy")


def test_a_registered_family_is_cut_planned_and_trained(toy):
    m = models.get("toy-tiny", depth=4)  # built by name, overrides checked against its defaults
    assert spec_of(m) is toy and spec_named("toy-tiny") is toy
    with pytest.raises(UserError, match="no option 'n_layer'"):
        models.get("toy-tiny", n_layer=2)
    c = to_chain(m)
    assert c.names == ["stem", "layers.0", "layers.1", "layers.2", "layers.3", "out"]
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(c(x), m(x))

    got = scaletrain.plan("toy-tiny", platform="a100-80g", devices=1, global_batch=8, fix={"pp": 1, "zero": 0})
    assert got and all(g["fits"] and g["step_time_s"] > 0 and g["peak_bytes"] > 0 for g in got)

    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    cfg = load_config(None, ["model.name=toy-tiny", "train.steps=2", "train.global_batch=4", "train.eval_batches=1",
                             "train.progress=off", "train.log_every=1", "memory.remat.method=periodic"])
    logs: list[str] = []
    tr = Trainer(cfg, None, log=logs.append)
    try:
        losses = tr.fit().losses
    finally:
        tr.close()
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(s.startswith("remat: periodic") and "block forwards" in s for s in logs)  # its chain was cut


def test_unregistered_family_is_gone_and_builtins_stay():
    assert spec_named("toy-tiny") is None and "toy-tiny" not in models.names()
    with pytest.raises(UserError, match="cannot find the blocks of ToyNet"):
        to_chain(ToyNet())
    assert {s for s in ("gpt2-tiny", "gpt2-moe", "vgg-mini", "resnet-mini", "mlp", "dlrm-mini")} <= set(models.names())
    assert spec_of(models.get("gpt2-moe", device="meta")).name == "moe"  # the subclass's family, not GPT-2's


class ToyLM(nn.Module):
    """A byte language model the library has never seen: embedding, residual MLP layers, a head."""

    task = "lm"

    def __init__(self, width: int = 32, depth: int = 2, vocab_size: int = 256, max_seq: int = 64):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, width=width)
        self.max_seq = max_seq
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(ToyLayer(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size, bias=False)

    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        return torch.zeros(batch, seq or self.max_seq, dtype=torch.long, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def register_toy_lm() -> ModelSpec:
    """The toy LM's family with Megatron's split given as data: fc1 by columns, fc2 by rows, the embedding
    and the head over the vocabulary."""
    return register(ModelSpec(
        name="toy-lm", classes=(ToyLM,),
        blocks=lambda m: [("embed", m.embed), *[(f"layers.{i}", b) for i, b in enumerate(m.layers)], ("head", m.head)],
        models={"toy-lm": ModelEntry(ToyLM, dict(width=32, depth=2), "residual MLP LM (test)", "shakespeare")},
        tp=ShardingPlan(layers="layers", colwise=("fc1",), rowwise=("fc2",), embedding="embed", head="head",
                        divides=("vocab_size", "width")),
        decoder=True))


TOY_LM = ["model.name=toy-lm", "train.steps=2", "train.global_batch=4", "data.seq_len=16", "train.eval_batches=1",
          "train.progress=off", "train.log_every=1"]


def _fit_toy_lm(extra: list[str]) -> tuple[list[float], tuple[int, ...]]:
    """(losses, the shape of layer 0's fc1 weight this rank holds)."""
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    tr = Trainer(load_config(None, TOY_LM + extra), None, log=lambda s: None)
    try:
        losses = tr.fit().losses
        w = tr.model.layers[0].fc1.weight
        return losses, tuple(getattr(w, "_local_tensor", w).shape)
    finally:
        tr.close()


def _toy_lm_ranks(rank: int, world: int) -> tuple[list[float], tuple[int, ...]]:
    register_toy_lm()
    return _fit_toy_lm(["parallel.tp=2"])


@pytest.mark.slow
def test_a_registered_sharding_plan_runs_tp2_equal_to_one_process():
    register_toy_lm()
    try:
        ref, full = _fit_toy_lm([])
    finally:
        unregister("toy-lm")
    for losses, local in run_distributed(_toy_lm_ranks, 2):
        assert local == (full[0] // 2, full[1])  # fc1 split by columns (its output rows) as the plan says
        assert losses == pytest.approx(ref, rel=1e-5)


def test_a_familys_extra_tokens_size_the_model_for_user_text(tmp_path):
    """BERT's mask id is its family's declaration (HFFamily.extra_tokens), not a name test in the trainer."""
    from scaletrain.models.spec import hf_families
    from scaletrain.train.config import load_config
    from scaletrain.train.model_data import user_overrides

    (tmp_path / "a.txt").write_text("hello world " * 50)
    data = f"data.name=text:{tmp_path / 'a.txt'}"
    sizes = {m: user_overrides(load_config(None, [f"model.name={m}", data]))["vocab_size"]
             for m in ("hf:bert", "hf:gpt2", "gpt2-tiny")}
    assert hf_families()["bert"].extra_tokens == 1
    assert sizes == {"hf:bert": 257, "hf:gpt2": 256, "gpt2-tiny": 256}
