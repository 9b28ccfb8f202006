"""Relevance propagated from any layer: the plugin's side of the CSC protocol.

Every method of the plugin has ``layer_propagator(model, inputs, baselines)`` (see
:class:`explain_core.metrics.SupportsLayerPropagation`). It runs one recorded forward pass with
the method's rules and handlers attached; :meth:`EnginePropagator.propagate` then sets a given
vector at a layer's output and reads what the method makes of it at every lower layer, in one
backward pass per vector:

- LRP-type methods (``lrp.*``, Excitation BP): the vector is the *relevance* at the output; it
  passes through the layer's rule; the result at a lower layer is its relevance ``h ⊙ s``.
- Signal-type methods (Guided BP, Deconv, RectGrad, PatternNet, PatternAttribution): the vector
  is the *signal* at the output; the result is the signal.
- DeepLIFT: the vector is the multiplier at the output; the result is the contribution
  ``Δh ⊙ m``. RevealCancel and its ablation only start at the output layer (their ReLUs route the
  signal through the positive/negative parts, which exist for the output only).
"""

from __future__ import annotations

from typing import Literal

import torch

from explain_core.engine import ForwardPass
from explain_core.metrics.csc import UnsupportedMethodError
from explain_core.vjp import vjp

Mode = Literal["relevance", "signal"]


class EnginePropagator:
    """A recorded :class:`ForwardPass` as a :class:`explain_core.metrics.LayerPropagator`.

    Args:
        forward: A pass run with ``record=True``.
        mode: ``"relevance"`` or ``"signal"`` (see the module docstring).
        batch: For DeepLIFT: the number of real samples (the reference half follows).
        handler: DeepLIFT's handler (for the output layer's positive/negative parts).
        method: Name for error messages.
    """

    def __init__(
        self,
        forward: ForwardPass,
        mode: Mode,
        *,
        batch: int | None = None,
        handler: object | None = None,
        method: str = "method",
    ) -> None:
        self.forward = forward
        self.mode = mode
        self.batch = batch
        self.handler = handler
        self.method = method
        self.layers = forward.layers

    def output_shape(self, start: str) -> torch.Size:  # noqa: D102
        shape = self.forward.records[start].output.shape
        if self.batch is not None:
            return torch.Size((self.batch, *shape[1:]))
        return shape

    def propagate(self, start: str, relevance: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: D102
        forward = self.forward
        if self.batch is not None:
            return self._deeplift(start, relevance)
        if self.mode == "relevance":
            result = forward.backward(
                start=start, relevance=relevance, read_layers=True, retain_graph=True
            )
        else:
            result = forward.backward(relevance, start=start, read_layers=True, retain_graph=True)
        plan = forward.plan
        out = {}
        for name, signal in result.layer_signals.items():
            if self.mode == "signal" or (
                name in plan.input_layers and plan.rules[name].returns_relevance
            ):
                out[name] = signal
            else:
                out[name] = forward.records[name].input.detach() * signal
        return out

    def _deeplift(self, start: str, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        forward, batch = self.forward, self.batch
        assert batch is not None
        names = forward.layers
        record = forward.records[start]
        rule = getattr(self.handler, "rule", "rescale")
        parts = self.handler.parts_of(record.output) if rule != "rescale" else None  # type: ignore[attr-defined]
        below = names[: names.index(start) + 1]
        tensors = [forward.records[name].input for name in below]
        if parts is not None:
            outputs, grads = parts, (vector, vector)
        elif rule != "rescale":
            raise UnsupportedMethodError(
                f"{self.method} routes the signal through positive/negative parts that exist only "
                f"for the output layer ({names[-1]!r}); start CSC there, not at {start!r}"
            )
        else:
            outputs = record.output
            grads = torch.cat([vector, torch.zeros_like(vector)])
        signals = vjp(outputs, tensors, grads, retain_graph=True, allow_unused=True)
        out = {}
        for name, tensor, signal in zip(below, tensors, signals, strict=True):
            x = tensor.detach()
            delta = x[:batch] - x[batch:]
            out[name] = delta * signal[:batch] if signal is not None else torch.zeros_like(delta)
        return out
