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
``matmul``, ``bmm``,   the uniform rule: half of the relevance to   the gradient (with the
``einsum`` of two      each factor (:class:`Uniform`)               attention weights constant,
activations                                                         all relevance goes to V)
``mul`` of two         the uniform rule; a sigmoid-like gate (an    attention weights (a
activations            LSTM's, squeeze-excitation's) held constant  softmax's output) or else
                                                                    the activated gate held
                                                                    constant (:class:`HoldGate`)
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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from explain_core.affine import BATCHNORM_TYPES, LINEAR_TYPES
from explain_core.engine import Composite
from explain_core.interfaces.relevance import Gradient, Matcher, Op, Rule, RuleCall
from explain_core.registry import MethodSpec
from explain_modbp import rules
from explain_modbp.activations import PassRelevance
from explain_modbp.composites import ACTIVATIONS
from explain_modbp.methods import CompositeMethod
from explain_modbp.norms import NORM_OPS, NormScale
from explain_modbp.products import HoldGate, Uniform

__all__ = [
    "LRPCP",
    "Constant",
    "LRPAttn",
    "elementwise_module",
    "lrp_attn",
    "lrp_cp",
]


class Constant(Rule):
    """The operation's output held constant: no signal reaches its inputs (CP-LRP's softmax)."""

    output_in_backward = False

    def gradient_scale(self, factors: int) -> float:  # noqa: D102
        return 0.0

    def backward(  # noqa: D102
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return tuple(None for _ in call.inputs)


def elementwise_module(name: str, module: nn.Module) -> bool:
    """Modules that act element-wise though written with several operations.

    Hugging Face's activation modules (``NewGELUActivation``: ``0.5·x·(1 + tanh(…))``; a model's
    own, such as ``BloomGelu``, which runs a custom autograd Function) and RMSNorm modules
    written with tensor operations (``LlamaRMSNorm`` and its copies: with the scale held constant
    ``y = w ⊙ x / rms`` is element-wise), which the pass rule explains as a whole
    (``R_x = R_y``).
    """
    kind = type(module)
    from_transformers = kind.__module__.startswith("transformers.")
    return (
        kind.__module__ == "transformers.activations"
        or (from_transformers and kind.__name__.endswith("Gelu"))
        or (kind.__name__.endswith("RMSNorm") and not isinstance(module, nn.RMSNorm))
    )


def _linear_rule(epsilon: float, gamma: float) -> Rule:
    if gamma:
        return rules.Gamma(gamma, epsilon=epsilon or 1e-6)
    return Gradient() if epsilon == 0 else rules.Epsilon(epsilon)


def _shared(epsilon: float, gamma: float) -> list[tuple[Matcher, Rule]]:
    linear = _linear_rule(epsilon, gamma)
    return [
        (LINEAR_TYPES + BATCHNORM_TYPES, linear),  # a BatchNorm that cannot be merged too
        (Op("linear", "addmm"), linear),
        (elementwise_module, PassRelevance()),
        (Op(*NORM_OPS), NormScale()),
        ACTIVATIONS,
    ]


def lrp_attn(epsilon: float = 0.0, gamma: float = 0.0) -> Composite:
    """AttnLRP: the uniform rule at products, the gradient at softmax, σ constant in norms.

    A sigmoid-like gate (an LSTM's, squeeze-excitation's) is held constant, as every LRP
    preset holds it: through the pass rule, relevance would reach the linear map before the
    sigmoid, whose output is 1/2 where that map's is 0, and blow up there.

    ``epsilon`` > 0 puts LRP-ε on the linear layers, ``gamma`` > 0 LRP-γ (as the AttnLRP paper
    tunes for vision transformers).
    """
    rules_ = [
        (Op("softmax"), Gradient()),
        (Op("matmul", "bmm", "einsum"), Uniform()),
        (Op("mul"), HoldGate(otherwise=Uniform(), squashing_only=True)),
    ]
    return Composite([*_shared(epsilon, gamma), *rules_], name="lrp.attn")


def lrp_cp(epsilon: float = 0.0, gamma: float = 0.0) -> Composite:
    """CP-LRP: the attention weights and normalising scales held constant."""
    # A·V with A constant: all relevance to V (the gradient), also written as a product
    # (a * v).sum(…); a gated MLP's act(gate) · up with the activated gate constant: all
    # relevance to up. Both conserve.
    rules_ = [
        (Op("softmax"), Constant()),
        (Op("matmul", "bmm", "einsum"), Gradient()),
        (Op("mul"), HoldGate(otherwise=Uniform(), attention_weights=True)),
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
