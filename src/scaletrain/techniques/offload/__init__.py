"""Offloading to host memory and disk, planned jointly with recomputation (issue 8).

- :mod:`.pools` — the device/host memory model (a real GPU with pinned host memory and side
  streams, or a byte-budgeted *logical* device pool on a CPU-only machine) and transfer counters;
- :mod:`.activations` — saved tensors of chosen blocks to the host, prefetched ahead of backward;
- :mod:`.weights` — parameters streamed block by block (L2L / ZeRO-Infinity);
- :mod:`.optimizer` — ZeRO-Offload: fp32 masters + Adam on the CPU, optional delayed update;
- :mod:`.disk` — ZeRO-Infinity's disk tier for optimizer states (and masters);
- :mod:`.probe` — what the chain saves and uses, found with fake tensors (no memory);
- :mod:`.planner` — predictions and the joint keep/recompute/offload + placement planner;
- :mod:`.runtime` — :class:`OffloadRuntime` / :func:`build_offload_runtime`: one step as the options place things;
- :mod:`.strategy` — :class:`~.strategy.OffloadStrategy`, how ``scaletrain train`` runs it (``memory.offload.*``);
- :mod:`.chunks`, :mod:`.chunk_runtime`, :mod:`.chunk_strategy` — ``memory.offload.plan=chunks``: PatrickStar's chunk
  manager (model states in equal chunks placed dynamically from the warm-up step's statistics).

Each module keeps its cost face next to its apply face.
"""

from scaletrain.techniques.offload.runtime import (OffloadOptions, OffloadRuntime,
                                                   build_offload_runtime, options_from_cfg)

__all__ = ["OffloadOptions", "OffloadRuntime", "build_offload_runtime", "options_from_cfg"]
