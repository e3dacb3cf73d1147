"""CLI sub-commands, one module each (see :mod:`scaletrain.cli`)."""
