"""LRP methods as registered attribution methods (``lrp.*``).

Each method builds its preset composite, runs one forward pass with the rules attached and one
backward pass from the explained logit (relevance ``R = f_k(x)`` at the output), and returns the
input relevance. ``delta`` is the explained logit minus the summed relevance: zero (up to
rounding) for conserving rules on bias-free models, what biases and ε absorb otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import nn

from explain_core.engine import Composite, ForwardPass, ModifiedBackprop
from explain_core.engine.ops import ACTIVATION_OPS
from explain_core.errors import InvalidInputError
from explain_core.interfaces.relevance import safe_divide
from explain_core.registry import Method, MethodResult
from explain_core.targets import select_target
from explain_modbp import composites

__all__ = [
    "LRPCMP",
    "LRPW2",
    "LRPZ",
    "LRPZB",
    "CompositeMethod",
    "ContrastiveLRP",
    "LRPAlphaBeta",
    "LRPCustom",
    "LRPEpsilon",
    "LRPEpsilonGamma",
    "LRPEpsilonGammaBox",
    "LRPEpsilonPlus",
    "LRPFlat",
    "LRPGamma",
    "LRPZPlus",
    "input_relevance",
    "lrp_engine",
    "one_hot",
    "per_sample_sum",
    "run_composite",
]


def one_hot(output: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``(batch, n_outputs)`` with a 1 at each sample's explained output."""
    signal = torch.zeros_like(output)
    signal.scatter_(1, chosen[:, None], 1.0)
    return signal


def per_sample_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over everything but the batch axis."""
    return tensor.reshape(tensor.shape[0], -1).sum(dim=1)


def input_relevance(forward: ForwardPass, signal: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """Relevance at the model input for a backward pass started with ``signal``."""
    result = forward.backward(signal, **kwargs)  # type: ignore[arg-type]
    if result.input_is_relevance:
        return result.input_signal
    return forward.input.detach() * result.input_signal


def lrp_engine(composite: Composite, *, record: bool = False) -> ModifiedBackprop:
    """The engine for a relevance composite (its rules for layers and operations)."""
    return ModifiedBackprop(composite, record=record)


def run_composite(
    composite: Composite,
    model: nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor | None,
    *,
    start: str = "logit",
) -> MethodResult:
    """Explain with a composite, starting from the logit (``"logit"``) or from 1 (``"one"``)."""
    forward = lrp_engine(composite).forward(model, inputs)
    output = forward.output.detach()
    chosen = select_target(output, target)
    signal = one_hot(output, chosen)
    if start == "one":  # relevance 1 at the explained output: signal 1 / f_k(x)
        signal = safe_divide(signal, output)
    relevance = input_relevance(forward, signal)
    explained = (output * signal).gather(1, chosen[:, None])[:, 0]
    return MethodResult(
        relevance,
        output,
        chosen,
        explained - per_sample_sum(relevance),
        {"composite": composite.name},
    )


class CompositeMethod(Method):
    """A method defined by one preset composite.

    Attributes:
        preset: Builds the composite from the method's options (its dataclass fields, passed by
            name).
    """

    start = "logit"
    preset: ClassVar[Callable[..., Composite]]
    convergence_delta = True
    multiplies_by_inputs = True  # relevance = input ⊙ modified gradient (as Captum's LRP)

    def __post_init__(self) -> None:
        self.build_composite()  # invalid options fail when the method is created

    def build_composite(self) -> Composite:
        """The composite with this method's options."""
        return self.preset(**{option.name: getattr(self, option.name) for option in fields(self)})

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        return run_composite(self.build_composite(), model, inputs, target, start=self.start)

    def layer_propagator(self, model, inputs, baselines):
        """Relevance from any layer with this method's rules (for the CSC metric)."""
        from explain_modbp.propagation import EnginePropagator

        forward = lrp_engine(self.build_composite(), record=True).forward(model, inputs)
        return EnginePropagator(forward, "relevance", method=type(self).__name__)


@dataclass
class LRPZ(CompositeMethod):
    """LRP-0 on every layer (equals Input×Gradient on ReLU networks)."""

    preset = staticmethod(composites.lrp_z)


@dataclass
class LRPEpsilon(CompositeMethod):
    """LRP-ε on every layer.

    Attributes:
        epsilon: Stabiliser of the denominators.
    """

    preset = staticmethod(composites.lrp_epsilon)
    epsilon: float = 1e-6


