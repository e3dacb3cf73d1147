"""Optimizers, by short path: ``from scaletrain.optim import AdamW8bit``.

The stable public names for the implementations under :mod:`scaletrain.techniques.optim` (memory-lean
and large-batch optimizers) and :mod:`scaletrain.techniques.offload.optimizer` (``CPUAdam``: Adam on
host-side fp32 masters). Each is an ordinary ``torch.optim.Optimizer``; :func:`build_optimizer`
builds one by its ``optim.name`` (``NAMES``) with its cost face's bookkeeping.
"""

from scaletrain.techniques.offload.optimizer import CPUAdam
from scaletrain.techniques.optim import (NAMES, LAMB, LARS, Adafactor, Adam8bit, AdamW8bit, CAME, build_optimizer,
                                         state_bytes, state_bytes_per_param)

__all__ = ["CAME", "LAMB", "LARS", "NAMES", "Adafactor", "Adam8bit", "AdamW8bit", "CPUAdam", "build_optimizer",
           "state_bytes", "state_bytes_per_param"]
