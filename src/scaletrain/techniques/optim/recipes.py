"""Documented hyperparameters per optimizer for the reference language models on the shipped text.

Config overrides (``KEY=VALUE``, as on the command line) found by small sweeps of ``gpt2-tiny`` on
Shakespeare at 16 sequences x 64 bytes per step, 200 steps, 10 % linear warm-up then cosine to
10 % (the trainer's schedule); the sweep and the curves are in ``benchmarks/optim/convergence.py``.
What the sweeps showed, and why the values differ from each paper's default:

- ``adam`` / ``adam8bit`` apply weight decay as an L2 term added to the gradient (coupled), which
  Adam then normalises: the config's 0.1 pulls every weight towards 0 at the full step size, so
  they run without decay (AdamW's decoupled 0.1 is what regularises).
- ``adafactor``: with its relative step size (lr = a cap on 1/sqrt(t), times the parameter's RMS)
  *and* the trainer's warm-up + cosine on top, the step decays twice: 1 % behind AdamW after 200
  steps, 4.6 % after 400 (cap 3e-2). Absolute steps (``relative_step=false``,
  ``scale_parameter=false``, lr 2e-3 under the trainer's schedule) with first-moment momentum
  ``beta1=0.9`` match AdamW at 400 steps (2.309 vs 2.307); without the momentum 2.406. The momentum
  costs 4 bytes/parameter: 4 + O(m + n) instead of Adam's 8.
- ``came``: the paper's lr 2e-4 with betas (0.9, 0.999, 0.9999) — the config's beta2 0.95 made its
  confidence estimate noisy (val 2.79-2.98); with 0.999, lr 3e-4 and no decay it matches AdamW.
- ``lamb`` / ``lars`` are the large-batch recipes (You et al. 2020 / 2017): lr with linear warm-up
  over 10 % of the steps. LARS's trust coefficient 1e-3 (tuned for ImageNet CNNs) moves a
  transformer's layers ~0.1 % per step; 0.05 is the best of our sweep. What closed LARS's gap to
  small-batch AdamW at 8x batch (2026-11-23 sweep, 30 runs, val loss at 16 x 200 steps; target
  2.505 = small-batch AdamW + 3 %): the ImageNet recipe's settings 2.525; no weight decay
  (the trust ratio's denominator ``||g|| + beta ||w||`` and the decay itself both slow the
  layers) 2.516; Nesterov momentum 0.9 2.488; adapting *every* tensor, LayerNorm gains and
  biases included, as the paper's Algorithm 1 does per layer (the exclusion of 1-D tensors is
  the later CNN/BERT recipes' choice: plain SGD at lr 0.2-0.3 moves LayerNorm gains far faster
  than the trust ratio moves the matrices) 2.487; all three with lr 0.2: 2.474 (+1.7 %);
  neighbours (lr 0.3, momentum 0.85) 2.477. Momentum 0.95 without Nesterov diverged slowly (2.583).
"""

from __future__ import annotations

RECIPES: dict[str, list[str]] = {
    "adamw": ["optim.lr=2e-3", "optim.weight_decay=0.1"],
    "adam": ["optim.lr=2e-3", "optim.weight_decay=0"],
    "adamw8bit": ["optim.lr=2e-3", "optim.weight_decay=0.1"],
    "adam8bit": ["optim.lr=2e-3", "optim.weight_decay=0"],
    "adafactor": ["optim.lr=2e-3", "optim.options.relative_step=false", "optim.options.scale_parameter=false",
                  "optim.options.beta1=0.9"],
    "came": ["optim.lr=3e-4", "optim.beta2=0.999", "optim.weight_decay=0"],
    "lamb": ["optim.lr=3e-2", "optim.weight_decay=0.01", "optim.beta2=0.99"],
    "lars": ["optim.lr=0.2", "optim.weight_decay=0", "optim.momentum=0.9", "optim.options.trust_coefficient=0.05",
             "optim.options.nesterov=true", "optim.options.exclude_from_layer_adaptation=false"],
}
"""optimizer name -> config overrides (add ``optim.name=NAME``)."""


def recipe(name: str) -> list[str]:
    """``optim.name=NAME`` plus its documented overrides."""
    return [f"optim.name={name}", *RECIPES[name]]