@dataclass
class LRPZPlus(CompositeMethod):
    """z⁺ (LRP-α1β0) on every layer.

    Attributes:
        bias: Count the biases in the z⁺ denominators (``b⁺``), as zennit does;
            default: ignored, as in the paper's Eq. 5.
    """

    preset = staticmethod(composites.lrp_zplus)
    bias: bool = False


@dataclass
class LRPAlphaBeta(CompositeMethod):
    """LRP-αβ on every layer (``alpha - beta == 1``).

    Attributes:
        alpha: Weight of positive contributions.
        beta: Weight of negative contributions.
        bias: Count the biases in the denominators (``b⁺`` with the positive, ``b⁻`` with the
            negative contributions), as zennit does; default: ignored (Eq. 5).
    """

    preset = staticmethod(composites.lrp_alpha_beta)
    alpha: float = 2.0
    beta: float = 1.0
    bias: bool = False


@dataclass
class LRPGamma(CompositeMethod):
    """LRP-γ on every layer.

    Attributes:
        gamma: Amplification of the contributions that agree in sign with each output.
        generalised: The sign-aware rule (default; the paper's ``w + γw⁺`` for non-negative
            inputs and outputs, stable for any sign) or ``w + γw⁺`` for every sign (``False``).
    """

    preset = staticmethod(composites.lrp_gamma)
    gamma: float = 0.25
    generalised: bool = True


@dataclass
class LRPW2(CompositeMethod):
    """Deep Taylor decomposition for real-valued inputs: w² on the input layer, z⁺ elsewhere.

    Attributes:
        bias: Count the biases in the z⁺ denominators (``b⁺``), as zennit does;
            default: ignored, as in the paper's Eq. 5.
    """

    preset = staticmethod(composites.lrp_w2)
    bias: bool = False
    multiplies_by_inputs = False  # the input layer's w² rule does not read the input


@dataclass
class LRPZB(CompositeMethod):
    """Deep Taylor decomposition for bounded inputs: z^B on the input layer, z⁺ elsewhere.

    Attributes:
        low: Lower input bound (number or tensor shaped like the inputs or one sample).
        high: Upper input bound.
        bias: Count the biases in the z⁺ denominators (``b⁺``), as zennit does;
            default: ignored, as in the paper's Eq. 5.
    """

    preset = staticmethod(composites.lrp_zb)
    low: float | torch.Tensor | None = None
    high: float | torch.Tensor | None = None
    bias: bool = False
    multiplies_by_inputs = False  # z^B on the input layer: also the bounds' terms


@dataclass
class LRPEpsilonGamma(CompositeMethod):
    """γ on convolutions, ε on dense layers (residual CNNs: see ``docs/cnn_layers.md``).

    Attributes:
        gamma: The convolutions' γ.
        epsilon: Stabiliser of the dense layers' (and γ's) denominators.
    """

    preset = staticmethod(composites.lrp_epsilon_gamma)
    gamma: float = 0.25
    epsilon: float = 1e-6


@dataclass
class LRPEpsilonGammaBox(CompositeMethod):
    """z^B on the input layer, γ on convolutions, ε on dense layers (zennit's EpsilonGammaBox).

    Attributes:
        low: Lower input bound (number or tensor shaped like the inputs or one sample).
        high: Upper input bound.
        gamma: The convolutions' γ.
        epsilon: Stabiliser of the dense layers' (and γ's) denominators.
    """

    preset = staticmethod(composites.lrp_epsilon_gamma_box)
    low: float | torch.Tensor | None = None
    high: float | torch.Tensor | None = None
    gamma: float = 0.25
    epsilon: float = 1e-6
    multiplies_by_inputs = False  # z^B on the input layer: also the bounds' terms


@dataclass
class LRPFlat(CompositeMethod):
    """Flat rule on the input layer, z⁺ on convolutions, ε on dense layers.

    Attributes:
        epsilon: Stabiliser of the dense layers' denominators.
        bias: Count the biases in the z⁺ denominators (``b⁺``), as zennit does;
            default: ignored, as in the paper's Eq. 5.
    """

    preset = staticmethod(composites.lrp_flat)
    epsilon: float = 1e-6
    bias: bool = False
    multiplies_by_inputs = False  # the input layer's flat rule does not read the input


@dataclass
class LRPEpsilonPlus(CompositeMethod):
    """The ε+z⁺ composite: z⁺ on convolutions, ε on dense layers.

    Attributes:
        epsilon: Stabiliser of the dense layers' denominators.
        bias: Count the biases in the z⁺ denominators (``b⁺``), as zennit does;
            default: ignored, as in the paper's Eq. 5.
    """

    preset = staticmethod(composites.lrp_epsilon_plus)
    epsilon: float = 1e-6
    bias: bool = False


