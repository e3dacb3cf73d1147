"""The model seen as an ordered list of single-tensor blocks: :class:`Chain` and :func:`to_chain`.

Kept as a public import path (``from scaletrain.chain import Chain, to_chain``); the code lives in
:mod:`scaletrain.models.chain`, where each model family's block list is found through its
:class:`~scaletrain.models.spec.ModelSpec`.
"""

from __future__ import annotations

from scaletrain.models.chain import Chain, to_chain

__all__ = ["Chain", "to_chain"]
