"""Base classes of the affine-layer rules.

A :class:`LayerRule` turns the relevance (or signal) at an affine layer's output into the signal
at its input (:class:`~explain_modbp.layer_composite.LayerComposite` maps modules to them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from explain_core.interfaces.relevance import Rule, RuleCall
from explain_modbp.layers import AffineLayer

if TYPE_CHECKING:
    from explain_modbp.attach import RulePass

__all__ = [
    "Gradient",
    "LayerRule",
    "safe_divide",
]


class LayerRule(Rule):
    """A rule for an affine layer (Linear, ConvNd, Linear/Conv + BatchNorm, lone BatchNorm).

    Subclasses implement :meth:`relevance_backward` (LRP-style rules: relevance at the output →
    signal at the input) or override :meth:`signal_backward` (gradient-style rules). The same
    object also works with the core's :meth:`explain_core.Composite.context` (through
    :meth:`Rule.backward`), in the signal convention.

    Attributes:
        relevance_output: The rule returns relevance (not a signal) at its input; such rules
            (w², flat, z^B) only apply to the layer that reads the model input.
        passes_gradient: The rule is the ordinary gradient; the engine attaches no hook.
    """

    relevance_output: ClassVar[bool] = False
    passes_gradient: ClassVar[bool] = False

    def prepare(self, layer: AffineLayer, x: torch.Tensor, z: torch.Tensor) -> Any:
        """Forward-time state (no autograd): e.g. the stabilised denominators."""
        return None

    def relevance_backward(
        self, layer: AffineLayer, state: Any, x: torch.Tensor, relevance: torch.Tensor
    ) -> torch.Tensor:
        """Signal (or relevance, if :attr:`relevance_output`) at the input from output relevance."""
        raise NotImplementedError(f"{type(self).__name__} defines no relevance_backward")

    def signal_backward(
        self,
        layer: AffineLayer,
        state: Any,
        x: torch.Tensor,
        z: torch.Tensor,
        signal: torch.Tensor,
    ) -> torch.Tensor:
        """Signal at the input from the signal at the output ``z`` (relevance ``z ⊙ signal``)."""
        return self.relevance_backward(layer, state, x, signal * z)

    def attach(
        self, engine_pass: RulePass, layer: AffineLayer, x: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor | None:
        """Return the module's replacement output during the forward pass (``None``: keep it)."""
        return engine_pass.apply_rule(self, layer, x, output)

    # The core interface (Composite.context): same rule, same convention.
    def forward(self, call: RuleCall) -> Any:  # noqa: D102
        layer = AffineLayer.from_module(call.name, call.module)
        return layer, self.prepare(layer, call.inputs[0], call.output)

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        layer, state = call.state
        return (self.signal_backward(layer, state, call.inputs[0], call.output, grad_output),)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({options})"


class Gradient(LayerRule):
    """The ordinary gradient ``Wᵀ s`` (no hook is attached for it)."""

    passes_gradient = True

    def signal_backward(self, layer, state, x, z, signal):  # noqa: D102
        return layer.transpose(signal, x)

    def relevance_backward(self, layer, state, x, relevance):  # noqa: D102
        return layer.transpose(safe_divide(relevance, layer.forward(x, bias=layer.bias)), x)


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` with 0 where the denominator is 0."""
    zero = denominator == 0
    return numerator / denominator.masked_fill(zero, 1.0) * ~zero
