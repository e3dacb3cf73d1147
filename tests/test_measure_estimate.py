"""Estimator: per-block Profile from fake tensors, optimizer model, whole-step composition."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from scaletrain import models
from scaletrain.chain import Chain
from scaletrain.errors import UserError
from scaletrain.measure import formulas, optimizers
from scaletrain.measure.blocks import trace_chain
from scaletrain.measure.estimate import estimate_chain, estimate_step, fake_copy, simulate_step
from scaletrain.measure.step import lm_loss, make_batch


pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [((1000, 64), torch.float32), ((64,), torch.float32), ((300, 300), torch.float32), ((5,), torch.float32),
          ((40, 40), torch.bfloat16)]


@pytest.mark.parametrize("name,kw", [
    ("adamw", {}), ("adamw", {"foreach": False}), ("adam", {"amsgrad": True}), ("adam", {"fused": True}),
    ("sgd", {}), ("sgd", {"momentum": 0.9, "foreach": False}), ("sgd", {"weight_decay": 0.1, "foreach": False}),
    ("sgd", {"momentum": 0.9, "nesterov": True}), ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1,
                                                           "foreach": False}),
    ("sgd", {"weight_decay": 0.1}), ("adam", {"weight_decay": 0.1, "foreach": False}),
    ("adam", {"weight_decay": 0.1}),
])
def test_optimizer_model_matches_the_real_optimizer(name: str, kw: dict) -> None:
    """The closed-form state and step-transient bytes equal torch's optimizer run on fake tensors
    (for-loop and foreach implementations; without ``foreach`` as the registry builds them)."""
    shapes = SHAPES if not kw.get("fused") else SHAPES[:4]
    states, transient = optimizers.simulate(name, shapes, **kw)
    assert optimizers.state_bytes(name, shapes, **kw) == states
    assert optimizers.torch_state_bytes(name, shapes, **kw) == states
    assert optimizers.step_transient_bytes(name, shapes, **kw) == transient
    from scaletrain.techniques.optim import registry

    assert registry.state_bytes(name, shapes, **kw) == states  # the project's cost face agrees


@pytest.mark.parametrize("name", ["adafactor", "came", "lamb", "lars"])
def test_registry_optimizers_state_bytes(name: str) -> None:
    """The registry's state bytes agree with the optimizer's own step on fake tensors."""
    states, transient = optimizers.simulate(name, SHAPES[:4])
    assert optimizers.state_bytes(name, SHAPES[:4]) == states
    assert optimizers.step_transient_bytes(name, SHAPES[:4]) == transient > 0


def test_unknown_names_are_user_errors() -> None:
    with pytest.raises(UserError, match="unknown optimizer"):
        estimate_step("mlp", optimizer="lion")
    with pytest.raises(UserError, match="unknown model"):
        estimate_step("gpt5")
    with pytest.raises(UserError, match="exceeds the model's context"):
        estimate_step("gpt2-tiny", seq=4096)
    with pytest.raises(UserError, match="unknown precision"):
        estimate_step("mlp", precision="fp8")


def test_profile_fields_tied_parameters_and_saved_excludes_input() -> None:
    m = models.get("gpt2-tiny", device="meta")
    prof = estimate_chain(m, m.input_spec(2, 64))
    wte = m.embed.wte.weight.numel() * 4
    assert prof.blocks[0].name == "embed" and prof.blocks[-1].name == "head"
    assert prof.blocks[0].param_bytes == wte + m.embed.wpe.weight.numel() * 4  # the tied weight is the embedding's
    assert prof.blocks[-1].param_bytes == 2 * 128 * 4  # head: final LayerNorm only
    assert prof.param_bytes == models.count_params(m) * 4
    h = prof.blocks[1]
    assert h.input_bytes == h.output_bytes == 2 * 64 * 128 * 4
    assert h.saved_bytes > 0 and h.flops_fwd > 0 and h.flops_bwd >= 2 * h.flops_fwd
    assert h.fwd_time_s == h.flops_fwd / prof.meta["flops_per_s"]
    # a Linear saves only its input (and weight): nothing beyond the input and parameters
    lin = estimate_chain(Chain([nn.Linear(64, 32)]), torch.empty(8, 64), target=torch.empty(8, dtype=torch.long),
                         loss_fn=torch.nn.functional.cross_entropy)
    assert lin.blocks[0].saved_bytes == 0 and lin.blocks[0].input_bytes == 8 * 64 * 4
    assert lin.blocks[0].output_bytes == 8 * 32 * 4


def test_dedupe_gives_the_same_traces() -> None:
    m = models.get("gpt2-tiny", device="meta")
    mode = FakeTensorMode()
    fm = fake_copy(m, mode)
    with mode:
        x, y = make_batch(fm, 2, 32)
        from scaletrain.chain import to_chain

        a = trace_chain(to_chain(fm), x, y, lm_loss, dedupe=False, accum=2)
        b = trace_chain(to_chain(fm), x, y, lm_loss, dedupe=True, accum=2)
    assert [t.events for t in a] == [t.events for t in b]
    assert [t.accum_bwd_events for t in a] == [t.accum_bwd_events for t in b]
    assert [t.param_ids for t in a] == [t.param_ids for t in b]


def test_gpt3_175b_shapes_without_memory() -> None:
    """GPT-3 175B (l=96, h=12288, a=96, s=2048) in 16-bit parameters: ZeRO's 2 + 2 + 12 bytes/param."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    est = estimate_step("gpt2-small", 1, 2048, precision="bf16", optimizer="adamw", params_dtype="bf16",
                        n_layer=96, n_embd=12288, n_head=96, n_positions=2048)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    psi = formulas.transformer_params(96, 12288, 50257, positions=2048, final_norm=True)
    assert est.parameters == psi
    n_tensors = 2 + 96 * 12 + 2  # parameter tensors (tied head once), each with a 4-byte Adam step on CPU
    assert est.bytes["parameters"] == 2 * psi
    assert est.bytes["optimizer_states"] == formulas.MIXED_ADAM_K * psi + 4 * n_tensors
    assert est.peak_breakdown["parameters"] + est.peak_breakdown["optimizer_states"] >= 14 * psi
    assert est.bytes["peak"] > 3 * 2**40  # > 3 TiB...
    assert grown < 2**30  # ...estimated while this process grew by less than 1 GiB


