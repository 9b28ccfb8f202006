"""Preset composites: which rule each layer of a model gets.

Every preset maps Linear ("dense") and Conv1d/2d/3d layers; a BatchNorm that directly follows a
Linear/Conv is merged into it for the duration of the attribution (the model is not changed). A
BatchNorm that cannot be merged (after a ReLU or an addition, as in pre-activation ResNets and
DenseNets) is a per-channel affine map ``a·x + b`` of its own and gets LRP-ε (the composite's ε
where it has one; LRP-0 in ``lrp.z`` and ``lrp.cmp``): the relevance its input explains, not its
shift. Excitation BP has no such rule and refuses it.
``InputLayer()`` entries rule the layer reading the model input, ``OutputLayer()`` the output layer.
Every LRP preset also passes relevance through element-wise activations (:data:`ACTIVATIONS`),
holds the scale of LayerNorm/GroupNorm/InstanceNorm constant (:data:`NORMS`) and the gate of
squeeze-excitation blocks (:data:`GATES`); Excitation BP refuses all three.

=========================  =============================================================
preset                     rules
=========================  =============================================================
``lrp.z``                  LRP-0 everywhere
``lrp.epsilon``            ε everywhere
``lrp.zplus``              z⁺ everywhere
``lrp.alpha_beta``         αβ everywhere (``lrp.alpha2beta1``: α=2, β=1)
``lrp.gamma``              γ everywhere
``lrp.w2``                 w² on the input layer, z⁺ elsewhere (Deep Taylor, real inputs)
``lrp.zb``                 z^B on the input layer (needs bounds), z⁺ elsewhere (Deep Taylor)
``lrp.flat``               flat on the input layer, z⁺ on convolutions, ε on dense layers
                           (zennit's EpsilonPlusFlat)
``lrp.epsilon_gamma_box``  z^B on the input layer (needs bounds), γ on convolutions, ε on
                           dense layers (zennit's EpsilonGammaBox)
``lrp.epsilon_gamma``      γ on convolutions, ε on dense layers (residual CNNs)
``lrp.epsilon_plus``       z⁺ on convolutions, ε on dense layers
``lrp.cmp``                αβ (α = 1 or 2) on convolutions, LRP-0 on dense layers
``excitation_bp``          W⁺ rule everywhere (marginal winning probability)
``excitation_bp.contrastive``  ``Z⁺ − N⁺`` on the output layer, W⁺ elsewhere
=========================  =============================================================
"""

from __future__ import annotations

from torch import nn

from explain_core.affine import (
    BATCHNORM_TYPES,
    FUNCTIONAL_LINEAR_OPS,
    LINEAR_TYPES,
    TRANSPOSED_CONV_TYPES,
)
from explain_core.engine import Composite
from explain_core.engine.ops import ACTIVATION_OPS
from explain_core.interfaces.relevance import Gradient, InputLayer, Op, OutputLayer, Rule
from explain_modbp import rules
from explain_modbp.activations import PassRelevance
from explain_modbp.norms import NORM_OPS, NormScale
from explain_modbp.products import HoldGate

LINEAR_OPS = Op(*FUNCTIONAL_LINEAR_OPS)
"""``F.linear``, ``torch.addmm``, and ``x @ W`` or ``torch.mm(x, W)`` with a weight, called in
forward (an LSTM's gates, written out; a projection head): dense layers to the affine rules,
which refuse a product of two activations."""
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, *TRANSPOSED_CONV_TYPES)
DENSE_TYPES = (nn.Linear,)


ACTIVATIONS = (Op(*ACTIVATION_OPS), PassRelevance())
"""LRP's pass rule for every element-wise activation other than ReLU (an operation rule)."""

NORMS = (Op(*NORM_OPS), NormScale())
"""LayerNorm, GroupNorm, InstanceNorm and RMSNorm with the normalising scale held constant."""

