"""Products of two input-dependent tensors: attention's ``QKᵀ`` and ``A·V``, gates.

Two rules, in the engine's signal convention (relevance ``R = h ⊙ s``):

- :class:`Uniform` (AttnLRP): each factor gets an equal share of the relevance.
- :class:`HoldGate` (CP-LRP's gated MLPs; squeeze-excitation and gating in CNNs, LSTM gates in
  Arras et al. 2017's "signal-take-all"): the factor an activation made (the gate) is held
  constant, and all relevance goes to the other factor (the signal).
"""

from __future__ import annotations

import torch

from explain_core.engine.ops import ACTIVATION_OPS
from explain_core.errors import UnsupportedModelError
from explain_core.interfaces.relevance import Rule, RuleCall
from explain_core.vjp import vjp

__all__ = ["HoldGate", "Uniform", "product_gradients"]


class Uniform(Rule):
    """The uniform rule: each of the ``n`` input-dependent factors gets ``1/n`` of the relevance.

    For a product of two activations ``y = a ⊙ b`` (or ``a @ b``) ``R_a = R_b = R_y / 2``: in
    Gradient×Input form, the gradient to each factor halved. A product with one input-dependent
    factor (a scaling by a weight) is linear and passes the gradient.
    """

    min_inputs = 2
    output_in_backward = False

    def gradient_scale(self, factors: int) -> float:  # noqa: D102
        return 1.0 / factors

    def backward(  # noqa: D102
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        share = len(call.inputs)
        return tuple(
            None if g is None else g / share if g is grad_output else g.div_(share)  # new: in place
            for g in product_gradients(call, grad_output)
        )


def product_gradients(
    call: RuleCall, grad_output: torch.Tensor, needed: tuple[bool, ...] | None = None
) -> tuple[torch.Tensor | None, ...]:
    """The gradient to each factor of a product (``None`` where not ``needed``).

    Written out for ``a * b`` and ``a @ b`` of matrices (the products attention models make),
    so that backward does not compute the product again; other calls go through autograd.
    """
    needed = needed or (True,) * len(call.inputs)
    if len(call.inputs) == 2 and not call.kwargs:
        a, b = call.inputs
        if call.name in ("mul", "mul_"):
            return (
                (grad_output * b).sum_to_size(a.shape) if needed[0] else None,
                (grad_output * a).sum_to_size(b.shape) if needed[1] else None,
            )
        if call.name in ("matmul", "bmm") and a.dim() >= 2 and b.dim() >= 2:
            return (
                (grad_output @ b.mT).sum_to_size(a.shape) if needed[0] else None,
                (a.mT @ grad_output).sum_to_size(b.shape) if needed[1] else None,
            )
    assert call.function is not None
    inputs = tuple(
        t.detach().requires_grad_(wanted) for t, wanted in zip(call.inputs, needed, strict=True)
    )
    with torch.enable_grad():
        output = call.function(*inputs)
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(vjp(output, wanted, grad_output, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in inputs)


_SQUASHING = frozenset({"sigmoid", "sigmoid_", "hardsigmoid", "hardsigmoid_"})


def _gate_level(source: RuleCall | None, attention_weights: bool = False) -> int:
    """How gate-like the factor ``source`` made is.

    3: attention weights (a softmax's output), if ``attention_weights``; 2: a sigmoid-like
    squashing into [0, 1] (squeeze-excitation); 1: another element-wise activation (SwiGLU's
    SiLU); 0: none.
    """
    if source is None:
        return 0
    if source.module is None:
        name = source.name
    else:
        kind = type(source.module)
        if kind.__module__ not in ("transformers.activations", "torch.nn.modules.activation"):
            return 0
        name = kind.__name__.lower()
    if name == "softmax":
        return 3 if attention_weights else 0
    if name in _SQUASHING:
        return 2
    return 1 if source.module is not None or name in ACTIVATION_OPS else 0


def _gate(
    sources: tuple[RuleCall | None, ...], lowest: int = 1, attention_weights: bool = False
) -> int | None:
    """The position of the gate among two factors, if one is more gate-like than the other.

    In squeeze-excitation the signal itself often comes from an activation (EfficientNet's
    SiLU, MobileNetV3's Hardswish), so a sigmoid-like factor is the gate before any other.
    ``lowest``: the least gate-like a gate may be (:func:`_gate_level`).
    """
    if len(sources) != 2:
        return None
    levels = [_gate_level(source, attention_weights) for source in sources]
    if levels[0] == levels[1] or max(levels) < lowest:
        return None
    return 0 if levels[0] > levels[1] else 1


class HoldGate(Rule):
    """A gated product ``act(g) ⊙ u`` with the activated gate held constant: all relevance to u.

    The gate is the factor an element-wise activation returned (``call.sources``), a
    sigmoid-like one (sigmoid, hard sigmoid) before any other (SiLU, …): in squeeze-excitation
    the signal often comes from an activation too. CP-LRP's rule for gated MLPs (SwiGLU,
    GeGLU), as its reference package writes it, and the squeeze-excitation rule of the CNN
    presets: ``x ⊙ σ(SE(x))`` passes all relevance to ``x``. A product without exactly one such
    factor takes ``otherwise`` (the uniform rule in CP-LRP), or is refused if it is ``None``.

    Args:
        otherwise: The rule for products without exactly one gate; ``None`` refuses them.
        squashing_only: Hold only sigmoid-like gates; products with another activation's
            output (SwiGLU's SiLU) take ``otherwise``. AttnLRP's choice: it splits those
            uniformly, but the pass rule cannot carry relevance into a sigmoid, whose output is
            1/2 where its input is 0 (the linear map before it would divide by that 0).
        attention_weights: Hold a softmax's output before any gate: attention weights
            written as a product (``(a.unsqueeze(-1) * v).sum(1)``, attention pooling), which
            CP-LRP holds constant as it does in ``A·V``.
    """

    min_inputs = 2
    output_in_backward = False

    def __init__(
        self,
        otherwise: Rule | None = None,
        *,
        squashing_only: bool = False,
        attention_weights: bool = False,
    ) -> None:
        if squashing_only and otherwise is None:
            raise ValueError("squashing_only needs a rule for the other products (otherwise=)")
        self.otherwise = otherwise
        self.squashing_only = squashing_only
        self.attention_weights = attention_weights

    def forward(self, call: RuleCall) -> int | None:
        """The gate's position (refused in the forward pass if none, without a fallback)."""
        gate = _gate(call.sources, 2 if self.squashing_only else 1, self.attention_weights)
        if gate is None and self.otherwise is None:
            raise UnsupportedModelError(
                f"operation {call.name!r} multiplies two input-dependent tensors, neither (or "
                "both alike) returned by an activation: the gate rule holds a sigmoid-like gate "
                "constant, and there is none here. Map the operation to a rule of its own in a "
                "composite, e.g. (Op('mul'), Uniform()), which splits the relevance equally"
            )
        return gate

    def backward(  # noqa: D102
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        if call.state is None:
            assert self.otherwise is not None
            return self.otherwise.backward(call, grad_output)
        signal = 1 - call.state  # all relevance to the factor that is not the gate
        return product_gradients(call, grad_output, tuple(i == signal for i in range(2)))
