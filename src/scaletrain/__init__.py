"""scaletrain: train an unmodified PyTorch model as fast as possible without running out of memory.

The flow (see DESIGN.md): nn.Module -> Chain -> Profile -> planner -> Plan -> runtime -> Trainer,
with the measurement tools checking every prediction against what happened.
"""

__version__ = "0.1.0"