GATES = (Op("mul", "mul_"), HoldGate())
"""Squeeze-excitation and other gates: the activated gate held constant, all relevance to the
signal; a product of two input-dependent tensors without such a gate is refused."""


def uniform(
    rule: Rule,
    name: str,
    *,
    first: Rule | None = None,
    batchnorm: Rule | None = None,
    activations: bool = True,
) -> Composite:
    """The same rule for every Linear/Conv layer.

    ``first`` goes on the input layer, ``batchnorm`` on BatchNorms that cannot be merged;
    ``activations`` maps LRP's pass rule to the element-wise activations, the normalisations'
    rule and the gate rule (else they are refused).
    """
    mapping = _with_batchnorm([(LINEAR_TYPES, rule), (LINEAR_OPS, rule)], batchnorm)
    layers = [ACTIVATIONS, NORMS, GATES] if activations else []
    return Composite(_first(first) + mapping + layers, name=name)


def conv_dense(
    conv: Rule,
    dense: Rule,
    name: str,
    *,
    first: Rule | None = None,
    batchnorm: Rule | None = None,
) -> Composite:
    """One rule for convolutions, another for dense layers; activation, norm and gate rules."""
    mapping = [(CONV_TYPES, conv), (DENSE_TYPES, dense), (LINEAR_OPS, dense)]
    mapping = _with_batchnorm(mapping, batchnorm)
    return Composite([*_first(first), *mapping, ACTIVATIONS, NORMS, GATES], name=name)


def _first(rule: Rule | None) -> list:
    return [(InputLayer(), rule)] if rule is not None else []


def _with_batchnorm(mapping: list, batchnorm: Rule | None) -> list:
    # Merged BatchNorms never reach the mapping (the trace folds them into their layer first).
    return [*mapping, (BATCHNORM_TYPES, batchnorm)] if batchnorm is not None else mapping


def _lone_batchnorm(epsilon: float = 1e-6) -> Rule:
    return rules.Epsilon(epsilon)


def gradient_composite(name: str = "gradient") -> Composite:
    """The ordinary gradient through every affine layer, also BatchNorms that cannot be merged.

    Guided BP, Deconv, RectGrad and DeepLIFT Rescale change only the activations.
    """
    # Not matrix products, which may multiply two activations, for which these methods have no
    # rule (F.linear's and addmm's weight is one: the trace refuses one made from the input).
    functional = Op("linear", "addmm")
    return Composite(
        [(LINEAR_TYPES + BATCHNORM_TYPES, Gradient()), (functional, Gradient())], name=name
    )


def lrp_z() -> Composite:
    """LRP-0 everywhere."""
    return uniform(rules.Zero(), "lrp.z", batchnorm=rules.Zero())


def lrp_epsilon(epsilon: float = 1e-6) -> Composite:
    """LRP-ε everywhere."""
    return uniform(rules.Epsilon(epsilon), "lrp.epsilon", batchnorm=rules.Epsilon(epsilon))


def lrp_zplus(bias: bool = False) -> Composite:
    """z⁺ (LRP-α1β0) everywhere."""
    return uniform(rules.ZPlus(bias), "lrp.zplus", batchnorm=_lone_batchnorm())


def lrp_alpha_beta(alpha: float = 2.0, beta: float = 1.0, bias: bool = False) -> Composite:
    """LRP-αβ everywhere."""
    rule = rules.AlphaBeta(alpha, beta, bias)
    return uniform(rule, f"lrp.alpha{alpha:g}beta{beta:g}", batchnorm=_lone_batchnorm())


def lrp_gamma(gamma: float = 0.25, generalised: bool = True) -> Composite:
    """LRP-γ everywhere."""
    rule = rules.Gamma(gamma, generalised=generalised)
    return uniform(rule, "lrp.gamma", batchnorm=_lone_batchnorm())


def lrp_w2(bias: bool = False) -> Composite:
    """Deep Taylor for real-valued inputs: w² on the input layer, z⁺ elsewhere."""
    return uniform(rules.ZPlus(bias), "lrp.w2", first=rules.WSquare(), batchnorm=_lone_batchnorm())


