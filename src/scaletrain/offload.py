"""Offloading (activations, weight streaming, optimizer on host or disk), by short path:
``from scaletrain import offload``.

``Trainer`` runs it from ``memory.offload.*`` (``plan="auto"`` with ``memory.device_budget``: the joint
offload + recompute planner chooses). For use outside the trainer, :func:`build_offload_runtime` places a
chain's parameters, optimizer states and activations as :class:`OffloadOptions` say. The implementation
lives in :mod:`scaletrain.techniques.offload`.
"""

from scaletrain.techniques.offload import OffloadOptions, OffloadRuntime, build_offload_runtime, options_from_cfg
from scaletrain.techniques.offload.optimizer import CPUAdam

__all__ = ["CPUAdam", "OffloadOptions", "OffloadRuntime", "build_offload_runtime", "options_from_cfg"]
