"""How ``scaletrain train`` runs ``memory.offload.plan=chunks``: the offload strategy (:mod:`.strategy`:
one process, metrics with predictions, evaluation counters kept apart) over a :class:`.chunk_runtime.ChunkRuntime`,
with checkpoints in the single-process layout (``model.state_dict()`` and the configured Adam's
``state_dict()``), so a chunked run resumes a plain one and vice versa."""

from __future__ import annotations

from typing import Any

import torch

from scaletrain.techniques.offload.strategy import OffloadStrategy, _mib


class ChunkStrategy(OffloadStrategy):
    """One process; model states in chunks placed by the warm-up step's statistics."""

    name = "offload-chunks"

    def describe(self) -> str:
        rt, p = self.rt, self.rt.prediction
        budget = f" of budget {_mib(self.budget)}" if self.budget is not None else ""
        return (f"chunks: {len(rt.layout)} chunks of {_mib(rt.S)} (parameters, gradients, Adam moments: "
                f"{_mib(4 * rt.S * len(rt.layout))} on the host); placement from the warm-up step's measured "
                f"use, evicting the chunk used farthest ahead; first step predicted device peak "
                f"{_mib(p.device_peak_bytes)}{budget}")

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The configured torch optimizer's ``state_dict()`` (what a plain run saves)."""
        return self.rt.optimizer_state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if state.get("sharded"):
            super(OffloadStrategy, self).load_optimizer_state_dict(optimizer, state)
            return
        self.rt.load_optimizer_state_dict(state)
