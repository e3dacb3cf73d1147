"""Reference models: published parameter counts and shapes."""

import pytest
import torch

from scaletrain import models
from scaletrain.errors import UserError

PUBLISHED = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "resnet50": 25_557_032,
    "vgg16": 138_357_544,
}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_published_parameter_counts(name, count):
    m = models.get(name, device="meta")
    assert models.count_params(m) == count


def test_gpt2_counts_match_formula():
    # l(12h^2 + 13h) + Vh + positions*h + 2h (final LayerNorm)
    for name in ("gpt2-small", "gpt2-xl", "gpt2-tiny"):
        m = models.get(name, device="meta")
        c = m.config
        l, h, v, p = c.n_layer, c.n_embd, c.vocab_size, c.n_positions
        assert models.count_params(m) == l * (12 * h * h + 13 * h) + v * h + p * h + 2 * h


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-mini", "resnet-mini", "vgg-mini", "mlp"])
def test_small_models_run(name):
    torch.manual_seed(0)
    m = models.get(name)
    x = m.input_spec(2, 16)
    x = torch.randint(0, 256, x.shape) if x.dtype == torch.long else torch.randn(x.shape)
    out = m(x)
    if m.task == "lm":
        assert out.shape == (2, 16, 256)
    else:
        assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


def test_tied_embeddings():
    m = models.get("gpt2-tiny")
    assert m.head.lm_head.weight is m.embed.wte.weight


def test_overrides_and_errors():
    m = models.get("gpt2-tiny", n_layer=2)
    assert len(m.h) == 2
    with pytest.raises(UserError, match="no option 'n_layers'"):
        models.get("gpt2-tiny", n_layers=2)
    with pytest.raises(UserError, match="unknown model 'gpt5'"):
        models.get("gpt5")
    mlp = models.get("mlp", widths=[16, 1024, 8, 4])
    assert mlp(torch.randn(3, 16)).shape == (3, 4)