def lrp_zb(low: object = None, high: object = None, bias: bool = False) -> Composite:
    """Deep Taylor for bounded inputs: z^B on the input layer, z⁺ elsewhere."""
    first = rules.ZBox(low, high)  # type: ignore[arg-type]
    return uniform(rules.ZPlus(bias), "lrp.zb", first=first, batchnorm=_lone_batchnorm())


def lrp_epsilon_gamma_box(
    low: object = None, high: object = None, gamma: float = 0.25, epsilon: float = 1e-6
) -> Composite:
    """z^B on the input layer, γ on convolutions, ε on dense layers (zennit's EpsilonGammaBox).

    The preset the literature tunes for residual CNNs (ResNet, RegNet): γ keeps the
    convolutions' maps positive-leaning and sharp, ε keeps the dense head faithful to the logit,
    z^B explains the bounded input (which cost half the deletion score of ``lrp.epsilon_gamma``
    in ``benchmarks/compare_cnn_presets.py``). Residual additions split relevance in proportion
    to the summands; BatchNorms are merged into the convolution before them.
    """
    return conv_dense(
        rules.Gamma(gamma, epsilon=epsilon),
        rules.Epsilon(epsilon),
        "lrp.epsilon_gamma_box",
        first=rules.ZBox(low, high),  # type: ignore[arg-type]
        batchnorm=_lone_batchnorm(epsilon),
    )


def lrp_epsilon_gamma(gamma: float = 0.25, epsilon: float = 1e-6) -> Composite:
    """γ on convolutions, ε on dense layers: EpsilonGammaBox without its input-layer rule.

    The most faithful LRP composite on residual CNNs in ``benchmarks/compare_cnn_presets.py``
    (pixel deletion on digits-trained nets), where z^B on the input layer halved the score.
    """
    return conv_dense(
        rules.Gamma(gamma, epsilon=epsilon),
        rules.Epsilon(epsilon),
        "lrp.epsilon_gamma",
        batchnorm=_lone_batchnorm(epsilon),
    )


def lrp_flat(epsilon: float = 1e-6, bias: bool = False) -> Composite:
    """Flat on the input layer, z⁺ on convolutions, ε on dense layers."""
    return conv_dense(
        rules.ZPlus(bias),
        rules.Epsilon(epsilon),
        "lrp.flat",
        first=rules.Flat(),
        batchnorm=_lone_batchnorm(epsilon),
    )


def lrp_epsilon_plus(epsilon: float = 1e-6, bias: bool = False) -> Composite:
    """z⁺ on convolutions, ε on dense layers (the common "ε+z⁺" composite)."""
    return conv_dense(
        rules.ZPlus(bias),
        rules.Epsilon(epsilon),
        "lrp.epsilon_plus",
        batchnorm=_lone_batchnorm(epsilon),
    )


def lrp_cmp(alpha: float = 1.0, bias: bool = False) -> Composite:
    """LRP-CMP: LRP-αβ (``β = α − 1``) on convolutions, LRP-0 on dense layers."""
    conv = rules.AlphaBeta(alpha, alpha - 1, bias)
    return conv_dense(conv, rules.Zero(), f"lrp.cmp(alpha={alpha:g})", batchnorm=rules.Zero())


def excitation() -> Composite:
    """Excitation backprop: the W⁺ rule everywhere."""
    return uniform(rules.Excitation(), "excitation_bp", activations=False)


def contrastive_excitation() -> Composite:
    """Contrastive excitation backprop: ``Z⁺ − N⁺`` on the output layer, W⁺ elsewhere."""
    excitation = rules.Excitation()
    return Composite(
        [
            (OutputLayer(), rules.ContrastiveExcitation()),
            (LINEAR_TYPES, excitation),
            (LINEAR_OPS, excitation),
        ],
        name="excitation_bp.contrastive",
    )