@dataclass
class LRPCMP(CompositeMethod):
    """LRP-CMP: αβ (``β = α − 1``; α = 1 or 2 in the paper) on convolutions, LRP-0 on dense.

    Attributes:
        alpha: Weight of positive contributions on convolutions.
        bias: Count the convolutions' biases in the αβ denominators, as zennit does;
            default: ignored (Eq. 5).
    """

    preset = staticmethod(composites.lrp_cmp)
    alpha: float = 1.0
    bias: bool = False


@dataclass
class LRPCustom(CompositeMethod):
    """LRP with your own composite, e.g. a preset with rules of your own for some modules.

    ``explain(model, x, "lrp.custom", composite=composites.lrp_epsilon_plus().with_rules(
    (nn.BatchNorm2d, Gradient()), ("features.0", Flat())))``: entries given to ``with_rules``
    take precedence; the first matching entry wins. A core :class:`~explain_core.Rule` mapped to
    any other module (a custom layer) replaces that module's backward pass.

    Attributes:
        composite: A :class:`~explain_core.engine.Composite`.
        activations: Pass relevance through element-wise activations other than ReLU (LRP's
            pass rule); ``False`` refuses them, as Excitation BP does.
    """

    composite: Composite | None = None
    activations: bool = True

    def build_composite(self) -> Composite:
        """The composite, with LRP's activation rule added (or removed: ``activations``)."""
        composite = self.composite
        if not isinstance(composite, Composite):
            raise InvalidInputError(
                "lrp.custom needs composite=: a Composite such as "
                "explain_modbp.composites.lrp_epsilon_plus().with_rules((nn.BatchNorm2d, "
                f"Epsilon())); got {type(composite).__name__}"
            )
        entries = [(m.matcher, m.rule) for m in composite.mapping]
        if not self.activations:  # refuse activations, as Excitation BP does
            entries = [(m, r) for m, r in entries if m != composites.ACTIVATIONS[0]]
        elif not composite.op_kinds & ACTIVATION_OPS:
            entries.append(composites.ACTIVATIONS)  # LRP's pass rule, after the user's own
        else:
            return composite
        return Composite(entries, name=composite.name, canonizers=composite.canonizers)


@dataclass
class ContrastiveLRP(Method):
    """Contrastive LRP (Gu et al. 2018; the paper's Eq. 15) with the z⁺ rule.

    ``max(0, n(R(x | r := y ⊙ m_k))) − n(R(x | r := y ⊙ (1 − m_k)))`` where ``n`` divides a map
    by its sum; one forward pass, two backward passes.

    Attributes:
        clamp: Apply the ``max(0, ·)`` of Eq. 15 to the target's map.
    """

    clamp: bool = True
    multiplies_by_inputs = True  # differences of normalised z⁺ relevances, input ⊙ signal
    contrasts_outputs = True

    def layer_propagator(self, model, inputs, baselines):
        """The z⁺ chain both of Eq. 15's backward passes use."""
        from explain_modbp.propagation import EnginePropagator

        forward = lrp_engine(composites.lrp_zplus(), record=True).forward(model, inputs)
        return EnginePropagator(forward, "relevance", method="lrp.contrastive")

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        forward = lrp_engine(composites.lrp_zplus()).forward(model, inputs)
        output = forward.output.detach()
        chosen = select_target(output, target)  # first: it refuses outputs not (batch, n)
        if output.shape[1] < 2:  # no other output: Eq. 15's second map is 0, the first z⁺'s
            raise InvalidInputError(
                "lrp.contrastive contrasts the explained output with the model's other outputs "
                f"(Gu et al. 2018, Eq. 15), and this model returns {output.shape[1]}: there is "
                "nothing to contrast it with. Explain a binary classifier's one logit with "
                "lrp.zplus, the rule lrp.contrastive applies, or another method"
            )
        target_signal = one_hot(output, chosen)
        for_target = input_relevance(forward, target_signal, retain_graph=True)
        for_others = input_relevance(forward, 1 - target_signal)
        shape = (-1,) + (1,) * (inputs.dim() - 1)
        first = safe_divide(for_target, per_sample_sum(for_target).reshape(shape))
        if self.clamp:
            first = first.clamp(min=0)
        second = safe_divide(for_others, per_sample_sum(for_others).reshape(shape))
        return MethodResult(
            first - second,
            output,
            chosen,
            None,
            {"target_relevance": for_target, "other_relevance": for_others},
        )
