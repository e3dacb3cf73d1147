"""What the trainer, the chain, the estimator and every technique need to know of a model they
did not write: the :class:`Adapter`.

A user's model is never modified or wrapped: the adapter only *reads* it. It says

- which task it trains (``"lm"``: token targets ``[batch, seq]``; ``"classify"``: class targets
  ``[batch]``), and the sizes the data must match (vocabulary, classes, image size, channels);
- how a batch becomes the model's inputs (:meth:`Adapter.inputs`: a tensor is the first positional
  argument; a dict such as ``{"input_ids", "attention_mask", "labels"}`` is passed by keyword);
- how the model's outputs become the loss (:meth:`Adapter.loss`: the model's own loss when it
  returned one — an HF ``ModelOutput`` with ``.loss``, or a scalar tensor — else the model family's
  loss function on the logits, cross-entropy by default);
- example inputs of a given (batch, seq) shape on the meta device (:meth:`Adapter.input_spec`),
  for the estimator, the profiler and the pipeline's partitioner;
- its list of blocks (:meth:`Adapter.chain`), what rematerialization, offloading and pipeline
  stages cut.

When a model cannot be adapted the error is one line naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor itself, ``.logits`` of an HF ``ModelOutput``, or the
    first element of a tuple (HF with ``return_dict=False``)."""
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise UserError(f"cannot find logits in the model's output ({type(out).__name__}): return a tensor or an "
                    "object with .logits, or pass scaletrain.adapt(model, loss=...)")


def own_loss(out: Any) -> torch.Tensor | None:
    """The loss the model computed itself (HF ``labels=``, or a module returning a scalar), if any."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else None
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32 (nats per target), ignoring targets -100 (padding, unmasked tokens).

    ``logits: [batch, seq, vocab]`` with ``y: [batch, seq]``, or ``[batch, classes]`` with ``y: [batch]``.
    """
    if logits.dim() == y.dim() + 1 and y.dim() >= 2:
        return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
    return F.cross_entropy(logits.float(), y)


@dataclass
class Adapter:
    """How scaletrain drives one model (see the module docstring). Build it with
    :func:`scaletrain.adapt`; fields may be overridden (``dataclasses.replace``)."""

    model: nn.Module
    family: str
    """Which adapter: "reference", "hf-causal", "hf-masked", "hf-seqcls", "image", "module"."""
    task: str = "lm"
    """"lm" (targets [batch, seq]) or "classify" (targets [batch])."""
    vocab_size: int | None = None
    num_classes: int | None = None
    image_size: int = 32
    """Side of the square input images, pixels (image models)."""
    channels: int = 3
    max_seq: int | None = None
    """Longest sequence the model accepts (tokens), for example inputs without a given length."""
    knows_input: bool = True
    """Whether :meth:`input_spec` can tell the input's shape (False: a module starting with a Linear
    layer, whose input may be [batch, features] or [batch, seq, features] — it must declare input_spec)."""
    logits_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    """The family's loss on logits and targets (mean over targets), used when the model returns no loss."""
    chain_finder: Callable[[nn.Module], Any] | None = None
    """Returns the model's :class:`~scaletrain.chain.Chain` (None: :func:`scaletrain.chain.to_chain`'s rules)."""
    sample_transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    """Per-sample (x, y) -> (x, y) applied to the shipped data (masked LM: mask tokens, -100 elsewhere)."""

    # -- batch -> inputs -> outputs -> loss ------------------------------------------------
    def inputs(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) of the model's forward for ``batch``: a tensor, an (x, y) pair, or a dict
        passed by keyword (``input_ids``, ``attention_mask``, ``labels``, ...)."""
        if isinstance(batch, dict):
            return (), dict(batch)
        if isinstance(batch, (tuple, list)):
            return (batch[0],), {}
        return (batch,), {}

    def forward(self, batch: Any) -> Any:
        """The model's outputs for ``batch`` (see :meth:`inputs`)."""
        args, kwargs = self.inputs(batch)
        return self.model(*args, **kwargs)

    def loss(self, out: Any, y: torch.Tensor | None = None) -> torch.Tensor:
        """The training loss: the model's own when it returned one, else :attr:`logits_loss`."""
        own = own_loss(out)
        if own is not None:
            return own
        if y is None:
            raise UserError(f"{type(self.model).__name__} returned no loss and no targets were given: pass labels")
        return self.logits_loss(logits_of(out), y)

    def batch_loss(self, batch: Any) -> torch.Tensor:
        """Forward and loss of one batch (a dict with ``labels``, or an (x, y) pair)."""
        y = batch.get("labels") if isinstance(batch, dict) else batch[1] if isinstance(batch, (tuple, list)) else None
        return self.loss(self.forward(batch), y)

    # -- shapes --------------------------------------------------------------------------
    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        """A meta-device example input of ``batch`` samples (``seq`` tokens for language models)."""
        source = getattr(self.model, "source", None)
        own = getattr(self.model, "input_spec", None) or getattr(source, "input_spec", None)
        if callable(own):
            return own(batch, seq)
        if not self.knows_input:
            raise UserError(f"cannot tell the input shape of {type(self.model).__name__}: give it a method "
                            "input_spec(batch, seq) returning a meta tensor of one batch's input")
        if self.task == "lm":
            s = seq or self.max_seq
            if not s:
                raise UserError(f"{type(self.model).__name__}: give a sequence length (its config has no maximum)")
            return torch.zeros(batch, s, dtype=torch.long, device="meta")
        return torch.zeros(batch, self.channels, self.image_size, self.image_size, device="meta")

    def example_inputs(self, batch: int, seq: int | None = None, device: str | torch.device = "cpu",
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A random (input, target) pair of ``batch`` samples on ``device`` (token ids below the vocabulary)."""
        spec = self.input_spec(batch, seq)
        if self.task == "lm":
            v = self.vocab_size or 256
            x = torch.randint(0, v, tuple(spec.shape), device=device, generator=generator)
            return x, torch.randint(0, v, tuple(spec.shape), device=device, generator=generator)
        if spec.dtype.is_floating_point:
            x = torch.randn(tuple(spec.shape), dtype=spec.dtype, device=device, generator=generator)
        else:  # token ids of a sequence classifier
            x = torch.randint(0, self.vocab_size or 256, tuple(spec.shape), device=device, generator=generator)
        return x, torch.randint(0, self.num_classes or 10, (batch,), device=device, generator=generator)

    # -- blocks --------------------------------------------------------------------------
    def chain(self) -> Any:
        """The model's chain of blocks (shares its modules); one-line error when none is found."""
        if self.chain_finder is not None:
            c = self.chain_finder(self.model)
            if c is not None:
                return c
        from scaletrain.models.chain import to_chain

        return to_chain(self.model)
