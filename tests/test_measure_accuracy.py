"""Issue 3 item 6: the estimate (fake tensors, nothing allocated) against a measured training step.

For each configuration a real step runs twice on CPU (forward, loss, backward, optimizer.step,
zero_grad(set_to_none=True)); the second is tracked by MemoryTracker. The estimator's peak
must be within 5% of the measured peak and every category at the peak within 5% or 1 MiB.
"""

from __future__ import annotations

import pytest

from scaletrain.measure.estimate import estimate_step
from scaletrain.measure.profiler import measure_step


pytestmark = pytest.mark.usefixtures("one_thread")

MIB = 2**20

SMALL = {"gpt2-tiny": dict(batch=2, seq=64), "resnet-mini": dict(batch=2), "vgg-mini": dict(batch=2),
         "mlp": dict(batch=4)}
SGD = {"optimizer_kwargs": {"momentum": 0.9}}  # SGD with a momentum buffer
CASES = [
    pytest.param(model, dict(shape, precision=prec, optimizer=opt, accum=accum, **(SGD if opt == "sgd" else {})),
                 id=f"{model}-{prec}-{opt}-accum{accum}")
    for model, shape in SMALL.items()
    for prec in ("fp32", "bf16")
    for opt in ("adamw", "sgd")
    for accum in (1, 2)
]
# gpt2-small (124M parameters) is slow on 2 shared cores (bf16 4 minutes on a CPU without AVX512-BF16):
# one configuration shows the estimate holds at scale; the bf16 / SGD / accumulation axes are the small models'.
CASES += [
    pytest.param("gpt2-small", dict(batch=1, seq=128, precision="fp32", optimizer="adamw", accum=1),
                 id="gpt2-small-fp32-adamw-accum1"),
    # the other precision setups: fp16 autocast with a GradScaler; 16-bit parameters + fp32 masters
    pytest.param("resnet-mini", dict(batch=2, precision="fp16", optimizer="adamw", accum=2), id="resnet-mini-fp16"),
    pytest.param("gpt2-tiny", dict(batch=2, seq=64, precision="bf16", optimizer="adamw", params_dtype="bf16"),
                 id="gpt2-tiny-bf16-params"),
    pytest.param("mlp", dict(batch=4, precision="fp32", optimizer="adam", params_dtype="bf16", accum=2),
                 id="mlp-bf16-params-adam"),
]


def _close(est: int, meas: int) -> bool:
    return abs(est - meas) <= max(0.05 * meas, MIB)


@pytest.mark.slow  # > 20 s: kept out of make test-fast
@pytest.mark.parametrize("model,cfg", CASES)
def test_estimate_matches_measured_step(model: str, cfg: dict) -> None:
    est = estimate_step(model, **cfg)
    meas = measure_step(model, **cfg)
    assert meas.bytes["peak"] > 0
    err = abs(est.bytes["peak"] - meas.bytes["peak"]) / meas.bytes["peak"]
    assert err <= 0.05, f"peak: estimated {est.bytes['peak']} vs measured {meas.bytes['peak']} ({err:.1%})"
    for cat, m in meas.peak_breakdown.items():
        e = est.peak_breakdown.get(cat, 0)
        assert _close(e, m), f"{cat} at the peak: estimated {e} vs measured {m} (peak at {meas.peak_phase})"
    for key in ("parameters", "gradients", "optimizer_states", "activations"):
        assert _close(est.bytes[key], meas.bytes[key]), f"{key}: estimated {est.bytes[key]} vs {meas.bytes[key]}"
