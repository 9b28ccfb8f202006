"""Element-wise activations other than ReLU (LeakyReLU, ELU, GELU, SiLU, tanh, sigmoid, …).

In the engine's signal convention (relevance ``R = h ⊙ s``) the gradient of a ReLU already passes
relevance on unchanged. For other activations ``a = f(z)`` the gradient ``f'(z)`` does not, so LRP
uses the pass rule instead (as zennit does for activations): ``R_z = R_a``, i.e. the signal
``s_z = s_a ⊙ f(z) / z`` (``f'(z)`` where ``z = 0``, its limit when ``f(0) = 0``). For positively
homogeneous activations (LeakyReLU, PReLU-like slopes) ``f(z)/z = f'(z)``: LRP-0 stays
Input×Gradient. The LRP presets map :data:`~explain_core.engine.ops.ACTIVATION_OPS` to
:class:`PassRelevance` (an operation rule, through the public composite API); DeepLIFT's
activations are in :mod:`.deeplift`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from explain_core.errors import InvalidInputError
from explain_core.interfaces.relevance import Rule, RuleCall


class Activation:
    """One call of an element-wise activation, as the model made it.

    Args:
        func: The function called (``F.elu``, ``torch.tanh``, ``Tensor.sigmoid_``, …).
        args: Its positional arguments; the first is the activation's input.
        kwargs: Its keyword arguments.
    """

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.func = func
        self.rest = args[1:]
        self.kwargs = kwargs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The call as written (in place if the model asked for that)."""
        return self.func(x, *self.rest, **self.kwargs)

    def out_of_place(self, x: torch.Tensor) -> torch.Tensor:
        """``f(x)`` without touching ``x``."""
        return self(x.clone())

    def slope(self, x: torch.Tensor) -> torch.Tensor:
        """``f'(x)``, element-wise."""
        with torch.enable_grad():
            t = x.detach().requires_grad_(True)
            (slope,) = torch.autograd.grad(self.out_of_place(t).sum(), t)  # element-wise: f'(t)
        return slope

    def apply_in_forward(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """Inside an autograd function's forward: run the call, marking ``x`` dirty if in place."""
        y = self(x)
        if y is x:
            ctx.mark_dirty(x)
        return y


def secant_slope(
    activation: Activation,
    delta_in: torch.Tensor,
    delta_out: torch.Tensor,
    at: torch.Tensor,
    eps: float = 0.0,
) -> torch.Tensor:
    """``Δout / Δin``, and ``f'(at)`` where ``Δin = 0`` or ``|Δin| < eps`` (computed only then)."""
    flat = (delta_in == 0) | (delta_in.abs() < eps)
    ratio = delta_out / delta_in.masked_fill(flat, 1.0)
    if bool(flat.any()):
        ratio = torch.where(flat, activation.slope(at), ratio)
    return ratio


class PassRelevance(Rule):
    """LRP's rule for element-wise maps: relevance passes unchanged, ``R_z = R_a``.

    In the signal convention ``s_z = s_a ⊙ f(z) / z`` (``f'(z)`` where ``z = 0``). Map it to the
    activations' operations in a composite, ``(Op("gelu", "silu"), PassRelevance())``, or to
    modules that act element-wise on one input (an activation module written with several
    operations; an RMSNorm with its scale held constant: ``y/x = w / rms``).
    """

    def forward(self, call: RuleCall) -> torch.Tensor | None:  # noqa: D102
        (z,) = call.inputs
        if call.output.shape != z.shape:
            raise InvalidInputError(
                f"the pass rule needs an element-wise map; {call.name!r} maps "
                f"{tuple(z.shape)} to {tuple(call.output.shape)}"
            )
        if not call.branch_free and not bool((z == 0).any()):
            return None  # f(z)/z everywhere: computed in backward from what is kept anyway
        # the limit f'(0) where z = 0 (f(0) = 0 for these maps)
        run = call.function if call.function is not None else call.module
        with torch.enable_grad():
            t = z.detach().requires_grad_(True)
            (slope,) = torch.autograd.grad(run(t).sum(), t)
        return slope

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        (z,) = call.inputs
        if call.state is None:
            return (grad_output * (call.output / z),)
        flat = z == 0
        return (
            grad_output * torch.where(flat, call.state, call.output / z.masked_fill(flat, 1.0)),
        )
