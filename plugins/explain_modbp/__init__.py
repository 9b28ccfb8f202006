"""Built-in plugin: modified backpropagation (LRP, Deep Taylor, Excitation BP, Guided BP, …).

The plugin's rules and preset composites run on the core's relevance engine
(:mod:`explain_core.engine`), which checks that it can see every operation, folds BatchNorms into
the preceding layers (a canonizer; the model is not changed) and computes each rule from tensors
saved in the forward pass. All methods are registered with the
family ``"modified-bp"``; see :func:`explain_register_methods` for the names.
"""

from __future__ import annotations

from explain_core.hookspecs import hookimpl
from explain_core.interfaces.relevance import CompositeSpec
from explain_core.registry import MethodSpec
from explain_modbp import deeplift, excitation, guided, methods, pattern, transformer
from explain_modbp.errors import PatternMismatchError
from explain_modbp.rules import (
    AlphaBeta,
    ContrastiveExcitation,
    Epsilon,
    Excitation,
    Flat,
    Gamma,
    WSquare,
    ZBox,
    Zero,
    ZPlus,
)

FAMILY = "modified-bp"

__all__ = [
    "AlphaBeta",
    "ContrastiveExcitation",
    "Epsilon",
    "Excitation",
    "Flat",
    "Gamma",
    "PatternMismatchError",
    "WSquare",
    "ZBox",
    "ZPlus",
    "Zero",
    "method_specs",
]


def method_specs() -> list[MethodSpec]:
    """Every method of the plugin."""

    def spec(name: str, factory: object, summary: str) -> MethodSpec:
        return MethodSpec(name, factory, FAMILY, summary)  # type: ignore[arg-type]

    specs = [
        spec("lrp.z", methods.LRPZ, "LRP-0 on every layer (= Input×Gradient on ReLU nets)"),
        spec("lrp.epsilon", methods.LRPEpsilon, "LRP-ε on every layer"),
        spec("lrp.zplus", methods.LRPZPlus, "z⁺ rule (LRP-α1β0) on every layer"),
        spec("lrp.alpha2beta1", methods.LRPAlphaBeta, "LRP-αβ with α=2, β=1 (options alpha, beta)"),
        spec("lrp.alpha_beta", methods.LRPAlphaBeta, "LRP-αβ on every layer (α − β = 1)"),
        spec("lrp.gamma", methods.LRPGamma, "LRP-γ on every layer"),
        spec("lrp.w2", methods.LRPW2, "Deep Taylor: w² on the input layer, z⁺ elsewhere"),
        spec("lrp.zb", methods.LRPZB, "Deep Taylor: z^B (bounds low/high) on input, z⁺ elsewhere"),
        spec("lrp.flat", methods.LRPFlat, "Flat on the input layer, z⁺ on conv, ε on dense"),
        spec("lrp.epsilon_gamma", methods.LRPEpsilonGamma, "γ on conv, ε on dense: residual CNNs"),
        spec(
            "lrp.epsilon_gamma_box",
            methods.LRPEpsilonGammaBox,
            "z^B (bounds low/high) on input, γ on conv, ε on dense (zennit's EpsilonGammaBox)",
        ),
        spec("lrp.epsilon_plus", methods.LRPEpsilonPlus, "ε+z⁺: z⁺ on conv, ε on dense layers"),
        spec("lrp.cmp", methods.LRPCMP, "LRP-CMP: αβ on conv (alpha=1 or 2), LRP-0 on dense"),
        spec("lrp.custom", methods.LRPCustom, "LRP with your own composite (option composite=)"),
        spec("lrp.contrastive", methods.ContrastiveLRP, "Contrastive LRP (z⁺, the paper's Eq. 15)"),
        spec("excitation_bp", excitation.ExcitationBP, "Excitation backprop (W⁺, probabilities)"),
        spec(
            "excitation_bp.contrastive",
            excitation.ContrastiveExcitationBP,
            "Contrastive excitation backprop (Z⁺ − N⁺ at the output layer)",
        ),
    ]
    for module in (guided, deeplift, pattern, transformer):
        specs.extend(module.method_specs(spec))
    return specs


@hookimpl
def explain_register_methods() -> list[MethodSpec]:
    """The modified-backpropagation family."""
    return method_specs()


@hookimpl
def explain_demo_steps() -> list[object]:
    """The modified-backpropagation section of ``explain demo``."""
    from explain_modbp.demo import ModifiedBackpropDemoStep
    from explain_modbp.demo_transformer import TransformerDemoStep

    return [ModifiedBackpropDemoStep(), TransformerDemoStep()]


@hookimpl
def explain_register_composites() -> list[CompositeSpec]:
    """The presets whose rules give a signal at the input, for the gradient attributors."""
    from explain_modbp import composites

    presets = [
        ("z", composites.lrp_z, "LRP-0 on every layer"),
        ("epsilon", composites.lrp_epsilon, "LRP-ε on every layer"),
        ("zplus", composites.lrp_zplus, "z⁺ on every layer"),
        ("alpha2beta1", composites.lrp_alpha_beta, "LRP-αβ with α=2, β=1 on every layer"),
        ("gamma", composites.lrp_gamma, "LRP-γ on every layer"),
        ("epsilon_plus", composites.lrp_epsilon_plus, "z⁺ on convolutions, ε on dense layers"),
        ("epsilon_gamma", composites.lrp_epsilon_gamma, "γ on convolutions, ε on dense layers"),
        ("cmp", composites.lrp_cmp, "αβ on convolutions, LRP-0 on dense layers"),
        ("excitation", composites.excitation, "the W⁺ rule on every layer"),
    ]
    return [CompositeSpec(name, build, summary) for name, build, summary in presets]
