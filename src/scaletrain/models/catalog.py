"""What ``scaletrain models`` lists — name, task, default data, description, parameters at the
defaults — readable without importing torch or transformers.

Why: building every model (even on the meta device) needs torch and transformers, ~10 s on a
loaded machine, to print a table. The registry (:mod:`.registry`) and the hf: families
(:mod:`.external`) take their descriptions and default data from here, and
``tests/test_models_catalog.py`` checks every parameter count against the model it builds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Listed:
    task: str
    """lm, mlm, classify or ctr."""
    default_data: str
    """The shipped dataset the model trains on when data.name is empty."""
    description: str
    parameters: int | None
    """Parameter elements at the defaults (tied ones once); None: not a fixed model."""
    published: int | None = None
    """The published count, when the model reproduces a published one."""


LISTED: dict[str, Listed] = {
    "gpt2-tiny": Listed("lm", "shakespeare", "GPT-2 shape, byte vocabulary, 4 layers x 128 hidden (CPU tests, "
                        "default run)", 858_880),
    "gpt2-mini": Listed("lm", "shakespeare", "GPT-2 shape, byte vocabulary, 6 layers x 256 hidden", 4_935_680),
    "gpt2-small": Listed("lm", "shakespeare", "GPT-2 124M", 124_439_808, 124_439_808),
    "gpt2-medium": Listed("lm", "shakespeare", "GPT-2 355M", 354_823_168, 354_823_168),
    "gpt2-large": Listed("lm", "shakespeare", "GPT-2 774M", 774_030_080, 774_030_080),
    "gpt2-xl": Listed("lm", "shakespeare", "GPT-2 1.5B", 1_557_611_200, 1_557_611_200),
    "resnet50": Listed("classify", "synthetic-images", "ResNet-50 (torchvision layout)", 25_557_032, 25_557_032),
    "resnet-mini": Listed("classify", "digits", "bottleneck ResNet, 4 blocks, width 8, 32x32 input", 130_002),
    "vgg16": Listed("classify", "synthetic-images", "VGG-16 (torchvision layout)", 138_357_544, 138_357_544),
    "vgg-mini": Listed("classify", "digits", "VGG-16 layout at 1/8 width, 32x32 input", 315_570),
    "gpt2-moe": Listed("lm", "shakespeare", "gpt2-tiny with a top-2 mixture of 4 experts in every 2nd block (expert "
                       "parallelism)", 1_650_176),
    "dlrm-mini": Listed("ctr", "synthetic-ctr", "DLRM: 4 embedding tables (36k rows x 16) with sparse bag lookups + "
                        "dense MLPs", 581_777),
    "mlp": Listed("classify", "digits", "fully connected chain of configurable widths (8x8x3 input)", 629_258),
    "hf:gpt2": Listed("lm", "shakespeare", "transformers GPT2LMHeadModel (tied embeddings), random init, 4 x 128, "
                      "byte vocabulary", 858_880),
    "hf:llama": Listed("lm", "shakespeare", "transformers LlamaForCausalLM (RMSNorm, rotary, SwiGLU), random init, "
                       "4 x 128", 857_216),
    "hf:mistral": Listed("lm", "shakespeare", "transformers MistralForCausalLM, random init, 4 x 128", 857_216),
    "hf:bert": Listed("mlm", "shakespeare", "transformers BertForMaskedLM (masked LM: 15 % of bytes masked), random "
                      "init, 4 x 128", 876_289),
    "hf:/path/dir": Listed("", "", "local config.json + safetensors weights, loaded by its architectures entry", None),
    "py:mod:fn": Listed("", "", "your factory: fn(**model.overrides) returning an nn.Module", None),
}
