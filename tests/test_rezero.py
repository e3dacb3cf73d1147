"""ReZero residuals on the reference GPT-2 (model.overrides.rezero=true: scaletrain.models.gpt2.ReZeroBlock)."""

from __future__ import annotations

import pytest
import torch

from scaletrain import models
from scaletrain.errors import ConfigError
from scaletrain.measure.estimate import estimate_step
from scaletrain.plan import Plan
from scaletrain.techniques import compat
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rezero_blocks_start_as_identity_without_layernorms() -> None:
    torch.manual_seed(0)
    m = models.get("gpt2-tiny", rezero=True)
    for block in m.h:
        assert not any(isinstance(x, torch.nn.LayerNorm) for x in block.modules())
        assert block.alpha.shape == (1,) and float(block.alpha.detach()) == 0.0
    x = torch.randn(2, 16, m.config.n_embd)
    assert torch.equal(m.h[0](x), x)


def test_rezero_trains() -> None:
    cfg = load_config(None, ["model.overrides.rezero=true", "data.seq_len=64", "train.global_batch=8",
                             "train.steps=20", "train.eval_every=0", "train.progress=off", "train.log_every=1000",
                             "optim.warmup_steps=2"])
    t = Trainer(cfg, None, log=lambda s: None)
    losses = t.fit().losses
    alphas = [float(b.alpha.detach()) for b in t.model.h]
    t.close()
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0]
    assert all(a != 0.0 for a in alphas)  # the residual weights learned


def test_rezero_fits_in_the_plain_models_memory_and_compat() -> None:
    plain = estimate_step("gpt2-tiny", 4, 32, n_layer=6)
    rezero = estimate_step("gpt2-tiny", 4, 32, n_layer=6, rezero=True)
    assert rezero.bytes["peak"] <= plain.bytes["peak"]
    assert rezero.profile.blocks[1].saved_bytes <= plain.profile.blocks[1].saved_bytes
    facts = compat.Facts.of(models.get("gpt2-tiny", rezero=True), world=2, device="cpu", seq_len=64)
    with pytest.raises(ConfigError, match="rezero.*LayerNorms"):
        compat.check(Plan().with_(tp=2), facts)
    compat.check(Plan().with_(dp=2, zero=1), facts)
