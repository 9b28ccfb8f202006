"""Guided backpropagation, Deconv and RectGrad: the gradient with rectified ReLU backward passes.

Affine layers pass the ordinary gradient; every ReLU (module, functional or in place) changes its
backward pass (the paper's Eq. 14, ``r_l = Wᵀ [M_l r_{l+1}]⁺``):

- Guided BP (Springenberg et al. 2015): ``[g]⁺ ⊙ 1[h > 0]`` (forward mask and rectification).
- Deconv (Zeiler & Fergus 2014): ``[g]⁺`` (no forward mask).
- RectGrad (Kim et al. 2019): ``g ⊙ 1[h ⊙ g > τ]`` with ``τ`` the ``q``-th percentile of
  ``h ⊙ g`` per sample and layer (``q = 98`` as recommended).

The attribution is the signal at the input (optionally times the input).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from explain_core.engine import Composite, ModifiedBackprop
from explain_core.engine.ops import RELU_OPS
from explain_core.interfaces.relevance import Op, Rule, RuleCall
from explain_core.registry import Method, MethodResult, MethodSpec
from explain_core.targets import select_target
from explain_modbp.composites import gradient_composite
from explain_modbp.methods import one_hot

Mode = Literal["guided", "deconv", "rectgrad"]


class RectifiedReLU(Rule):
    """A ReLU whose backward pass is rectified (Guided BP, Deconv) or thresholded (RectGrad).

    An operation rule: map it to the ReLU operations in a composite,
    ``(Op(*RELU_OPS), RectifiedReLU("guided"))``.

    Args:
        mode: ``"guided"``, ``"deconv"`` or ``"rectgrad"``.
        q: RectGrad's percentile in ``[0, 100)``.
    """

    def __init__(self, mode: Mode, q: float = 98.0) -> None:
        if mode not in ("guided", "deconv", "rectgrad"):
            raise ValueError(f"mode must be 'guided', 'deconv' or 'rectgrad'; got {mode!r}")
        if not 0 <= q < 100:
            raise ValueError(f"q must lie in [0, 100); got {q}")
        self.mode = mode
        self.q = q

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        y, g = call.output, grad_output
        active = y > 0
        if self.mode == "guided":
            return (g.clamp(min=0) * active,)
        if self.mode == "deconv":
            return (g.clamp(min=0),)
        importance = (y * g).reshape(g.shape[0], -1)
        threshold = torch.quantile(importance, self.q / 100.0, dim=1, keepdim=True)
        keep = (importance > threshold).reshape(g.shape) & active
        return (g * keep,)


def rectified_composite(rule: RectifiedReLU) -> Composite:
    """The gradient through affine layers, ``rule`` at every ReLU."""
    return gradient_composite(rule.mode).with_rules((Op(*RELU_OPS), rule))


def rectified_signal(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor | None,
    rule: RectifiedReLU,
    times_input: bool,
) -> MethodResult:
    """Run the gradient with rectified ReLUs from the explained output."""
    forward = ModifiedBackprop(rectified_composite(rule)).forward(model, inputs)
    output = forward.output.detach()
    chosen = select_target(output, target)
    signal = forward.backward(one_hot(output, chosen)).input_signal
    attribution = inputs * signal if times_input else signal
    return MethodResult(attribution, output, chosen, None, {"signal": signal})


def rectified_propagator(model, inputs, rule: RectifiedReLU):
    """Signals from any layer with rectified ReLUs (for CSC)."""
    from explain_modbp.propagation import EnginePropagator

    composite = rectified_composite(rule)
    forward = ModifiedBackprop(composite, record=True).forward(model, inputs)
    return EnginePropagator(forward, "signal", method=rule.mode)


class _RectifiedMethod(Method):
    """A method running the gradient with one :class:`RectifiedReLU` mode.

    Subclasses are dataclasses with a ``times_input`` option.
    """

    mode: ClassVar[Mode]
    times_input: bool

    @property
    def multiplies_by_inputs(self) -> bool:  # type: ignore[override]
        """Whether the result is multiplied by the input: the ``times_input`` option."""
        return self.times_input

    def rule(self) -> RectifiedReLU:
        """The ReLU rule with this method's options."""
        return RectifiedReLU(self.mode)

    def attribute(self, model, inputs, target, baselines) -> MethodResult:
        return rectified_signal(model, inputs, target, self.rule(), self.times_input)

    def layer_propagator(self, model, inputs, baselines):
        return rectified_propagator(model, inputs, self.rule())


@dataclass
class GuidedBackprop(_RectifiedMethod):
    """Guided backpropagation: ``[g]⁺ ⊙ 1[h > 0]`` at every ReLU.

    Attributes:
        times_input: Multiply the signal by the input.
    """

    mode: ClassVar[Mode] = "guided"
    times_input: bool = False


@dataclass
class Deconvolution(_RectifiedMethod):
    """Deconvolution: ``[g]⁺`` at every ReLU (no forward mask).

    Attributes:
        times_input: Multiply the signal by the input.
    """

    mode: ClassVar[Mode] = "deconv"
    times_input: bool = False


@dataclass
class RectGrad(_RectifiedMethod):
    """RectGrad: keep the gradient only where ``h ⊙ g`` exceeds its ``q``-th percentile.

    Attributes:
        q: Percentile (98 as recommended by Kim et al.).
        times_input: Multiply the signal by the input.
    """

    mode: ClassVar[Mode] = "rectgrad"
    q: float = 98.0
    times_input: bool = False

    def __post_init__(self) -> None:
        self.rule()  # an invalid q fails when the method is created

    def rule(self) -> RectifiedReLU:  # noqa: D102
        return RectifiedReLU(self.mode, self.q)


def method_specs(spec: Callable[[str, object, str], MethodSpec]) -> list[MethodSpec]:
    """The registered names of this module."""
    return [
        spec("guided_bp", GuidedBackprop, "Guided backpropagation ([g]⁺ with the ReLU mask)"),
        spec("deconv", Deconvolution, "Deconvolution ([g]⁺ at every ReLU, no forward mask)"),
        spec("rectgrad", RectGrad, "RectGrad: gradient above the q=98 percentile of h⊙g"),
    ]