def test_fp32_adam_is_16_bytes_per_parameter() -> None:
    est = estimate_step("gpt2-tiny", 1, 32, optimizer="adamw")
    psi = est.parameters
    n_tensors = len(list(models.get("gpt2-tiny", device="meta").parameters()))
    model_states = est.bytes["parameters"] + est.bytes["gradients"] + est.bytes["optimizer_states"]
    assert model_states == formulas.fp32_adam_bytes(psi) + 4 * n_tensors


@pytest.mark.parametrize("model,kw", [
    ("gpt2-tiny", dict(batch=2, seq=32, accum=2, precision="bf16")),
    ("resnet-mini", dict(batch=2, optimizer="sgd")),
    ("mlp", dict(batch=4, precision="bf16", optimizer="sgd", accum=2, optimizer_kwargs={"momentum": 0.9})),
    ("vgg-mini", dict(batch=2, accum=3)),
])
def test_composition_equals_whole_step_simulation(model: str, kw: dict) -> None:
    """Per-block traces replayed as a step == the whole step run on fake tensors, byte for byte."""
    est = estimate_step(model, **kw)
    sim = simulate_step(model, **kw)
    assert est.bytes["peak"] == sim.bytes["peak"]
    assert est.peak_breakdown == sim.peak_breakdown


def test_data_dependent_models_get_a_clear_error() -> None:
    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0].sum() * x  # the mask's size depends on the values

    model = nn.Sequential(nn.Linear(8, 8), Gate(), nn.Linear(8, 2))
    with pytest.raises(UserError, match="data-dependent"):
        estimate_step(model, 4, example_input=torch.randn(4, 8), target=torch.zeros(4, dtype=torch.long),
                      loss_fn=nn.functional.cross_entropy)
    # the mixture of experts routes with static shapes (dropped choices go to a spare row): it estimates
    assert estimate_step("gpt2-moe", 2, 32).bytes["peak"] > 0


def test_platform_sets_device_flops_and_fit() -> None:
    from scaletrain import platform

    h100 = platform.get("h100")
    big = estimate_step("gpt2-xl", 16, 1024, precision="fp32", optimizer="adamw", platform="h100")
    assert big.device == "cuda" and big.meta["fits"] is False and big.bytes["peak"] > h100.device_memory_bytes
    small = estimate_step("gpt2-tiny", 2, 64, precision="bf16", platform=h100)
    assert small.meta["fits"] is True
    b = small.profile.blocks[1]
    assert b.fwd_time_s == b.flops_fwd / h100.flops("bf16")
    # CUDA: every storage is a whole number of the caching allocator's 512-byte blocks
    assert all(v % 512 == 0 for v in small.peak_breakdown.values())
