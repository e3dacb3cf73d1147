"""Shared pieces of the pipeline benchmarks: the model, the data, the JSON record.

The model is GPT-2 "tiny" with 6 layers (8 chain blocks: embedding, 6 layers, head), so
P = 4 with the interleaved schedule (v = 2) gets one block per stage. Everything runs on CPU
with gloo, one thread per rank (``scaletrain.testing.run_distributed``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from scaletrain import models

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODEL_KW = dict(n_layer=6, n_embd=128, n_head=4, n_positions=128)
MB, SEQ = 4, 128
"""Micro-batch size (samples) and sequence length (tokens)."""


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, nats/token. out: [batch, seq, vocab], y: [batch, seq]."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def make_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    return models.get("gpt2-tiny", **{**MODEL_KW, **overrides})


def random_microbatches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches of random byte tokens (timing does not depend on the values)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (MB, SEQ), generator=g), torch.randint(0, 256, (MB, SEQ), generator=g))
            for _ in range(n)]


def example_input() -> torch.Tensor:
    return torch.zeros(MB, SEQ, dtype=torch.long)


def machine() -> dict[str, Any]:
    """Where and when: the record every benchmark JSON carries."""
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux
        load = (float("nan"),) * 3
    return {
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    return path
