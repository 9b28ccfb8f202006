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
from typing import Any, ClassVar, Literal

import torch

from explain_core.registry import Method, MethodResult, MethodSpec
from explain_core.targets import select_target
from explain_modbp.composites import gradient_composite
from explain_modbp.engine import ModifiedBackprop
from explain_modbp.methods import one_hot
from explain_modbp.ops import RELU_OPS, OpHandler

Mode = Literal["guided", "deconv", "rectgrad"]


class _RectifiedReLU(torch.autograd.Function):
    """ReLU whose backward pass is rectified (Guided BP, Deconv) or thresholded (RectGrad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mode: Mode, quantile: float, inplace: bool) -> Any:
        if inplace:
            ctx.mark_dirty(x)
            y = x.relu_()
        else:
            y = x.relu()
        ctx.save_for_backward(y)
        ctx.mode = mode
        ctx.quantile = quantile
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (y,) = ctx.saved_tensors
        active = y > 0
        if ctx.mode == "guided":
            return g.clamp(min=0) * active, None, None, None
        if ctx.mode == "deconv":
            return g.clamp(min=0), None, None, None
        importance = (y * g).reshape(g.shape[0], -1)
        threshold = torch.quantile(importance, ctx.quantile, dim=1, keepdim=True)
        keep = (importance > threshold).reshape(g.shape) & active
        return g * keep, None, None, None


class RectifiedReLUHandler(OpHandler):
    """Replaces every ReLU's backward pass (see the module docstring).

    Args:
        mode: ``"guided"``, ``"deconv"`` or ``"rectgrad"``.
        q: RectGrad's percentile in ``[0, 100)``.
    """

    ops: ClassVar[frozenset[str]] = RELU_OPS

    def __init__(self, mode: Mode, q: float = 98.0) -> None:
        if mode not in ("guided", "deconv", "rectgrad"):
            raise ValueError(f"mode must be 'guided', 'deconv' or 'rectgrad'; got {mode!r}")
        if not 0 <= q < 100:
            raise ValueError(f"q must lie in [0, 100); got {q}")
        self.mode = mode
        self.q = q

    def handle(self, name, func, args, kwargs):  # noqa: D102
        x = args[0]
        inplace = name == "relu_" or bool(
            kwargs.get("inplace", args[1] if len(args) > 1 else False)
        )
        return _RectifiedReLU.apply(x, self.mode, self.q / 100.0, inplace)


def rectified_signal(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor | None,
    handler: RectifiedReLUHandler,
    times_input: bool,
) -> MethodResult:
    """Run the gradient with rectified ReLUs from the explained output."""
    forward = ModifiedBackprop(gradient_composite(), handler).forward(model, inputs)
    output = forward.output.detach()
    chosen = select_target(output, target)
    signal = forward.backward(one_hot(output, chosen)).input_signal
    attribution = inputs * signal if times_input else signal
    return MethodResult(attribution, output, chosen, None, {"signal": signal})


def rectified_propagator(model, inputs, handler: RectifiedReLUHandler):
    """Signals from any layer with rectified ReLUs (for CSC)."""
    from explain_modbp.propagation import EnginePropagator

    forward = ModifiedBackprop(gradient_composite(), handler, record=True).forward(model, inputs)
    return EnginePropagator(forward, "signal", method=handler.mode)


class _RectifiedMethod(Method):
    """A method running the gradient with one :class:`RectifiedReLUHandler` mode.

    Subclasses are dataclasses with a ``times_input`` option.
    """

    mode: ClassVar[Mode]
    times_input: bool

    def handler(self) -> RectifiedReLUHandler:
        """The handler with this method's options."""
        return RectifiedReLUHandler(self.mode)

    def attribute(self, model, inputs, target, baselines) -> MethodResult:
        return rectified_signal(model, inputs, target, self.handler(), self.times_input)

    def layer_propagator(self, model, inputs, baselines):
        return rectified_propagator(model, inputs, self.handler())


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
        self.handler()  # an invalid q fails when the method is created

    def handler(self) -> RectifiedReLUHandler:  # noqa: D102
        return RectifiedReLUHandler(self.mode, self.q)


def method_specs(spec: Callable[[str, object, str], MethodSpec]) -> list[MethodSpec]:
    """The registered names of this module."""
    return [
        spec("guided_bp", GuidedBackprop, "Guided backpropagation ([g]⁺ with the ReLU mask)"),
        spec("deconv", Deconvolution, "Deconvolution ([g]⁺ at every ReLU, no forward mask)"),
        spec("rectgrad", RectGrad, "RectGrad: gradient above the q=98 percentile of h⊙g"),
    ]
