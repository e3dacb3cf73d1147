"""Memory-lean and large-batch optimizers (issue 5), selectable by name via :func:`build_optimizer`.

Each optimizer keeps its cost face (``state_nbytes``: exact bytes of state it allocates) next to
its apply face (the ``torch.optim.Optimizer``); :mod:`.registry` maps names to both.
"""

from scaletrain.techniques.optim.adafactor import Adafactor
from scaletrain.techniques.optim.adam8bit import Adam8bit, AdamW8bit
from scaletrain.techniques.optim.came import CAME
from scaletrain.techniques.optim.lamb import LAMB
from scaletrain.techniques.optim.lars import LARS
from scaletrain.techniques.optim.registry import (
    NAMES, OPTIMIZERS, build_optimizer, measured_state_bytes, param_groups, state_bytes,
    state_bytes_per_param,
)

__all__ = [
    "Adafactor", "Adam8bit", "AdamW8bit", "CAME", "LAMB", "LARS", "NAMES", "OPTIMIZERS",
    "build_optimizer", "measured_state_bytes", "param_groups", "state_bytes",
    "state_bytes_per_param",
]
