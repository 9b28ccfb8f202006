"""Attention models: AttnLRP (Achtibat et al. 2024) and CP-LRP (Ali et al. 2022), as rules.

Both are written in the engine's signal convention (relevance ``R = h ⊙ s``, the Gradient×Input
form of the papers) as operation rules, so a model's own attention code needs no rewriting:

=====================  ===========================================  ===========================
operation              AttnLRP (``lrp.attn``)                       CP-LRP (``lrp.cp``)
=====================  ===========================================  ===========================
Linear                 the gradient (``epsilon=0``) or LRP-ε        the same
``layer_norm``         σ held constant (:class:`NormScale`)         the same
``rms_norm``           the scale held constant                      the same
GELU, SiLU, tanh, …    ``R_x = R_y`` (``f(x)/x``, LRP's pass rule)  the same
``softmax``            the gradient: ``R_x = x ⊙ (R_s − s·ΣR_s)``   held constant (no signal)
``matmul``, ``bmm``    the uniform rule: half of the relevance to   the gradient (with the
of two activations     each factor (:class:`Uniform`)               attention weights constant,
                                                                    all relevance goes to V)
``mul`` of two         the uniform rule                             the activated gate held
activations                                                         constant (:class:`HoldGate`)
=====================  ===========================================  ===========================

Modules that act element-wise though written with several operations — Hugging Face's activation
modules and RMSNorm modules such as ``LlamaRMSNorm`` (scale held constant) — take the pass rule
as a whole (:func:`elementwise_module`).

Additions, reshapes, means and sums pass the gradient, which conserves relevance. CP-LRP makes a
bias-free transformer dynamic-linear, so its relevance sums to the explained score; AttnLRP's
softmax rule does not conserve (the papers' own measurement), and its gap is the result's
``delta``. The ε of the linear layers defaults to 0, as in the AttnLRP reference package.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from explain_core.affine import LINEAR_TYPES
from explain_core.engine import Composite
from explain_core.engine.ops import ACTIVATION_OPS
from explain_core.interfaces.relevance import Gradient, Matcher, Op, Rule, RuleCall
from explain_core.registry import MethodSpec
from explain_modbp import rules
from explain_modbp.activations import PassRelevance
from explain_modbp.composites import ACTIVATIONS
from explain_modbp.methods import CompositeMethod

__all__ = [
    "LRPCP",
    "Constant",
    "HoldGate",
    "LRPAttn",
    "NormScale",
    "Uniform",
    "elementwise_module",
    "lrp_attn",
    "lrp_cp",
]

PRODUCTS = ("matmul", "bmm", "mul")
"""Operation kinds that multiply two activations in attention models (``QKᵀ``, ``A·V``, gates)."""


class Uniform(Rule):
    """The uniform rule: each of the ``n`` input-dependent factors gets ``1/n`` of the relevance.

    For a product of two activations ``y = a ⊙ b`` (or ``a @ b``) ``R_a = R_b = R_y / 2``: in
    Gradient×Input form, the gradient to each factor halved. A product with one input-dependent
    factor (a scaling by a weight) is linear and passes the gradient.
    """

    min_inputs = 2
    output_in_backward = False

    def backward(  # noqa: D102
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grads = product_gradients(call, grad_output)
        share = len(call.inputs)
        return tuple(None if g is None else g / share for g in grads)


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
    grads = iter(torch.autograd.grad(output, wanted, grad_output, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in inputs)


def _activated(source: RuleCall | None) -> bool:
    """Whether ``source`` (the call that made a factor) is an element-wise activation."""
    if source is None:
        return False
    if source.module is None:
        return source.name in ACTIVATION_OPS
    kind = type(source.module)
    return kind.__module__ in ("transformers.activations", "torch.nn.modules.activation")


class HoldGate(Rule):
    """A gated product ``act(g) ⊙ u`` with the activated gate held constant: all relevance to u.

    CP-LRP's rule for gated MLPs (SwiGLU, GeGLU), as its reference package writes it; the gate is
    the factor an element-wise activation returned (``call.sources``). A product without
    exactly one such factor takes the uniform rule.
    """

    min_inputs = 2
    output_in_backward = False

    def backward(  # noqa: D102
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        gates = [_activated(source) for source in call.sources]
        if len(gates) != 2 or sum(gates) != 1:
            return Uniform().backward(call, grad_output)
        return product_gradients(call, grad_output, tuple(not gate for gate in gates))


class Constant(Rule):
    """The operation's output held constant: no signal reaches its inputs (CP-LRP's softmax)."""

    output_in_backward = False

    def backward(  # noqa: D102
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return tuple(None for _ in call.inputs)


_LAYER_NORM = inspect.signature(F.layer_norm)
_RMS_NORM = inspect.signature(F.rms_norm)


class NormScale(Rule):
    """LayerNorm and RMSNorm with the normalising scale held constant (AttnLRP's and CP-LRP's).

    ``layer_norm``: ``y = γ ⊙ (x − μ)/σ + β`` with σ constant is linear in ``x`` (the mean
    subtraction stays): ``s_x = C(γ ⊙ s_y / σ)``, ``C`` the centering over the normalised
    dimensions; β absorbs relevance. ``rms_norm``: ``y = γ ⊙ x / rms(x)`` with ``rms`` constant:
    ``s_x = γ ⊙ s_y / rms``, so ``R_x = R_y`` element-wise.
    """

    output_in_backward = False

    def forward(self, call: RuleCall) -> tuple[torch.Tensor | None, torch.Tensor, tuple, bool]:  # noqa: D102
        centred = call.name == "layer_norm"
        signature = _LAYER_NORM if centred else _RMS_NORM
        bound = signature.bind(*call.args, **call.kwargs).arguments
        x = call.inputs[0]
        dims = tuple(range(-len(bound["normalized_shape"]), 0))
        eps = bound.get("eps")
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        if centred:
            scale = torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
        else:
            scale = torch.sqrt(x.square().mean(dims, keepdim=True) + eps)
        weight = bound.get("weight")
        return (None if weight is None else weight.detach()), scale, dims, centred

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        weight, scale, dims, centred = call.state
        signal = grad_output / scale
        if weight is not None:
            signal = signal * weight
        if centred:
            signal = signal - signal.mean(dims, keepdim=True)
        return (signal,)


def elementwise_module(name: str, module: nn.Module) -> bool:
    """Modules that act element-wise though written with several operations.

    Hugging Face's activation modules (``NewGELUActivation``: ``0.5·x·(1 + tanh(…))``) and
    RMSNorm modules written with tensor operations (``LlamaRMSNorm`` and its copies: with the
    scale held constant ``y = w ⊙ x / rms`` is element-wise), which the pass rule explains as a
    whole (``R_x = R_y``).
    """
    kind = type(module)
    return kind.__module__ == "transformers.activations" or (
        kind.__name__.endswith("RMSNorm") and not isinstance(module, nn.RMSNorm)
    )


def _linear_rule(epsilon: float, gamma: float) -> Rule:
    if gamma:
        return rules.Gamma(gamma, epsilon=epsilon or 1e-6)
    return Gradient() if epsilon == 0 else rules.Epsilon(epsilon)


def _shared(epsilon: float, gamma: float) -> list[tuple[Matcher, Rule]]:
    linear = _linear_rule(epsilon, gamma)
    return [
        (LINEAR_TYPES, linear),
        (Op("linear", "addmm"), linear),
        (elementwise_module, PassRelevance()),
        (Op("layer_norm", "rms_norm"), NormScale()),
        ACTIVATIONS,
    ]


def lrp_attn(epsilon: float = 0.0, gamma: float = 0.0) -> Composite:
    """AttnLRP: the uniform rule at products, the gradient at softmax, σ constant in norms.

    ``epsilon`` > 0 puts LRP-ε on the linear layers, ``gamma`` > 0 LRP-γ (as the AttnLRP paper
    tunes for vision transformers).
    """
    rules_ = [(Op("softmax"), Gradient()), (Op(*PRODUCTS), Uniform())]
    return Composite([*_shared(epsilon, gamma), *rules_], name="lrp.attn")


def lrp_cp(epsilon: float = 0.0, gamma: float = 0.0) -> Composite:
    """CP-LRP: the attention weights and normalising scales held constant."""
    # A·V with A constant: all relevance to V (the gradient); a gated MLP's act(gate) · up
    # with the activated gate constant: all relevance to up. Both conserve.
    rules_ = [
        (Op("softmax"), Constant()),
        (Op("matmul", "bmm"), Gradient()),
        (Op("mul"), HoldGate()),
    ]
    return Composite([*_shared(epsilon, gamma), *rules_], name="lrp.cp")


@dataclass
class _AttentionLRP(CompositeMethod):
    """The options of both attention methods.

    Attributes:
        epsilon: LRP-ε on the linear layers; 0 (the default) passes their gradient.
        gamma: LRP-γ on the linear layers instead (with ``epsilon`` as its stabiliser).
    """

    epsilon: float = 0.0
    gamma: float = 0.0


@dataclass
class LRPAttn(_AttentionLRP):
    """AttnLRP (Achtibat et al., ICML 2024): see the module for its rules and options."""

    preset = staticmethod(lrp_attn)


@dataclass
class LRPCP(_AttentionLRP):
    """CP-LRP (Ali et al., ICML 2022): attention weights and normalising scales held constant."""

    preset = staticmethod(lrp_cp)


def method_specs(spec: Callable[[str, object, str], MethodSpec]) -> list[MethodSpec]:
    """The registered names of this module."""
    return [
        spec("lrp.attn", LRPAttn, "AttnLRP for attention models (uniform products, σ constant)"),
        spec("lrp.cp", LRPCP, "CP-LRP: attention weights and normalising scales held constant"),
    ]
